// The CUDA backend's device: one retained primary context per GPU, an HCQ device over two streams
// (cuda_hcq.hpp, Note [CUDA queues]), device memory behind the LRU cache with a pinned staging
// ring, CUDA C++ compiled by NVRTC (cuda_compiler.cpp). Everything goes through the driver table of
// cuda_api.hpp (Note [CUDA at run time]): a build with this backend runs on machines without a
// GPU, where opening CUDA is a DeviceUnavailable saying why and the default-device probe moves on.
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "cuda_api.hpp"
#include "cuda_compiler.hpp"
#include "cuda_hcq.hpp"
#include "cuda_state.hpp"
#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/device.hpp"
#include "tinydev/error.hpp"
#include "tinydev/log.hpp"
#include "tinydev/profile.hpp"

namespace tinydev {
namespace cuda {

// The one thread that lets GPU waits on failed signals go (Note [CUDA waits on failed signals]).
// Never destroyed (devices outlive static destructors); started by the first device.
class FailedWaitWatcher {
 public:
  // Starts the thread once; DeviceUnavailable if it cannot.
  static void start();
  // The signal pool's on_poison: hands the poison on and returns (any thread, under any locks).
  static void on_poison(SignalSlot& slot) noexcept;

 private:
  FailedWaitWatcher();
  [[noreturn]] void run();
  // One pass under the live-devices mutex; whether failed waits are left whose streams still run.
  bool pass(std::uint64_t& seen, std::chrono::milliseconds& tick);
  static std::atomic<FailedWaitWatcher*> instance_;
  const pid_t pid_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<std::uint64_t> poisons_{0};  // poisons of CUDA signals so far
  std::vector<CudaHCQDevice::Release> releases_;  // the watcher thread's only
};


namespace {

// ---- the shared signal pool -------------------------------------------------------------------

// Note [CUDA signal memory]
// Slots are pinned (the GPU writes them over PCIe without the driver paging anything), mapped
// into every context (PORTABLE | DEVICEMAP), and under unified addressing their device address is
// their host address, which is what a queue's commands use; a driver that maps them elsewhere is
// refused at open.
const DeviceState* g_signal_owner_of_pool = nullptr;  // set with the pool (Note [CUDA at exit])

// Makes `state`'s context current for a scope and then restores the thread's previous one: the
// signal pool grows from inside another device's submit (a profiling span's signals), whose
// next driver calls need that device's context.
class ContextSwitch {
 public:
  explicit ContextSwitch(const DeviceState& state) : api_(state.api) {
    if (api_.cuCtxGetCurrent(&previous_) != CUDA_SUCCESS) previous_ = nullptr;
    state.make_current();
    switch_back_ = previous_ != nullptr && previous_ != state.context;
  }
  ~ContextSwitch() {
    if (switch_back_) api_.cuCtxSetCurrent(previous_);
  }
  ContextSwitch(const ContextSwitch&) = delete;
  ContextSwitch& operator=(const ContextSwitch&) = delete;

 private:
  const Driver& api_;
  CUcontext previous_ = nullptr;
  bool switch_back_ = false;
};

// Pinned host memory mapped into every context at its own address (Note [CUDA signal memory]), as
// GPU signals and waits on it need: signal slots, and the word probing them (Note [Probing stream
// memory operations]). DeviceUnavailable where the driver maps it elsewhere.
void* alloc_mapped_at_host_address(const DeviceState& state, std::size_t bytes, std::string_view what) {
  void* p = nullptr;
  check(state.api.cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP),
        fmt::format("cuMemHostAlloc of {} bytes for {}", bytes, what), state.name);
  CUdeviceptr mapped = 0;
  const CUresult r = state.api.cuMemHostGetDevicePointer(&mapped, p, 0);
  if (r != CUDA_SUCCESS || mapped != reinterpret_cast<CUdeviceptr>(p)) {
    state.api.cuMemFreeHost(p);
    throw DeviceUnavailable(fmt::format("{}: {} is not mapped at its host address ({}): tinydev needs unified "
                                        "addressing (a 64-bit process on a GPU that has it)",
                                        state.name, what, r == CUDA_SUCCESS ? "mapped elsewhere" : describe(r)));
  }
  return p;
}

// The stream memory operations queues issue (Note [CUDA queues]): a 64-bit write, and a wait until
// the word is at least the value.
CUstreamBatchMemOpParams write_value_op(CUdeviceptr address, std::uint64_t value) {
  CUstreamBatchMemOpParams op{};
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  op.writeValue.address = address;
  op.writeValue.value64 = value;
  op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return op;
}
CUstreamBatchMemOpParams wait_value_op(CUdeviceptr address, std::uint64_t value) {
  CUstreamBatchMemOpParams op{};
  op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
  op.waitValue.address = address;
  op.waitValue.value64 = value;
  op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
  return op;
}

const std::shared_ptr<SignalPool>& shared_signal_pool(const std::shared_ptr<DeviceState>& first) {
  // The first device's context owns the slots' memory (g_signal_owner_of_pool, Note [CUDA at exit]).
  static auto* pool = (g_signal_owner_of_pool = first.get(), new std::shared_ptr<SignalPool>(std::make_shared<SignalPool>(
      "CUDA", SignalMemory{.allocate =
                               [state = first](std::size_t bytes) -> void* {
                                 const ContextSwitch in_owner(*state);
                                 return alloc_mapped_at_host_address(*state, bytes, "signal memory");
                               },
                           .release =
                               [state = first](void* memory, std::size_t) {
                                 if (!state->released.load()) state->api.cuMemFreeHost(memory);
                               },
                           .device_writes_without_wake = true,
                           .on_poison = &FailedWaitWatcher::on_poison})));
  return *pool;
}

// The live CUDA devices (they share one signal pool), for signal_users_now and release at exit.
struct LiveDevices {
  std::mutex mutex;
  std::vector<CudaHCQDevice*> devices;
};
LiveDevices& live_devices() {
  static auto* live = new LiveDevices;  // never destroyed: devices outlive static destructors
  return *live;
}

CudaHCQDevice& cuda_device(Compiled& device, std::string_view queue) {
  auto* cuda = dynamic_cast<CudaHCQDevice*>(&device);
  if (!cuda)
    throw InvalidArgument(fmt::format("cannot submit a CUDA {} queue to {}: it runs on CUDA devices only", queue,
                                      device.name()));
  cuda->check_not_forked();  // a forked child must not reach the driver (Note [Devices and fork])
  return *cuda;
}

template <class Queue>
void check_pools(const Queue& queue, const CudaHCQDevice& device) {
  for (const SignalPool* pool : queue.pools())
    if (!device.can_reach(*pool))
      throw InvalidArgument(fmt::format("cannot submit to {}: the queue uses a signal of pool '{}', which a GPU "
                                        "cannot reach; use signals from a CUDA device's alloc_signal()",
                                        device.name(), pool->name()));
}

// The queue kernels, one thread each. PTX, so the driver JITs them for any GPU it supports.
// tinydev_timestamp(u64* out): *out = %globaltimer (ns).
// tinydev_signal(u64* word, u64 value): makes the work before it visible system-wide, then stores.
// tinydev_wait(u64* word, u64 value): spins until (s64)(*word - value) >= 0, the GEQ of
// cuStreamWaitValue64, reading the word from memory each time (volatile: pinned host memory that
// the host or another GPU writes).
constexpr char kQueuePtx[] = R"(.version 8.0
.target sm_50
.address_size 64
.visible .entry tinydev_timestamp(.param .u64 out)
{
  .reg .b64 %rd<3>;
  ld.param.u64 %rd1, [out];
  mov.u64 %rd2, %globaltimer;
  st.volatile.u64 [%rd1], %rd2;
  ret;
}
.visible .entry tinydev_signal(.param .u64 word, .param .u64 value)
{
  .reg .b64 %rd<3>;
  ld.param.u64 %rd1, [word];
  ld.param.u64 %rd2, [value];
  membar.sys;
  st.volatile.u64 [%rd1], %rd2;
  membar.sys;
  ret;
}
.visible .entry tinydev_wait(.param .u64 word, .param .u64 value)
{
  .reg .b64 %rd<5>;
  .reg .pred %p;
  ld.param.u64 %rd1, [word];
  ld.param.u64 %rd2, [value];
POLL:
  ld.volatile.u64 %rd3, [%rd1];
  sub.s64 %rd4, %rd3, %rd2;
  setp.lt.s64 %p, %rd4, 0;
  @%p bra POLL;
  membar.sys;
  ret;
}
)";

// The most bytes of packed arguments a launch takes (the driver's limit for kernel parameters on
// Volta and later, CUDA 12.1 and later).
constexpr std::size_t kMaxArgumentBytes = 32764;
// Note [CUDA queue depth]: past this many timeline values in flight, a submit first waits.
constexpr std::uint64_t kMaxInFlight = 1000;
// Direct calls between two timeline signals at most (Note [Lazy timeline signals]).
constexpr std::uint32_t kLazySignalEvery = 256;

void check_sizes(const std::string& kernel, const std::string& device, Dim3 g, Dim3 l) {
  if (grid_size(g) == 0 || grid_size(l) == 0)
    throw InvalidArgument(fmt::format("{} on {}: global size ({},{},{}) and local size ({},{},{}) may have no zero "
                                      "dimension",
                                      kernel, device, g[0], g[1], g[2], l[0], l[1], l[2]));
}

}  // namespace

// ---- copies into host memory by host functions ---------------------------------------------------

// Note [CUDA copyout without blocking]
// A stream's copyout returns at once with the Event of its bytes (tinydev/stream.hpp), but the
// caller's memory is pageable, and the driver's cuMemcpyAsync into pageable memory returns only
// once its stream ran the copy: behind the stream's event waits, which may be for an event the
// calling thread completes later, and with no timeout. So a copyout that cannot run at once (its
// lane is busy, or waits for an event not yet complete) goes on the lane's copy stream as: its
// waits; a cuMemcpyAsync of the source into pinned bounce memory, which is truly asynchronous; a
// host function (cuLaunchHostFunc) copying the bounce into the caller's memory; then the timeline
// signal, so the Event completes once the bytes are there. A source larger than the bounce goes in
// chunks, each a copy then a host function; the bounce is reused with no host wait, because all
// that uses it is in order on the one copy stream. A pinned source needs no bounce: one host
// function copies it. A host function calls no CUDA function (as the driver requires) and only
// copies; the driver may run every stream's host functions on one thread, so one waits for the
// copies queued before it, at most a bounce (4 MiB) per lane. The bounce grows by powers of two
// from 64 KiB to 4 MiB as copyouts need (a lane's pinned memory stays under 8 MiB with the
// outgrown ones, like its staging ring), kept until exit: freeing pinned memory may synchronize
// the context, behind waits for events not yet complete.
// What a host function copies is a record of its lane (stable in a deque), dropped once the
// lane's timeline passed its value: on a healthy lane that means its host function ran (a faulted
// lane submits nothing until recover(), which first drains its streams). Once the lane's timeline
// is poisoned (a failed submission, a sticky error), the Events of the copyouts queued before
// and not finished report the failure for good (Note [Events after a poison] in src/stream.cpp),
// and the caller may free their memory: so a host function copies only while the timeline is not
// poisoned, or was poisoned at a value its own has reached, holding the lane's host-copy mutex,
// and whoever poisons the timeline holds that mutex while doing so. No host function is then
// copying when anyone sees the poison, and none whose Event failed copies after. An idle stream (nothing queued, its waits complete,
// run_inline_when_idle) copies out through the staging ring instead (cuda_stream.cpp): complete
// on return, and faster for large copies, since the GPU's copy of one chunk overlaps the host's
// copy of the one before.
// A copyin on a busy lane is the mirror image: the caller's bytes are read into memory of the
// lane's before it returns (copyin's contract), then on the copy stream a host function copies
// each chunk into the bounce and a cuMemcpyAsync moves it to the GPU. Through the ring it would
// wait for slots the stream's earlier work still holds (a lane has 4), and into a pinned Buffer
// the driver's host-to-host cuMemcpyAsync is synchronous: both would block the caller behind the
// stream's event waits.
//
// Note [CUDA copyin captures]
// The bytes a busy lane's copyins captured are held until the timeline passed their copy. A
// producer feeding a stream that waits for an event nobody completes yet would otherwise grow
// them without bound (a serving loop copying requests in faster than the GPU takes them). So a
// lane holds at most kMaxCapturedBytes (64 MiB) of them: a copyin that would go past waits first
// for the earliest ones to be copied, as a submission past the queue depth waits (Note [CUDA queue
// depth]), and throws Timeout after TINYDEV_WAIT_TIMEOUT_MS saying so. One copyin larger than the limit is taken once
// nothing else is held. The limit is per lane, so at most 64 streams x 64 MiB at once; a copyin
// that runs on the caller (an idle lane, run_inline_when_idle) captures nothing: it is copied
// through the ring before the call returns.
// The captures are anonymous mappings (CaptureBlock), with huge pages advised from 2 MiB on, and a
// lane keeps those whose copies ran for its next copyins while they and the queued ones stay
// within the same 64 MiB (a copyin that fits none unmaps spares, oldest first, to stay within
// it); they are unmapped when the lane is given back (a lane taken back after its dropped
// stream's work finished keeps them for its next stream). Fresh memory for each copyin
// made the call page-fault its way through the bytes: 64 MiB took 230 ms here, against 4 ms for a
// memcpy into memory already faulted in (bench_cuda: "the call returns").

struct HostCopy {
  std::byte* dest;
  const std::byte* src;
  std::size_t size;
  // Into memory the caller may free once told of a failure (a copyout's destination, a pinned
  // Buffer): the lane's timeline, and the copy is not made once it is poisoned. nullptr: into the
  // lane's bounce (a copyin's), always made.
  const SignalSlot* timeline;
  std::uint64_t value;  // the timeline value its copy's Event waits for
  std::mutex* mutex;    // the lane's host-copy mutex
};

namespace {

constexpr std::size_t kMinBounceBytes = std::size_t{64} << 10;
constexpr std::size_t kMaxBounceBytes = std::size_t{4} << 20;
// Note [CUDA copyin captures]: the most bytes of callers' copyins a lane holds queued.
constexpr std::size_t kMaxCapturedBytes = std::size_t{64} << 20;

// The host function (cuLaunchHostFunc), on a driver thread.
void CUDA_CB run_host_copy(void* data) {
  const auto* copy = static_cast<const HostCopy*>(data);
  std::lock_guard lock(*copy->mutex);
  // Not once the timeline was poisoned before this copy's value: its Event reports the failure
  // for good then (Note [Events after a poison] in src/stream.cpp).
  const SignalSlot* t = copy->timeline;
  if (!t || t->poisoned.load(std::memory_order_acquire) == 0 ||
      copy->value <= t->poisoned_at.load(std::memory_order_relaxed))
    std::memcpy(copy->dest, copy->src, copy->size);
}

}  // namespace

// Memory a copyin's bytes are captured in (Note [CUDA copyin captures]): anonymous pages mapped
// for it, huge pages where the kernel gives them, unmapped when it goes. Move-only.
class CaptureBlock {
 public:
  CaptureBlock() = default;
  // At least `bytes` (whole 2 MiB pages from 2 MiB on, else a power of two from 64 KiB). Throws
  // OutOfMemory naming `what` when the kernel refuses.
  CaptureBlock(std::size_t bytes, std::string_view what) : size_(rounded(bytes)) {
    // From 2 MiB on, mapped 2 MiB longer and trimmed to a 2 MiB boundary: huge pages need one.
    const std::size_t slack = size_ >= kHuge ? kHuge : 0;
    void* p = ::mmap(nullptr, size_ + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw OutOfMemory(fmt::format("{}: cannot map {} bytes to hold a copyin's bytes until it is queued: {}", what,
                                    size_, std::strerror(errno)));
    auto* start = static_cast<std::byte*>(p);
    if (slack) {
      const std::size_t head = (kHuge - reinterpret_cast<std::uintptr_t>(p) % kHuge) % kHuge;
      if (head) ::munmap(start, head);
      if (slack - head) ::munmap(start + head + size_, slack - head);
      start += head;
      // Huge pages fault in 512 times fewer: a fresh 64 MiB takes milliseconds, not a tenth of a second.
      (void)::madvise(start, size_, MADV_HUGEPAGE);  // where transparent huge pages are on
    }
    data_ = start;
  }
  CaptureBlock(CaptureBlock&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  CaptureBlock& operator=(CaptureBlock&& other) noexcept {
    if (this != &other) {
      unmap();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  ~CaptureBlock() { unmap(); }
  // The size of a block made for `bytes`.
  static std::size_t rounded(std::size_t bytes) noexcept {
    return bytes >= kHuge ? (bytes + kHuge - 1) / kHuge * kHuge : std::bit_ceil(std::max(bytes, std::size_t{64} << 10));
  }
  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  static constexpr std::size_t kHuge = std::size_t{2} << 20;
  void unmap() noexcept {
    if (data_) ::munmap(data_, size_);
    data_ = nullptr;
    size_ = 0;
  }
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// A lane's host copies (Note [CUDA copyout without blocking]); every lane has one from the start.
struct CudaHCQDevice::HostCopies {
  std::mutex mutex;  // held by a host function copying, and by whoever poisons the lane's timeline
  Allocation bounce{};  // pinned, device-mapped; made at the first copyout that needs one
  std::vector<Allocation> outgrown;  // smaller bounces, kept until exit
  struct Record {
    std::uint64_t value;  // the timeline value after which the host function has run
    HostCopy copy;
    CaptureBlock capture;  // a copyin's captured bytes (its first record's)
  };
  std::deque<Record> records;
  std::size_t captured_bytes = 0;  // the records' captures' sizes, summed (Note [CUDA copyin captures])
  // Captures whose copies ran, kept for the next copyins (pages already faulted in) while they and
  // the queued ones stay within kMaxCapturedBytes (Note [Spare captures] in tinydev/hcq_stream.hpp);
  // unmapped when the lane goes back.
  detail::SpareCaptures<CaptureBlock> spare_captures;

  // A block of at least `bytes`: a spare one (Note [Spare captures]), else a new one.
  CaptureBlock take_capture(std::size_t bytes, std::string_view what) {
    if (auto spare = spare_captures.take(CaptureBlock::rounded(bytes), captured_bytes, kMaxCapturedBytes))
      return std::move(*spare);
    return CaptureBlock(bytes, what);
  }
  // Unmaps every spare capture (the lane goes back, or a spare of it is not wanted).
  void drop_spare_captures() noexcept { spare_captures.clear(); }
  // A record's capture, its copy done: kept if it fits the lane's budget, else unmapped.
  void keep_capture(CaptureBlock block) noexcept { spare_captures.keep(std::move(block), captured_bytes, kMaxCapturedBytes); }
};

// ---- programs ---------------------------------------------------------------------------------

CudaProgram::CudaProgram(std::string name, CudaHCQDevice& device, void* module, void* function,
                         std::optional<KernelSignature> signature)
    : Program(std::move(name)), device_(device), module_(module), function_(function), signature_(signature),
      launch_what_(fmt::format("launching '{}'", this->name())) {}

void CudaProgram::throw_wrong_counts(std::size_t buffers, std::size_t values) const {
  throw InvalidArgument(fmt::format("{} on {}: the kernel takes {} buffers and {} values, got {} and {} (a GPU kernel "
                                    "reads a wrong word as an address: Note [CUDA kernel signatures])",
                                    name(), device_.name(), signature_->num_buffers, signature_->num_values, buffers,
                                    values));
}

namespace {
// Unloads `module` (kernel `name`'s) once no stream of the GPU waits on the GPU for a signal (Note
// [CUDA implicit synchronization]); a failure is logged, not thrown (destructors and error paths).
void unload_module(CudaHCQDevice& device, void* module, std::string_view name) noexcept {
  try {
    device.release_when_unblocked(CudaHCQDevice::DriverRelease::module, reinterpret_cast<std::uintptr_t>(module), 0);
  } catch (const std::exception& e) {
    debug_log(1, device.name(), "unloading '{}' failed: {}", name, e.what());
  }
}
}  // namespace

// A direct call holds no reference to its program, so the last launch may still be queued or
// running: the module is unloaded after the timeline passed it (a hung GPU leaks the module after
// TINYDEV_WAIT_TIMEOUT_MS, or 1 s once a wait timed out, instead of unloading code under a running
// kernel). Queued execs and graphs keep their
// programs alive themselves.
CudaProgram::~CudaProgram() {
  const DeviceState& s = device_.state();
  if (s.released.load() || !device_.opened_in_this_process()) return;
  // A retired program's marks were reached (no lock taken then: it may be deleted by a thread that
  // holds a submit mutex); a program dropped with nothing in flight has nothing to wait for either.
  if (const std::uint64_t launched = last_direct_value_.load(std::memory_order_acquire);
      !work_done_ && launched != 0 && device_.timeline_slot()->value.load(std::memory_order_acquire) < launched) {
    try {
      // The timeline value covering the last direct call is signalled by now, or by
      // last_submitted_value() (Note [Lazy timeline signals]); after a wrap both are past.
      device_.wait_timeline_reached(std::min(launched, device_.last_submitted_value()), device_.free_wait_timeout());
    } catch (const Timeout& e) {
      debug_log(1, device_.name(), "'{}' is unloaded at exit only: {}", name(), e.what());
      return;
    } catch (const std::exception&) {
      // The device failed, but work queued before may still run (Note [CUDA waits on failed
      // signals]): not under a kernel of this module.
      if (!device_.wait_queues_drained(device_.free_wait_timeout())) {
        debug_log(1, device_.name(), "'{}' is unloaded at exit only: its failed device's queues did not drain", name());
        return;
      }
    }
  }
  unload_module(device_, module_, name());
}

namespace {
// Note [CUDA program retirement]: programs waiting for timeline values, per device or lane.
struct RetiredPrograms {
  std::mutex mutex;
  std::vector<std::pair<CudaProgram*, std::vector<std::pair<const CudaHCQDevice*, std::uint64_t>>>> programs;
};
RetiredPrograms& retired_programs() {
  static auto* retired = new RetiredPrograms;  // never destroyed: programs may retire during exit
  return *retired;
}
bool reached(const std::vector<std::pair<const CudaHCQDevice*, std::uint64_t>>& marks) {
  // An idle device finished everything (a waited direct call's mark is the value after the one
  // it waited for, which no work may ever signal).
  for (const auto& [device, value] : marks)
    if (device->timeline_slot()->value.load(std::memory_order_acquire) < value && !device->idle()) return false;
  return true;
}
}  // namespace

std::shared_ptr<CudaProgram> CudaProgram::make(std::string name, CudaHCQDevice& device, void* module, void* function,
                                               std::optional<KernelSignature> signature) {
  return std::shared_ptr<CudaProgram>(new CudaProgram(std::move(name), device, module, function, signature),
                                      &CudaProgram::retire);
}

void CudaProgram::retire(CudaProgram* program) {
  std::vector<std::pair<const CudaHCQDevice*, std::uint64_t>> marks;
  CudaHCQDevice& device = program->device_;
  if (!device.state().released.load() && device.opened_in_this_process()) {
    const auto mark = [&](const CudaHCQDevice& d, std::uint64_t value) {
      if (d.timeline_slot()->value.load(std::memory_order_acquire) < value) marks.emplace_back(&d, value);
    };
    // The values taken so far, read without the submit mutex (the last handle may go while a
    // stream holds its lane's); a direct call's covering value is signalled at the latest by the
    // next synchronize, which reclaims.
    mark(device, std::max(device.timeline_value() - 1, program->last_direct_value_.load(std::memory_order_acquire)));
    device.for_each_lane([&](const CudaHCQDevice& lane) { mark(lane, lane.timeline_value() - 1); });
  }
  {
    RetiredPrograms& retired = retired_programs();
    std::lock_guard lock(retired.mutex);
    if (!marks.empty()) {
      retired.programs.emplace_back(program, std::move(marks));
      program = nullptr;
    }
  }
  if (program) program->work_done_ = true;
  delete program;  // nothing in flight: unloaded now (~CudaProgram)
  reclaim_retired();
}

void CudaProgram::reclaim_retired() {
  std::vector<CudaProgram*> done;
  {
    RetiredPrograms& retired = retired_programs();
    std::lock_guard lock(retired.mutex);
    std::erase_if(retired.programs, [&](const auto& entry) {
      if (!reached(entry.second)) return false;
      done.push_back(entry.first);
      return true;
    });
  }
  for (CudaProgram* program : done) {
    program->work_done_ = true;  // ~CudaProgram must not wait (nor lock): a submit mutex may be held here
    delete program;              // outside the lock: ~CudaProgram calls the driver
  }
}

const std::string& CudaProgram::device() const noexcept { return device_.name(); }

// The arguments go in one packed buffer, as the seed's fill_kernargs lays them out (8-byte
// addresses, then 4-byte values), which is the kernel's own parameter layout for the kernel ABI.
std::optional<double> CudaProgram::operator()(std::span<const Allocation> buffers, std::span<const std::int32_t> values,
                                              const LaunchParams& params) {
  check_sizes(name(), device_.name(), params.global, params.local);
  check_counts(buffers.size(), values.size());
  const std::size_t size = Kernargs::bytes_for(buffers.size(), values.size());
  if (size > kMaxArgumentBytes)
    throw InvalidArgument(fmt::format("{} on {}: {} bytes of arguments is more than a CUDA launch takes ({})", name(),
                                      device_.name(), size, kMaxArgumentBytes));
  std::array<std::byte, kMaxArgumentBytes> packed;
  const Kernargs args{packed.data(), static_cast<std::uint32_t>(buffers.size()),
                      static_cast<std::uint32_t>(values.size())};
  for (std::size_t i = 0; i < buffers.size(); ++i) args.set_buffer(i, buffers[i].va_addr);
  for (std::size_t i = 0; i < values.size(); ++i) args.set_value(i, values[i]);
  std::optional<double> seconds = device_.launch_direct(*this, packed.data(), static_cast<std::uint32_t>(size),
                                                        params.global, params.local, params.wait);
  // Read after the launch: at least the value that covers it (~CudaProgram waits for it).
  last_direct_value_.store(device_.timeline_value(), std::memory_order_release);
  return seconds;
}

class CudaRuntime final : public Runtime {
 public:
  explicit CudaRuntime(CudaHCQDevice& device) : device_(device) {}

  std::shared_ptr<Program> load(std::string_view kernel_name, std::span<const std::byte> blob) override {
    const DeviceState& s = device_.state();
    device_.throw_if_failed();
    // The blob may come from the compile cache: the driver gets only what looks like CUBIN (ELF),
    // a fatbin or PTX text, always NUL-terminated (PTX is read up to its NUL).
    static constexpr unsigned char kElf[] = {0x7f, 'E', 'L', 'F'};
    static constexpr unsigned char kFatbin[] = {0x50, 0xed, 0x55, 0xba};
    const auto starts_with = [&](std::span<const unsigned char> magic) {
      return blob.size() >= magic.size() && std::memcmp(blob.data(), magic.data(), magic.size()) == 0;
    };
    const std::string_view text(reinterpret_cast<const char*>(blob.data()), blob.size());
    if (!starts_with(kElf) && !starts_with(kFatbin) && text.find(".version") == std::string_view::npos)
      throw InvalidArgument(fmt::format("{}: the blob for kernel '{}' ({} bytes) is neither CUBIN, a fatbin nor PTX: "
                                        "pass what this device's compile() returned",
                                        s.name, quote_for_message(kernel_name), blob.size()));
    std::vector<std::byte> image(blob.begin(), blob.end());
    image.push_back(std::byte{0});
    device_.note_kernel_load(kernel_name);
    s.make_current();
    CUmodule module = nullptr;
    if (const CUresult r = s.api.cuModuleLoadData(&module, image.data()); r != CUDA_SUCCESS)
      throw InvalidArgument(fmt::format("{}: the driver could not load the module of kernel '{}': {}", s.name,
                                        quote_for_message(kernel_name), describe(r)));
    CUfunction function = nullptr;
    const std::string name(kernel_name);
    if (const CUresult r = s.api.cuModuleGetFunction(&function, module, name.c_str()); r != CUDA_SUCCESS) {
      unload_module(device_, module, name);
      throw InvalidArgument(fmt::format("{}: kernel '{}' is not in the compiled module ({}): check the kernel name, "
                                        "and that it is declared extern \"C\"",
                                        s.name, quote_for_message(kernel_name), describe(r)));
    }
    std::optional<KernelSignature> signature;
    try {
      signature = signature_of(function, name);
    } catch (...) {
      unload_module(device_, module, name);
      throw;
    }
    return CudaProgram::make(name, device_, module, function, signature);
  }

 private:
  // The kernel's signature from the driver (Note [CUDA kernel signatures]): nullopt where the
  // driver cannot tell; InvalidArgument for a parameter list no launch of tinydev can pass.
  std::optional<KernelSignature> signature_of(CUfunction function, const std::string& name) const {
    const DeviceState& s = device_.state();
    if (!s.api.cuFuncGetParamInfo) return std::nullopt;
    struct Parameter {
      std::size_t offset = 0, size = 0;
    };
    std::vector<Parameter> parameters;
    // No driver call gives the count: ask index by index until the driver says there is none.
    for (std::size_t i = 0; i <= kMaxArgumentBytes; ++i) {
      Parameter p;
      const CUresult r = s.api.cuFuncGetParamInfo(function, i, &p.offset, &p.size);
      if (r == CUDA_ERROR_INVALID_VALUE) break;  // past the last parameter
      if (r != CUDA_SUCCESS) {
        debug_log(1, "CUDA", "{}: cuFuncGetParamInfo of '{}' failed ({}): its launches are not checked", s.name,
                  quote_for_message(name), describe(r));
        return std::nullopt;
      }
      parameters.push_back(p);
    }
    KernelSignature signature{.grid_index = false};
    for (const Parameter& p : parameters) {
      const std::size_t packed_at = std::size_t{signature.num_buffers} * 8 + std::size_t{signature.num_values} * 4;
      if (p.size == 8 && signature.num_values == 0 && p.offset == packed_at) ++signature.num_buffers;
      else if (p.size == 4 && p.offset == packed_at) ++signature.num_values;
      else {
        std::string layout;
        for (const Parameter& q : parameters)
          layout += fmt::format("{}{} bytes at {}", layout.empty() ? "" : ", ", q.size, q.offset);
        throw InvalidArgument(fmt::format("{}: kernel '{}' has parameters tinydev cannot pass ({}): a kernel takes its "
                                          "buffers first (8-byte pointers), then 32-bit values (int or float); "
                                          "docs/cuda.md, Note [CUDA kernel signatures]",
                                          s.name, quote_for_message(name), layout));
      }
    }
    return signature;
  }

  CudaHCQDevice& device_;
};

// ---- queues -----------------------------------------------------------------------------------

void CudaComputeQueue::_exec(const CudaProgram& program, const Kernargs& kernargs, Dim3 global, Dim3 local) {
  check_sizes(program.name(), program.device(), global, local);
  program.check_counts(kernargs.num_buffers, kernargs.num_values);
  if (!kernargs.ptr && kernargs.size() != 0)
    throw InvalidArgument(fmt::format("exec of '{}': the kernargs have no memory; allocate them with the "
                                      "device's alloc_kernargs()",
                                      program.name()));
  if (kernargs.size() > kMaxArgumentBytes)
    throw InvalidArgument(fmt::format("exec of '{}': {} bytes of arguments is more than a CUDA launch takes ({})",
                                      program.name(), kernargs.size(), kMaxArgumentBytes));
  mutable_commands().push_back(CudaCommand{.kind = CommandKind::exec, .program = &program, .kernargs = kernargs.ptr,
                                           .kernarg_bytes = static_cast<std::uint32_t>(kernargs.size()),
                                           .global = global, .local = local});
}

void CudaComputeQueue::_update_exec(std::size_t cmd, Dim3 global, Dim3 local) {
  CudaCommand& c = *command_words(cmd);
  check_sizes(c.program->name(), c.program->device(), global, local);
  c.global = global;
  c.local = local;
}

void CudaComputeQueue::_submit(Compiled& device) {
  CudaHCQDevice& cuda = cuda_device(device, "compute");
  check_pools(*this, cuda);
  cuda.submit_commands(CudaLane::compute, *snapshot());
}

void CudaCopyQueue::_update_copy(std::size_t cmd, const std::optional<Allocation>& dest,
                                 const std::optional<Allocation>& src) {
  CudaCommand& c = *command_words(cmd);
  check_copy(dest ? *dest : Allocation{0, c.size, nullptr}, src ? *src : Allocation{0, c.size, nullptr}, c.size);
  if (dest) c.dest = dest->va_addr;
  if (src) c.src = src->va_addr;
}

void CudaCopyQueue::_submit(Compiled& device) {
  CudaHCQDevice& cuda = cuda_device(device, "copy");
  check_pools(*this, cuda);
  cuda.submit_commands(CudaLane::copy, *snapshot());
}

// ---- allocator --------------------------------------------------------------------------------

// Note [CUDA cache bound]
// The seed's cache is unbounded: memory a model frees between steps is what it allocates again,
// and cuMemFree is slow and may synchronize the whole device (Note [CUDA implicit
// synchronization]). The LRU layer's default bound is for host memory (1/16 of it, at most 2 GiB:
// Note [Default LRU bound]), which on a GPU of 80 GiB freed any buffer over 2 GiB at once and
// evicted (cuMemFree, waiting for queued work) from the third 1 GiB buffer freed. A CUDA
// allocator's cache is bounded by the GPU's memory instead: in effect the seed's, since out of
// memory empties it (the ladder in LRUAllocator::alloc). Pinned host buffers (host=true) share
// it: the cache holds no more of them than the process had allocated at once, and the seed's
// keeps them all too (docs/cuda.md says how to give them back). TINYDEV_LRU_MAX_BYTES still
// overrides it.
std::uint64_t CudaHCQDevice::total_memory() const noexcept { return state_->total_memory; }

std::uint64_t CudaHCQDevice::free_memory() const {
  const DeviceState& s = *state_;
  s.make_current();
  std::size_t free = 0, total = 0;
  check(s.api.cuMemGetInfo(&free, &total), "cuMemGetInfo", name());
  return free;
}

CudaAllocator::CudaAllocator(CudaHCQDevice& device, std::uint64_t device_memory, std::size_t staging_slots)
    : HCQAllocator<CudaHCQDevice>(device, kDefaultBatchSize, staging_slots) {
  set_default_max_bytes(device_memory);
}

CudaAllocator::~CudaAllocator() {
  // Never throws (a failed open destroys its device, and with it this): a free the driver refuses
  // is said at TINYDEV_DEBUG>=1 and the memory left to the context.
  const auto release = [&](auto&& what, std::string_view which) {
    try {
      what();
    } catch (const std::exception& e) {
      debug_log(1, device_.name(), "giving back {} when its allocator went failed: {}", which, e.what());
    }
  };
  release([&] { release_ring(); }, "the staging ring");
  release([&] { free_cache(); }, "the allocation cache");
}

// Note [CUDA host-to-host copies]
// The driver runs a cuMemcpyAsync between two host memories synchronously: it returns once the
// stream reached the copy and ran it. Through the staging ring a copyin to a pinned host buffer
// (host=true) would be one, blocking the caller on the device's queued work, so pinned buffers are
// host-visible: copyin writes them with memcpy when the device is idle (queued work may read
// them otherwise, and then the ring orders it), copyout reads them with memcpy after the queued
// work, and as_buffer maps them. A copy queue's own host-to-host copy (two pinned buffers, or a
// ring slot) stays a cuMemcpyAsync: it must not sit behind a wait on a signal the submitting
// thread sets later (docs/cuda.md).
void* CudaAllocator::pinned_tag() noexcept {
  static char tag;
  return &tag;
}

bool CudaAllocator::host_visible(const Allocation& allocation) const noexcept {
  return allocation.backend == pinned_tag();
}

std::string CudaAllocator::describe() const { return fmt::format("{} allocator (device memory)", device_.name()); }

Allocation CudaAllocator::alloc_impl(std::size_t size, const BufferOptions& options) {
  const DeviceState& s = device_.state();
  device_.throw_if_failed();
  s.make_current();
  // A refused allocation first gives back what was deferred (Note [CUDA implicit
  // synchronization]), for device memory waiting briefly for GPU waits between streams to pass,
  // and tries again.
  if (options.host) {
    // Pinned and mapped into every context: the staging ring's slots, zero-copy host buffers.
    // No waiting for deferred memory: the staging ring grows under the submit mutex.
    void* p = device_.alloc_pinned(size, "a pinned buffer");
    return Allocation{reinterpret_cast<std::uintptr_t>(p), size, pinned_tag()};
  }
  CUdeviceptr p = 0;
  CUresult r = s.api.cuMemAlloc(&p, size);
  if (r == CUDA_ERROR_OUT_OF_MEMORY && device_.release_deferred_within(std::chrono::milliseconds(500))) {
    s.make_current();
    r = s.api.cuMemAlloc(&p, size);
  }
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    if (const std::size_t deferred = device_.deferred_device_bytes(); deferred > 0)
      throw OutOfMemory(fmt::format("{}: cuMemAlloc of {} bytes failed: {}; {} bytes freed earlier are not given back "
                                    "to the driver while a stream of the GPU waits on the GPU for a signal (Note [CUDA "
                                    "implicit synchronization]): set the signals those streams wait for, or "
                                    "synchronize",
                                    s.name, size, cuda::describe(r), deferred));
  }
  check(r, fmt::format("cuMemAlloc of {} bytes", size), s.name);
  return Allocation{static_cast<std::uintptr_t>(p), size, nullptr};
}

void CudaAllocator::free_impl(Allocation allocation, std::size_t size, const BufferOptions& options) {
  const DeviceState& s = device_.state();
  if (s.released.load()) return;  // at exit, the context (and its memory) is gone already
  // Queued work may still use the memory (the seed's allocators synchronize too); a hung kernel's
  // memory, or a forked child's view of the parent's, is leaked instead.
  if (!wait_before_free(size)) return;
  // Another stream's wait on the GPU must not hold the free (Note [CUDA implicit synchronization]).
  device_.release_when_unblocked(
      options.host ? CudaHCQDevice::DriverRelease::host_memory : CudaHCQDevice::DriverRelease::device_memory,
      allocation.va_addr, size);
}

// ---- the device -------------------------------------------------------------------------------

CudaHCQDevice::CudaHCQDevice(const std::string& name, std::shared_ptr<DeviceState> state)
    : HCQCompiled(name, std::make_shared<CudaAllocator>(*this, state->total_memory),
                  std::make_unique<CudaCompiler>(arch_for(state->major, state->minor), settings().cuda_ptx),
                  std::make_unique<CudaRuntime>(*this), SourceLanguage::CUDA, shared_signal_pool(state)),
      state_(std::move(state)),
      kernargs_(name) {
  FailedWaitWatcher::start();  // before this device submits anything (Note [CUDA waits on failed signals])
  // The clock: %globaltimer against the host's, taken around a timestamp (Note [CUDA queues]); of
  // three tries the one with the shortest round trip (the first pays for loading the kernel).
  Signal probe = alloc_signal(0);
  std::uint64_t best_round_trip = ~std::uint64_t{0};
  for (std::uint64_t round = 1; round <= 3; ++round) {
    const std::uint64_t before = Profiler::now_ns();
    compute_queue().timestamp(probe).signal(probe, round).submit(*this);
    probe.wait(round, std::chrono::seconds(30));
    const std::uint64_t after = Profiler::now_ns();
    if (after - before >= best_round_trip) continue;
    best_round_trip = after - before;
    clock_offset_ns_ = static_cast<std::int64_t>((before + after) / 2) - static_cast<std::int64_t>(probe.timestamp());
  }
  free_signal(probe);
  // Last: a constructor that throws runs no destructor, and only the destructor unregisters.
  LiveDevices& live = live_devices();
  std::lock_guard lock(live.mutex);
  live.devices.push_back(this);
}

CudaHCQDevice::CudaHCQDevice(CudaHCQDevice& parent, const std::string& lane_name)
    // A stream's copies are a request's, not a model's weights: 4 pinned slots of 2 MiB (8 MiB a
    // lane, made at its first staged copy), not the device's 32 (64 MiB for each of 64 lanes).
    // Given at construction, not by set_staging_shape: that takes the lane's submit lock, and
    // lanes are made under the lane pool's lock, which a lane's copies take under their submit
    // lock (release_deferred asks every lane): the two orders ThreadSanitizer calls a deadlock.
    : HCQCompiled(lane_name, std::make_shared<CudaAllocator>(*this, parent.state_->total_memory, 4),
                  parent.shared_compiler(), parent.shared_runtime(),
                  SourceLanguage::CUDA, shared_signal_pool(parent.state_)),
      state_(open_lane_state(*parent.state_, lane_name)),
      kernargs_(lane_name),
      host_copies_(std::make_unique<HostCopies>()),
      parent_(&parent) {
  never_wrap_timeline();  // its events live on (Note [Timeline wrap])
  clock_offset_ns_ = parent.clock_offset_ns_;  // the same GPU's clock
  LiveDevices& live = live_devices();
  std::lock_guard lock(live.mutex);
  live.devices.push_back(this);
}

namespace {

// Note [CUDA hardware queues]
// The driver maps a context's CUDA streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by
// default, at most 32), round robin; streams on one queue run in the order their work was
// submitted. A device has two streams and each lane two more, all in the GPU's primary context, so
// from the fourth lane on (10 streams), two of tinydev's streams share a queue by default. Waits for Events of
// other streams cannot deadlock that way (an Event's work was submitted before any wait for it),
// but a stream waiting for an Event the host completes later (a raw Signal) holds up the work of
// the streams behind it on its queue until then, and a host waiting for that work before it
// completes the Event waits for ever. tinydev does not change the variable (a library writing the
// environment races with other threads reading it); the first lane past the queues says so once.
void warn_if_queues_shared(const std::string& lane, std::size_t lane_number) {
  static std::atomic<bool> warned{false};
  // The driver's default where the variable is unset or not a number it takes (1 to 32).
  int queues = 8;
  if (const char* set = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS")) {
    const std::string_view text(set);
    int parsed = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), parsed);
    if (error == std::errc() && end == text.data() + text.size() && parsed >= 1 && parsed <= 32) queues = parsed;
  }
  const std::size_t streams = 2 + 2 * lane_number;
  if (streams <= static_cast<std::size_t>(queues) || warned.exchange(true)) return;
  log_message(LogLevel::warning, lane,
              fmt::format("the GPU now has {} CUDA streams of tinydev's on {} hardware queues "
                          "(CUDA_DEVICE_MAX_CONNECTIONS): streams sharing a queue run in order, so a stream waiting "
                          "for an Event the host completes later holds up the others on its queue until then. Set "
                          "CUDA_DEVICE_MAX_CONNECTIONS=32 before the process's first CUDA call to give {} streams a "
                          "queue each (Note [CUDA hardware queues], docs/cuda.md)",
                          streams, queues, 32 / 2 - 1));
}

}  // namespace

std::shared_ptr<Stream> CudaHCQDevice::create_stream(const StreamOptions& options) {
  check_usable();
  throw_if_failed();
  if (parent_) return parent_->create_stream(options);
  CudaHCQDevice* lane = lanes_.take(kMaxStreams, name(), [&](std::size_t number) {
    auto made = std::unique_ptr<CudaHCQDevice>(new CudaHCQDevice(*this, fmt::format("{} stream {}", name(), number)));
    warn_if_queues_shared(made->name(), number);
    // Lanes live as long as the process, as registry devices do: the profiler's flush hook
    // processes their profile records (each holds two pinned signal slots until then).
    made->on_opened();
    return made;
  });
  try {
    return make_cuda_stream(*this, *lane, options);
  } catch (...) {
    return_lane(lane);
    throw;
  }
}

CudaHCQDevice::~CudaHCQDevice() {
  // Host copies (Note [CUDA copyout without blocking]) go where no host function can still run;
  // otherwise they are left, records and bounce memory alike (at exit the context takes the memory).
  // After a fault the timeline no longer says (a queue goes on past a failed wait it was let
  // through: Note [CUDA waits on failed signals]); the streams do.
  const auto may_still_run = [&] {
    return !idle() || (timeline_slot()->poisoned.load(std::memory_order_acquire) && !queues_idle());
  };
  if (host_copies_ && (state_->released.load() || may_still_run())) {
    (void)host_copies_.release();
  } else if (host_copies_) {
    try {
      state_->make_current();
      for (const Allocation& a : host_copies_->outgrown) (void)state_->api.cuMemFreeHost(a.host_ptr());
      if (host_copies_->bounce.size) (void)state_->api.cuMemFreeHost(host_copies_->bounce.host_ptr());
    } catch (const Error&) {
    }
  }
  LiveDevices& live = live_devices();
  std::lock_guard lock(live.mutex);
  std::erase(live.devices, this);
}

bool CudaHCQDevice::can_reach(const SignalPool& pool) const noexcept { return &pool == &signal_pool(); }

std::vector<CudaHCQDevice::TimelineMark> CudaHCQDevice::signal_users_now() const {
  std::vector<TimelineMark> marks = HCQCompiled::signal_users_now();
  LiveDevices& live = live_devices();
  std::lock_guard lock(live.mutex);
  for (const CudaHCQDevice* device : live.devices) {
    if (device == this) continue;
    auto own = device->HCQCompiled::signal_users_now();
    marks.insert(marks.end(), own.begin(), own.end());
  }
  return marks;
}

std::uint64_t CudaHCQDevice::device_to_cpu_ns(std::uint64_t device_ns, bool) const {
  return static_cast<std::uint64_t>(static_cast<std::int64_t>(device_ns) + clock_offset_ns_);
}

void CudaHCQDevice::poison_own_timeline(std::string_view reason) const noexcept {
  // The first reason stays: it is the root cause. Waiters on the timeline wake with it.
  poison_timeline(timeline_signal().slot(), reason);
}

void CudaHCQDevice::poison_timeline(SignalSlot& slot, std::string_view reason) const {
  // Note [CUDA copyout without blocking]: no host function copies while, or after, it is poisoned.
  std::unique_lock<std::mutex> lock;
  if (host_copies_ && &slot == timeline_slot()) lock = std::unique_lock(host_copies_->mutex);
  slot.poison(reason);
}

bool CudaHCQDevice::queues_idle() const {
  if (state_->released.load()) return true;
  if (state_->api.cuCtxSetCurrent(state_->context) != CUDA_SUCCESS) return true;  // nothing more to learn
  for (CUstream stream : {state_->compute, state_->copy})
    if (state_->api.cuStreamQuery(stream) == CUDA_ERROR_NOT_READY) return false;
  return true;
}

std::string CudaHCQDevice::recovery_hint() const {
  if (context_failed_.load(std::memory_order_acquire))
    return "The CUDA context failed earlier and cannot be used until the process restarts (a sticky driver error; "
           "Note [CUDA recovery])";
  return HCQCompiled::recovery_hint();
}

std::string CudaHCQDevice::recover(std::chrono::milliseconds timeout) {
  if (context_failed_.load(std::memory_order_acquire))
    throw DeviceFault(fmt::format("{} cannot recover: {}. A sticky CUDA error leaves the context unusable and the "
                                  "driver cannot clear it without destroying the context; restart the process",
                                  name(), fault()));
  // Under the submit mutex throughout, so no submission comes between the drain and the forget.
  std::lock_guard lock(submit_mutex());
  std::string was = HCQCompiled::recover(timeout);
  if (!was.empty()) forget_failed_gpu_waits();  // the queues drained: every wait they held passed
  return was;
}

void CudaHCQDevice::throw_if_failed() const {
  const SignalSlot& slot = timeline_signal().slot();
  if (!slot.poisoned.load(std::memory_order_acquire)) return;
  if (context_failed_.load(std::memory_order_acquire))
    throw Error(fmt::format("{} failed earlier and cannot be used until the process restarts: {}", name(),
                            slot.poison_text()));
  throw_fault();  // a failure recover() clears (Note [CUDA recovery])
}

// Note [CUDA waits on failed signals]
// A poison is the host's mark (tinydev/signal.hpp): a GPU queue waiting on the slot's value with
// cuStreamWaitValue64 does not see it and would wait for ever, holding up its stream, everything
// waiting for that stream's timeline, recover() (which drains the queues first) and any driver
// call that waits for the context's work. A CPU queue stops at a failed wait and poisons what it
// would have signalled after it; a GPU queue cannot skip its commands, but it can be let go:
//  - Each submission that waits on a signal other than its own timeline, below the value it
//    wants, is recorded (pending_) with the waits and the signals after its first wait, until its
//    waits passed; so is one that waits on its timeline and then signals another signal (the
//    timeline's value may come from work let go past a failure, and what it signals then must
//    fail too, as behind a CPU queue's failure). What a submission never got to issue (a driver
//    call failed, a wait failed already) is dropped from its record when it returns; a record is
//    only dropped whole once it is fully issued. A wait on a signal that failed already
//    (poison_failed) is not issued at all: the submission stops there and poisons the signals
//    after it, as a CPU queue does.
//  - The CUDA signal pool's on_poison hook wakes one thread, the FailedWaitWatcher. It finds each
//    record's earliest failed wait and poisons the signals the submission would set after it (its
//    timeline among them, so the device or stream is faulted, as on the CPU; an earlier wait
//    failing later moves the failure earlier), again and again until no new poison comes: the
//    failure reaches everything downstream of it first. Only waits at or after a record's
//    earliest failure are let go.
//  - Only then does it let the waits go by writing the value each failed wait wants into the
//    slot: the GPU queue runs on, its kernels on whatever their inputs hold, and writes signals
//    that are poisoned already, so no waiter takes them for success (poison_failed: values after
//    the poison do not count) and the Events of that work stay failed. A slot that is a device's
//    current timeline is written only once that device's queues are idle, so the device never
//    takes work as finished that still runs (its frees and cache reuse read that value). The
//    watcher writes again while a let-go wait's stream has not gone idle (a late write of a lower
//    value by another queue would otherwise catch the GPU again), polling every 1 to 20 ms; a
//    failed record goes once its stream is idle or its device recovered. A signal is written or
//    poisoned only under SignalPool::hold_reuse while its SignalSlot::reuses is unchanged: one
//    freed and handed out again is another signal, and its record is dropped.
// The recording happens before the submission looks at the poison flags, and the hook runs after
// the flag is set, each with a full fence between, so either the submission sees the failure or
// the watcher sees the record. The queues then drain, recover() works as on the CPU, and a
// faulted device's frees wait for its queues to be idle rather than for its timeline
// (HCQAllocator::wait_before_free). The watcher holds the live-devices mutex while it asks the
// driver, and the exit handler marks devices released under it (Note [CUDA at exit]).
namespace {
// Whether `slot` holds `value` by the GEQ a GPU wait uses: (int64_t)(*addr - value) >= 0.
bool gpu_reached(const SignalSlot& slot, std::uint64_t value) noexcept {
  return static_cast<std::int64_t>(slot.value.load(std::memory_order_acquire) - value) >= 0;
}
// Whether a GPU wait for `value` on `slot` would pass now and has not failed.
bool wait_passes(const SignalSlot& slot, std::uint64_t value) noexcept {
  return gpu_reached(slot, value) && !poison_failed(slot, value);
}
}  // namespace

// Note [CUDA implicit synchronization]
// cuMemFree, cuMemFreeHost and cuModuleUnload "may perform implicit synchronization": the driver
// first waits for every stream of the context. A stream held by a GPU wait on a signal set later
// (a user's signal, an Event the host or another device sets) then holds the freeing thread, for
// ever if that thread is the one to set it; on the CPU devices a free waits for its own device's
// queues only (the seed's _free) and an unload for nothing. So while any stream of the context
// (the device's or a stream lane's) holds a GPU wait that has not passed (the records of Note
// [CUDA waits on failed signals]), such a release is deferred: listed on the context's device
// and made by the next release, refused allocation or synchronize that finds no such wait. Work
// that only runs kernels and copies finishes by itself, so a release behind it is made at once
// (the driver's wait is then short). Device memory deferred is not counted in use by the
// allocator but the driver still holds it: a refused device allocation waits up to 500 ms for a
// moment with no such wait (waits between streams pass by themselves), releases what was
// deferred and retries; its OutOfMemory says how much is still deferred. A refused pinned one
// (a pinned buffer, or the staging ring's or a stream's bounce memory, the last two made under
// the submit mutex: CudaHCQDevice::alloc_pinned) releases what it can at once and retries. A GPU wait
// another thread submits while a release is past its check is issued only once that release
// returned (DriverReleaseWindow; the submission waits, its submit mutex held, for the releases
// in the driver then, each waiting for kernels and copies alone; not for later ones, which see
// its record): the record and the check both take the lane's pending_mutex_, so either the
// release sees the record and is deferred, or the submission sees the release in progress. At
// exit the context takes what is still deferred along.
bool CudaHCQDevice::holds_unpassed_gpu_waits(std::span<const SignalSlot* const> ignoring) const {
  std::lock_guard lock(pending_mutex_);
  return std::ranges::any_of(pending_, [&](const PendingSubmission& p) {
    return std::ranges::any_of(p.ops, [&](const PendingOp& op) {
      return op.is_wait && !op.stale() && !gpu_reached(*op.slot, op.value) &&
             std::ranges::find(ignoring, op.slot) == ignoring.end();
    });
  });
}

// Note [CUDA lazy loading]
// With lazy module loading, the driver's default on Linux since CUDA 12.2 (CUDA_MODULE_LOADING),
// a kernel is loaded onto the GPU in cuModuleGetFunction, not with its module, and NVIDIA's
// programming guide warns that loading a kernel "might require context synchronization": the
// load may wait for every stream of the GPU. A stream held by a GPU wait on a signal set later (an
// Event the host completes) then holds the loading thread, for ever if that thread is the one to
// complete it; there is no call tinydev could defer, as with frees (Note [CUDA implicit
// synchronization]), since the caller needs the kernel now. So a load while any stream of the GPU
// holds a GPU wait that has not passed, on a signal other than this GPU's own timelines (those
// pass as the GPU's earlier work runs), is said, before the driver is called: a warning once per
// GPU, naming the kernel and the ways out (load kernels before streams wait on events the host
// completes, or set CUDA_MODULE_LOADING=EAGER before the process's first CUDA call), and at
// TINYDEV_DEBUG=1 every time; with CUDA_MODULE_LOADING=EAGER nothing is said. The fake driver
// does not make loads wait (the real driver's behaviour here is "might"); docs/cuda.md.
void CudaHCQDevice::note_kernel_load(std::string_view kernel) {
  if (const char* mode = std::getenv("CUDA_MODULE_LOADING"); mode && std::string_view(mode) == "EAGER") return;
  // Waits on this GPU's own timelines (the device's, its streams') pass once the GPU's earlier
  // work ran; only waits on other signals (an Event the host completes, a user's Signal, another
  // GPU's work) can hold a stream until someone sets them.
  CudaHCQDevice& root = context_device();
  std::vector<const SignalSlot*> timelines{root.timeline_slot()};
  root.for_each_lane([&](const CudaHCQDevice& lane) { timelines.push_back(lane.timeline_slot()); });
  if (!root.context_holds_gpu_waits(timelines)) return;
  const std::string message = fmt::format(
      "kernel '{}' is being loaded while a stream of {} waits on the GPU for a signal not yet set: with lazy module "
      "loading (the driver's default since CUDA 12.2) the driver may wait for every stream of the GPU before the "
      "kernel is usable, for ever if this thread is the one to set that signal. Load kernels before streams wait "
      "for Events the host completes, or set CUDA_MODULE_LOADING=EAGER before the process's first CUDA call (Note "
      "[CUDA lazy loading], docs/cuda.md)",
      quote_for_message(kernel), root.name());
  if (!root.warned_of_lazy_loading_.exchange(true)) log_message(LogLevel::warning, root.name(), message);
  else debug_log(1, root.name(), "{}", message);
}

bool CudaHCQDevice::context_holds_gpu_waits(std::span<const SignalSlot* const> ignoring) {
  CudaHCQDevice& root = context_device();
  bool held = root.holds_unpassed_gpu_waits(ignoring);
  if (!held) root.for_each_lane([&](const CudaHCQDevice& lane) { held = held || lane.holds_unpassed_gpu_waits(ignoring); });
  return held;
}

void CudaHCQDevice::release_now(const DeferredRelease& release) const {
  const DeviceState& s = *state_;
  s.make_current();
  CUresult r = CUDA_SUCCESS;
  const char* call = "";
  switch (release.kind) {
    case DriverRelease::device_memory:
      r = s.api.cuMemFree(static_cast<CUdeviceptr>(release.handle));
      call = "cuMemFree";
      break;
    case DriverRelease::host_memory:
      r = s.api.cuMemFreeHost(reinterpret_cast<void*>(release.handle));
      call = "cuMemFreeHost";
      break;
    case DriverRelease::module:
      r = s.api.cuModuleUnload(reinterpret_cast<CUmodule>(release.handle));
      call = "cuModuleUnload";
      break;
  }
  // After a sticky error the driver refuses every call with it, frees too: the memory and modules
  // go with the context, at exit. Not an error for the free's caller (a destructor, a cache being
  // emptied), whose later calls say the device failed.
  if (sticky(r)) {
    note_if_sticky(r, fmt::format("{}: {} failed: {}", s.name, call, describe(r)));
    debug_log(1, s.name, "{} failed: {}; the context failed earlier, so what it held goes with it at exit", call,
              describe(r));
    return;
  }
  check(r, call, s.name);
}

// A thread between the check for GPU waits and the end of the driver releases it allowed, on the
// context's device (Note [CUDA implicit synchronization]). Nests: a release may make the deferred
// ones inside its own window.
class DriverReleaseWindow {
 public:
  explicit DriverReleaseWindow(CudaHCQDevice& root) : windows_(root.release_windows_) {
    std::lock_guard lock(windows_.mutex);
    ticket_ = ++windows_.last_ticket;
    windows_.open_tickets.push_back(ticket_);
    windows_.open.fetch_add(1, std::memory_order_seq_cst);  // before the check
  }
  ~DriverReleaseWindow() {
    {
      std::lock_guard lock(windows_.mutex);
      std::erase(windows_.open_tickets, ticket_);
      windows_.open.fetch_sub(1, std::memory_order_seq_cst);
    }
    windows_.closed.notify_all();
  }
  DriverReleaseWindow(const DriverReleaseWindow&) = delete;
  DriverReleaseWindow& operator=(const DriverReleaseWindow&) = delete;

 private:
  CudaHCQDevice::ReleaseWindows& windows_;
  std::uint64_t ticket_ = 0;
};

void CudaHCQDevice::wait_for_driver_releases() const {
  ReleaseWindows& windows = programs_device().release_windows_;
  // After the record (its lane's pending_mutex_): a window this misses sees the record.
  if (windows.open.load(std::memory_order_seq_cst) == 0) [[likely]]
    return;
  std::unique_lock lock(windows.mutex);
  // Only the windows open now: a later one sees the record and defers, so a stream of frees
  // cannot keep this waiting.
  const std::uint64_t last = windows.last_ticket;
  windows.closed.wait(lock, [&] {
    return std::ranges::none_of(windows.open_tickets, [&](std::uint64_t ticket) { return ticket <= last; });
  });
}

void CudaHCQDevice::release_when_unblocked(DriverRelease kind, std::uintptr_t handle, std::size_t bytes) {
  // At exit the context takes everything along; a forked child must not touch the parent's.
  if (state_->released.load() || !opened_in_this_process()) return;
  CudaHCQDevice& root = context_device();
  const DriverReleaseWindow window(root);  // from before the check to after the driver call
  if (root.context_holds_gpu_waits()) {
    std::lock_guard lock(root.deferred_mutex_);
    root.deferred_.push_back(DeferredRelease{kind, handle, bytes});
    debug_log(2, name(), "a stream of the GPU waits on the GPU for a signal: the driver may wait for it before a "
                         "free or unload, so it is made later (Note [CUDA implicit synchronization])");
    return;
  }
  root.release_deferred();
  release_now(DeferredRelease{kind, handle, bytes});
}

std::size_t CudaHCQDevice::release_deferred() {
  CudaHCQDevice& root = context_device();
  if (root.state_->released.load() || !root.opened_in_this_process()) return 0;
  {
    std::lock_guard lock(root.deferred_mutex_);
    if (root.deferred_.empty()) return 0;
  }
  const DriverReleaseWindow window(root);  // from before the check to after the driver calls
  if (root.context_holds_gpu_waits()) return 0;
  std::vector<DeferredRelease> ready;
  {
    std::lock_guard lock(root.deferred_mutex_);
    ready.swap(root.deferred_);
  }
  for (const DeferredRelease& r : ready) {
    try {
      root.release_now(r);
    } catch (const std::exception& e) {
      debug_log(1, root.name(), "a deferred release failed: {}", e.what());
    }
  }
  return ready.size();
}

bool CudaHCQDevice::release_deferred_within(std::chrono::milliseconds timeout) {
  CudaHCQDevice& root = context_device();
  if (root.state_->released.load() || !root.opened_in_this_process()) return false;
  const auto deferred = [&] {
    std::lock_guard lock(root.deferred_mutex_);
    return !root.deferred_.empty();
  };
  if (!deferred()) return false;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (release_deferred() > 0 || !deferred()) return true;  // or another thread released them
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void* CudaHCQDevice::alloc_pinned(std::size_t bytes, std::string_view what) {
  const DeviceState& s = *state_;
  s.make_current();
  void* p = nullptr;
  const auto alloc = [&] { return s.api.cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP); };
  CUresult r = alloc();
  if (r == CUDA_ERROR_OUT_OF_MEMORY && release_deferred() > 0) {
    s.make_current();  // the releases may have switched contexts
    r = alloc();
  }
  check(r, fmt::format("cuMemHostAlloc of {} bytes ({})", bytes, what), s.name);
  return p;
}

std::size_t CudaHCQDevice::deferred_device_bytes() const {
  const CudaHCQDevice& root = programs_device();
  std::lock_guard lock(root.deferred_mutex_);
  std::size_t bytes = 0;
  for (const DeferredRelease& r : root.deferred_)
    if (r.kind == DriverRelease::device_memory) bytes += r.bytes;
  return bytes;
}

std::uint64_t CudaHCQDevice::note_gpu_waits(CudaLane lane, std::span<const CudaCommand> commands) {
  const SignalSlot* own_timeline = timeline_slot();
  std::vector<PendingOp> ops;
  bool other_wait = false, other_signal = false;
  for (std::size_t i = 0; i < commands.size(); ++i) {
    const CudaCommand& c = commands[i];
    const auto op = [&](bool is_wait) {
      return PendingOp{c.slot, c.value, c.slot->reuses.load(std::memory_order_acquire), static_cast<std::uint32_t>(i),
                       is_wait};
    };
    if (c.kind == CommandKind::wait && !wait_passes(*c.slot, c.value)) {
      ops.push_back(op(true));
      other_wait |= c.slot != own_timeline;
    } else if (c.kind == CommandKind::signal && !ops.empty()) {
      ops.push_back(op(false));
      other_signal |= c.slot != own_timeline;
    }
  }
  // A wait on the timeline alone needs no letting go (this device's own earlier work writes it),
  // but the signals after it must fail if that value comes from work let go past a failure.
  if (!other_wait && !other_signal) return 0;
  std::uint64_t id = 0;
  {
    std::lock_guard lock(pending_mutex_);
    // Submissions whose waits all passed can block nothing any more; failed ones are the watcher's.
    const auto passed = [](const PendingSubmission& p) {
      return p.failed_at == kNotFailed && !p.issuing && std::ranges::all_of(p.ops, [](const PendingOp& op) {
        return !op.is_wait || op.stale() || wait_passes(*op.slot, op.value);
      });
    };
    while (!pending_.empty() && passed(pending_.front())) pending_.pop_front();
    if (pending_.size() >= 256) std::erase_if(pending_, passed);
    id = ++pending_ids_;
    pending_.push_back(PendingSubmission{id, lane, std::move(ops)});
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the record, then the poison flags (submit_commands)
  return id;
}

void CudaHCQDevice::issued_gpu_waits(std::uint64_t id, std::size_t issued_end) noexcept {
  if (id == 0) return;
  std::lock_guard lock(pending_mutex_);
  const auto it = std::ranges::find_if(pending_, [&](const PendingSubmission& p) { return p.id == id; });
  if (it == pending_.end()) return;
  // What never reached the GPU blocks nothing and needs no letting go; what did stays recorded.
  std::erase_if(it->ops, [&](const PendingOp& op) { return op.command >= issued_end; });
  if (it->failed_at != kNotFailed && it->failed_at >= it->ops.size()) it->failed_at = kNotFailed;
  it->issuing = false;
  if (std::ranges::none_of(it->ops, &PendingOp::is_wait)) pending_.erase(it);
}

// Drops the ops whose signal was freed and handed out again (the record says nothing about another
// signal) and keeps failed_at on the same place; whether the record still waits on anything (a
// record being issued is kept either way).
bool CudaHCQDevice::drop_stale_ops(PendingSubmission& p) noexcept {
  std::size_t kept = 0, failed_at = kNotFailed;
  for (std::size_t i = 0; i < p.ops.size(); ++i) {
    if (i == p.failed_at) failed_at = kept;
    if (!p.ops[i].stale()) p.ops[kept++] = p.ops[i];
  }
  if (p.failed_at != kNotFailed && failed_at == kNotFailed) failed_at = kept;
  p.ops.resize(kept);
  p.failed_at = failed_at;
  return p.issuing || std::ranges::any_of(p.ops, &PendingOp::is_wait);
}

void CudaHCQDevice::fail_gpu_waits() {
  struct Poison {
    SignalSlot* slot;
    std::uint32_t reuses;
    std::string reason;
  };
  std::vector<Poison> poisons;
  std::vector<std::pair<std::uint64_t, std::size_t>> failures;  // record id, its earliest failed wait
  {
    std::lock_guard lock(pending_mutex_);
    std::erase_if(pending_, [](PendingSubmission& p) { return !drop_stale_ops(p); });
    for (const PendingSubmission& p : pending_) {
      // The earliest failed wait; one before the failure already seen moves the failure earlier.
      const auto failed = std::ranges::find_if(p.ops, [](const PendingOp& op) {
        return op.is_wait && poison_failed(*op.slot, op.value);
      });
      const auto at = static_cast<std::size_t>(failed - p.ops.begin());
      if (failed == p.ops.end() || at >= p.failed_at) continue;
      // The same words as submit_commands' for a wait it found failed before issuing it: this
      // submission may still be issuing, and either of the two may say it first.
      const std::string reason = fmt::format("{}: its queue waits for value {} of a signal that failed: {}", name(),
                                             failed->value, failed->slot->poison_text());
      for (std::size_t i = at + 1; i < std::min(p.failed_at, p.ops.size()); ++i)
        if (!p.ops[i].is_wait) poisons.push_back(Poison{p.ops[i].slot, p.ops[i].reuses, reason});
      failures.emplace_back(p.id, at);
    }
  }
  // Outside the pending mutex: the timeline's poison takes the lane's host-copy mutex. Its Events
  // not reached by then fail, those of work before the failed one too (Note [Events after a
  // poison]: their callers may free what that work uses). Timelines are never handed out again;
  // any other signal is poisoned only while it is the one recorded.
  for (const Poison& p : poisons) {
    if (p.slot == timeline_slot()) {
      poison_timeline(*p.slot, p.reason);
      continue;
    }
    const auto hold = signal_pool().hold_reuse();
    if (!p.slot->stale_since(p.reuses)) p.slot->poison(p.reason);
  }
  // Only now, with every poison made, may collect_releases let these waits go (a throw above
  // leaves the records as they were, for the next pass).
  std::lock_guard lock(pending_mutex_);
  for (const auto& [id, at] : failures)
    for (PendingSubmission& p : pending_)
      if (p.id == id) p.failed_at = std::min(p.failed_at, at);
}

bool CudaHCQDevice::collect_releases(std::vector<Release>& releases) {
  std::lock_guard lock(pending_mutex_);
  const DeviceState& s = *state_;
  bool asked_driver = false;
  const auto stream_idle = [&](CudaLane lane) {
    if (s.released.load(std::memory_order_acquire)) return true;  // nothing runs any more
    if (!asked_driver && s.api.cuCtxSetCurrent(s.context) != CUDA_SUCCESS) return true;
    asked_driver = true;
    // NOT_READY: work left; an error other than that: the context failed, nothing runs on.
    return s.api.cuStreamQuery(lane == CudaLane::compute ? s.compute : s.copy) != CUDA_ERROR_NOT_READY;
  };
  // A failed submission fully issued whose stream went idle passed every wait it had.
  std::erase_if(pending_, [&](PendingSubmission& p) {
    return !drop_stale_ops(p) || (p.failed_at != kNotFailed && !p.issuing && stream_idle(p.lane));
  });
  bool outstanding = false;
  for (const PendingSubmission& p : pending_) {
    if (p.failed_at == kNotFailed) continue;
    outstanding = true;
    if (p.issuing) continue;  // what reached the GPU is known once it returns (the next pass)
    // Only waits at or after the failure: the signals after those are poisoned. A wait before it
    // that failed since is let go once the next pass moved the failure to it.
    for (std::size_t i = p.failed_at; i < p.ops.size(); ++i) {
      const PendingOp& op = p.ops[i];
      if (op.is_wait && poison_failed(*op.slot, op.value)) releases.push_back(Release{op.slot, op.value, op.reuses});
    }
  }
  return outstanding;
}

void CudaHCQDevice::forget_failed_gpu_waits() noexcept {
  std::lock_guard lock(pending_mutex_);
  std::erase_if(pending_, [](const PendingSubmission& p) { return p.failed_at != kNotFailed && !p.issuing; });
}

std::atomic<FailedWaitWatcher*> FailedWaitWatcher::instance_{nullptr};

void FailedWaitWatcher::start() {
  static FailedWaitWatcher* watcher = new FailedWaitWatcher;  // a failed start throws, and the next device tries again
  instance_.store(watcher, std::memory_order_release);
}

FailedWaitWatcher::FailedWaitWatcher() : pid_(::getpid()) {
  try {
    std::thread([this] { run(); }).detach();
  } catch (const std::system_error& e) {
    throw DeviceUnavailable(fmt::format("CUDA: cannot start the thread that lets GPU waits on failed signals go: {}",
                                        e.what()));
  }
}

void FailedWaitWatcher::on_poison(SignalSlot&) noexcept {
  FailedWaitWatcher* w = instance_.load(std::memory_order_acquire);
  if (!w || ::getpid() != w->pid_) return;  // a forked child: no watcher runs there, and its locks may be held
  w->poisons_.fetch_add(1, std::memory_order_seq_cst);
  { std::lock_guard lock(w->mutex_); }  // the watcher reads poisons_ under it before it sleeps
  w->wake_.notify_one();
}

void FailedWaitWatcher::run() {
  std::uint64_t seen = 0;
  auto tick = std::chrono::milliseconds(1);
  bool outstanding = false;  // waits were let go whose streams have not gone idle yet
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      const auto fresh = [&] { return poisons_.load(std::memory_order_seq_cst) != seen; };
      if (outstanding) wake_.wait_for(lock, tick, fresh);
      else wake_.wait(lock, fresh);
    }
    try {
      outstanding = pass(seen, tick);
    } catch (const std::exception& e) {
      // Out of memory formatting a reason, say: the next pass tries again.
      debug_log(1, "CUDA", "letting GPU waits on failed signals go: {}", e.what());
      outstanding = true;
      tick = std::chrono::milliseconds(20);
    }
  }
}

bool FailedWaitWatcher::pass(std::uint64_t& seen, std::chrono::milliseconds& tick) {
  LiveDevices& live = live_devices();
  std::lock_guard lock(live.mutex);
  if (live.devices.empty()) return false;
  // Every failure first, down to the last queue it reaches: each poison it makes counts too.
  do {
    seen = poisons_.load(std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // the poison flags, then the records
    for (CudaHCQDevice* device : live.devices) device->fail_gpu_waits();
  } while (poisons_.load(std::memory_order_seq_cst) != seen);
  // Then the waits go.
  releases_.clear();
  bool outstanding = false;
  for (CudaHCQDevice* device : live.devices) outstanding |= device->collect_releases(releases_);
  bool wrote = false;
  for (const CudaHCQDevice::Release& r : releases_) {
    if (gpu_reached(*r.slot, r.value)) continue;
    // A device's timeline is written only once nothing of that device runs any more, so it never
    // takes work as finished that is not (its frees and cache reuse read the value).
    const auto owner =
        std::ranges::find_if(live.devices, [&](const CudaHCQDevice* d) { return d->timeline_slot() == r.slot; });
    if (owner != live.devices.end() && !(*owner)->queues_idle()) continue;
    // Any signal only while it is still the one the wait was recorded with.
    const auto hold = live.devices.front()->signal_pool().hold_reuse();
    if (r.slot->stale_since(r.reuses) || gpu_reached(*r.slot, r.value)) continue;
    r.slot->store(r.value);
    wrote = true;
  }
  tick = wrote ? std::chrono::milliseconds(1) : std::min(tick * 2, std::chrono::milliseconds(20));
  return outstanding;
}

void CudaHCQDevice::note_if_sticky(int result, std::string_view reason) const noexcept {
  if (!sticky(static_cast<CUresult>(result))) return;
  context_failed_.store(true, std::memory_order_release);
  poison_own_timeline(reason);
}

void CudaHCQDevice::check_health() const {
  if (state_->released.load()) return;
  if (state_->api.cuCtxSetCurrent(state_->context) != CUDA_SUCCESS) return;
  for (CUstream stream : {state_->compute, state_->copy}) {
    const CUresult r = state_->api.cuStreamQuery(stream);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_NOT_READY) {
      context_failed_.store(true, std::memory_order_release);  // an asynchronous error is sticky
      poison_own_timeline(fmt::format("{}: the GPU reported an error while running queued work: {}", name(), describe(r)));
    }
  }
}

void CudaHCQDevice::submit_commands(CudaLane lane, std::span<const CudaCommand> commands) {
  std::lock_guard lock(submit_mutex());
  throw_if_failed();
  // What the queue would still have signalled from command `from` on never comes (Note [CUDA
  // failures]): its timeline values were taken already, and a hole would stop every later wait.
  const auto poison_from = [&](std::size_t from, std::string_view reason) {
    for (std::size_t j = from; j < commands.size(); ++j)
      if (commands[j].kind == CommandKind::signal) poison_timeline(*commands[j].slot, reason);
  };
  // Note [CUDA queue depth]: a producer far ahead of the GPU waits here, not in the driver (whose
  // own queue, once full, blocks inside a launch with our submit mutex held).
  const std::uint64_t reached = timeline_signal().slot().value.load(std::memory_order_acquire);
  if (timeline_value() > reached + kMaxInFlight + 1) {
    try {
      wait_timeline_reached(timeline_value() - 1 - kMaxInFlight);
    } catch (const Error& e) {
      // Nothing of this queue went in: all it would signal fails, user signals too, as after any
      // submit that failed.
      poison_from(0, fmt::format("{}: a submission waited for the GPU to drain its queue (at most {} timeline "
                                 "values in flight) and gave up: {}",
                                 name(), kMaxInFlight, e.what()));
      throw;
    }
  }
  const DeviceState& s = *state_;
  s.make_current();
  CUstream stream = lane == CudaLane::compute ? s.compute : s.copy;
  std::array<CUstreamBatchMemOpParams, 64> batch;
  unsigned batched = 0;
  std::size_t i = 0, batch_first = 0;  // the command being issued; the first one in `batch`
  // Note [CUDA waits on failed signals]: recorded before any poison flag is looked at; how much
  // reached the GPU is told when this returns or throws.
  struct Issued {
    CudaHCQDevice& device;
    std::uint64_t id;
    std::size_t end;  // set where issuing stops early
    const std::size_t& current;  // the command being issued, the first batched one, how many are
    const std::size_t& first_batched;
    const unsigned& batched;
    const int exceptions = std::uncaught_exceptions();
    bool stopped = false;
    void stop_at(std::size_t command) noexcept {
      end = command;
      stopped = true;
    }
    ~Issued() {
      // Thrown out of the loop other than by issue(): nothing from the batch or the current command on went.
      if (!stopped && std::uncaught_exceptions() > exceptions) end = batched ? first_batched : current;
      device.issued_gpu_waits(id, end);
    }
  } issued{*this, note_gpu_waits(lane, commands), commands.size(), i, batch_first, batched};
  // A recorded GPU wait must not reach a stream while a free or unload that did not see the
  // record is in the driver (Note [CUDA implicit synchronization]).
  if (issued.id != 0) wait_for_driver_releases();
  // `from`: the first command the failed call issued (a batch's first, else the current one).
  const auto issue = [&](CUresult r, std::string_view what, std::size_t from) {
    if (r == CUDA_SUCCESS) [[likely]]
      return;
    issued.stop_at(from);  // from `from` on, nothing reached the GPU
    const std::string reason = fmt::format("{}: {} failed (command {} of a {} queue): {}", name(), what, from,
                                           lane == CudaLane::compute ? "compute" : "copy", describe(r));
    if (sticky(r)) {
      context_failed_.store(true, std::memory_order_release);
      poison_own_timeline(reason);
    }
    poison_from(from, reason);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) throw OutOfMemory(reason);
    throw Error(reason);
  };
  // A one-thread kernel storing %globaltimer into the slot's timestamp (Note [CUDA queues]).
  const auto timestamp = [&](SignalSlot* slot) { return static_cast<CUresult>(launch_timestamp(slot, stream)); };
  const auto flush = [&] {
    if (batched == 0) return;
    const unsigned n = batched;
    batched = 0;
    issue(s.api.cuStreamBatchMemOp(stream, n, batch.data(), 0), "cuStreamBatchMemOp", batch_first);
  };
  for (; i < commands.size(); ++i) {
    const CudaCommand& c = commands[i];
    switch (c.kind) {
      case CommandKind::signal:
      case CommandKind::wait: {
        const auto address = reinterpret_cast<CUdeviceptr>(&c.slot->value);  // Note [CUDA signal memory]
        if (c.kind == CommandKind::wait && issued.id != 0 && poison_failed(*c.slot, c.value)) {
          // A wait that failed already is not issued: the queue stops here, as a CPU queue does,
          // and what it would signal after the wait never comes.
          flush();
          issued.stop_at(i);
          poison_from(i + 1, fmt::format("{}: its queue waits for value {} of a signal that failed: {}", name(), c.value,
                                         c.slot->poison_text()));
          return;
        }
        if (!s.memops) {
          flush();
          const std::uint64_t args[2] = {static_cast<std::uint64_t>(address), c.value};
          issue(static_cast<CUresult>(launch(s, c.kind == CommandKind::signal ? s.signal : s.wait, stream,
                                             reinterpret_cast<const std::byte*>(args), sizeof args, {1, 1, 1},
                                             {1, 1, 1})),
                c.kind == CommandKind::signal ? "launching the signal kernel" : "launching the wait kernel", i);
          break;
        }
        if (batched == batch.size()) flush();
        if (batched == 0) batch_first = i;
        batch[batched] =
            c.kind == CommandKind::signal ? write_value_op(address, c.value) : wait_value_op(address, c.value);
        batched += 1;
        break;
      }
      case CommandKind::timestamp:
        flush();
        issue(timestamp(c.slot), "launching the timestamp kernel", i);
        break;
      case CommandKind::memory_barrier:
        break;  // work on a stream is ordered and its writes visible to what follows
      case CommandKind::exec: {
        flush();
        std::optional<ProfileRecord> span;
        issue(static_cast<CUresult>(begin_span(span, c.program->name(), stream)), "launching the timestamp kernel", i);
        const CUresult r = launch(s, static_cast<CUfunction>(c.program->function()), stream, c.kernargs,
                                  c.kernarg_bytes, c.global, c.local);
        if (r != CUDA_SUCCESS) [[unlikely]] {
          drop_span(span);
          issue(r, c.program->launch_what(), i);
        }
        issue(static_cast<CUresult>(end_span(span, stream)), "launching the timestamp kernel", i);
        const std::int64_t launched = GlobalCounters::kernel_count.fetch_add(1, std::memory_order_relaxed) + 1;
        debug_log(2, name(), "*** {:<7} {:>6} {:<40} (queued)", name(), launched, c.program->name());
        break;
      }
      case CommandKind::copy:
        flush();
        if (c.host_copy) {  // Note [CUDA copyout without blocking]
          issue(s.api.cuLaunchHostFunc(stream, run_host_copy, const_cast<HostCopy*>(c.host_copy)),
                "cuLaunchHostFunc (a copy into host memory)", i);
          break;
        }
        if (const CUresult r = s.api.cuMemcpyAsync(static_cast<CUdeviceptr>(c.dest), static_cast<CUdeviceptr>(c.src),
                                                   c.size, stream);
            r != CUDA_SUCCESS) [[unlikely]]
          issue(r, fmt::format("cuMemcpyAsync of {} bytes", c.size), i);
        break;
    }
  }
  flush();
  // Which stream the timeline's newest value comes from (launch_direct's wait can be skipped when
  // it is the compute stream, whose order already covers it).
  for (auto it = commands.rbegin(); it != commands.rend(); ++it)
    if (it->kind == CommandKind::signal && it->slot == &timeline_signal().slot()) {
      last_signal_on_compute_ = lane == CudaLane::compute;
      break;
    }
}

void CudaHCQDevice::release_host_copies(bool keep_spare_captures) {
  if (!host_copies_) return;
  HostCopies& h = *host_copies_;
  if (!keep_spare_captures) h.drop_spare_captures();  // no copy reads a spare
  // Only a healthy lane lets records go: a faulted one's timeline may show values reached whose
  // host functions wait behind an event still (Note [CUDA copyout without blocking]).
  if (!fault().empty()) return;
  const std::uint64_t reached = timeline_slot()->value.load(std::memory_order_acquire);
  std::vector<CaptureBlock> done;  // unmapped outside the host-copy mutex
  {
    std::lock_guard copies_lock(h.mutex);
    while (!h.records.empty() && h.records.front().value <= reached) {
      h.captured_bytes -= h.records.front().capture.size();
      if (h.records.front().capture.data()) done.push_back(std::move(h.records.front().capture));
      h.records.pop_front();
    }
  }
  if (keep_spare_captures)
    for (CaptureBlock& block : done) h.keep_capture(std::move(block));
}

CudaHCQDevice::HostCopies& CudaHCQDevice::host_copies_for(std::size_t bounce_bytes, std::string_view what) {
  throw_if_failed();
  check_usable();
  if (!host_copies_) throw InvalidArgument(fmt::format("{}: a {} that returns at once runs on a stream's lane", name(), what));
  HostCopies& h = *host_copies_;
  release_host_copies();
  if (h.bounce.size < bounce_bytes) {
    const std::size_t bytes = std::bit_ceil(std::max(bounce_bytes, kMinBounceBytes));
    h.outgrown.reserve(h.outgrown.size() + 1);  // nothing may throw once the pinned memory is ours
    void* p = alloc_pinned(bytes, fmt::format("a stream {}'s bounce memory", what));
    if (h.bounce.size) h.outgrown.push_back(h.bounce);
    h.bounce = Allocation{reinterpret_cast<std::uintptr_t>(p), bytes, CudaAllocator::pinned_tag()};
  }
  return h;
}

template <class Fill>
std::uint64_t CudaHCQDevice::submit_on_copy_stream(std::span<const std::pair<Signal, std::uint64_t>> waits,
                                                   Fill&& fill) {
  auto reservation = reserve_timeline_value();
  const std::uint64_t value = reservation.value();
  std::vector<CudaCommand> commands;
  commands.push_back(CudaSignalPrimitives::wait(timeline_signal(), value - 1));
  for (const auto& [signal, wanted] : waits) commands.push_back(CudaSignalPrimitives::wait(signal, wanted));
  fill(value, commands);
  commands.push_back(CudaSignalPrimitives::signal(timeline_signal(), value));
  // A failure poisons the timeline (under the host-copy mutex): the host functions launched so
  // far that copy into the caller's memory copy nothing.
  submit_commands(CudaLane::copy, commands);
  reservation.submitted();
  return value;
}

void CudaHCQDevice::add_host_copy(std::vector<CudaCommand>& commands, std::uint64_t value, std::byte* to,
                                  const std::byte* from, std::size_t n, bool unless_poisoned,
                                  CaptureBlock* capture) {
  HostCopies& h = *host_copies_;
  std::lock_guard copies_lock(h.mutex);  // host functions of earlier copies may be running
  h.records.push_back({value,
                       HostCopy{to, from, n, unless_poisoned ? &timeline_signal().slot() : nullptr, value, &h.mutex},
                       capture ? std::move(*capture) : CaptureBlock()});
  h.captured_bytes += h.records.back().capture.size();
  commands.push_back(CudaCommand{.kind = CommandKind::copy, .host_copy = &h.records.back().copy});
}

std::uint64_t CudaHCQDevice::submit_copyout_later(std::span<std::byte> dest, const Allocation& src,
                                                  std::span<const std::pair<Signal, std::uint64_t>> waits) {
  std::lock_guard lock(submit_mutex());
  const bool pinned_source = static_cast<const CudaAllocator&>(allocator()).host_visible(src);
  // The bounce: big enough for the whole copy, or for chunks of it; none for a pinned source.
  const std::size_t chunk = pinned_source ? dest.size() : std::min(dest.size(), kMaxBounceBytes);
  HostCopies& h = host_copies_for(pinned_source ? 0 : chunk, "copyout");
  return submit_on_copy_stream(waits, [&](std::uint64_t value, std::vector<CudaCommand>& commands) {
    // Into the caller's memory: not once the timeline was poisoned before `value`.
    if (pinned_source) {
      add_host_copy(commands, value, dest.data(), src.host_ptr<std::byte>(), dest.size(), true);
      return;
    }
    for (std::size_t i = 0; i < dest.size(); i += chunk) {
      const std::size_t n = std::min(chunk, dest.size() - i);
      commands.push_back(
          CudaCommand{.kind = CommandKind::copy, .dest = h.bounce.va_addr, .src = src.va_addr + i, .size = n});
      add_host_copy(commands, value, dest.data() + i, h.bounce.host_ptr<std::byte>(), n, true);
    }
  });
}

void CudaHCQDevice::wait_for_capture_room(std::size_t requested) {
  HostCopies& h = *host_copies_;
  const std::size_t bytes = CaptureBlock::rounded(requested);  // what its block holds
  if (h.captured_bytes == 0 || h.captured_bytes + bytes <= kMaxCapturedBytes) return;
  // The value after which enough of the earliest captures are copied (records are in order).
  std::uint64_t until = 0;
  {
    std::lock_guard copies_lock(h.mutex);
    std::size_t left = h.captured_bytes;
    for (const auto& record : h.records) {
      if (!record.capture.data()) continue;
      left -= record.capture.size();
      until = record.value;
      if (left == 0 || left + bytes <= kMaxCapturedBytes) break;
    }
  }
  debug_log(2, name(), "a copyin of {} bytes waits for timeline value {}: the lane holds {} bytes of queued copyins",
            requested, until, h.captured_bytes);
  try {
    wait_timeline_reached(until);
  } catch (const Timeout& e) {
    throw Timeout(fmt::format("{}: a copyin of {} bytes waited for room in vain: the stream's earlier copyins, queued "
                              "behind its waits, still hold {} bytes of the callers' (at most {} are queued per "
                              "stream: Note [CUDA copyin captures]). Complete the events the stream waits for, or "
                              "wait for its work before copying more in: {}",
                              name(), requested, h.captured_bytes, kMaxCapturedBytes, e.what()));
  }
  release_host_copies();
}

std::uint64_t CudaHCQDevice::submit_copyin_later(const Allocation& dest, std::span<const std::byte> src,
                                                 std::span<const std::pair<Signal, std::uint64_t>> waits) {
  std::lock_guard lock(submit_mutex());
  const bool pinned_dest = static_cast<const CudaAllocator&>(allocator()).host_visible(dest);
  const std::size_t chunk = pinned_dest ? src.size() : std::min(src.size(), kMaxBounceBytes);
  HostCopies& h = host_copies_for(pinned_dest ? 0 : chunk, "copyin");
  wait_for_capture_room(src.size());
  // The caller's bytes, read now (copyin's contract); the lane's (its first record's) until the
  // copy ran.
  CaptureBlock captured = h.take_capture(src.size(), name());
  std::memcpy(captured.data(), src.data(), src.size());
  const std::byte* bytes = captured.data();
  return submit_on_copy_stream(waits, [&](std::uint64_t value, std::vector<CudaCommand>& commands) {
    // Into a pinned Buffer: as a copyout's, not once the timeline is poisoned (the caller may have
    // freed the Buffer when told).
    if (pinned_dest) {
      add_host_copy(commands, value, dest.host_ptr<std::byte>(), bytes, src.size(), true, &captured);
      return;
    }
    // Into the bounce, the lane's own: made even on a poisoned timeline (no GPU copy reads garbage
    // from it then).
    for (std::size_t i = 0; i < src.size(); i += chunk) {
      const std::size_t n = std::min(chunk, src.size() - i);
      add_host_copy(commands, value, h.bounce.host_ptr<std::byte>(), bytes + i, n, false, i == 0 ? &captured : nullptr);
      commands.push_back(
          CudaCommand{.kind = CommandKind::copy, .dest = dest.va_addr + i, .src = h.bounce.va_addr, .size = n});
    }
  });
}

std::optional<double> CudaHCQDevice::launch_direct(const CudaProgram& program, const std::byte* args,
                                                   std::uint32_t bytes, Dim3 global, Dim3 local, bool timed) {
  // Ahead of a reserved value not yet submitted, the lazy value covering this call would be
  // signalled before the reserved one (Note [Timeline reservations]).
  check_no_reservation_held("a direct kernel call");
  const DeviceState& s = *state_;
  const auto function = static_cast<CUfunction>(program.function());
  auto work = [&](void* stream) {
    return static_cast<int>(launch(s, function, static_cast<CUstream>(stream), args, bytes, global, local));
  };
  const std::optional<double> seconds = run_ordered(work, program.launch_what(), timed, program.name());
  const std::int64_t launched = GlobalCounters::kernel_count.fetch_add(1, std::memory_order_relaxed) + 1;
  if (seconds) {
    GlobalCounters::time_sum.fetch_add(*seconds, std::memory_order_relaxed);
    debug_log(2, name(), "*** {:<7} {:>6} {:<40} tm {:9.2f}us", name(), launched, program.name(), *seconds * 1e6);
  } else {
    debug_log(2, name(), "*** {:<7} {:>6} {:<40} {:>4} B of arguments", name(), launched, program.name(), bytes);
  }
  return seconds;
}

int CudaHCQDevice::launch_timestamp(SignalSlot* slot, void* stream) {
  const auto out = reinterpret_cast<std::uint64_t>(&slot->timestamp_ns);
  return launch(*state_, state_->timestamp, static_cast<CUstream>(stream), reinterpret_cast<const std::byte*>(&out),
                sizeof out, {1, 1, 1}, {1, 1, 1});
}

// Profiling: a span of stream work between two timestamp kernels, turned into a trace event at the
// next synchronize. Nothing when not profiling or `name` is empty. A failed launch frees the span.
int CudaHCQDevice::begin_span(std::optional<ProfileRecord>& span, std::string_view name, void* stream) {
  if (name.empty() || !profiling()) [[likely]]
    return CUDA_SUCCESS;
  span = ProfileRecord{alloc_signal(), alloc_signal(), std::string(name), false, Profiler::current_request()};
  const int r = launch_timestamp(&span->start.slot(), stream);
  if (r != CUDA_SUCCESS) drop_span(span);
  return r;
}

int CudaHCQDevice::end_span(std::optional<ProfileRecord>& span, void* stream) {
  if (!span) return CUDA_SUCCESS;
  const int r = launch_timestamp(&span->end.slot(), stream);
  if (r != CUDA_SUCCESS) drop_span(span);
  else add_profile_record(std::move(*span));
  span.reset();
  return r;
}

void CudaHCQDevice::drop_span(std::optional<ProfileRecord>& span) {
  if (!span) return;
  free_signal(span->start);
  free_signal(span->end);
  span.reset();
}

std::optional<double> CudaHCQDevice::run_ordered(StreamWork work, std::string_view what,
                                                 bool timed, std::string_view profile_name) {
  check_usable();  // a forked child (Note [Devices and fork]) or a faulted device: an error, not a launch
  std::lock_guard lock(submit_mutex());
  throw_if_failed();
  const DeviceState& s = *state_;
  // Untimed work takes no timeline value: it is lazy work (Note [Lazy timeline signals] in
  // tinydev/hcq_device.hpp), signalled by whoever next needs the timeline. Timed work takes a
  // value and waits for it.
  const std::uint64_t value = timed ? next_timeline_value() : 0;
  const std::uint64_t after = timed ? value - 1 : timeline_value() - 1;
  // A taken timeline value is signalled whatever happens (unless the device has failed).
  const auto signal = [&] {
    if (!timed) return;
    const CudaCommand command = CudaSignalPrimitives::signal(timeline_signal(), value);
    submit_commands(CudaLane::compute, std::span(&command, 1));
    last_signal_on_compute_ = true;
  };
  try {
    // Work on the copy stream is ordered by the timeline; the compute stream's own order covers
    // what was signalled from it, and what it already waited for.
    if (!last_signal_on_compute_) {
      const CudaCommand command = CudaSignalPrimitives::wait(timeline_signal(), after);
      submit_commands(CudaLane::compute, std::span(&command, 1));
      last_signal_on_compute_ = true;
    }
    s.make_current();
    std::optional<ProfileRecord> span;
    check(static_cast<CUresult>(begin_span(span, profile_name, s.compute)), "launching the timestamp kernel", name());
    if (timed) check(s.api.cuEventRecord(s.start, s.compute), "cuEventRecord", name());
    if (const auto r = static_cast<CUresult>(work(s.compute)); r != CUDA_SUCCESS) [[unlikely]] {
      const std::string reason = fmt::format("{}: {} failed: {}", name(), what, describe(r));
      note_if_sticky(r, reason);
      drop_span(span);
      throw Error(reason);
    }
    if (timed) check(s.api.cuEventRecord(s.end, s.compute), "cuEventRecord", name());
    check(static_cast<CUresult>(end_span(span, s.compute)), "launching the timestamp kernel", name());
  } catch (const Timeout& e) {
    // The wait's submit gave up at the queue-depth bound (Note [CUDA queue depth]): a signal's
    // submit would wait as long again, so the value fails here.
    if (timed)
      poison_timeline(timeline_signal().slot(),
                      fmt::format("{}: {} gave up waiting for the GPU to drain its queue: {}", name(), what, e.what()));
    throw;
  } catch (...) {
    // Nothing of this call runs: the timeline moves on (a non-sticky failure leaves the device usable).
    if (!timeline_signal().slot().poisoned.load()) signal();
    throw;
  }
  if (!timed) {
    note_lazy_work();
    // Bounded like queued work (Note [CUDA queue depth]): every so often the lazy work is
    // signalled, and that submit waits when the GPU is far behind.
    ++lazy_calls_total_;
    if (++lazy_calls_ >= kLazySignalEvery) signal_lazy_work_now();
    return std::nullopt;
  }
  signal();
  wait_timeline(value);
  check(s.api.cuEventSynchronize(s.end), fmt::format("{} (waiting for it)", what), name());
  float ms = 0;
  check(s.api.cuEventElapsedTime(&ms, s.start, s.end), "cuEventElapsedTime", name());
  return ms / 1e3;
}

void CudaHCQDevice::signal_lazy_work(std::uint64_t value) {
  // The compute stream's order puts this after every direct call made since the last value.
  const CudaCommand command = CudaSignalPrimitives::signal(timeline_signal(), value);
  lazy_calls_ = 0;
  // About lazy_marks_.size() x kLazySignalEvery direct calls in flight at most (a GPU far behind
  // blocks the caller here, not inside the driver): the marks are lazy signals at least
  // kLazySignalEvery calls apart, and a new one first waits for the oldest, made at least that
  // many calls ago. Counted in calls, not signals: lazy work is also signalled whenever something
  // takes a timeline value (a stream after every operation, HCQLaneStream::finish), and waiting
  // for the fourth last of those signals would block a stream's fifth graph replay queued behind
  // an event not yet complete, which must return at once (tinydev/stream.hpp); signals that
  // frequent are bounded by the timeline's own depth (Note [CUDA queue depth]).
  const std::size_t marks = lazy_marks_.size();
  const LazyMark& newest = lazy_marks_[(lazy_mark_next_ + marks - 1) % marks];
  if (newest.value == 0 || lazy_calls_total_ - newest.calls >= kLazySignalEvery) {
    LazyMark& oldest = lazy_marks_[lazy_mark_next_];
    if (oldest.value && lazy_calls_total_ - oldest.calls >= marks * kLazySignalEvery) wait_timeline_reached(oldest.value);
    oldest = LazyMark{value, lazy_calls_total_};
    lazy_mark_next_ = (lazy_mark_next_ + 1) % marks;
  }
  submit_commands(CudaLane::compute, std::span(&command, 1));
  last_signal_on_compute_ = true;
}

bool CudaHCQDevice::prepare_transfer(CudaHCQDevice& dest) {
  // Peer access, once per pair and both ways, where the GPUs allow it; otherwise HCQAllocator
  // stages the copy through the destination's staging ring (Note [Staged transfers] in
  // tinydev/hcq_allocator.hpp), not through cuMemcpyAsync between the GPUs, which the driver
  // would stage itself, returning only once the copy ran.
  static std::mutex mutex;
  static std::set<std::pair<int, int>> enabled, refused;
  const DeviceState& a = *state_;
  const DeviceState& b = dest.state();
  if (a.ordinal == b.ordinal) return true;  // one GPU (a stream's lane and its device): nothing to enable
  std::lock_guard lock(mutex);
  const std::pair<int, int> pair = std::minmax(a.ordinal, b.ordinal);
  if (!enabled.count(pair) && !refused.count(pair)) {
    int ab = 0, ba = 0;
    check(a.api.cuDeviceCanAccessPeer(&ab, a.device, b.device), "cuDeviceCanAccessPeer", name());
    check(a.api.cuDeviceCanAccessPeer(&ba, b.device, a.device), "cuDeviceCanAccessPeer", name());
    if (ab && ba) {
      for (const auto& [from, to] : {std::pair{&a, &b}, std::pair{&b, &a}}) {
        from->make_current();
        const CUresult r = a.api.cuCtxEnablePeerAccess(to->context, 0);
        if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
          check(r, fmt::format("cuCtxEnablePeerAccess to {}", to->name), from->name);
      }
      enabled.insert(pair);
    } else {
      refused.insert(pair);
    }
  }
  const bool peer = enabled.count(pair) != 0;
  if (peer) debug_log(2, name(), "transfer {} -> {}: peer to peer", name(), dest.name());
  return peer;  // else HCQAllocator's staged transfer says so
}

Kernargs CudaHCQDevice::alloc_kernargs(std::uint32_t num_buffers, std::uint32_t num_values) {
  std::lock_guard lock(submit_mutex());
  return kernargs_.alloc(num_buffers, num_values, timeline_signal().slot().value,
                         timeline_value());
}

std::shared_ptr<std::byte[]> CudaHCQDevice::allocate_kernargs_block(std::size_t bytes) const {
  return std::shared_ptr<std::byte[]>(new std::byte[bytes]());
}

void CudaHCQDevice::synchronize() {
  throw_if_failed();
  HCQCompiled::synchronize();
  throw_if_failed();
  lanes_.synchronize_all();  // every stream's work ends, finished or failed
  CudaProgram::reclaim_retired();
  release_deferred();
}

void CudaHCQDevice::on_timeline_wrapped() {
  static_cast<CudaAllocator&>(allocator()).reset_staging_timelines();
  kernargs_.timeline_wrapped();
  last_signal_on_compute_ = true;  // nothing is in flight
  lazy_marks_.fill(LazyMark{});
}

DeviceCapabilities CudaHCQDevice::capabilities() const {
  return DeviceCapabilities{.compiles_source = true,
                            .rejects_invalid_source = true,
                            .caches_compiles = true,
                            .runs_kernels = true,
                            .checks_signatures = state_->api.cuFuncGetParamInfo != nullptr,
                            .native_graphs = true,
                            .hcq = true,
                            .streams = true};
}

namespace {
int attribute(const DeviceState& s, CUdevice_attribute which, std::string_view what) {
  int value = 0;
  check(s.api.cuDeviceGetAttribute(&value, which, s.device), fmt::format("cuDeviceGetAttribute({})", what), s.name);
  return value;
}
}  // namespace

std::map<std::string, std::string> CudaHCQDevice::properties() const {
  auto props = Compiled::properties();
  const DeviceState& s = *state_;
  char gpu[256] = {};
  s.api.cuDeviceGetName(gpu, sizeof(gpu) - 1, s.device);
  std::size_t memory = 0;
  s.api.cuDeviceTotalMem(&memory, s.device);
  const auto& compiler = static_cast<const CudaCompiler&>(this->compiler());
  props["gpu"] = gpu;
  props["compute capability"] = fmt::format("{}.{}", s.major, s.minor);
  props["memory"] = fmt::format("{:.1f} GiB", static_cast<double>(memory) / (1ull << 30));
  props["multiprocessors"] = std::to_string(attribute(s, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SMs"));
  props["64-bit stream memory operations"] =
      s.memops ? "yes"
               : fmt::format("no ({}signals and waits run as one-thread kernels{})",
                             s.memops_refused.empty() ? ""
                                                      : fmt::format("the GPU reports them, but at open {}; ", s.memops_refused),
                             s.kernel_time_limit ? ", and this GPU's kernel time limit ends a wait that lasts longer, with "
                                                   "the context"
                                                 : "");
  const std::string unsupported = compiler.unsupported_reason();
  props["compiler"] = unsupported.empty() ? fmt::format("NVRTC {} to {} for {}", compiler.nvrtc_version(),
                                                        compiler.ptx() ? "PTX (driver JIT)" : "CUBIN", compiler.arch())
                                          : "none: " + unsupported;
  props["driver"] = fmt::format("{}.{} ({})", s.api.version / 1000, s.api.version % 1000 / 10, s.api.path);
  props["queues"] = fmt::format("HCQ: compute + copy streams, signals by {}",
                                s.memops ? "stream memory operations" : "one-thread kernels");
  props["kernel signatures"] = s.api.cuFuncGetParamInfo
                                   ? "checked at launch (cuFuncGetParamInfo)"
                                   : "not checked: the driver has no cuFuncGetParamInfo (CUDA 12.4 and later)";
  return props;
}

namespace {

// The ordinal of "CUDA" (0) or "CUDA:3" (3); canonicalize has checked the form.
int ordinal_of(const std::string& canonical_name) {
  const auto colon = canonical_name.find(':');
  if (colon == std::string::npos) return 0;
  int ordinal = 0;
  std::from_chars(canonical_name.data() + colon + 1, canonical_name.data() + canonical_name.size(), ordinal);
  return ordinal;
}

// Note [CUDA at exit]
// Each device retains its GPU's primary context. At exit (an atexit handler registered after the
// driver initialized, so it runs before the driver's own teardown) every live device first
// finishes its work, while every context is alive: one GPU's queue may wait on another's signals,
// and all signals live in memory of the first device's context (Note [CUDA signal memory]).
// Then each device is marked released (from then on it refuses calls instead of touching a dead
// context, and frees of its memory are skipped: the context takes it along) and its context is
// released, last opened first. The context that owns the signal memory is the exception: it
// stays retained until the process ends, because releasing a primary context's last reference
// resets it and unmaps its memory, and handlers that run after this one (a profile writer
// registered before the first CUDA open, static destructors of Buffers) still read signals. A
// forked child inherits this handler but not the devices: it does nothing there.
pid_t g_exit_handler_pid = 0;  // the process that registered release_at_exit

void release_at_exit() {
  if (::getpid() != g_exit_handler_pid) return;  // a forked child: the parent's contexts, not ours
  std::vector<CudaHCQDevice*> devices;
  {
    // Not held while synchronizing: a synchronize takes the device's submit mutex, which is
    // taken before this one elsewhere (free_signal -> signal_users_now).
    LiveDevices& live = live_devices();
    std::lock_guard lock(live.mutex);
    devices = live.devices;
  }
  for (CudaHCQDevice* device : devices) {
    if (device->is_lane()) continue;  // its device's synchronize covers it
    try {
      // A device whose wait timed out (a hung kernel) is waited for at most 1 s: the process exits.
      if (device->has_timed_out())
        device->wait_submitted(device->free_wait_timeout());
      else
        device->synchronize();
    } catch (const std::exception& e) {
      debug_log(1, device->name(), "unfinished work at exit: {}", e.what());
    }
  }
  {
    // Under the mutex: the FailedWaitWatcher asks the driver only while holding it, after
    // looking at `released`.
    LiveDevices& live = live_devices();
    std::lock_guard lock(live.mutex);
    for (CudaHCQDevice* device : devices) device->state().released.store(true, std::memory_order_release);
  }
  for (auto it = devices.rbegin(); it != devices.rend(); ++it) {
    DeviceState& s = (*it)->state();
    if (&s == g_signal_owner_of_pool) continue;
    s.api.cuDevicePrimaryCtxRelease(s.device);  // an error here (driver already gone) is ignored
  }
}

// Note [Probing stream memory operations]
// CAN_USE_64_BIT_STREAM_MEM_OPS says the driver offers them, not that this GPU's setup takes
// them: a virtualized GPU or a driver setting can refuse them at the call (not supported, invalid
// value), and every queue's first signal would then fail. So a GPU whose attribute says yes writes
// one word of pinned, device-mapped memory (as the signal slots are) from its compute stream and,
// once that landed, waits for it on its copy stream. A refusal, or a word that did not change,
// turns them off for this GPU with a warning: signals and waits then run as one-thread kernels,
// as on a GPU without them, and `tinydev devices` says why. Only the calls' own refusals do that:
// any other failure (no pinned memory, memory not mapped at its host address, a sticky error, an
// error a synchronize reports) fails the open, as it would fail the device's first signal.
// Returns "" when they work, else why not.
std::string probe_stream_memory_operations(const DeviceState& state) {
  const Driver& api = state.api;
  void* word = alloc_mapped_at_host_address(state, 64, "the word probing stream memory operations");
  struct Freed {
    const Driver& api;
    void* word;
    ~Freed() { api.cuMemFreeHost(word); }
  } freed{api, word};
  auto* value = static_cast<volatile std::uint64_t*>(word);
  *value = 0;
  constexpr std::uint64_t kWritten = 0x7464'7072'6f62'6501ull;  // above 2^32: all 64 bits must land
  const auto address = reinterpret_cast<CUdeviceptr>(word);  // mapped at its host address
  CUstreamBatchMemOpParams op = write_value_op(address, kWritten);
  const auto refused = [&](CUresult r, std::string_view what) {
    if (sticky(r)) check(r, fmt::format("{} (probing stream memory operations)", what), state.name);
    return fmt::format("{} was refused: {}", what, describe(r));
  };
  if (CUresult r = api.cuStreamBatchMemOp(state.compute, 1, &op, 0); r != CUDA_SUCCESS)
    return refused(r, "a 64-bit write (cuStreamBatchMemOp)");
  check(api.cuStreamSynchronize(state.compute), "cuStreamSynchronize (probing stream memory operations)", state.name);
  if (*value != kWritten)
    return fmt::format("a 64-bit write from the GPU did not land in pinned memory (read {:#x}, wrote {:#x})",
                       static_cast<std::uint64_t>(*value), kWritten);
  // The value is there already, so this wait never holds the stream.
  op = wait_value_op(address, kWritten);
  if (CUresult r = api.cuStreamBatchMemOp(state.copy, 1, &op, 0); r != CUDA_SUCCESS)
    return refused(r, "a 64-bit wait (cuStreamBatchMemOp)");
  check(api.cuStreamSynchronize(state.copy), "cuStreamSynchronize (probing stream memory operations)", state.name);
  return {};
}

// Retains the GPU's primary context and makes the state's two streams, its two timing events and,
// with `load_kernels`, the queue kernels; on a failure undoes what it made and throws.
void retain_context_and_queues(DeviceState& state, bool load_kernels) {
  const Driver& api = state.api;
  const std::string& name = state.name;
  const CUresult retained = api.cuDevicePrimaryCtxRetain(&state.context, state.device);
  // A GPU in exclusive-process compute mode that another process holds, or a prohibited one: not
  // this process's to open, as a GPU that is not there (the default-device probe moves on).
  if (retained == CUDA_ERROR_DEVICE_UNAVAILABLE)
    throw DeviceUnavailable(fmt::format(
        "{}: the driver says the GPU is unavailable (CUDA_ERROR_DEVICE_UNAVAILABLE): its compute mode is "
        "exclusive-process and another process uses it, or it is prohibited (`nvidia-smi --query-gpu=compute_mode` "
        "says which); use another GPU or wait for that process",
        name));
  check(retained, "cuDevicePrimaryCtxRetain", name);
  try {
    state.make_current();
    check(api.cuStreamCreate(&state.compute, CU_STREAM_NON_BLOCKING), "cuStreamCreate", name);
    check(api.cuStreamCreate(&state.copy, CU_STREAM_NON_BLOCKING), "cuStreamCreate", name);
    check(api.cuEventCreate(&state.start, CU_EVENT_DEFAULT), "cuEventCreate", name);
    check(api.cuEventCreate(&state.end, CU_EVENT_DEFAULT), "cuEventCreate", name);
    if (load_kernels) {
      check(api.cuModuleLoadData(&state.queue_module, kQueuePtx), "loading the queue kernels", name);
      const std::pair<CUfunction*, const char*> kernels[] = {
          {&state.timestamp, "tinydev_timestamp"}, {&state.signal, "tinydev_signal"}, {&state.wait, "tinydev_wait"}};
      for (const auto& [function, kernel] : kernels)
        check(api.cuModuleGetFunction(function, state.queue_module, kernel), fmt::format("finding {}", kernel), name);
      // A GPU's first open (a lane takes its parent's answer).
      if (state.memops) {
        state.memops_refused = probe_stream_memory_operations(state);
        if (!state.memops_refused.empty()) {
          state.memops = false;
          log_message(LogLevel::warning, name,
                      fmt::format("the GPU reports 64-bit stream memory operations, but {}: they are off for this "
                                  "GPU, and queue signals and waits run as one-thread kernels (Note [Probing stream "
                                  "memory operations])",
                                  state.memops_refused));
        }
      }
    }
  } catch (...) {
    if (state.queue_module) api.cuModuleUnload(state.queue_module);
    if (state.end) api.cuEventDestroy(state.end);
    if (state.start) api.cuEventDestroy(state.start);
    if (state.copy) api.cuStreamDestroy(state.copy);
    if (state.compute) api.cuStreamDestroy(state.compute);
    api.cuDevicePrimaryCtxRelease(state.device);
    throw;
  }
}

std::shared_ptr<DeviceState> open_state(const std::string& name) {
  const Driver& api = driver();  // DeviceUnavailable: no driver, too old, cuInit failed
  static const bool registered = [] {
    g_exit_handler_pid = ::getpid();
    // Note [CUDA queues]: the compute and copy streams wait for each other's signals with stream
    // memory operations, which the GPU's scheduler does not see; on one hardware queue a wait
    // submitted before its signal blocks that queue for ever.
    if (const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
        connections && std::strtol(connections, nullptr, 10) == 1)
      log_message(LogLevel::warning, "CUDA",
                  "CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream on one hardware queue: a queue that waits for "
                  "a signal set by work submitted later to another queue then waits for ever; unset it or make it "
                  "2 or more (docs/cuda.md)");
    return std::atexit(&release_at_exit) == 0;
  }();
  (void)registered;
  static const bool versions_checked = [&] {
    try {
      if (const Nvrtc& compiler = nvrtc(); compiler.major > api.version / 1000)
        log_message(LogLevel::warning, "CUDA",
                    fmt::format("NVRTC {}.{} ({}) compiles for CUDA {} drivers, and this driver is {}.{}: kernels may "
                                "fail to load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION); update the NVIDIA driver or "
                                "install NVRTC {}",
                                compiler.major, compiler.minor, compiler.path, compiler.major, api.version / 1000,
                                api.version % 1000 / 10, api.version / 1000));
    } catch (const Error&) {
      // No NVRTC (or one refused): the device's compiler, made below, throws DeviceUnavailable saying so.
    }
    return true;
  }();
  (void)versions_checked;
  auto state = std::make_shared<DeviceState>(api, name);
  int count = 0;
  check(api.cuDeviceGetCount(&count), "cuDeviceGetCount", name);
  const int ordinal = ordinal_of(name);
  if (ordinal >= count) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    throw DeviceUnavailable(fmt::format("{}: this machine has {} CUDA device{}{}{}", name, count, count == 1 ? "" : "s",
                                        count > 0 ? fmt::format(" (CUDA to CUDA:{})", count - 1) : std::string(),
                                        visible ? fmt::format("; CUDA_VISIBLE_DEVICES='{}'", visible) : std::string()));
  }
  state->ordinal = ordinal;
  check(api.cuDeviceGet(&state->device, ordinal), "cuDeviceGet", name);
  state->major = attribute(*state, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "compute capability");
  state->minor = attribute(*state, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "compute capability");
  state->memops = attribute(*state, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, "stream mem ops") != 0;
  state->kernel_time_limit = attribute(*state, CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT, "kernel time limit") != 0;
  std::size_t total_memory = 0;
  check(api.cuDeviceTotalMem(&total_memory, state->device), "cuDeviceTotalMem", name);
  state->total_memory = total_memory;
  if (!attribute(*state, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, "unified addressing"))
    throw DeviceUnavailable(fmt::format("{}: the GPU has no unified addressing, which tinydev's CUDA queues need", name));
  retain_context_and_queues(*state, /*load_kernels=*/true);  // probes the memory operations
  // Note [CUDA queues]: without memory operations a wait is a kernel that spins, and a time limit
  // (a display attached, WSL) kills it, and the context with it, when the wait lasts too long.
  if (!state->memops && state->kernel_time_limit)
    log_message(LogLevel::warning, name,
                "this GPU has no 64-bit stream memory operations, so queue waits run as spinning kernels, and it "
                "has a kernel time limit (a display attached, or WSL): a wait longer than that limit (seconds) "
                "kills the CUDA context; keep waits short, or use a GPU without a display");
  return state;
}

}  // namespace

// A stream's lane (Note [CUDA streams]): the parent's GPU and context (retained once more, so
// release at exit stays balanced), its queue kernels, and two non-blocking streams of its own.
std::string_view queue_kernels_ptx() noexcept { return kQueuePtx; }

std::shared_ptr<DeviceState> open_lane_state(const DeviceState& parent, const std::string& name) {
  const Driver& api = parent.api;
  auto state = std::make_shared<DeviceState>(api, name);
  state->ordinal = parent.ordinal;
  state->device = parent.device;
  state->major = parent.major;
  state->minor = parent.minor;
  state->memops = parent.memops;
  state->memops_refused = parent.memops_refused;
  state->kernel_time_limit = parent.kernel_time_limit;
  state->total_memory = parent.total_memory;
  // The parent's queue kernels: its module lives as long as the process.
  state->timestamp = parent.timestamp;
  state->signal = parent.signal;
  state->wait = parent.wait;
  retain_context_and_queues(*state, /*load_kernels=*/false);
  return state;
}

}  // namespace cuda

// The GPUs the driver sees (CUDA_VISIBLE_DEVICES applied), for Device.available(): 0 without a
// usable driver. Opens no device.
unsigned count_cuda_devices() noexcept {
  try {
    const cuda::Driver& api = cuda::driver();
    int count = 0;
    if (api.cuDeviceGetCount(&count) != CUDA_SUCCESS || count < 0) return 0;
    return static_cast<unsigned>(count);
  } catch (...) {
    return 0;
  }
}

std::unique_ptr<Compiled> open_cuda_device(const std::string& canonical_name) {
  auto device = std::make_unique<cuda::CudaHCQDevice>(canonical_name, cuda::open_state(canonical_name));
  return device;
}

}  // namespace tinydev
