// CUDA streams (the contract is tinydev/stream.hpp; docs/serving.md).
//
// Note [CUDA streams]
// A stream runs on a lane: a CudaHCQDevice of its own (cuda_hcq.hpp) with two non-blocking CUDA
// streams, a timeline that never wraps, its own staging ring (4 pinned slots of 2 MiB: a request's
// copies, not a model's) and kernel-argument pages, in the parent's context, running the parent's
// programs on the parent's buffers, with the signals every CUDA device shares. Each operation is
// one submission on the lane, as on the CPU (Note [CPU streams]): a wait for the lane's previous
// timeline value, waits for the events given to wait() since, the work, and a signal of the next
// value; the Event returned is (lane timeline, that value). Two streams' kernels and copies
// therefore run at once on the GPU, ordered only through events, which are stream memory operations
// on the shared signals (a GPU-side wait: the host does not block). Graph replays are the lane's
// native CUDA graphs, launched on its compute stream. Unlike a CPU stream's, its kernels never run
// on the caller (a GPU kernel cannot run on the host). A copyout returns at once: on a busy lane,
// through pinned bounce memory and a host function that copies into the caller's memory (Note [CUDA
// copyout without blocking] in cuda_device.cpp; not a cuMemcpyAsync into pageable memory, which the
// driver runs synchronously behind the event waits); on an idle one (nothing queued, its waits
// complete, run_inline_when_idle), through the lane's staging ring, complete on return. A copyin
// reads the caller's bytes before it returns, and on a busy lane queues them through the bounce
// too. The GPU runs at most CUDA_DEVICE_MAX_CONNECTIONS (8 by default) hardware queues: beyond
// that, streams share them, and a stream waiting for an event holds up the others on its queue
// until the event completes (Note [CUDA hardware queues] in cuda_device.cpp). What the
// queued work uses (Buffers, the Program) is held until the timeline passed it and let go by a
// later call on the caller's thread.
#include "cuda_hcq.hpp"
#include "tinydev/hcq_stream.hpp"

namespace tinydev::cuda {
namespace {

class CudaStream final : public HCQLaneStream<CudaHCQDevice> {
 public:
  CudaStream(CudaHCQDevice& device, CudaHCQDevice& lane, const StreamOptions& options)
      : HCQLaneStream(device, lane, options), copy_inline_when_idle_(options.run_inline_when_idle) {}

  // The bytes are read before this returns. An idle lane stages them through its ring (the
  // allocator's copyin); a busy one queues them through its bounce memory, since the ring's slots
  // (and the driver's host-to-host copy into a pinned Buffer) would wait behind the stream's work
  // (Note [CUDA copyout without blocking]).
  Event copyin(const Buffer& dest, std::span<const std::byte> src) override {
    check_copyin(dest, src.size());
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    if (runs_on_caller()) return copyin_through_lane(dest, src);
    lane_.submit_copyin_later(dest.allocation(), src, waits_);
    waits_.clear();
    return finish(std::span(&dest, 1), nullptr);
  }

  // Returns at once (Note [CUDA streams]): an idle lane copies through its staging ring (the
  // allocator's pipelined copyout) and the Event is complete; a busy one queues the copy through
  // bounce memory (Note [CUDA copyout without blocking]).
  Event copyout(std::span<std::byte> dest, const Buffer& src) override {
    check_copyout(dest.size(), src);
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    if (runs_on_caller()) {
      lane_.allocator().copyout(dest, src.allocation());
    } else {
      lane_.submit_copyout_later(dest, src.allocation(), waits_);
      waits_.clear();
    }
    return finish(std::span(&src, 1), nullptr);
  }

  Event launch(const std::shared_ptr<Program>& program, std::span<const Buffer> buffers,
               std::span<const std::int32_t> values, const LaunchParams& params) override {
    const CudaProgram& cuda_program = program_of<CudaProgram>(program);
    cuda_program.check_counts(buffers.size(), values.size());
    std::vector<Allocation> allocations(buffers.size());
    allocations_of(buffers, allocations, "launch");
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    lane_.release_host_copies();
    auto reservation = lane_.reserve_timeline_value();
    return submit_launch(reservation, cuda_program, program, buffers, allocations, values, params);
  }

 private:
  bool made_here(const Graph& graph) const noexcept override { return is_cuda_graph_of(graph, lane_); }
  // Whether a copy runs on the caller, through the lane's staging ring: the lane is idle (waits
  // for events that completed already order nothing) and run_inline_when_idle. The submit mutex
  // is held.
  bool runs_on_caller() {
    lane_.release_host_copies();
    drop_passed_waits();
    return copy_inline_when_idle_ && waits_.empty() && lane_.idle();
  }
  const bool copy_inline_when_idle_;  // StreamOptions::run_inline_when_idle
};

}  // namespace

std::shared_ptr<Stream> make_cuda_stream(CudaHCQDevice& device, CudaHCQDevice& lane, const StreamOptions& options) {
  return std::make_shared<CudaStream>(device, lane, options);
}

}  // namespace tinydev::cuda
