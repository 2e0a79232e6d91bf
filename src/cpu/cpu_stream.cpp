// CPU streams (Note [CPU streams] in cpu_hcq.hpp; the contract is tinydev/stream.hpp).
#include <fmt/format.h>

#include <cstring>
#include <deque>
#include <mutex>

#include "cpu_hcq.hpp"
#include "fatal_signals.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/profile.hpp"
#include "tinydev/hcq_graph.hpp"
#include "tinydev/hcq_stream.hpp"
#include "tinydev/registry.hpp"

namespace tinydev::cpu {

// Note [CPU streams]
// A stream records each operation as one submission on its lane: a wait for the lane's previous
// timeline value, waits for the events given to wait() since the last submission, the work, and a
// signal of the next timeline value; the Event returned is (lane timeline, that value). Kernels run
// on the lane's compute worker, copies on its copy worker, so two streams run at once on two cores
// and grids from two streams share the thread pool (which runs several grids at once). When the
// lane is idle and every event waited for is complete, the work runs on the caller instead, with
// no queue recorded (StreamOptions::run_inline_when_idle; the lane's timeline still takes and
// reaches the value). What the work
// uses (Buffers, the Program) is held with the value that ends it and let go by a later call on
// the caller's thread once the timeline passed that value: never on a worker, where a Buffer's
// free could wait for the worker itself.
class CpuStream final : public HCQLaneStream<CpuHCQDevice> {
 public:
  CpuStream(CpuHCQDevice& device, CpuHCQDevice& lane, const StreamOptions& options)
      : HCQLaneStream(device, lane, options), options_(options) {
    // Without inline runs, a copyin goes through the lane's staging ring even when the lane is idle.
    lane_.cpu_allocator().set_force_staging(!options_.run_inline_when_idle);
  }

  Event copyin(const Buffer& dest, std::span<const std::byte> src) override {
    check_copyin(dest, src.size());
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    if (runs_here(lane_.timeline_value())) {
      // Nothing of this stream is queued or waited for: copy now, as the allocator's idle path does.
      std::memcpy(dest.allocation().host_ptr<std::byte>(), src.data(), src.size());
      return Event(lane_.timeline_signal(), lane_.timeline_value() - 1, name_);
    }
    // Through the lane's staging ring while its slots are free (memory already faulted in: a fresh
    // MiB costs milliseconds of page faults on some VMs); else captured and queued, so it returns
    // at once either way (Note [CPU stream copyin captures]).
    if (lane_.cpu_allocator().ring_takes_without_waiting(src.size())) return copyin_through_lane(dest, src);
    return copyin_captured(dest, src);
  }

  Event copyout(std::span<std::byte> dest, const Buffer& src) override {
    check_copyout(dest.size(), src);
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    auto reservation = lane_.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    if (runs_here(value)) {
      std::memcpy(dest.data(), src.allocation().host_ptr<const std::byte>(), dest.size());
      return ran_here(reservation, value);
    }
    return submit_copyout(reservation, dest, src);
  }

  Event launch(const std::shared_ptr<Program>& program, std::span<const Buffer> buffers,
               std::span<const std::int32_t> values, const LaunchParams& params) override {
    const auto* cpu_program = &program_of<CpuProgram>(program);
    cpu_program->check_launch(buffers.size(), values.size(), params.global);  // at most kMaxKernelArgs in all
    Allocation allocations[kMaxKernelArgs];
    allocations_of(buffers, allocations, "launch");
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    auto reservation = lane_.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    if (runs_here(value)) {
      // As a direct Program call: the arguments packed as the kernel ABI takes them.
      std::uint64_t args[kMaxKernelArgs];
      std::size_t count = 0;
      for (std::size_t i = 0; i < buffers.size(); ++i) args[count++] = allocations[i].va_addr;
      for (std::int32_t v : values) args[count++] = static_cast<std::uint32_t>(v);
      const bool profiling = Profiler::global().enabled();
      const std::uint64_t start = profiling ? Profiler::now_ns() : 0;
      {
        RunningKernel running{cpu_program->name().c_str(), name_->c_str(), "a stream's caller"};
        RunningKernelScope scope(&running);
        cpu_program->launch(args, count, params.global);
      }
      GlobalCounters::kernel_count.fetch_add(1, std::memory_order_relaxed);
      if (profiling) Profiler::global().add(ProfileEvent{cpu_program->name(), start, Profiler::now_ns(), *name_, "COMPUTE"});
      return ran_here(reservation, value);
    }
    return submit_launch(reservation, *cpu_program, program, buffers,
                         std::span<const Allocation>(allocations, buffers.size()), values, params);
  }

 private:
  bool made_here(const Graph& graph) const noexcept override {
    const auto* hcq = dynamic_cast<const HCQGraph<CpuHCQDevice>*>(&graph);
    return hcq && &hcq->device() == &lane_;
  }
  // Whether the work of timeline value `value` (reserved, its lock held) runs on the caller with no
  // queue at all: inline runs asked for, every event waited for complete (those are dropped from
  // the waits), and everything before it finished. Otherwise it goes to the lane's workers.
  bool runs_here(std::uint64_t value) {
    if (!options_.run_inline_when_idle) return false;
    drop_passed_waits();
    return waits_.empty() && lane_.timeline_signal().slot().value.load(std::memory_order_acquire) + 1 >= value;
  }
  // The work of `value` ran on the caller: the timeline reaches it, as a queue's signal would.
  Event ran_here(HCQCompiled<CpuComputeQueue, CpuCopyQueue>::TimelineReservation& reservation, std::uint64_t value) {
    lane_.timeline_signal().slot().store(value);
    reservation.submitted();
    return Event(lane_.timeline_signal(), value, name_);
  }
  StreamOptions options_;
};

std::shared_ptr<Stream> make_cpu_stream(CpuHCQDevice& device, CpuHCQDevice& lane, const StreamOptions& options) {
  return std::make_shared<CpuStream>(device, lane, options);
}

}  // namespace tinydev::cpu
