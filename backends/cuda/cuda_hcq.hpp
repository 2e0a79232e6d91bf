// backends/cuda/cuda_hcq.hpp (installed as <tinydev/cuda/cuda_hcq.hpp>): a CUDA GPU as an HCQ
// device (docs/cuda.md). Free of CUDA's headers: driver handles appear as opaque pointers here,
// so code that includes this (the conformance suite) needs no CUDA toolkit.
//
// Note [CUDA queues]
// Each device has two non-blocking streams, one per lane: compute queues run on the compute
// stream, copy queues on the copy stream. Submitting a queue issues its commands on that stream:
// `signal` and `wait` are 64-bit stream memory operations on the signal's slot (neighbouring ones
// in one cuStreamBatchMemOp), `exec` is cuLaunchKernel with the packed argument buffer (the
// driver copies it at launch), `copy` is cuMemcpyAsync (unified addressing: device and pinned host
// memory alike), `timestamp` launches a one-thread kernel that stores %globaltimer. Signal slots
// live in pinned, device-mapped host memory shared by every CUDA device (one pool), so a GPU
// reads and writes them directly and one device's queue can wait on another's signals. A GPU's
// write wakes no host thread: host waiters poll (Note [Polled signals] in tinydev/signal.hpp).
// Where the device lacks 64-bit stream memory operations, signal and wait fall back to
// one-thread kernels on the stream (tinydev_signal stores the value after a system-wide fence,
// tinydev_wait polls the word until GEQ), with the same semantics: the GPU waits, no host thread
// does. Not host functions (cuLaunchHostFunc): the driver may run every stream's host functions
// on one thread, so a wait blocking there would keep another stream's signal from ever running,
// and the driver forbids host functions to wait for other streams' work. Not events either: an
// event cannot stand for a value the host sets, or for a signal not yet submitted.
//
// Note [CUDA failures]
// A driver call that fails while a queue is submitted poisons every signal the rest of that queue
// would have set (their waiters get the driver's error instead of hanging) and throws. A sticky
// error (an illegal address, a failed launch, seen at submit or found by a waiting host) makes the
// context unusable: the device's timeline is poisoned with the driver's error name and string,
// and every later call on the device throws an Error saying so.
//
// Ownership: devices live as long as the process; the primary context each retains is released
// at exit, after finishing its work (Note [CUDA at exit] in cuda_device.cpp). A queue references
// the programs it was recorded with; they must outlive its work (a graph keeps its own alive).
// Thread safety: as HCQCompiled; submissions to one device are serialized by its submit mutex.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tinydev/hcq.hpp"
#include "tinydev/hcq_stream.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::cuda {

struct DeviceState;  // cuda_device.cpp: the context, streams and driver table of one GPU
class CudaHCQDevice;

// A kernel loaded into one GPU's context.
//
// Note [CUDA kernel signatures]
// A launch passes its arguments as one packed buffer (8-byte addresses, then 4-byte values), and
// the GPU reads its parameters from that buffer at the offsets the kernel was compiled with. The
// driver refuses a buffer whose size is not the kernel's (a launch error), but counts that add up
// to that size (two values where a buffer goes) pass, the kernel reads a wrong word as an address,
// and the illegal address that follows poisons the whole context (Note [CUDA failures]); the
// error the size gives names no parameter either. So at load the driver is asked for each parameter's offset and size
// (cuFuncGetParamInfo, drivers of CUDA 12.4 and later): a parameter list of that layout becomes
// the program's signature (grid_index false: a GPU kernel reads its index from the hardware), and
// direct calls, queued execs and graph nodes with other counts are InvalidArgument before
// anything reaches the driver; a list of another layout (an 8-byte parameter after a 4-byte one,
// a 1- or 2-byte value, a struct of another size) cannot be passed at all and load() refuses it.
// The driver gives sizes, not types: a leading 8-byte value (a double) is taken for a buffer and
// a 4-byte struct for a value, which the caller must then pass as such. An older driver tells
// nothing: signature() is nullopt and the caller is trusted, as on the CPU with a bare object.
//
// Note [CUDA program retirement]
// A queued exec and a stream launch refer to their program by a plain pointer, and the kernel
// they launched may not have run yet when the last handle goes; unloading its module then would
// pull the code from under it. So the programs load() hands out are retired, not deleted, when
// their last handle goes: with the timeline value last submitted on the device and on each of its
// stream lanes (and the value covering the last direct call) that had not been reached then. The
// module is unloaded once every one of them is reached or its device is idle (a waited direct
// call's covering value is the one after the value it waited for, which may never be signalled),
// checked when another program retires and at every synchronize of the device. A program with
// nothing in flight is unloaded at once. The unload itself is put off while a stream of the GPU waits
// on the GPU for a signal (Note [CUDA implicit synchronization] in cuda_device.cpp).
class CudaProgram final : public Program {
 public:
  CudaProgram(std::string name, CudaHCQDevice& device, void* module, void* function,
              std::optional<KernelSignature> signature);
  ~CudaProgram() override;

  // Launches on the compute stream, ordered after the work submitted to the device before it
  // (it takes a timeline value). `global` is the grid (blocks), `local` the block (threads).
  std::optional<double> operator()(std::span<const Allocation> buffers, std::span<const std::int32_t> values = {},
                                   const LaunchParams& params = {}) override;

  // The parameter counts the driver reported at load (Note [CUDA kernel signatures]).
  std::optional<KernelSignature> signature() const noexcept override { return signature_; }
  // Throws InvalidArgument when `buffers` and `values` are not the kernel's counts (where known).
  void check_counts(std::size_t buffers, std::size_t values) const {
    if (signature_ && (buffers != signature_->num_buffers || values != signature_->num_values)) [[unlikely]]
      throw_wrong_counts(buffers, values);
  }

  const std::string& device() const noexcept;
  void* function() const noexcept { return function_; }  // the CUfunction
  const std::string& launch_what() const noexcept { return launch_what_; }  // "launching 'name'", for errors

  // What load() hands out: a program its last handle retires (Note [CUDA program retirement]).
  static std::shared_ptr<CudaProgram> make(std::string name, CudaHCQDevice& device, void* module, void* function,
                                           std::optional<KernelSignature> signature);
  // Unloads the retired programs whose work has all run (Note [CUDA program retirement]).
  static void reclaim_retired();

 private:
  static void retire(CudaProgram* program);
  [[noreturn]] void throw_wrong_counts(std::size_t buffers, std::size_t values) const;
  CudaHCQDevice& device_;
  void* module_;    // CUmodule
  void* function_;  // CUfunction
  std::optional<KernelSignature> signature_;
  std::string launch_what_;
  std::atomic<std::uint64_t> last_direct_value_{0};  // a timeline value at or after the last direct call's
  // Set before a retired program is deleted: its work ran (reached marks, or an idle device), so
  // ~CudaProgram waits for nothing (it may run under a submit mutex).
  bool work_done_ = false;
};

// A copy between host memories that a host function makes on a stream (cuLaunchHostFunc): how a
// lane's copyout reaches the caller's pageable memory (Note [CUDA copyout without blocking] in
// cuda_device.cpp, which defines it).
struct HostCopy;
class CaptureBlock;  // memory a copyin's bytes are captured in (cuda_device.cpp)

// One recorded command (a queue's word). Which fields matter depends on `kind`.
struct CudaCommand {
  CommandKind kind{};
  SignalSlot* slot = nullptr;  // signal, wait, timestamp (its address is also the GPU's: Note [CUDA queues])
  std::uint64_t value = 0;
  const CudaProgram* program = nullptr;  // exec
  const std::byte* kernargs = nullptr;
  std::uint32_t kernarg_bytes = 0;
  Dim3 global{1, 1, 1}, local{1, 1, 1};
  std::uint64_t dest = 0, src = 0, size = 0;  // copy
  // copy: made by a host function instead (dest, src and size unused); a record of the lane's.
  const HostCopy* host_copy = nullptr;
};

enum class CudaLane : std::uint8_t { compute, copy };

// A non-owning reference to a callable `int(void* stream)` (a CUresult-returning driver call on
// the stream): what CudaHCQDevice::run_ordered runs, without allocating on the launch path. The
// callable must outlive the call it is passed to.
class StreamWork {
 public:
  template <class F>
  StreamWork(F& f) noexcept  // NOLINT: implicit, like std::function_ref
      : callable_(&f), call_([](void* c, void* stream) { return (*static_cast<F*>(c))(stream); }) {}
  int operator()(void* stream) const { return call_(callable_, stream); }

 private:
  void* callable_;
  int (*call_)(void*, void*);
};

struct CudaSignalPrimitives {
  static CudaCommand signal(const Signal& s, std::uint64_t v) { return {.kind = CommandKind::signal, .slot = &s.slot(), .value = v}; }
  static CudaCommand wait(const Signal& s, std::uint64_t v) { return {.kind = CommandKind::wait, .slot = &s.slot(), .value = v}; }
  static CudaCommand timestamp(const Signal& s) { return {.kind = CommandKind::timestamp, .slot = &s.slot()}; }
  static void update(CudaCommand& c, const std::optional<Signal>& s, const std::optional<std::uint64_t>& v) {
    if (s) c.slot = &s->slot();
    if (v) c.value = *v;
  }
};

class CudaComputeQueue final : public HWComputeQueue<CudaComputeQueue, CudaCommand, CudaProgram> {
  // The primitives (tinydev/hcq_concepts.hpp): public for the concept checks; only the queue
  // templates call them.
 public:
  void _signal(const Signal& s, std::uint64_t v) { mutable_commands().push_back(CudaSignalPrimitives::signal(s, v)); }
  void _wait(const Signal& s, std::uint64_t v) { mutable_commands().push_back(CudaSignalPrimitives::wait(s, v)); }
  void _timestamp(const Signal& s) { mutable_commands().push_back(CudaSignalPrimitives::timestamp(s)); }
  void _exec(const CudaProgram& program, const Kernargs& kernargs, Dim3 global, Dim3 local);
  void _update_signal(std::size_t cmd, const std::optional<Signal>& s, const std::optional<std::uint64_t>& v) {
    CudaSignalPrimitives::update(*command_words(cmd), s, v);
  }
  void _update_wait(std::size_t cmd, const std::optional<Signal>& s, const std::optional<std::uint64_t>& v) {
    CudaSignalPrimitives::update(*command_words(cmd), s, v);
  }
  void _update_exec(std::size_t cmd, Dim3 global, Dim3 local);
  void _submit(Compiled& device);
};

class CudaCopyQueue final : public HWCopyQueue<CudaCopyQueue, CudaCommand> {
 public:
  void _signal(const Signal& s, std::uint64_t v) { mutable_commands().push_back(CudaSignalPrimitives::signal(s, v)); }
  void _wait(const Signal& s, std::uint64_t v) { mutable_commands().push_back(CudaSignalPrimitives::wait(s, v)); }
  void _timestamp(const Signal& s) { mutable_commands().push_back(CudaSignalPrimitives::timestamp(s)); }
  void _copy(const Allocation& dest, const Allocation& src, std::size_t size) {
    mutable_commands().push_back(
        CudaCommand{.kind = CommandKind::copy, .dest = dest.va_addr, .src = src.va_addr, .size = size});
  }
  void _update_signal(std::size_t cmd, const std::optional<Signal>& s, const std::optional<std::uint64_t>& v) {
    CudaSignalPrimitives::update(*command_words(cmd), s, v);
  }
  void _update_wait(std::size_t cmd, const std::optional<Signal>& s, const std::optional<std::uint64_t>& v) {
    CudaSignalPrimitives::update(*command_words(cmd), s, v);
  }
  void _update_copy(std::size_t cmd, const std::optional<Allocation>& dest, const std::optional<Allocation>& src);
  void _submit(Compiled& device);
};

// Device memory (cuMemAlloc) behind the LRU cache; host=true is pinned, device-mapped host memory
// (cuMemHostAlloc), which the staging ring's slots are too.
class CudaAllocator final : public HCQAllocator<CudaHCQDevice> {
 public:
  // `device_memory` (the GPU's) is the cache's default bound (Note [CUDA cache bound]);
  // `staging_slots` the ring's slots of kDefaultBatchSize (a lane's is smaller than a device's).
  CudaAllocator(CudaHCQDevice& device, std::uint64_t device_memory, std::size_t staging_slots = kDefaultBatchCount);
  ~CudaAllocator() override;
  std::string describe() const override;
  // Pinned host buffers (host=true, tagged by their Allocation::backend): copies to and from them
  // are the host's own memcpy where the device allows (idle for copyin, after the queued work for
  // copyout), never a host-to-host cuMemcpyAsync, which the driver runs synchronously (Note [CUDA
  // host-to-host copies] in cuda_device.cpp); as_buffer maps them.
  bool host_visible(const Allocation& allocation) const noexcept override;
  static void* pinned_tag() noexcept;  // the Allocation::backend of pinned host buffers

 protected:
  Allocation alloc_impl(std::size_t size, const BufferOptions& options) override;
  void free_impl(Allocation allocation, std::size_t size, const BufferOptions& options) override;
};

class CudaHCQDevice final : public HCQCompiled<CudaComputeQueue, CudaCopyQueue> {
 public:
  CudaHCQDevice(const std::string& name, std::shared_ptr<DeviceState> state);
  // A stream's lane (Note [CUDA streams] in cuda_stream.cpp): streams, timeline, staging ring and
  // kernel arguments of its own; the parent's context, compiler, runtime, programs and signals.
  CudaHCQDevice(CudaHCQDevice& parent, const std::string& lane_name);
  ~CudaHCQDevice() override;

  // Streams run on lanes, made on first use and reused (at most kMaxStreams alive at once).
  std::shared_ptr<Stream> create_stream(const StreamOptions& options = {}) override;
  static constexpr std::size_t kMaxStreams = 64;
  // Takes back a lane whose stream is gone and whose work finished (HCQLaneStream's destructor).
  void return_lane(CudaHCQDevice* lane) {
    lane->release_host_copies(false);  // its work finished: a copyin's captured bytes go now, spares too
    lanes_.give_back(lane);
  }
  // A lane whose stream was dropped with work unfinished (HCQLaneStream's destructor).
  void abandon_lane(CudaHCQDevice* lane) { lanes_.abandon(lane); }
  // Calls f(lane) for each stream lane made on this device so far.
  template <class F>
  void for_each_lane(F&& f) {
    lanes_.for_each(std::forward<F>(f));
  }
  // The default queue, then every stream of this device (a stream's failure stays the stream's).
  void synchronize() override;
  // The device whose programs this device's queues run: itself, or a lane's parent.
  const CudaHCQDevice& programs_device() const noexcept { return parent_ ? *parent_ : *this; }
  CudaHCQDevice& context_device() noexcept { return parent_ ? *parent_ : *this; }

  // Note [CUDA implicit synchronization] (cuda_device.cpp): what the driver may free only after
  // every stream of the context finished. Releases `handle` (a device pointer, a pinned host
  // pointer or a CUmodule) now, or, while a stream of this GPU (the device's or a stream's lane)
  // holds a GPU wait that has not passed, later: at the next release, refused allocation or
  // synchronize that finds none. Driver errors of a release made now throw (a deferred one's are
  // logged). Thread-safe; any device of the context may be called.
  enum class DriverRelease : std::uint8_t { device_memory, host_memory, module };
  void release_when_unblocked(DriverRelease kind, std::uintptr_t handle, std::size_t bytes);
  // Makes the deferred releases if no stream of the GPU holds a GPU wait now; returns how many.
  std::size_t release_deferred();
  // The same, trying until `timeout` while some are deferred; whether any was made.
  bool release_deferred_within(std::chrono::milliseconds timeout);
  // The bytes of device memory whose release is deferred.
  std::size_t deferred_device_bytes() const;
  // Pinned host memory mapped into every context (cuMemHostAlloc PORTABLE|DEVICEMAP), `bytes` of
  // it for `what` (named in the error); a refused one is tried again once after the deferred
  // releases were made, without waiting for them (callers may hold the submit mutex).
  void* alloc_pinned(std::size_t bytes, std::string_view what);
  bool is_lane() const noexcept { return parent_ != nullptr; }
  // Note [CUDA lazy loading] (cuda_device.cpp): says, before `kernel` is loaded, that the load may
  // wait for a stream of the GPU held by a GPU wait: once per GPU as a warning, every time at
  // TINYDEV_DEBUG=1. Thread-safe.
  void note_kernel_load(std::string_view kernel);

  // Every CUDA device's signals: pinned, device-mapped host memory all of them reach.
  bool can_reach(const SignalPool& pool) const noexcept override;
  std::vector<TimelineMark> signal_users_now() const override;
  std::uint64_t device_to_cpu_ns(std::uint64_t device_ns, bool is_copy) const override;

  // Issues `commands` on the lane's stream (Note [CUDA queues], Note [CUDA failures]).
  void submit_commands(CudaLane lane, std::span<const CudaCommand> commands);
  // A stream's copyout that returns at once (Note [CUDA copyout without blocking] in
  // cuda_device.cpp): on this lane's copy stream, after its timeline's last value and `waits`,
  // `src` (exactly dest.size() bytes) through pinned bounce memory into `dest`, then the
  // timeline's next value, which it returns. The caller holds submit_mutex() and keeps `dest`
  // alive and `src` allocated until that value is reached.
  std::uint64_t submit_copyout_later(std::span<std::byte> dest, const Allocation& src,
                                     std::span<const std::pair<Signal, std::uint64_t>> waits);
  // The same for a copyin: `src` is read before this returns, then goes through the bounce memory
  // by host functions (into a pinned `dest`, directly) on the copy stream.
  std::uint64_t submit_copyin_later(const Allocation& dest, std::span<const std::byte> src,
                                    std::span<const std::pair<Signal, std::uint64_t>> waits);
  // Lets go of the host copies (a copyin's captured bytes among them) whose work ran, on a lane
  // without a fault; a stream calls it before each operation, the lane's return after its work
  // (which also unmaps the captures kept for reuse: `keep_spare_captures` false).
  void release_host_copies(bool keep_spare_captures = true);
  // Launches a program outside any queue, ordered on the timeline (CudaProgram::operator()).
  std::optional<double> launch_direct(const CudaProgram& program, const std::byte* args, std::uint32_t bytes,
                                      Dim3 global, Dim3 local, bool timed);
  // Runs `work(compute stream)` (a CUresult-returning driver call) ordered on the timeline: after
  // everything submitted before, before everything submitted after. Untimed work takes no
  // timeline value of its own (Note [Lazy timeline signals] in tinydev/hcq_device.hpp). A
  // failure throws `what` with the driver's error (a sticky one fails the device); the timeline
  // moves on either way. Returns the seconds between events around the work when `timed` (then
  // it waits for it). When profiling, the work's span goes in the trace under `profile_name`.
  std::optional<double> run_ordered(StreamWork work, std::string_view what, bool timed,
                                    std::string_view profile_name = {});
  // Before a transfer from this device to `dest`: enables peer access both ways once where the
  // GPUs allow it (HCQAllocator::transfer calls it) and returns whether this device's copy stream
  // reaches dest's memory (the same GPU, or peers); false: the transfer is staged through dest's
  // staging ring (Note [Staged transfers]). TINYDEV_DEBUG>=2 says which path copies.
  bool prepare_transfer(CudaHCQDevice& dest);

  Kernargs alloc_kernargs(std::uint32_t num_buffers, std::uint32_t num_values);
  std::shared_ptr<std::byte[]> allocate_kernargs_block(std::size_t bytes) const;

  // Native CUDA graphs (Note [CUDA graph replay] in cuda_graph.cpp).
  bool supports_graph() const noexcept override { return true; }
  std::unique_ptr<Graph> create_graph(std::vector<GraphNode> nodes) override;
  DeviceCapabilities capabilities() const override;
  std::map<std::string, std::string> properties() const override;

  DeviceState& state() const noexcept { return *state_; }
  // The GPU's memory (cuDeviceTotalMem at open): its allocator's cache bound (Note [CUDA cache bound]).
  std::uint64_t total_memory() const noexcept;
  // The GPU's memory free now, for every process on it (cuMemGetInfo): what a large allocation can
  // still get, before this device's cache is emptied. Error if the driver call fails.
  std::uint64_t free_memory() const;
  // Throws the Error of a sticky failure seen earlier (Note [CUDA failures]), the DeviceFault of
  // one recover() clears, nothing otherwise.
  void throw_if_failed() const;
  // A driver call for this device failed with CUresult `result`: if the error is sticky (the
  // context is unusable from now on), the device is marked failed and its timeline poisoned with
  // `reason`, as a failed launch does (Note [CUDA failures]). Any thread.
  void note_if_sticky(int result, std::string_view reason) const noexcept;
  // Note [CUDA recovery]: after a sticky driver error the context is unusable and the driver
  // offers no way back short of destroying it: recover() refuses then; other faults (a poisoned
  // signal this device waited for) recover as on the CPU.
  std::string recover(std::chrono::milliseconds timeout = default_wait_timeout()) override;

 protected:
  void on_timeline_wrapped() override;
  void signal_lazy_work(std::uint64_t value) override;
  void check_health() const override;
  // Under the lane's host-copy mutex (Note [CUDA copyout without blocking]).
  void poison_own_timeline(std::string_view reason) const noexcept override;

 private:
  std::string recovery_hint() const override;
  // Both streams finished what they hold (recover() drains them first).
  bool queues_idle() const override;
  int launch_timestamp(SignalSlot* slot, void* stream);  // the CUresult of the timestamp kernel's launch
  // Note [CUDA waits on failed signals] (cuda_device.cpp): the submissions of this device whose
  // GPU waits have not all passed, with what each signals after them.
  friend class FailedWaitWatcher;
  struct PendingOp {
    SignalSlot* slot;
    std::uint64_t value;
    std::uint32_t reuses;  // the slot's SignalSlot::reuses then: a slot handed out again is not touched
    std::uint32_t command;  // its index in the submission
    bool is_wait;
    // The signal was freed and handed out again since: the record says nothing about it any more.
    bool stale() const noexcept { return slot->stale_since(reuses); }
  };
  static constexpr std::size_t kNotFailed = ~std::size_t{0};
  struct PendingSubmission {
    std::uint64_t id;
    CudaLane lane;
    // Its waits not reached when submitted, and the signals after the first of them, in order.
    std::vector<PendingOp> ops;
    bool issuing = true;  // submit_commands has not finished issuing it
    std::size_t failed_at = kNotFailed;  // the earliest failed wait in ops: the signals after it are poisoned
  };
  struct Release {  // a failed wait to let go: `slot` gets `value`
    SignalSlot* slot;
    std::uint64_t value;
    std::uint32_t reuses;
  };
  // Records `commands` if they wait on another signal that has not reached the value, or wait on
  // the timeline and then signal another signal; returns its id (0: nothing recorded).
  std::uint64_t note_gpu_waits(CudaLane lane, std::span<const CudaCommand> commands);
  // The submission is issued up to (not including) command `issued_end`: what came after never
  // reached the GPU.
  void issued_gpu_waits(std::uint64_t id, std::size_t issued_end) noexcept;
  // The watcher's side: marks the submissions with a failed wait and poisons what they signal
  // after it; appends the waits of marked submissions that still need their signal written,
  // dropping the marked ones whose stream went idle (the driver is asked).
  void fail_gpu_waits();
  bool collect_releases(std::vector<Release>& releases);
  // Drops the ops whose signal was handed out again, keeping failed_at in place; whether the
  // record is still needed (it waits on something, or is being issued).
  static bool drop_stale_ops(PendingSubmission& p) noexcept;
  // After recover(): the queues drained, so the failed submissions' waits all passed.
  void forget_failed_gpu_waits() noexcept;
  mutable std::mutex pending_mutex_;
  std::deque<PendingSubmission> pending_;
  std::uint64_t pending_ids_ = 0;
  // Whether one of this device's submissions holds a GPU wait that has not passed (its record),
  // not counting waits on the signals in `ignoring`.
  bool holds_unpassed_gpu_waits(std::span<const SignalSlot* const> ignoring = {}) const;
  // The same for every stream of the context: this device's parent and all its lanes.
  bool context_holds_gpu_waits(std::span<const SignalSlot* const> ignoring = {});
  struct DeferredRelease {
    DriverRelease kind;
    std::uintptr_t handle;
    std::size_t bytes;
  };
  void release_now(const DeferredRelease& release) const;  // the driver call; throws its error
  // On the context's device (context_device()): releases deferred (Note [CUDA implicit synchronization]).
  mutable std::mutex deferred_mutex_;
  std::vector<DeferredRelease> deferred_;
  // On the context's device: the threads between the check for GPU waits and the end of the
  // driver releases it allowed (DriverReleaseWindow in cuda_device.cpp), each by a ticket. A
  // submission with a GPU wait issues it only once the windows open when it recorded the wait
  // closed, so it cannot hold a release already past its check; later windows see its record.
  struct ReleaseWindows {
    std::atomic<unsigned> open{0};  // how many are open: a submission's fast path reads it alone
    std::mutex mutex;
    std::condition_variable closed;
    std::uint64_t last_ticket = 0;             // under mutex
    std::vector<std::uint64_t> open_tickets;   // under mutex
  };
  mutable ReleaseWindows release_windows_;
  friend class DriverReleaseWindow;
  // Returns once the driver releases of the context past their check now have returned
  // (submit_commands, after recording its GPU waits).
  void wait_for_driver_releases() const;
  // Profiling spans around stream work (each returns a CUresult; see cuda_device.cpp).
  int begin_span(std::optional<ProfileRecord>& span, std::string_view name, void* stream);
  int end_span(std::optional<ProfileRecord>& span, void* stream);
  void drop_span(std::optional<ProfileRecord>& span);
  std::shared_ptr<DeviceState> state_;
  KernargsPages kernargs_;
  struct HostCopies;  // Note [CUDA copyout without blocking]: a lane's bounce memory and host copies
  std::unique_ptr<HostCopies> host_copies_;  // a lane's, from its construction; nullptr on a device
  // Poisons `slot` (the timeline's: holding the host-copy mutex, Note [CUDA copyout without blocking]).
  void poison_timeline(SignalSlot& slot, std::string_view reason) const;
  // The lane's host copies, records its timeline passed let go, the bounce at least `bounce_bytes`
  // (submit mutex held). InvalidArgument on a device that is not a lane, naming `what`.
  HostCopies& host_copies_for(std::size_t bounce_bytes, std::string_view what);
  // Submits on the copy stream, after the timeline's last value and `waits`, what
  // `fill(value, commands)` appends, then the timeline's next value, which it returns (submit
  // mutex held).
  template <class Fill>
  std::uint64_t submit_on_copy_stream(std::span<const std::pair<Signal, std::uint64_t>> waits, Fill&& fill);
  // Appends a host function copying `n` bytes, a record of the lane's until `value` is passed
  // (Note [CUDA copyout without blocking]). `unless_poisoned`: not made once the timeline was
  // poisoned before `value`. `capture`: memory the record takes and keeps (a copyin's captured
  // bytes) until its copy ran.
  void add_host_copy(std::vector<CudaCommand>& commands, std::uint64_t value, std::byte* to, const std::byte* from,
                     std::size_t n, bool unless_poisoned, CaptureBlock* capture = nullptr);
  // Before a copyin captures `bytes` more: waits until the lane holds few enough captured bytes
  // (Note [CUDA copyin captures]); Timeout after TINYDEV_WAIT_TIMEOUT_MS (submit mutex held).
  void wait_for_capture_room(std::size_t bytes);
  CudaHCQDevice* parent_ = nullptr;  // a lane's device
  StreamLanes<CudaHCQDevice> lanes_;
  // The compute stream's order covers the timeline's last value (it was signalled or waited for
  // there): direct calls need no wait before them.
  bool last_signal_on_compute_ = true;
  std::uint32_t lazy_calls_ = 0;  // direct calls since the last timeline signal
  std::uint64_t lazy_calls_total_ = 0;  // direct calls ever made (untimed)
  struct LazyMark {
    std::uint64_t value = 0;  // a lazy signal's timeline value (0: none)
    std::uint64_t calls = 0;  // lazy_calls_total_ when it was signalled
  };
  std::array<LazyMark, 4> lazy_marks_{};  // the last lazy signals
  std::size_t lazy_mark_next_ = 0;
  std::int64_t clock_offset_ns_ = 0;    // host ns - %globaltimer ns, measured at open
  std::atomic<bool> warned_of_lazy_loading_{false};  // on the context's device (Note [CUDA lazy loading])
  mutable std::atomic<bool> context_failed_{false};  // a sticky driver error happened (Note [CUDA recovery])
};

// A stream of `device` running on `lane` (Note [CUDA streams]; cuda_stream.cpp).
std::shared_ptr<Stream> make_cuda_stream(CudaHCQDevice& device, CudaHCQDevice& lane, const StreamOptions& options);
// Whether `graph` is a native graph `device`'s create_graph made (cuda_graph.cpp).
bool is_cuda_graph_of(const Graph& graph, const CudaHCQDevice& device) noexcept;
// The PTX of the queue kernels every device loads at open (tinydev_timestamp, tinydev_signal,
// tinydev_wait; Note [CUDA queues]), for the tests to assemble where no GPU can load it.
std::string_view queue_kernels_ptx() noexcept;

}  // namespace tinydev::cuda

TINYDEV_API_END
