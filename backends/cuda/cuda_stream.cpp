// CUDA streams (the contract is tinydev/stream.hpp; docs/serving.md).
//
// Note [CUDA streams]
// A stream runs on a lane: a CudaHCQDevice of its own (cuda_hcq.hpp) with two non-blocking CUDA
// streams, a timeline that never wraps, its own staging ring and kernel-argument pages, in the
// parent's context, running the parent's programs on the parent's buffers, with the signals every
// CUDA device shares. Each operation is one submission on the lane, as on the CPU (Note [CPU
// streams]): a wait for the lane's previous timeline value, waits for the events given to wait()
// since, the work, and a signal of the next value; the Event returned is (lane timeline, that
// value). Two streams' kernels and copies therefore run at once on the GPU, ordered only through
// events, which are stream memory operations on the shared signals (a GPU-side wait: the host does
// not block). Graph replays are the lane's native CUDA graphs, launched on its compute stream.
// Unlike a CPU stream, nothing runs on the caller (StreamOptions::run_inline_when_idle does not
// apply: a GPU kernel cannot run on the host). A copyout into pageable memory is the driver's
// cuMemcpyAsync, which returns once the copy is done (the driver's rule for pageable memory), so
// the Event it returns is already complete. What the queued work uses (Buffers, the Program) is
// held until the timeline passed it and let go by a later call on the caller's thread.
#include <fmt/format.h>


#include "cuda_hcq.hpp"
#include "tinydev/hcq_stream.hpp"

namespace tinydev::cuda {
namespace {

class CudaStream final : public HCQLaneStream<CudaHCQDevice> {
 public:
  CudaStream(CudaHCQDevice& device, CudaHCQDevice& lane, const StreamOptions& options)
      : HCQLaneStream(device, lane) {
    (void)options;  // run_inline_when_idle: a GPU's work does not run on the caller
  }

  Event copyin(const Buffer& dest, std::span<const std::byte> src) override {
    check_buffer(dest, "copyin");
    if (src.size() != dest.nbytes())
      throw InvalidArgument(fmt::format("{}: copyin of {} bytes into a buffer of {} bytes: give exactly the buffer's size",
                                        *name_, src.size(), dest.nbytes()));
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    flush_waits();
    // The lane's staging ring, ordered after the lane's work; the caller's bytes are read before
    // this returns.
    lane_.allocator().copyin(dest.allocation(), src);
    return finish(std::span(&dest, 1), nullptr);
  }

  Event copyout(std::span<std::byte> dest, const Buffer& src) override {
    check_buffer(src, "copyout");
    if (dest.size() != src.nbytes())
      throw InvalidArgument(fmt::format("{}: copyout of a buffer of {} bytes into {} bytes: give exactly the buffer's "
                                        "size",
                                        *name_, src.nbytes(), dest.size()));
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    auto reservation = lane_.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    auto q = lane_.copy_queue();
    q.wait(lane_.timeline_signal(), value - 1);
    for (const auto& [signal, wanted] : waits_) q.wait(signal, wanted);
    q.copy(Allocation{reinterpret_cast<std::uintptr_t>(dest.data()), dest.size(), nullptr}, src.allocation(),
           dest.size());
    q.signal(lane_.timeline_signal(), value);
    waits_.clear();
    q.submit(lane_);
    reservation.submitted();
    return finish(std::span(&src, 1), nullptr);
  }

  Event launch(const std::shared_ptr<Program>& program, std::span<const Buffer> buffers,
               std::span<const std::int32_t> values, const LaunchParams& params) override {
    auto* cuda_program = dynamic_cast<const CudaProgram*>(program.get());
    if (!cuda_program || cuda_program->device() != device_.name())
      throw InvalidArgument(fmt::format("{}: kernel '{}' was not loaded on {}: load it with Device[\"{}\"].load_kernel",
                                        *name_, program ? program->name() : std::string("(null)"), device_.name(),
                                        device_.name()));
    cuda_program->check_counts(buffers.size(), values.size());
    std::vector<Allocation> allocations(buffers.size());
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      check_buffer(buffers[i], "launch");
      allocations[i] = buffers[i].allocation();
    }
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    auto reservation = lane_.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    const Kernargs kernargs = lane_.alloc_kernargs(static_cast<std::uint32_t>(buffers.size()),
                                                   static_cast<std::uint32_t>(values.size()));
    fill_kernargs(*cuda_program, kernargs, allocations, values);
    auto q = lane_.compute_queue();
    q.wait(lane_.timeline_signal(), value - 1);
    for (const auto& [signal, wanted] : waits_) q.wait(signal, wanted);
    q.exec(*cuda_program, kernargs, params.global, params.local).signal(lane_.timeline_signal(), value);
    waits_.clear();
    q.submit(lane_);
    reservation.submitted();
    return finish(buffers, program);
  }

  std::unique_ptr<Graph> create_graph(std::vector<GraphNode> nodes) override {
    for (const GraphNode& node : nodes)
      if (const auto* k = std::get_if<GraphKernel>(&node); k && !k->program)
        throw InvalidArgument(fmt::format("{}: a graph kernel node has no program", *name_));
    return lane_.create_graph(std::move(nodes));
  }

  Event replay(Graph& graph, std::span<const Buffer> inputs, std::span<const std::int32_t> variables) override {
    if (!is_cuda_graph_of(graph, lane_))
      throw InvalidArgument(fmt::format("{}: this graph was not made by this stream's create_graph: a graph replays on "
                                        "the stream that made it",
                                        *name_));
    std::vector<Allocation> allocations;
    allocations.reserve(inputs.size());
    for (const Buffer& b : inputs) {
      check_buffer(b, "replay");
      allocations.push_back(b.allocation());
    }
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    flush_waits();
    graph.replay(allocations, variables, /*wait=*/false);
    return finish(inputs, nullptr);
  }

};

}  // namespace

std::shared_ptr<Stream> make_cuda_stream(CudaHCQDevice& device, CudaHCQDevice& lane, const StreamOptions& options) {
  return std::make_shared<CudaStream>(device, lane, options);
}

}  // namespace tinydev::cuda
