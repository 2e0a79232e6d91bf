// include/tinydev/cpu/cpu_hcq.hpp: the CPU as an HCQ device, the
// core every CPU backend builds on (target tinydev_cpu, which links no LLVM).
//
// The CPU backends' devices are CpuHCQDevices: each runs a compute queue and a copy queue on a
// worker thread of its own, executing submitted commands in order: `exec` calls the kernel (grids
// spread over CpuThreadPool), `copy` is a memcpy, `signal`/`wait`/`timestamp` act on signal
// memory. All CPU devices share one signal pool (host memory every CPU queue reaches), so one CPU
// device's queue can wait on another's signals.
//
// Ownership: a Program dropped while an exec of it is queued stays alive until the exec ran (Note
// [Program retirement]: programs are kept until every CPU queue worker finished what was
// submitted before their last handle went).
// Kernel arguments must stay alive until the work finished (a device's alloc_kernargs pages do; a
// graph keeps its own). Devices, and the lanes their streams run on, live as long as the process.
// Thread safety: as HCQCompiled; the workers are internal.
#pragma once

#include <array>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <functional>

#include "cpu_program.hpp"
#include "tinydev/hcq.hpp"
#include "tinydev/hcq_stream.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::cpu {

class CpuHCQDevice;

// One recorded CPU command (a queue's word). Which fields matter depends on `kind`; the fields of
// different kinds share memory, so read only those of the command's own kind.
// Note [Compact commands]: a pipelined eager submit (wait, exec, signal) hands its words to the
// worker on another core, and every cache line they span crosses between the two cores, twice
// (the worker reads it; the submit that reuses the memory writes it back). With each kind's
// fields overlaid a command is 56 bytes, not 112, and those three commands span 3 lines, not 4-5.
// Made only through the factories below, which start the right members' lifetimes.
struct CpuCommand {
  CommandKind kind{};
  std::uint32_t num_buffers = 0;  // exec
  union {
    SignalSlot* signal = nullptr;  // signal, wait, timestamp
    const CpuProgram* program;     // exec
    std::byte* dest;               // copy
  };
  union {
    std::uint64_t value = 0;  // signal, wait
    std::byte* kernargs;      // exec
    const std::byte* src;     // copy
  };
  union {
    std::uint64_t size = 0;  // copy
    std::uint64_t request;   // exec: Profiler::current_request() where it was recorded
  };
  std::uint64_t graph = 0;  // exec: Profiler::current_graph() where it was recorded
  std::uint32_t num_values = 0;  // exec
  // exec. No local size: a CPU kernel runs its global grid on one thread, whatever the local one.
  Dim3 global{1, 1, 1};

  static CpuCommand of_signal(CommandKind kind, SignalSlot* signal, std::uint64_t value) noexcept {
    CpuCommand c;
    c.kind = kind;
    c.signal = signal;
    c.value = value;
    return c;
  }
  static CpuCommand of_barrier() noexcept {
    CpuCommand c;
    c.kind = CommandKind::memory_barrier;
    return c;
  }
  static CpuCommand of_exec(const CpuProgram* program, std::byte* kernargs, std::uint32_t num_buffers,
                            std::uint32_t num_values, Dim3 global, std::uint64_t request, std::uint64_t graph) noexcept {
    CpuCommand c;
    c.kind = CommandKind::exec;
    c.program = program;
    c.kernargs = kernargs;
    c.num_buffers = num_buffers;
    c.num_values = num_values;
    c.global = global;
    c.request = request;
    c.graph = graph;
    return c;
  }
  static CpuCommand of_copy(std::byte* dest, const std::byte* src, std::uint64_t size) noexcept {
    CpuCommand c;
    c.kind = CommandKind::copy;
    c.dest = dest;
    c.src = src;
    c.size = size;
    return c;
  }
};
static_assert(sizeof(CpuCommand) == 56, "Note [Compact commands]: a command's fields grew");
static_assert(std::is_trivially_copyable_v<CpuCommand>);

// The signal primitives both CPU queues share.
struct CpuSignalPrimitives {
  static CpuCommand signal(const Signal& s, std::uint64_t v) { return CpuCommand::of_signal(CommandKind::signal, &s.slot(), v); }
  static CpuCommand wait(const Signal& s, std::uint64_t v) { return CpuCommand::of_signal(CommandKind::wait, &s.slot(), v); }
  static CpuCommand timestamp(const Signal& s) { return CpuCommand::of_signal(CommandKind::timestamp, &s.slot(), 0); }
  static void update(CpuCommand& c, const std::optional<Signal>& s, const std::optional<std::uint64_t>& v) {
    if (s) c.signal = &s->slot();
    if (v) c.value = *v;
  }
};

class CpuComputeQueue final : public HWComputeQueue<CpuComputeQueue, CpuCommand, CpuProgram> {
  // The primitives (tinydev/hcq_concepts.hpp): public for the concept checks; only the queue
  // templates call them.
 public:
  void _signal(const Signal& s, std::uint64_t v) { mutable_commands().push_back(CpuSignalPrimitives::signal(s, v)); }
  void _wait(const Signal& s, std::uint64_t v) { mutable_commands().push_back(CpuSignalPrimitives::wait(s, v)); }
  void _timestamp(const Signal& s) { mutable_commands().push_back(CpuSignalPrimitives::timestamp(s)); }
  void _memory_barrier() { mutable_commands().push_back(CpuCommand::of_barrier()); }
  void _exec(const CpuProgram& program, const Kernargs& kernargs, Dim3 global, Dim3 local);
  void _update_signal(std::size_t cmd, const std::optional<Signal>& s, const std::optional<std::uint64_t>& v) {
    CpuSignalPrimitives::update(*command_words(cmd), s, v);
  }
  void _update_wait(std::size_t cmd, const std::optional<Signal>& s, const std::optional<std::uint64_t>& v) {
    CpuSignalPrimitives::update(*command_words(cmd), s, v);
  }
  void _update_exec(std::size_t cmd, Dim3 global, Dim3 local);
  void _submit(Compiled& device);
  // The recorded words as they stand (for CpuHCQDevice::run_inline_if_idle).
  std::shared_ptr<const std::vector<CpuCommand>> words() const { return snapshot(); }
};

class CpuCopyQueue final : public HWCopyQueue<CpuCopyQueue, CpuCommand> {
  // The primitives (tinydev/hcq_concepts.hpp): public for the concept checks; only the queue
  // templates call them.
 public:
  void _signal(const Signal& s, std::uint64_t v) { mutable_commands().push_back(CpuSignalPrimitives::signal(s, v)); }
  void _wait(const Signal& s, std::uint64_t v) { mutable_commands().push_back(CpuSignalPrimitives::wait(s, v)); }
  void _timestamp(const Signal& s) { mutable_commands().push_back(CpuSignalPrimitives::timestamp(s)); }
  void _copy(const Allocation& dest, const Allocation& src, std::size_t size) {
    mutable_commands().push_back(
        CpuCommand::of_copy(dest.host_ptr<std::byte>(), src.host_ptr<const std::byte>(), size));
  }
  void _update_signal(std::size_t cmd, const std::optional<Signal>& s, const std::optional<std::uint64_t>& v) {
    CpuSignalPrimitives::update(*command_words(cmd), s, v);
  }
  void _update_wait(std::size_t cmd, const std::optional<Signal>& s, const std::optional<std::uint64_t>& v) {
    CpuSignalPrimitives::update(*command_words(cmd), s, v);
  }
  void _update_copy(std::size_t cmd, const std::optional<Allocation>& dest, const std::optional<Allocation>& src);
  void _submit(Compiled& device);
  // The recorded words as they stand (for CpuHCQDevice::run_inline_if_idle).
  std::shared_ptr<const std::vector<CpuCommand>> words() const { return snapshot(); }
};

// Copies `size` bytes with non-temporal stores (tinydev::detail::streaming_copy, Note [Streaming
// copies]; plain memcpy off x86-64). The ranges must not overlap. What the copy queue uses for
// blocks of 256 KiB and more.
inline void streaming_copy(std::byte* dest, const std::byte* src, std::size_t size) noexcept {
  detail::streaming_copy(dest, src, size);
}

// Runs the commands of one submission from index `from` to its end on the calling thread, and
// returns commands.size(). A command that throws stops it: every signal the rest would set is
// poisoned with the reason (Note [Queue failure]). Without `blocking`, it stops before a wait
// whose value is not reached and returns that command's index instead of sleeping. `blocked`,
// if given, is told what a blocking wait waits for.
struct BlockedOn;
std::size_t execute_commands(const std::vector<CpuCommand>& commands, std::size_t from, const std::string& device,
                             const std::string& lane, bool blocking, BlockedOn* blocked = nullptr);

// What a worker is doing while a `wait` command blocks it or a kernel runs (for timeout
// messages). Written by the worker, read by any thread; slots never move, so reading through
// `signal` is safe. The running kernel's name belongs to a program the worker's submission holds:
// a reader announces itself in `readers` before reading it, and the worker, having cleared
// `running_name`, issues a seq_cst fence and waits for readers to leave before it lets the
// submission go: either the reader sees nullptr, or the worker sees the reader.
struct BlockedOn {
  std::atomic<SignalSlot*> signal{nullptr};  // nullptr: not blocked on a wait
  std::atomic<std::uint64_t> value{0};
  std::atomic<std::size_t> command{0};
  std::atomic<std::int64_t> since_ns{0};
  std::atomic<std::int64_t> running_command{-1};  // the exec running now, -1: none
  std::atomic<std::int64_t> running_since_ns{0};
  std::atomic<const std::string*> running_name{nullptr};
  std::atomic<int> readers{0};
};

// Executes submitted command lists in order on one thread, started at the first submission.
class CpuQueueWorker {
 public:
  CpuQueueWorker(std::string device, std::string lane);
  ~CpuQueueWorker();
  void submit(std::shared_ptr<const std::vector<CpuCommand>> commands);
  // "its COMPUTE queue is blocked on command 3 of a submission, a wait for CPU signal #4 to reach
  // 7 (it is at 0, for 1200 ms)", "its COMPUTE queue has been running kernel 'k' (command 1 of a
  // submission) for 1200 ms", or "" when it is neither waiting nor running a kernel.
  std::string describe_blocked() const;
  // Whether everything submitted has finished running (nothing queued, nothing running).
  // Submissions made so far (queued, running or run) and submissions run to their end (Note
  // [Program retirement]).
  std::uint64_t submitted() const noexcept { return submitted_.load(std::memory_order_acquire); }
  std::uint64_t finished() const noexcept { return finished_.load(std::memory_order_acquire); }
  bool idle() const noexcept {
    // submitted_ first: finished_ never passes it, so equal means all those submissions finished.
    const std::uint64_t submitted = submitted_.load(std::memory_order_seq_cst);
    return finished_.load(std::memory_order_seq_cst) == submitted;
  }

 private:
  using Words = std::shared_ptr<const std::vector<CpuCommand>>;
  void run();
  void run_submission(const std::vector<CpuCommand>& words);
  // Note [Submission ring] (src/cpu/cpu_hcq.cpp) says how submissions reach the worker, and Note
  // [Worker layout] why the fields are grouped as they are: by who writes them, each group on
  // cache lines of its own, so a pipelined submitter and its worker pass each other only the
  // lines a hand-off needs.
  static constexpr std::size_t kRing = 128;
  // Set up once (thread_: by the first submit, under mutex_), then only read; and the condition
  // variable, touched only when the worker sleeps.
  std::string device_, lane_;
  std::thread thread_;
  std::condition_variable wake_;
  // Submitters' side, under mutex_; the worker takes it only to sleep and to take the overflow.
  alignas(64) mutable std::mutex mutex_;
  std::atomic<std::uint64_t> submitted_{0};  // every submission, ring and overflow
  std::uint64_t head_seen_ = 0;              // a submitter's last look at head_ (never ahead of it)
  bool sleeping_ = false;
  bool stop_ = false;
  std::vector<Words> overflow_;  // submissions made while the ring was full, in order
  // Ring positions published (stored by submitters under mutex_, spun on by the worker), and
  // whether overflow_ holds submissions (the worker looks once the ring is empty).
  alignas(64) std::atomic<std::uint64_t> tail_{0};
  std::atomic<bool> overflowed_{false};
  // The worker's own stores: ring positions run, submissions finished (once per submission),
  // and what it runs (per kernel).
  alignas(64) std::atomic<std::uint64_t> head_{0};
  std::atomic<std::uint64_t> finished_{0};
  alignas(64) mutable BlockedOn blocked_;  // describe_blocked() announces itself as a reader
  // Slot p % kRing holds ring position p's words: written by submitters, read by the worker.
  // A cache line each: a submitter filling slot p does not take back the line the worker is
  // reading slot p - 1 from (Note [Worker layout]).
  struct alignas(64) Slot {
    Words words;
  };
  std::array<Slot, kRing> ring_;
};

// A stream of `device` running on `lane` (Note [CPU streams]; src/cpu/cpu_stream.cpp).
std::shared_ptr<Stream> make_cpu_stream(CpuHCQDevice& device, CpuHCQDevice& lane, const StreamOptions& options);

class CpuAllocator final : public HCQAllocator<CpuHCQDevice> {
 public:
  explicit CpuAllocator(CpuHCQDevice& device);
  ~CpuAllocator() override;
  std::string describe() const override;

 protected:
  Allocation alloc_impl(std::size_t size, const BufferOptions& options) override;
  void free_impl(Allocation allocation, std::size_t size, const BufferOptions& options) override;
};

class CpuHCQDevice : public HCQCompiled<CpuComputeQueue, CpuCopyQueue>, public CallOrdering {
 public:
  // Makes the device's runtime, which must hand out CpuPrograms (ObjectRuntime does) and tell
  // `ordering` (the device) before each direct Program call.
  using RuntimeFactory = std::function<std::unique_ptr<Runtime>(const std::string& device_name, CallOrdering* ordering)>;

  CpuHCQDevice(const std::string& name, std::unique_ptr<Compiler> compiler, SourceLanguage language,
               const RuntimeFactory& make_runtime);
  ~CpuHCQDevice() override;

  // Note [CPU streams]: a stream runs on a lane, a CpuHCQDevice of its own (two workers started
  // at first use, a timeline that never wraps, kernel-argument pages, a staging ring) that shares
  // this device's compiler, runtime and signal pool. Lanes are kept when their stream is dropped
  // and handed to the next create_stream; at most kMaxStreams streams of one device live at once.
  static constexpr std::size_t kMaxStreams = 64;
  std::shared_ptr<Stream> create_stream(const StreamOptions& options = {}) override;
  // Takes back a lane whose stream is gone and whose work finished (HCQLaneStream's destructor).
  void return_lane(CpuHCQDevice* lane) { lanes_.give_back(lane); }
  // A lane whose stream was dropped with work unfinished (HCQLaneStream's destructor).
  void abandon_lane(CpuHCQDevice* lane) { lanes_.abandon(lane); }
  // The device whose programs this device's queues run: itself, or for a lane its stream's device.
  const std::string& kernels_device() const noexcept { return parent_ ? parent_->name() : name(); }
  // The default queue, then every stream of this device.
  void synchronize() override;


  // Every CPU device's signals: host memory that every CPU queue can reach.
  static const std::shared_ptr<SignalPool>& shared_signal_pool();
  bool can_reach(const SignalPool& pool) const noexcept override { return &pool == shared_signal_pool().get(); }
  // Every live CPU device: any of their queues may use a CPU signal.
  std::vector<TimelineMark> signal_users_now() const override;
  std::uint64_t device_to_cpu_ns(std::uint64_t device_ns, bool) const override { return device_ns; }

  CpuQueueWorker& compute_worker() noexcept { return compute_worker_; }
  const CpuQueueWorker& compute_worker() const noexcept { return compute_worker_; }
  CpuQueueWorker& copy_worker() noexcept { return copy_worker_; }
  CpuAllocator& cpu_allocator() noexcept { return static_cast<CpuAllocator&>(allocator()); }

  // Kernel-argument space for one launch (Note [Kernargs pages] in tinydev/hcq_queue.hpp): valid until the work submitted
  // with it finished. For arguments reused across many submissions, use allocate_kernargs_block.
  Kernargs alloc_kernargs(std::uint32_t num_buffers, std::uint32_t num_values);
  // Host memory the queues read kernel arguments from, owned by the caller (graphs).
  std::shared_ptr<std::byte[]> allocate_kernargs_block(std::size_t bytes) const;

  void before_direct_call() override;
  // Note [Inline replay]: runs a graph's two queues on the calling thread, interleaved in signal
  // order, when the device is idle (its timeline at `before`, the value before the graph's, and
  // both workers idle), and returns true; returns false, running nothing, otherwise. `lock` holds
  // submit_mutex() and is released before the graph runs (everything submitted later waits for
  // the graph's timeline value anyway), so other threads are not held up for the graph's length.
  bool run_inline_if_idle(const CpuComputeQueue& compute, const CpuCopyQueue& copy, std::uint64_t before,
                          std::unique_lock<std::recursive_mutex>& lock);
  // Graphs are native (HCQGraph over these queues).
  bool supports_graph() const noexcept override { return true; }
  std::unique_ptr<Graph> create_graph(std::vector<GraphNode> nodes) override;
  DeviceCapabilities capabilities() const override;
  std::map<std::string, std::string> properties() const override;

 protected:
  void on_timeline_wrapped() override;
  std::string describe_stall() const override;
  bool queues_idle() const override { return compute_worker_.idle() && copy_worker_.idle(); }

 private:
  friend class CpuStream;
  // A stream's lane (Note [CPU streams]).
  CpuHCQDevice(CpuHCQDevice& parent, std::string lane_name);

  CpuQueueWorker compute_worker_;
  CpuQueueWorker copy_worker_;
  KernargsPages kernargs_;
  CpuHCQDevice* parent_ = nullptr;
  StreamLanes<CpuHCQDevice> lanes_;
};

}  // namespace tinydev::cpu

TINYDEV_API_END
