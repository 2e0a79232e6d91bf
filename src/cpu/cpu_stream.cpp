// CPU streams (Note [CPU streams] in cpu_hcq.hpp; the contract is tinydev/stream.hpp).
#include <fmt/format.h>

#include <deque>
#include <mutex>

#include "cpu_hcq.hpp"
#include "tinydev/hcq_graph.hpp"
#include "tinydev/registry.hpp"

namespace tinydev::cpu {

// Note [CPU streams]
// A stream records each operation as one submission on its lane: a wait for the lane's previous
// timeline value, waits for the events given to wait() since the last submission, the work, and a
// signal of the next timeline value; the Event returned is (lane timeline, that value). Kernels run
// on the lane's compute worker, copies on its copy worker, so two streams run at once on two cores
// and grids from two streams share the thread pool (which runs several grids at once). An idle
// lane runs the submission on the caller instead (StreamOptions::run_inline_when_idle; stopping at
// the first wait for an event not reached yet and handing the rest to the worker). What the work
// uses (Buffers, the Program) is held with the value that ends it and let go by a later call on
// the caller's thread once the timeline passed that value: never on a worker, where a Buffer's
// free could wait for the worker itself.
class CpuStream final : public Stream {
 public:
  CpuStream(CpuHCQDevice& device, CpuHCQDevice& lane, const StreamOptions& options)
      : device_(device), lane_(lane), options_(options), name_(std::make_shared<const std::string>(lane.name())) {}

  ~CpuStream() override {
    // Our work reads buffers we hold: wait for it (bounded), then give the lane back for reuse. A
    // lane whose work does not finish, or that cannot recover from a fault, is not reused.
    bool reusable = lane_.opened_in_this_process();
    if (reusable && lane_.fault().empty()) {
      try {
        std::lock_guard lock(mutex_);
        flush_waits();
        lane_.wait_timeline(lane_.last_submitted_value(), std::chrono::seconds(30));
      } catch (const Timeout& e) {
        debug_log(0, "tinydev: {}: dropped while its work still runs ({}); its lane is not reused", *name_, e.what());
        reusable = false;
      } catch (const std::exception&) {
        // The work failed: recovered below.
      }
    }
    if (reusable && !lane_.fault().empty()) {
      try {
        lane_.recover(std::chrono::seconds(5));
      } catch (const std::exception&) {
        reusable = false;
      }
    }
    if (!reusable) {
      // The work may still read what it holds: leak it rather than free it under the work.
      new std::deque<Held>(std::move(held_));
      return;
    }
    held_.clear();
    device_.return_lane(&lane_);
  }

  const std::string& name() const noexcept override { return *name_; }
  Compiled& device() const noexcept override { return device_; }

  Event copyin(const Buffer& dest, std::span<const std::byte> src) override {
    check_buffer(dest, "copyin");
    if (src.size() != dest.nbytes())
      throw InvalidArgument(fmt::format("{}: copyin of {} bytes into a buffer of {} bytes: give exactly the buffer's size",
                                        *name_, src.size(), dest.nbytes()));
    std::lock_guard lock(mutex_);
    prepare();
    flush_waits();
    auto& allocator = lane_.cpu_allocator();
    allocator.set_force_staging(!options_.run_inline_when_idle);
    // The lane's staging ring: a direct copy when the lane is idle, else through its copy queue,
    // ordered after the lane's work; either way the caller's bytes are read before this returns.
    allocator.copyin(dest.allocation(), src);
    return finish({dest}, nullptr);
  }

  Event copyout(std::span<std::byte> dest, const Buffer& src) override {
    check_buffer(src, "copyout");
    if (dest.size() != src.nbytes())
      throw InvalidArgument(fmt::format("{}: copyout of a buffer of {} bytes into {} bytes: give exactly the buffer's "
                                        "size",
                                        *name_, src.nbytes(), dest.size()));
    std::lock_guard lock(mutex_);
    prepare();
    auto reservation = lane_.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    CpuCopyQueue q;
    q.wait(lane_.timeline_signal(), value - 1);
    for (const auto& [signal, wanted] : waits_) q.wait(signal, wanted);
    q.copy(Allocation{reinterpret_cast<std::uintptr_t>(dest.data()), dest.size(), nullptr}, src.allocation(),
           dest.size());
    q.signal(lane_.timeline_signal(), value);
    run(q.words(), /*compute=*/false, value - 1);
    reservation.submitted();
    waits_.clear();
    return finish({src}, nullptr);
  }

  Event launch(const std::shared_ptr<Program>& program, std::span<const Buffer> buffers,
               std::span<const std::int32_t> values, const LaunchParams& params) override {
    auto* cpu_program = dynamic_cast<const CpuProgram*>(program.get());
    if (!cpu_program || cpu_program->device() != device_.name())
      throw InvalidArgument(fmt::format("{}: kernel '{}' was not loaded on {}: load it with Device[\"{}\"].load_kernel",
                                        *name_, program ? program->name() : std::string("(null)"), device_.name(),
                                        device_.name()));
    std::vector<Allocation> allocations;
    allocations.reserve(buffers.size());
    for (const Buffer& b : buffers) {
      check_buffer(b, "launch");
      allocations.push_back(b.allocation());
    }
    std::lock_guard lock(mutex_);
    prepare();
    auto reservation = lane_.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    const Kernargs kernargs = lane_.alloc_kernargs(static_cast<std::uint32_t>(allocations.size()),
                                                   static_cast<std::uint32_t>(values.size()));
    fill_kernargs(*cpu_program, kernargs, allocations, values);
    CpuComputeQueue q;
    q.wait(lane_.timeline_signal(), value - 1);
    for (const auto& [signal, wanted] : waits_) q.wait(signal, wanted);
    q.exec(*cpu_program, kernargs, params.global, params.local).signal(lane_.timeline_signal(), value);
    run(q.words(), /*compute=*/true, value - 1);
    reservation.submitted();
    waits_.clear();
    return finish(std::vector<Buffer>(buffers.begin(), buffers.end()), program);
  }

  std::unique_ptr<Graph> create_graph(std::vector<GraphNode> nodes) override {
    for (const GraphNode& node : nodes)
      if (const auto* k = std::get_if<GraphKernel>(&node); k && !k->program)
        throw InvalidArgument(fmt::format("{}: a graph kernel node has no program", *name_));
    return lane_.create_graph(std::move(nodes));
  }

  Event replay(Graph& graph, std::span<const Buffer> inputs, std::span<const std::int32_t> variables) override {
    auto* hcq = dynamic_cast<HCQGraph<CpuHCQDevice>*>(&graph);
    if (!hcq || &hcq->device() != &lane_)
      throw InvalidArgument(fmt::format("{}: this graph was not made by this stream's create_graph: a graph replays on "
                                        "the stream that made it",
                                        *name_));
    std::vector<Allocation> allocations;
    allocations.reserve(inputs.size());
    for (const Buffer& b : inputs) {
      check_buffer(b, "replay");
      allocations.push_back(b.allocation());
    }
    std::lock_guard lock(mutex_);
    prepare();
    flush_waits();
    hcq->replay(allocations, variables, /*wait=*/false);
    return finish(std::vector<Buffer>(inputs.begin(), inputs.end()), nullptr);
  }

  Event transfer(const Buffer& dest, const Buffer& src) override {
    check_buffer(src, "transfer");
    if (!dest.is_allocated())
      throw InvalidArgument(fmt::format("{}: transfer into an unallocated buffer: allocate it first", *name_));
    if (dest.nbytes() != src.nbytes())
      throw InvalidArgument(fmt::format("{}: transfer of {} bytes into a buffer of {} bytes: the sizes must match",
                                        *name_, src.nbytes(), dest.nbytes()));
    auto* dest_device = dynamic_cast<CpuHCQDevice*>(&Device[dest.device()]);
    if (!dest_device)
      throw InvalidArgument(fmt::format("{}: transfer to {}: a CPU stream transfers to CPU devices only", *name_,
                                        dest.device()));
    std::lock_guard lock(mutex_);
    prepare();
    flush_waits();
    HCQAllocator<CpuHCQDevice>::transfer(dest.allocation(), src.allocation(), src.nbytes(), lane_, *dest_device);
    return finish({dest, src}, nullptr);
  }

  void wait(const Event& event) override {
    if (event.query()) return;  // complete (or DeviceFault: the work it stands for failed)
    if (!lane_.can_reach(*event.signal().pool())) {
      event.wait();  // another backend's event: waited for here, on the host
      return;
    }
    std::lock_guard lock(mutex_);
    waits_.emplace_back(event.signal(), event.value());
  }

  Event record() override {
    std::lock_guard lock(mutex_);
    prepare();
    flush_waits();
    return Event(lane_.timeline_signal(), lane_.last_submitted_value(), name_);
  }

  void synchronize(std::chrono::milliseconds timeout) override {
    std::lock_guard lock(mutex_);
    lane_.check_usable();
    flush_waits();
    lane_.wait_timeline(lane_.last_submitted_value(), timeout);
    release_finished();
  }

  std::string fault() const override { return lane_.fault(); }
  std::string recover(std::chrono::milliseconds timeout) override {
    std::lock_guard lock(mutex_);
    std::string was = lane_.recover(timeout);
    waits_.clear();
    release_finished();
    return was;
  }

 private:
  struct Held {
    std::uint64_t value;
    std::vector<Buffer> buffers;
    std::shared_ptr<Program> program;
  };

  void check_buffer(const Buffer& b, std::string_view what) const {
    if (b.device() != device_.name())
      throw InvalidArgument(fmt::format("{}: {} of a buffer on {}: a stream of {} uses {}'s buffers", *name_, what,
                                        b.device(), device_.name(), device_.name()));
    if (!b.is_allocated())
      throw InvalidArgument(fmt::format("{}: {} of an unallocated buffer: allocate it first", *name_, what));
  }
  // Before an operation (stream mutex held): usable, and what finished work held let go.
  void prepare() {
    lane_.check_usable();
    release_finished();
  }
  void release_finished() {
    const std::uint64_t reached = lane_.timeline_signal().value();
    while (!held_.empty() && held_.front().value <= reached) held_.pop_front();
  }
  // Event waits not yet part of a submission go in one of their own (before work that records its
  // own queues: graphs, staged copies, transfers).
  void flush_waits() {
    if (waits_.empty()) return;
    auto reservation = lane_.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    CpuComputeQueue q;
    q.wait(lane_.timeline_signal(), value - 1);
    for (const auto& [signal, wanted] : waits_) q.wait(signal, wanted);
    q.signal(lane_.timeline_signal(), value);
    lane_.compute_worker().submit(q.words());
    reservation.submitted();
    waits_.clear();
  }
  void run(std::shared_ptr<const std::vector<CpuCommand>> words, bool compute, std::uint64_t before) {
    if (options_.run_inline_when_idle) lane_.run_inline_or_submit(std::move(words), compute, before);
    else (compute ? lane_.compute_worker() : lane_.copy_worker()).submit(std::move(words));
  }
  // The event ending everything submitted so far; what it used is held until then.
  Event finish(std::vector<Buffer> buffers, std::shared_ptr<Program> program) {
    const std::uint64_t value = lane_.last_submitted_value();
    if (lane_.timeline_signal().value() < value) held_.push_back(Held{value, std::move(buffers), std::move(program)});
    return Event(lane_.timeline_signal(), value, name_);
  }

  CpuHCQDevice& device_;
  CpuHCQDevice& lane_;
  StreamOptions options_;
  std::shared_ptr<const std::string> name_;
  std::mutex mutex_;
  std::vector<std::pair<Signal, std::uint64_t>> waits_;  // events to wait for in the next submission
  std::deque<Held> held_;
};

std::shared_ptr<Stream> make_cpu_stream(CpuHCQDevice& device, CpuHCQDevice& lane, const StreamOptions& options) {
  return std::make_shared<CpuStream>(device, lane, options);
}

}  // namespace tinydev::cpu
