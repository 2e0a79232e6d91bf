// A fake CUDA driver for CI machines without a GPU (TINYDEV_CUDA_DRIVER points the backend at it).
// It exports the driver functions the CUDA backend resolves (backends/cuda/cuda_api.hpp), under
// the same versioned names, and emulates them on the CPU:
//  - FAKE_CUDA_DEVICES GPUs (default 2) of compute capability 9.0, each with FAKE_CUDA_MEMORY
//    bytes (default 256 MiB) of "device memory" (host memory the fake tracks: frees and copies of
//    memory it did not hand out, or past an allocation's end, are errors, as a driver's are);
//  - modules are the real CUBIN/PTX NVRTC produced; a kernel is found by name in the image and run
//    by a host implementation registered here (the test suite's kernels: add, ping, pong, scale,
//    fill, odd, and the backend's own tinydev_timestamp), whose parameter layout
//    cuFuncGetParamInfo reports;
//  - each stream is a thread running its work in order, as a GPU's stream runs asynchronously to
//    the host: kernels, copies, stream memory operations (a wait polls the word, a write stores it
//    and wakes nobody, as a GPU's does), host functions and events; cuStreamSynchronize,
//    cuStreamQuery, cuEventSynchronize and cuCtxSynchronize wait for or look at that work; a
//    cuMemcpyAsync into pageable memory, or between host memories, returns only once its stream
//    ran it, as the driver's does (fake_cuda_calls("cuMemcpyAsync (synchronous)") counts them);
//  - a kernel touching memory the fake did not hand out fails when it runs with
//    CUDA_ERROR_ILLEGAL_ADDRESS, which, as on a GPU, is sticky: every later call in that context
//    returns it;
//  - FAKE_CUDA_FAIL="cuLaunchKernel=719,cuMemAlloc_v2=2" makes those functions return that
//    CUresult (read on every call), "cuMemcpyAsync@7=1" only the 7th call (counted as
//    fake_cuda_calls counts), and "run:add=719" makes kernel `add` fail when it runs (a sticky
//    error), so the backend's error paths run in CI;
//  - graphs: kernel, 1-D copy and empty nodes, instantiated, patched (cuGraphExec*NodeSetParams)
//    and launched on a stream, running their nodes in an order their dependencies allow that is
//    as far from the order they were added as it gets (the latest-added ready node first), so a
//    missing dependency shows as a wrong result; fake_cuda_graph_edges() counts the last
//    instantiated graph's dependencies;
//  - FAKE_CUDA_NO_PEER=1: no device can access another's memory (copies between them still
//    work, staged by the "driver": as the driver's, such a cuMemcpyAsync returns only once its
//    stream ran it, counted as fake_cuda_calls("cuMemcpyAsync (staged between GPUs)"));
//    FAKE_CUDA_NO_MEMOPS=1: no 64-bit stream memory operations.
//  - cuMemFree, cuMemFreeHost and cuModuleUnload first wait for every stream of the context the
//    memory or module belongs to, as the driver may ("this API may perform implicit
//    synchronization"): a free while a stream waits on a word only the caller will write hangs
//    here as it can on a GPU. fake_cuda_calls("implicit synchronization") counts the waits.
//  - built with FAKE_CUDA_DRIVER_12_0 (libtinydev_fake_cuda_12_0.so), it exports what a driver of
//    CUDA 12.0 has: no cuFuncGetParamInfo (12.4), cuEventElapsedTime under its CUDA 2.0 symbol
//    only (cuEventElapsedTime_v2 is 12.8's), and cuDriverGetVersion says 12000 unless
//    FAKE_CUDA_DRIVER_VERSION says otherwise.
//  fake_cuda_pinned_bytes() is the pinned host memory in use and fake_cuda_limit_pinned_bytes(n)
//  makes cuMemHostAlloc refuse past n bytes (0: no limit).
//  fake_cuda_hold_implicit_synchronization(1) holds those implicit synchronizations before they
//  look at the streams, until it is called with 0.
//  fake_cuda_hold_copies_to_host(1) holds every queued copy from device memory into pinned host
//  memory when its stream reaches it (a copy engine that stalls), until called with 0;
//  fake_cuda_calls("held copy to host") counts the copies that waited.
//  fake_cuda_peer_enabled(from, to) tells tests whether the backend enabled peer access, and
//  fake_cuda_calls("cuGraphLaunch") how often a function was called.
// Not a general emulator: what the backend does not call is not here.
#include <cuda.h>
#include <sys/mman.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

struct FakeStream;

struct FakeDevice {
  int ordinal = 0;
  std::size_t capacity = 0, used = 0;
  std::map<std::uintptr_t, std::size_t> allocations;  // device "pointers" and their sizes
  std::atomic<int> sticky{CUDA_SUCCESS};              // a sticky error poisons the context
  std::vector<FakeStream*> streams;
  std::set<int> peers;  // devices whose memory this one's context may access (cuCtxEnablePeerAccess)
  int retained = 0;     // primary context references (cuDevicePrimaryCtxRetain/Release)
};

struct FakeModule {
  std::string image;  // the bytes loaded, searched for kernel names
};

struct Dim {
  unsigned x, y, z;
  std::size_t count() const { return std::size_t{x} * y * z; }
};
using HostKernel = void (*)(const std::byte* params, std::size_t size, Dim grid, Dim block);

struct KernelInfo {
  HostKernel run;
  std::vector<std::size_t> params;  // the parameters' sizes, each at its natural alignment (cuFuncGetParamInfo)
  int leading_pointers = -1;  // how many parameters are pointers; -1: every leading 8-byte one
  // The leading pointer parameters, checked before the kernel runs.
  int pointers() const {
    if (leading_pointers >= 0) return leading_pointers;
    int n = 0;
    while (n < static_cast<int>(params.size()) && params[static_cast<std::size_t>(n)] == 8) ++n;
    return n;
  }
  // The size of the parameter buffer: the last parameter's end, no padding after it. The driver
  // takes a packed buffer (CU_LAUNCH_PARAM_BUFFER_SIZE) of exactly this size and refuses others
  // (LLVM's offload plugin and Slang found so: a size padded to 8 fails the launch).
  std::size_t param_bytes() const {
    std::size_t at = 0;
    for (std::size_t bytes : params) at = (at + bytes - 1) / bytes * bytes + bytes;
    return at;
  }
};

struct FakeFunction {
  std::string name;
  KernelInfo kernel;
  const void* module;  // a kernel whose module was unloaded before it ran fails (a driver's is gone)
};
// The modules loaded and not unloaded. Guarded by g_mutex.
std::set<const void*>& live_modules() {
  static auto* live = new std::set<const void*>;
  return *live;
}

struct FakeEvent {
  std::mutex mutex;
  std::condition_variable done_cv;
  std::uint64_t recorded = 0, completed = 0;  // records made and finished (a later record resets it)
  std::chrono::steady_clock::time_point at{};
};

std::mutex g_mutex;
bool g_initialized = false;
std::vector<FakeDevice*>& devices() {
  static auto* d = new std::vector<FakeDevice*>;
  return *d;
}
std::map<std::uintptr_t, std::size_t>& host_allocations() {
  static auto* h = new std::map<std::uintptr_t, std::size_t>;
  return *h;
}
// The context (device ordinal) each pinned host allocation was made in: a context reset takes it.
std::map<std::uintptr_t, int>& host_owners() {
  static auto* h = new std::map<std::uintptr_t, int>;
  return *h;
}
thread_local FakeDevice* t_current = nullptr;

std::size_t env_number(const char* name, std::size_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

// The result FAKE_CUDA_FAIL asks `function` to return, or CUDA_SUCCESS. An item "name@N=code"
// fails only the function's N-th call (`call`, counted as fake_cuda_calls counts).
CUresult injected(std::string_view function, long call = 0) {
  const char* spec = std::getenv("FAKE_CUDA_FAIL");
  if (!spec) return CUDA_SUCCESS;
  std::string_view rest(spec);
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const auto eq = item.find('=');
    std::string_view name = item.substr(0, eq);
    const auto at = name.find('@');
    const bool this_call = at == std::string_view::npos ||
                           std::strtol(std::string(name.substr(at + 1)).c_str(), nullptr, 10) == call;
    name = name.substr(0, at);
    if (eq != std::string_view::npos && name == function && this_call)
      return static_cast<CUresult>(std::strtol(std::string(item.substr(eq + 1)).c_str(), nullptr, 10));
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return CUDA_SUCCESS;
}
// How often each function with FAKE_INJECT was called (tests ask fake_cuda_calls).
std::mutex g_calls_mutex;
std::map<std::string, long, std::less<>>& calls() {
  static auto* c = new std::map<std::string, long, std::less<>>;
  return *c;
}
long count_call(std::string_view function) {  // returns this call's number, from 1
  std::lock_guard lock(g_calls_mutex);
  auto it = calls().find(function);
  if (it == calls().end()) it = calls().emplace(std::string(function), 0).first;
  return it->second += 1;
}
#define FAKE_INJECT(name)                                  \
  if (CUresult r = injected(#name, count_call(#name)); r != CUDA_SUCCESS) return r

// The current context's sticky error, if any (every call in a poisoned context returns it).
#define FAKE_STICKY()                                                                       \
  if (t_current && t_current->sticky.load() != CUDA_SUCCESS) return static_cast<CUresult>(t_current->sticky.load())

// The allocation of `device` that holds [address, address + size), or false.
bool inside(const FakeDevice& device, std::uintptr_t address, std::size_t size) {
  auto it = device.allocations.upper_bound(address);
  if (it == device.allocations.begin()) return false;
  --it;
  return address >= it->first && address + size <= it->first + it->second;
}
bool inside_host(std::uintptr_t address, std::size_t size) {
  auto it = host_allocations().upper_bound(address);
  if (it == host_allocations().begin()) return false;
  --it;
  return address >= it->first && address + size <= it->first + it->second;
}
// Whether a kernel of `device` may touch [address, address + size): its own memory, a peer's it
// enabled access to, or mapped host memory. Caller holds g_mutex.
bool reachable(const FakeDevice& device, std::uintptr_t address, std::size_t size) {
  if (inside(device, address, size) || inside_host(address, size)) return true;
  for (const FakeDevice* other : devices())
    if (other != &device && device.peers.count(other->ordinal) && inside(*other, address, size)) return true;
  return false;
}
bool inside_any(std::uintptr_t address, std::size_t size) {
  for (const FakeDevice* d : devices())
    if (inside(*d, address, size)) return true;
  return inside_host(address, size);
}

// ---- streams ----------------------------------------------------------------------------------

// A stream runs its work in order on a thread of its own. A failing item's error is sticky for
// the whole context; the rest of the work is then dropped.
struct FakeStream {
  explicit FakeStream(FakeDevice* device) : device(device), thread([this] { run(); }) {}
  ~FakeStream() {
    {
      std::lock_guard lock(mutex);
      stop = true;
    }
    wake.notify_all();
    thread.join();
  }

  void enqueue(std::function<CUresult()> work) {
    {
      std::lock_guard lock(mutex);
      pending.push_back(std::move(work));
      queued += 1;
    }
    wake.notify_all();
  }
  // Waits until everything queued so far ran; returns the context's sticky error.
  CUresult synchronize() {
    std::unique_lock lock(mutex);
    const std::uint64_t target = queued;
    idle.wait(lock, [&] { return finished >= target; });
    return static_cast<CUresult>(device->sticky.load());
  }
  CUresult query() {
    if (device->sticky.load() != CUDA_SUCCESS) return static_cast<CUresult>(device->sticky.load());
    std::lock_guard lock(mutex);
    return finished == queued ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
  }

  void run() {
    while (true) {
      std::function<CUresult()> work;
      {
        std::unique_lock lock(mutex);
        wake.wait(lock, [&] { return stop || !pending.empty(); });
        if (pending.empty()) return;
        work = std::move(pending.front());
        pending.pop_front();
      }
      if (device->sticky.load() == CUDA_SUCCESS) {
        const CUresult r = work();
        if (r != CUDA_SUCCESS) {
          int expected = CUDA_SUCCESS;
          device->sticky.compare_exchange_strong(expected, r);
        }
      }
      {
        std::lock_guard lock(mutex);
        finished += 1;
      }
      idle.notify_all();
    }
  }

  FakeDevice* device;
  std::mutex mutex;
  std::condition_variable wake, idle;
  std::deque<std::function<CUresult()>> pending;
  std::uint64_t queued = 0, finished = 0;
  bool stop = false;
  std::thread thread;
};

FakeStream* stream_of(CUstream stream) { return reinterpret_cast<FakeStream*>(stream); }

// Runs `work` on `stream`, or at once on the legacy stream (nullptr).
CUresult submit(CUstream stream, std::function<CUresult()> work) {
  if (!stream) return work();
  stream_of(stream)->enqueue(std::move(work));
  return CUDA_SUCCESS;
}

// Waits for all work queued so far on every stream of `device` (cuCtxSynchronize).
void synchronize_streams(FakeDevice& device) {
  std::vector<FakeStream*> streams;
  {
    std::lock_guard lock(g_mutex);
    streams = device.streams;
  }
  for (FakeStream* s : streams) s->synchronize();
}
// A point where tests hold the fake: while held, whoever reaches it waits (counted under
// `counter` in fake_cuda_calls) until it is let go.
struct TestHold {
  explicit TestHold(const char* counter_name) : counter(counter_name) {}
  const char* counter;
  std::mutex mutex;
  std::condition_variable changed;
  bool held = false;
  void set(int hold) {
    {
      std::lock_guard lock(mutex);
      held = hold != 0;
    }
    changed.notify_all();
  }
  void wait_while_held() {
    std::unique_lock lock(mutex);
    if (!held) return;
    count_call(counter);
    changed.wait(lock, [&] { return !held; });
  }
};
// Tests hold implicit synchronizations before they start (fake_cuda_hold_implicit_synchronization),
// to submit work while a free is inside the driver.
TestHold g_synchronization_hold{"held implicit synchronization"};
// And copies from device memory into pinned host memory (fake_cuda_hold_copies_to_host).
TestHold g_copy_to_host_hold{"held copy to host"};
// What cuMemFree, cuMemFreeHost and cuModuleUnload do before they free (the driver may
// synchronize the context; the fake always does).
void synchronize_implicitly(FakeDevice* device) {
  if (!device) return;
  count_call("implicit synchronization");
  g_synchronization_hold.wait_while_held();
  synchronize_streams(*device);
}

std::uint64_t* word_at(CUdeviceptr address) { return reinterpret_cast<std::uint64_t*>(address); }

// A stream memory operation's word must be device memory or mapped host memory, 8-byte aligned.
CUresult check_word(CUdeviceptr address) {
  if (address % 8 != 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(g_mutex);
  return inside_any(static_cast<std::uintptr_t>(address), 8) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult write_value(CUdeviceptr address, std::uint64_t value) {
  std::atomic_ref<std::uint64_t>(*word_at(address)).store(value, std::memory_order_seq_cst);
  return CUDA_SUCCESS;
}
// GEQ as the driver defines it: (int64_t)(*addr - value) >= 0, polled as a GPU polls.
CUresult wait_value(CUdeviceptr address, std::uint64_t value) {
  for (int spins = 0;; ++spins) {
    const std::uint64_t now = std::atomic_ref<std::uint64_t>(*word_at(address)).load(std::memory_order_seq_cst);
    if (static_cast<std::int64_t>(now - value) >= 0) return CUDA_SUCCESS;
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    else std::this_thread::yield();
  }
}

bool memops_supported() { return env_number("FAKE_CUDA_NO_MEMOPS", 0) == 0; }

// ---- kernels ----------------------------------------------------------------------------------

template <class T>
T param(const std::byte* params, std::size_t offset) {
  T v;
  std::memcpy(&v, params + offset, sizeof v);
  return v;
}
template <class T>
T* pointer_param(const std::byte* params, std::size_t offset) {
  return reinterpret_cast<T*>(param<std::uint64_t>(params, offset));
}

// add(float* out, const float* a, const float* b, int n): out[i] = a[i] + b[i] for i < n.
void add_kernel(const std::byte* p, std::size_t, Dim, Dim) {
  auto* o = pointer_param<float>(p, 0);
  const auto* a = pointer_param<const float>(p, 8);
  const auto* b = pointer_param<const float>(p, 16);
  for (std::int32_t i = 0, n = param<std::int32_t>(p, 24); i < n; ++i) o[i] = a[i] + b[i];
}
// ping / pong(int* dst, const int* src): dst[0] = src[0] + 1.
void inc_kernel(const std::byte* p, std::size_t, Dim, Dim) {
  pointer_param<std::int32_t>(p, 0)[0] = pointer_param<const std::int32_t>(p, 8)[0] + 1;
}
// scale(float* out, const float* a, int k, int n): out[i] = a[i] * k for i < n.
void scale_kernel(const std::byte* p, std::size_t, Dim, Dim) {
  auto* o = pointer_param<float>(p, 0);
  const auto* a = pointer_param<const float>(p, 8);
  const auto k = static_cast<float>(param<std::int32_t>(p, 16));
  for (std::int32_t i = 0, n = param<std::int32_t>(p, 20); i < n; ++i) o[i] = a[i] * k;
}
// fill(int* out, int k): out[t] = k + t for every thread t of the launch.
void fill_kernel(const std::byte* p, std::size_t, Dim grid, Dim block) {
  auto* o = pointer_param<std::int32_t>(p, 0);
  const auto k = param<std::int32_t>(p, 8);
  const std::size_t threads = grid.count() * block.count();
  for (std::size_t t = 0; t < threads; ++t) o[t] = k + static_cast<std::int32_t>(t);
}
// The renderer-style kernels of tests/cuda/test_cuda.cpp (kRendererStyle), thread by thread as the
// GPU runs them, so that the test's launches, buffers and checks run in CI too.
// E_4096_4(half* data0, const float* data1): data0[g * 256 + l] = half(data1[...] * 2).
void renderer_elementwise_kernel(const std::byte* p, std::size_t, Dim grid, Dim block) {
  auto* out = pointer_param<_Float16>(p, 0);
  const auto* in = pointer_param<const float>(p, 8);
  for (std::size_t g = 0; g < grid.x; ++g)
    for (std::size_t l = 0; l < block.x; ++l) out[g * 256 + l] = static_cast<_Float16>(in[g * 256 + l] * 2.0f);
}
// r_64_32(float* data0, const bf16* data1): each block's 32 threads sum 8 values each, then
// thread 0 sums the 32 partial sums in order.
void renderer_reduce_kernel(const std::byte* p, std::size_t, Dim grid, Dim block) {
  auto* out = pointer_param<float>(p, 0);
  const auto* in = pointer_param<const std::uint16_t>(p, 8);
  const auto value = [&](std::size_t i) {
    const std::uint32_t w = static_cast<std::uint32_t>(in[i]) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  };
  for (std::size_t g = 0; g < grid.x; ++g) {
    std::vector<float> partial(block.x, 0.0f);
    for (std::size_t l = 0; l < block.x; ++l)
      for (std::size_t r = 0; r < 8; ++r) partial[l] += value(g * 256 + l * 8 + r);
    float sum = 0.0f;
    for (const float s : partial) sum += s;
    out[g] = sum;
  }
}
// r_16_16_16(float* c, const float* a, const float* b, int n): c = a @ b, one 16 x 16 tile of c
// per block, k in tiles of 16 as the kernel walks it.
void renderer_matmul_kernel(const std::byte* p, std::size_t, Dim grid, Dim block) {
  auto* c = pointer_param<float>(p, 0);
  const auto* a = pointer_param<const float>(p, 8);
  const auto* b = pointer_param<const float>(p, 16);
  const auto n = static_cast<std::size_t>(param<std::int32_t>(p, 24));
  for (std::size_t by = 0; by < grid.y; ++by)
    for (std::size_t bx = 0; bx < grid.x; ++bx)
      for (std::size_t ty = 0; ty < block.y; ++ty)
        for (std::size_t tx = 0; tx < block.x; ++tx) {
          const std::size_t row = by * 16 + ty, col = bx * 16 + tx;
          float acc = 0.0f;
          for (std::size_t k = 0; k < n; ++k) acc += a[row * n + k] * b[k * n + col];
          c[row * n + col] = acc;
        }
}
// odd(int n, float* p): a value before a pointer, which tinydev's packed arguments cannot pass.
// nop(): nothing, without parameters.
void nothing_kernel(const std::byte*, std::size_t, Dim, Dim) {}
// The backend's signal kernel: *(u64*)word = value, as cuStreamWriteValue64 would.
void signal_kernel(const std::byte* p, std::size_t, Dim, Dim) {
  write_value(param<std::uint64_t>(p, 0), param<std::uint64_t>(p, 8));
}
// The backend's wait kernel: polls *(u64*)word until GEQ value, as cuStreamWaitValue64 would.
void wait_kernel(const std::byte* p, std::size_t, Dim, Dim) {
  wait_value(param<std::uint64_t>(p, 0), param<std::uint64_t>(p, 8));
}
// The backend's timestamp kernel: *(u64*)p = %globaltimer (here the host's steady clock, in ns).
void timestamp_kernel(const std::byte* p, std::size_t, Dim, Dim) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch()).count();
  std::atomic_ref<std::uint64_t>(*pointer_param<std::uint64_t>(p, 0)).store(static_cast<std::uint64_t>(ns));
}

const std::map<std::string, KernelInfo, std::less<>>& kernels() {
  static const auto* k = new std::map<std::string, KernelInfo, std::less<>>{
      {"add", {&add_kernel, {8, 8, 8, 4}}},     {"ping", {&inc_kernel, {8, 8}}},
      {"pong", {&inc_kernel, {8, 8}}},          {"scale", {&scale_kernel, {8, 8, 4, 4}}},
      {"fill", {&fill_kernel, {8, 4}}},         {"odd", {&nothing_kernel, {4, 8}}},
      {"nop", {&nothing_kernel, {}}},
      {"E_4096_4", {&renderer_elementwise_kernel, {8, 8}}}, {"r_64_32", {&renderer_reduce_kernel, {8, 8}}},
      {"r_16_16_16", {&renderer_matmul_kernel, {8, 8, 8, 4}}},
      {"tinydev_timestamp", {&timestamp_kernel, {8}}},
      {"tinydev_signal", {&signal_kernel, {8, 8}, 1}},  {"tinydev_wait", {&wait_kernel, {8, 8}, 1}}};
  return *k;
}

CUresult device_copy(void* dest, const void* src, std::size_t size) {
  std::memmove(dest, src, size);
  return CUDA_SUCCESS;
}

// A copy's device-side ends must lie in memory the fake handed out (a host pointer outside it is
// pageable memory, which the driver copies too).
CUresult check_copy(CUdeviceptr dest, CUdeviceptr src, std::size_t size, bool dest_device, bool src_device) {
  std::lock_guard lock(g_mutex);
  if (dest_device && !inside_any(static_cast<std::uintptr_t>(dest), size)) return CUDA_ERROR_INVALID_VALUE;
  if (src_device && !inside_any(static_cast<std::uintptr_t>(src), size)) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

// Unified addressing: each end of an asynchronous copy is memory the fake handed out, whole, or
// pageable host memory outside it.
bool copy_ends_ok(CUdeviceptr dest, CUdeviceptr src, std::size_t size) {
  std::lock_guard lock(g_mutex);
  return (inside_any(dest, size) || !inside_any(dest, 1)) && (inside_any(src, size) || !inside_any(src, 1));
}

// The packed argument buffer of a launch's `extra` (CU_LAUNCH_PARAM_BUFFER_POINTER and _SIZE).
bool launch_arguments(void** extra, const std::byte*& params, std::size_t& size) {
  params = nullptr;
  size = 0;
  for (void** e = extra; e && *e != CU_LAUNCH_PARAM_END; e += 2) {
    if (*e == CU_LAUNCH_PARAM_BUFFER_POINTER) params = static_cast<const std::byte*>(e[1]);
    if (*e == CU_LAUNCH_PARAM_BUFFER_SIZE) size = *static_cast<const std::size_t*>(e[1]);
  }
  return params != nullptr || extra == nullptr;  // no `extra`: no arguments (a kernel without parameters)
}

// Where memory at `address` lives, as a graph's copy node sees it: a GPU's ordinal, -1 for pinned
// host memory, -2 for memory the fake did not hand out (pageable host memory).
int home_of(CUdeviceptr address) {
  std::lock_guard lock(g_mutex);
  for (const FakeDevice* d : devices())
    if (inside(*d, static_cast<std::uintptr_t>(address), 1)) return d->ordinal;
  return inside_host(static_cast<std::uintptr_t>(address), 1) ? -1 : -2;
}

// Whether either of GPUs `a` and `b` enabled peer access to the other.
bool peers(int a, int b) {
  std::lock_guard lock(g_mutex);
  return devices()[static_cast<std::size_t>(a)]->peers.count(b) || devices()[static_cast<std::size_t>(b)]->peers.count(a);
}

// Runs kernel `f` of `device` as the GPU would: FAKE_CUDA_FAIL's run:<name> first, then an
// illegal address for a buffer argument the device cannot reach.
CUresult run_kernel(const FakeFunction& f, const FakeDevice& device, const std::vector<std::byte>& args, Dim grid,
                    Dim block) {
  if (CUresult r = injected("run:" + f.name); r != CUDA_SUCCESS) return r;
  {
    std::lock_guard lock(g_mutex);
    if (!live_modules().count(f.module)) return CUDA_ERROR_INVALID_HANDLE;  // unloaded before it ran
    for (int i = 0; i < f.kernel.pointers(); ++i)
      if (!reachable(device, param<std::uint64_t>(args.data(), 8 * static_cast<std::size_t>(i)), 1))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  f.kernel.run(args.data(), args.size(), grid, block);
  return CUDA_SUCCESS;
}

}  // namespace

// What tests ask the fake: how often `function` (one with FAKE_INJECT) was called.
extern "C" long fake_cuda_calls(const char* function) {
  std::lock_guard lock(g_calls_mutex);
  auto it = calls().find(std::string_view(function));
  return it == calls().end() ? 0 : it->second;
}

// Pinned host memory in use, in bytes (every context's), and a limit on it: past the limit,
// cuMemHostAlloc is CUDA_ERROR_OUT_OF_MEMORY (0, the default, is no limit).
namespace {
std::atomic<std::size_t> g_pinned_limit{0};
std::size_t pinned_bytes_locked() {  // caller holds g_mutex
  std::size_t bytes = 0;
  for (const auto& [address, size] : host_allocations()) bytes += size;
  return bytes;
}
}  // namespace
extern "C" std::size_t fake_cuda_pinned_bytes() {
  std::lock_guard lock(g_mutex);
  return pinned_bytes_locked();
}
extern "C" void fake_cuda_limit_pinned_bytes(std::size_t limit) { g_pinned_limit.store(limit); }

// What tests ask the fake: while `hold` is nonzero, an implicit synchronization (cuMemFree,
// cuMemFreeHost, cuModuleUnload) waits before it looks at the streams; fake_cuda_calls("held
// implicit synchronization") counts the ones that waited.
extern "C" void fake_cuda_hold_implicit_synchronization(int hold) { g_synchronization_hold.set(hold); }

// What tests ask the fake: while `hold` is nonzero, a queued copy from device memory into pinned
// host memory waits when its stream reaches it (the staging ring's device-to-host chunks).
extern "C" void fake_cuda_hold_copies_to_host(int hold) { g_copy_to_host_hold.set(hold); }

// What tests ask the fake: whether the backend enabled device `from`'s access to `to`'s memory.
extern "C" int fake_cuda_peer_enabled(int from, int to) {
  std::lock_guard lock(g_mutex);
  if (from < 0 || from >= static_cast<int>(devices().size())) return 0;
  return devices()[static_cast<std::size_t>(from)]->peers.count(to) ? 1 : 0;
}

extern "C" {

CUresult CUDAAPI cuInit(unsigned int) {
  FAKE_INJECT(cuInit);
  std::lock_guard lock(g_mutex);
  if (!g_initialized) {
    const std::size_t count = env_number("FAKE_CUDA_DEVICES", 2);
    if (count == 0) return CUDA_ERROR_NO_DEVICE;
    for (std::size_t i = 0; i < count; ++i) {
      auto* d = new FakeDevice;  // never freed: the driver outlives its users
      d->ordinal = static_cast<int>(i);
      d->capacity = env_number("FAKE_CUDA_MEMORY", 256u << 20);
      devices().push_back(d);
    }
    g_initialized = true;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDriverGetVersion(int* version) {
  FAKE_INJECT(cuDriverGetVersion);  // needs no cuInit, as the driver's
#if defined(FAKE_CUDA_DRIVER_12_0)
  *version = static_cast<int>(env_number("FAKE_CUDA_DRIVER_VERSION", 12000));
#else
  *version = static_cast<int>(env_number("FAKE_CUDA_DRIVER_VERSION", 13000));
#endif
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorName(CUresult error, const char** out) {
  switch (error) {
#define FAKE_NAME(code) \
  case code: *out = #code; break;
    FAKE_NAME(CUDA_SUCCESS)
    FAKE_NAME(CUDA_ERROR_INVALID_VALUE)
    FAKE_NAME(CUDA_ERROR_OUT_OF_MEMORY)
    FAKE_NAME(CUDA_ERROR_NOT_INITIALIZED)
    FAKE_NAME(CUDA_ERROR_NO_DEVICE)
    FAKE_NAME(CUDA_ERROR_INVALID_DEVICE)
    FAKE_NAME(CUDA_ERROR_INVALID_IMAGE)
    FAKE_NAME(CUDA_ERROR_INVALID_CONTEXT)
    FAKE_NAME(CUDA_ERROR_INVALID_HANDLE)
    FAKE_NAME(CUDA_ERROR_NOT_FOUND)
    FAKE_NAME(CUDA_ERROR_NOT_READY)
    FAKE_NAME(CUDA_ERROR_ILLEGAL_ADDRESS)
    FAKE_NAME(CUDA_ERROR_LAUNCH_FAILED)
    FAKE_NAME(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
    FAKE_NAME(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
    FAKE_NAME(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED)
    FAKE_NAME(CUDA_ERROR_NOT_SUPPORTED)
#undef FAKE_NAME
    default: *out = nullptr; return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char** out) {
  const char* name = nullptr;
  if (cuGetErrorName(error, &name) != CUDA_SUCCESS) {
    *out = nullptr;
    return CUDA_ERROR_INVALID_VALUE;
  }
  *out = "(fake driver)";
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetCount(int* count) {
  FAKE_INJECT(cuDeviceGetCount);
  std::lock_guard lock(g_mutex);
  if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  *count = static_cast<int>(devices().size());
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  std::lock_guard lock(g_mutex);
  if (ordinal < 0 || ordinal >= static_cast<int>(devices().size())) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetName(char* name, int len, CUdevice device) {
  std::snprintf(name, static_cast<std::size_t>(len), "tinydev fake GPU %d", device);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice) {
  switch (attribute) {
    // FAKE_CUDA_COMPUTE_CAPABILITY=70 makes every GPU a 7.0 (default 9.0).
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
      *value = static_cast<int>(env_number("FAKE_CUDA_COMPUTE_CAPABILITY", 90) / 10);
      break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
      *value = static_cast<int>(env_number("FAKE_CUDA_COMPUTE_CAPABILITY", 90) % 10);
      break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 132; break;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS: *value = memops_supported() ? 1 : 0; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *value = 1; break;
    case CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT: *value = env_number("FAKE_CUDA_KERNEL_TIME_LIMIT", 0) ? 1 : 0; break;
    default: *value = 0; break;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceTotalMem(size_t* bytes, CUdevice device) {
  std::lock_guard lock(g_mutex);
  *bytes = devices().at(static_cast<std::size_t>(device))->capacity;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceCanAccessPeer(int* can, CUdevice device, CUdevice peer) {
  *can = device != peer && env_number("FAKE_CUDA_NO_PEER", 0) == 0 ? 1 : 0;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  FAKE_INJECT(cuDevicePrimaryCtxRetain);
  std::lock_guard lock(g_mutex);
  FakeDevice* d = devices().at(static_cast<std::size_t>(device));
  d->retained += 1;
  *context = reinterpret_cast<CUcontext>(d);
  return CUDA_SUCCESS;
}

// Makes released pinned memory inaccessible. Under AddressSanitizer the region is poisoned
// instead (an access is a use-after-poison report): LeakSanitizer reads every live heap block at
// exit and would fault on a PROT_NONE one.
static void unmap_for_good(void* memory, std::size_t bytes) {
#if defined(__SANITIZE_ADDRESS__)
  ASAN_POISON_MEMORY_REGION(memory, bytes);
#else
  ::mprotect(memory, bytes, PROT_NONE);
#endif
}

// Releasing the last reference resets the context, as the driver does: its memory is gone. Pinned
// host memory it made is made inaccessible (PROT_NONE), so whoever still reads it crashes here as
// on a GPU machine instead of reading freed memory quietly.
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice device) {
  FAKE_INJECT(cuDevicePrimaryCtxRelease);
  std::lock_guard lock(g_mutex);
  if (device < 0 || static_cast<std::size_t>(device) >= devices().size()) return CUDA_ERROR_INVALID_DEVICE;
  FakeDevice* d = devices()[static_cast<std::size_t>(device)];
  if (d->retained == 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (--d->retained > 0) return CUDA_SUCCESS;
  for (auto it = host_owners().begin(); it != host_owners().end();) {
    if (it->second != d->ordinal) {
      ++it;
      continue;
    }
    const std::size_t bytes = (std::max<std::size_t>(host_allocations().at(it->first), 1) + 4095) / 4096 * 4096;
    unmap_for_good(reinterpret_cast<void*>(it->first), bytes);  // leaked: the process is ending
    host_allocations().erase(it->first);
    it = host_owners().erase(it);
  }
  d->allocations.clear();
  d->used = 0;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext* context) {
  if (!context) return CUDA_ERROR_INVALID_VALUE;
  *context = reinterpret_cast<CUcontext>(t_current);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext context) {
  t_current = reinterpret_cast<FakeDevice*>(context);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSynchronize() {
  FAKE_INJECT(cuCtxSynchronize);
  if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
  synchronize_streams(*t_current);
  return static_cast<CUresult>(t_current->sticky.load());
}

CUresult CUDAAPI cuCtxEnablePeerAccess(CUcontext peer, unsigned int) {
  FAKE_STICKY();
  if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
  const auto* other = reinterpret_cast<FakeDevice*>(peer);
  if (other == t_current || env_number("FAKE_CUDA_NO_PEER", 0) != 0) return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
  std::lock_guard lock(g_mutex);
  if (!t_current->peers.insert(other->ordinal).second) return CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetInfo(size_t* free, size_t* total) {
  std::lock_guard lock(g_mutex);
  if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
  *total = t_current->capacity;
  *free = t_current->capacity - t_current->used;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr* pointer, size_t size) {
  FAKE_INJECT(cuMemAlloc);
  FAKE_STICKY();
  std::lock_guard lock(g_mutex);
  if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  if (size > t_current->capacity - t_current->used) return CUDA_ERROR_OUT_OF_MEMORY;
  void* p = std::aligned_alloc(256, (size + 255) / 256 * 256);
  if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  t_current->allocations[reinterpret_cast<std::uintptr_t>(p)] = size;
  t_current->used += size;
  *pointer = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFree(CUdeviceptr pointer) {
  FAKE_INJECT(cuMemFree);
  FAKE_STICKY();  // as the driver's: the memory goes only with the context
  FakeDevice* owner = nullptr;
  {
    std::lock_guard lock(g_mutex);
    for (FakeDevice* d : devices())
      if (d->allocations.count(static_cast<std::uintptr_t>(pointer))) owner = d;
  }
  synchronize_implicitly(owner);
  std::lock_guard lock(g_mutex);
  for (FakeDevice* d : devices()) {
    auto it = d->allocations.find(static_cast<std::uintptr_t>(pointer));
    if (it == d->allocations.end()) continue;
    d->used -= it->second;
    d->allocations.erase(it);
    std::free(reinterpret_cast<void*>(pointer));
    return CUDA_SUCCESS;
  }
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuMemHostAlloc(void** pointer, size_t size, unsigned int) {
  FAKE_INJECT(cuMemHostAlloc);
  if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;  // pinned memory belongs to a context
  std::lock_guard lock(g_mutex);
  if (const std::size_t limit = g_pinned_limit.load(); limit != 0 && pinned_bytes_locked() + size > limit)
    return CUDA_ERROR_OUT_OF_MEMORY;
  void* p = std::aligned_alloc(4096, (std::max<std::size_t>(size, 1) + 4095) / 4096 * 4096);
  if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  host_allocations()[reinterpret_cast<std::uintptr_t>(p)] = size;
  host_owners()[reinterpret_cast<std::uintptr_t>(p)] = t_current->ordinal;
  *pointer = p;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFreeHost(void* pointer) {
  count_call("cuMemFreeHost");
  FAKE_STICKY();
  FakeDevice* owner = nullptr;
  {
    std::lock_guard lock(g_mutex);
    auto it = host_owners().find(reinterpret_cast<std::uintptr_t>(pointer));
    if (it != host_owners().end())
      for (FakeDevice* d : devices())
        if (d->ordinal == it->second) owner = d;
  }
  synchronize_implicitly(owner);
  std::lock_guard lock(g_mutex);
  if (host_allocations().erase(reinterpret_cast<std::uintptr_t>(pointer)) == 0) return CUDA_ERROR_INVALID_VALUE;
  host_owners().erase(reinterpret_cast<std::uintptr_t>(pointer));
  std::free(pointer);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostGetDevicePointer(CUdeviceptr* device_pointer, void* pointer, unsigned int flags) {
  FAKE_INJECT(cuMemHostGetDevicePointer);
  std::lock_guard lock(g_mutex);
  if (flags != 0 || !inside_host(reinterpret_cast<std::uintptr_t>(pointer), 1)) return CUDA_ERROR_INVALID_VALUE;
  *device_pointer = reinterpret_cast<CUdeviceptr>(pointer);  // unified addressing: the same address
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dest, const void* src, size_t size) {
  FAKE_INJECT(cuMemcpyHtoD);
  FAKE_STICKY();
  if (CUresult r = check_copy(dest, 0, size, true, false); r != CUDA_SUCCESS) return r;
  return device_copy(reinterpret_cast<void*>(dest), src, size);
}
CUresult CUDAAPI cuMemcpyDtoH(void* dest, CUdeviceptr src, size_t size) {
  FAKE_INJECT(cuMemcpyDtoH);
  FAKE_STICKY();
  if (CUresult r = check_copy(0, src, size, false, true); r != CUDA_SUCCESS) return r;
  return device_copy(dest, reinterpret_cast<const void*>(src), size);
}
CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dest, CUdeviceptr src, size_t size, CUstream stream) {
  FAKE_INJECT(cuMemcpyAsync);
  FAKE_STICKY();
  // Unified addressing: either end may be host memory; the device ends are checked when it runs.
  // How far it is asynchronous depends on the ends, as the driver's API sync behaviour says:
  // from pageable memory to a GPU the bytes are staged before it returns; into pageable memory,
  // or between two host memories, it returns only once the stream ran the copy (behind whatever
  // the stream waits for). Only device and pinned memory on both ends leave it fully async.
  const int to = home_of(dest), from = home_of(src);
  if (from == -2 && to >= 0) {
    auto staged = std::make_shared<std::vector<std::byte>>(reinterpret_cast<const std::byte*>(src),
                                                           reinterpret_cast<const std::byte*>(src) + size);
    return submit(stream, [=] {
      if (!copy_ends_ok(dest, 0, size)) return CUDA_ERROR_ILLEGAL_ADDRESS;
      return device_copy(reinterpret_cast<void*>(dest), staged->data(), size);
    });
  }
  const CUresult r = submit(stream, [=] {
    if (!copy_ends_ok(dest, src, size)) return CUDA_ERROR_ILLEGAL_ADDRESS;
    if (to == -1 && from >= 0) g_copy_to_host_hold.wait_while_held();
    return device_copy(reinterpret_cast<void*>(dest), reinterpret_cast<const void*>(src), size);
  });
  if (r != CUDA_SUCCESS || !stream) return r;
  if (to >= 0 && from >= 0 && to != from && !peers(to, from)) {
    // Between GPUs without peer access the driver stages the copy through host memory itself and
    // returns once it ran (holding the context's other copies meanwhile).
    count_call("cuMemcpyAsync (staged between GPUs)");
    return stream_of(stream)->synchronize();
  }
  if (!(to == -2 || (to < 0 && from < 0))) return r;
  count_call("cuMemcpyAsync (synchronous)");  // fake_cuda_calls counts these too
  return stream_of(stream)->synchronize();
}

CUresult CUDAAPI cuModuleLoadData(CUmodule* module, const void* image) {
  FAKE_INJECT(cuModuleLoadData);
  FAKE_STICKY();
  const auto* bytes = static_cast<const char*>(image);
  std::size_t size = 0;
  if (std::memcmp(bytes, "\x7f" "ELF", 4) == 0) {
    // An ELF image: its section headers end it (e_shoff + e_shnum * e_shentsize).
    std::uint64_t shoff = 0;
    std::uint16_t shentsize = 0, shnum = 0;
    std::memcpy(&shoff, bytes + 0x28, 8);
    std::memcpy(&shentsize, bytes + 0x3a, 2);
    std::memcpy(&shnum, bytes + 0x3c, 2);
    size = shoff + std::size_t{shentsize} * shnum;
  } else if (std::strstr(bytes, ".version") != nullptr) {
    size = std::strlen(bytes);
  } else {
    return CUDA_ERROR_INVALID_IMAGE;
  }
  *module = reinterpret_cast<CUmodule>(new FakeModule{std::string(bytes, size)});
  std::lock_guard lock(g_mutex);
  live_modules().insert(*module);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleUnload(CUmodule module) {
  count_call("cuModuleUnload");
  FAKE_STICKY();
  synchronize_implicitly(t_current);
  {
    std::lock_guard lock(g_mutex);
    live_modules().erase(module);
  }
  delete reinterpret_cast<FakeModule*>(module);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleGetFunction(CUfunction* function, CUmodule module, const char* name) {
  const auto* m = reinterpret_cast<const FakeModule*>(module);
  // The name must be in the image (as a symbol name) and have a host version here: its own, or
  // that of the name up to its first '_' ("add_dropped_7" runs "add").
  auto kernel = kernels().find(std::string_view(name));
  if (kernel == kernels().end()) kernel = kernels().find(std::string_view(name).substr(0, std::string_view(name).find('_')));
  const bool in_image = m->image.find(std::string(name) + '\0') != std::string::npos ||
                        m->image.find(std::string(name) + '(') != std::string::npos;  // PTX: .entry name(
  if (!in_image || kernel == kernels().end()) return CUDA_ERROR_NOT_FOUND;
  static std::mutex functions_mutex;
  static auto* functions = new std::map<std::pair<const void*, std::string>, FakeFunction>;
  std::lock_guard lock(functions_mutex);
  auto [it, added] = functions->try_emplace({module, name}, FakeFunction{name, kernel->second, module});
  it->second.module = module;  // a new module at the address of an unloaded one
  *function = reinterpret_cast<CUfunction>(&it->second);
  return CUDA_SUCCESS;
}

#if !defined(FAKE_CUDA_DRIVER_12_0)
// The offset and size of parameter `index` (CUDA 12.4's call; no call gives the count).
CUresult CUDAAPI cuFuncGetParamInfo(CUfunction function, size_t index, size_t* offset, size_t* size) {
  FAKE_INJECT(cuFuncGetParamInfo);
  const auto* f = reinterpret_cast<const FakeFunction*>(function);
  if (!f || !offset || index >= f->kernel.params.size()) return CUDA_ERROR_INVALID_VALUE;
  std::size_t at = 0;
  for (std::size_t i = 0; i <= index; ++i) {
    const std::size_t bytes = f->kernel.params[i];
    at = (at + bytes - 1) / bytes * bytes;
    if (i == index) {
      *offset = at;
      if (size) *size = bytes;
    }
    at += bytes;
  }
  return CUDA_SUCCESS;
}
#endif

CUresult CUDAAPI cuLaunchKernel(CUfunction function, unsigned int gx, unsigned int gy, unsigned int gz,
                                unsigned int bx, unsigned int by, unsigned int bz, unsigned int, CUstream stream,
                                void**, void** extra) {
  FAKE_INJECT(cuLaunchKernel);
  FAKE_STICKY();
  if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
  if (std::size_t{gx} * gy * gz == 0 || std::size_t{bx} * by * bz == 0 || std::size_t{bx} * by * bz > 1024)
    return CUDA_ERROR_INVALID_VALUE;
  const std::byte* params;
  std::size_t size;
  if (!launch_arguments(extra, params, size)) return CUDA_ERROR_INVALID_VALUE;
  const auto* f = reinterpret_cast<const FakeFunction*>(function);
  if (size != f->kernel.param_bytes()) return CUDA_ERROR_INVALID_VALUE;
  // The driver copies the arguments at launch: the caller may reuse its buffer at once.
  std::vector<std::byte> args(params, params + size);
  FakeDevice* device = t_current;
  return submit(stream, [f, device, args = std::move(args), grid = Dim{gx, gy, gz}, block = Dim{bx, by, bz}] {
    return run_kernel(*f, *device, args, grid, block);
  });
}

CUresult CUDAAPI cuLaunchHostFunc(CUstream stream, CUhostFn fn, void* data) {
  FAKE_INJECT(cuLaunchHostFunc);
  FAKE_STICKY();
  return submit(stream, [=] {
    fn(data);
    return CUDA_SUCCESS;
  });
}

CUresult CUDAAPI cuStreamWriteValue64(CUstream stream, CUdeviceptr address, cuuint64_t value, unsigned int) {
  FAKE_INJECT(cuStreamWriteValue64);
  FAKE_STICKY();
  if (!memops_supported()) return CUDA_ERROR_NOT_SUPPORTED;
  if (CUresult r = check_word(address); r != CUDA_SUCCESS) return r;
  return submit(stream, [=] { return write_value(address, value); });
}

CUresult CUDAAPI cuStreamWaitValue64(CUstream stream, CUdeviceptr address, cuuint64_t value, unsigned int flags) {
  FAKE_INJECT(cuStreamWaitValue64);
  FAKE_STICKY();
  if (!memops_supported() || flags != CU_STREAM_WAIT_VALUE_GEQ) return CUDA_ERROR_NOT_SUPPORTED;
  if (CUresult r = check_word(address); r != CUDA_SUCCESS) return r;
  return submit(stream, [=] { return wait_value(address, value); });
}

CUresult CUDAAPI cuStreamBatchMemOp(CUstream stream, unsigned int count, CUstreamBatchMemOpParams* ops,
                                    unsigned int flags) {
  FAKE_INJECT(cuStreamBatchMemOp);
  FAKE_STICKY();
  if (!memops_supported()) return CUDA_ERROR_NOT_SUPPORTED;
  if (count == 0 || count > 256 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  std::vector<CUstreamBatchMemOpParams> batch(ops, ops + count);
  for (const CUstreamBatchMemOpParams& op : batch) {
    if (op.operation == CU_STREAM_MEM_OP_WAIT_VALUE_64) {
      if (op.waitValue.flags != CU_STREAM_WAIT_VALUE_GEQ) return CUDA_ERROR_NOT_SUPPORTED;
      if (CUresult r = check_word(op.waitValue.address); r != CUDA_SUCCESS) return r;
    } else if (op.operation == CU_STREAM_MEM_OP_WRITE_VALUE_64) {
      if (CUresult r = check_word(op.writeValue.address); r != CUDA_SUCCESS) return r;
    } else {
      return CUDA_ERROR_NOT_SUPPORTED;
    }
  }
  return submit(stream, [batch = std::move(batch)] {
    for (const CUstreamBatchMemOpParams& op : batch) {
      if (op.operation == CU_STREAM_MEM_OP_WAIT_VALUE_64) wait_value(op.waitValue.address, op.waitValue.value64);
      else write_value(op.writeValue.address, op.writeValue.value64);
    }
    return CUDA_SUCCESS;
  });
}

CUresult CUDAAPI cuStreamCreate(CUstream* stream, unsigned int) {
  FAKE_INJECT(cuStreamCreate);
  FAKE_STICKY();
  if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
  auto* s = new FakeStream(t_current);
  std::lock_guard lock(g_mutex);
  t_current->streams.push_back(s);
  *stream = reinterpret_cast<CUstream>(s);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamDestroy(CUstream stream) {
  FakeStream* s = stream_of(stream);
  s->synchronize();
  {
    std::lock_guard lock(g_mutex);
    std::erase(s->device->streams, s);
  }
  delete s;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamSynchronize(CUstream stream) {
  FAKE_INJECT(cuStreamSynchronize);
  if (!stream) return t_current ? static_cast<CUresult>(t_current->sticky.load()) : CUDA_ERROR_INVALID_CONTEXT;
  return stream_of(stream)->synchronize();
}
CUresult CUDAAPI cuStreamQuery(CUstream stream) {
  FAKE_INJECT(cuStreamQuery);
  if (!stream) return CUDA_SUCCESS;
  return stream_of(stream)->query();
}

CUresult CUDAAPI cuEventCreate(CUevent* event, unsigned int) {
  *event = reinterpret_cast<CUevent>(new FakeEvent);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventDestroy(CUevent event) {
  delete reinterpret_cast<FakeEvent*>(event);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventRecord(CUevent event, CUstream stream) {
  FAKE_STICKY();
  auto* e = reinterpret_cast<FakeEvent*>(event);
  std::uint64_t record;
  {
    std::lock_guard lock(e->mutex);
    record = ++e->recorded;
  }
  return submit(stream, [e, record] {
    {
      std::lock_guard lock(e->mutex);
      if (e->recorded == record) {
        e->at = std::chrono::steady_clock::now();
        e->completed = record;
      }
    }
    e->done_cv.notify_all();
    return CUDA_SUCCESS;
  });
}
CUresult CUDAAPI cuEventSynchronize(CUevent event) {
  auto* e = reinterpret_cast<FakeEvent*>(event);
  std::unique_lock lock(e->mutex);
  // Also ends when the context fails: the record then never completes.
  while (e->completed != e->recorded) {
    e->done_cv.wait_for(lock, std::chrono::milliseconds(1));
    if (t_current && t_current->sticky.load() != CUDA_SUCCESS) return static_cast<CUresult>(t_current->sticky.load());
  }
  return CUDA_SUCCESS;
}
#if defined(FAKE_CUDA_DRIVER_12_0)
#undef cuEventElapsedTime  // a 12.0 driver has only the CUDA 2.0 symbol, not 12.8's cuEventElapsedTime_v2
#endif
CUresult CUDAAPI cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
  FAKE_INJECT(cuEventElapsedTime);
  auto* s = reinterpret_cast<FakeEvent*>(start);
  auto* e = reinterpret_cast<FakeEvent*>(end);
  std::scoped_lock lock(s->mutex, e->mutex);
  if (s->completed == 0 || e->completed == 0) return CUDA_ERROR_INVALID_HANDLE;
  if (s->completed != s->recorded || e->completed != e->recorded) return CUDA_ERROR_NOT_READY;
  *ms = std::chrono::duration<float, std::milli>(e->at - s->at).count();
  return CUDA_SUCCESS;
}


}  // extern "C"

// ---- graphs: nodes run in an order their dependencies allow, the latest-added ready node first ----

namespace {
struct FakeNode {
  bool kernel = false;
  bool empty = false;  // cuGraphAddEmptyNode
  const FakeFunction* function = nullptr;
  std::vector<std::byte> args;
  Dim grid{1, 1, 1}, block{1, 1, 1};
  CUdeviceptr dest = 0, src = 0;
  std::size_t size = 0;
  std::vector<std::size_t> deps;  // indices of the graph's nodes this one runs after
};
std::atomic<long> g_last_graph_edges{0};
struct FakeGraph {
  std::vector<std::unique_ptr<FakeNode>> nodes;  // node handles point at these
};
struct FakeGraphExec {
  FakeDevice* device = nullptr;
  std::vector<const FakeNode*> handles;  // the graph's node handles, to find a node on patching
  std::vector<FakeNode> nodes;           // the instantiated parameters
};

// A kernel node's parameters from CUDA_KERNEL_NODE_PARAMS (arguments through `extra` only).
CUresult kernel_node(const CUDA_KERNEL_NODE_PARAMS* p, FakeNode& node) {
  if (!p || !p->func || p->kernelParams) return CUDA_ERROR_INVALID_VALUE;
  const std::byte* params;
  std::size_t size;
  const bool packed = launch_arguments(p->extra, params, size);
  node.kernel = true;
  node.function = reinterpret_cast<const FakeFunction*>(p->func);
  if (!packed || size != node.function->kernel.param_bytes()) return CUDA_ERROR_INVALID_VALUE;
  node.args.assign(params, params + size);
  node.grid = Dim{p->gridDimX, p->gridDimY, p->gridDimZ};
  node.block = Dim{p->blockDimX, p->blockDimY, p->blockDimZ};
  if (node.grid.count() == 0 || node.block.count() == 0 || node.block.count() > 1024) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}
// A 1-D copy between unified addresses.
CUresult copy_node(const CUDA_MEMCPY3D* p, FakeNode& node) {
  if (!p || p->srcMemoryType != CU_MEMORYTYPE_UNIFIED || p->dstMemoryType != CU_MEMORYTYPE_UNIFIED ||
      p->Height != 1 || p->Depth != 1 || p->WidthInBytes == 0)
    return CUDA_ERROR_INVALID_VALUE;
  // As the driver: a pitch, where given, holds at least a row.
  if ((p->srcPitch != 0 && p->srcPitch < p->WidthInBytes + p->srcXInBytes) ||
      (p->dstPitch != 0 && p->dstPitch < p->WidthInBytes + p->dstXInBytes))
    return CUDA_ERROR_INVALID_VALUE;
  node.kernel = false;
  node.dest = p->dstDevice;
  node.src = p->srcDevice;
  node.size = p->WidthInBytes;
  return copy_ends_ok(node.dest, node.src, node.size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult empty_node(const void*, FakeNode& node) {
  node.empty = true;
  return CUDA_SUCCESS;
}
CUresult run_node(const FakeNode& node, FakeDevice* device) {
  if (node.empty) return CUDA_SUCCESS;
  if (!node.kernel) {
    if (!copy_ends_ok(node.dest, node.src, node.size)) return CUDA_ERROR_ILLEGAL_ADDRESS;
    return device_copy(reinterpret_cast<void*>(node.dest), reinterpret_cast<const void*>(node.src), node.size);
  }
  return run_kernel(*node.function, *device, node.args, node.grid, node.block);
}
template <class Params, class Fill>
CUresult add_node(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, std::size_t count, const Params* params,
                  Fill fill) {
  auto* g = reinterpret_cast<FakeGraph*>(graph);
  if (!g || !out) return CUDA_ERROR_INVALID_VALUE;
  std::vector<std::size_t> indices;
  for (std::size_t i = 0; i < count; ++i) {  // dependencies must be earlier nodes of this graph
    std::size_t found = g->nodes.size();
    for (std::size_t n = 0; n < g->nodes.size(); ++n)
      if (reinterpret_cast<CUgraphNode>(g->nodes[n].get()) == deps[i]) found = n;
    if (found == g->nodes.size()) return CUDA_ERROR_INVALID_VALUE;
    indices.push_back(found);
  }
  auto node = std::make_unique<FakeNode>();
  if (CUresult r = fill(params, *node); r != CUDA_SUCCESS) return r;
  node->deps = std::move(indices);
  *out = reinterpret_cast<CUgraphNode>(node.get());
  g->nodes.push_back(std::move(node));
  return CUDA_SUCCESS;
}
template <class Params, class Fill>
CUresult set_node(CUgraphExec exec, CUgraphNode handle, const Params* params, bool kernel, Fill fill) {
  auto* e = reinterpret_cast<FakeGraphExec*>(exec);
  for (std::size_t i = 0; i < e->handles.size(); ++i) {
    if (reinterpret_cast<CUgraphNode>(const_cast<FakeNode*>(e->handles[i])) != handle) continue;
    if (e->nodes[i].kernel != kernel || e->nodes[i].empty) return CUDA_ERROR_INVALID_VALUE;
    FakeNode updated;
    if (CUresult r = fill(params, updated); r != CUDA_SUCCESS) return r;
    if (kernel && updated.function != e->nodes[i].function) return CUDA_ERROR_INVALID_VALUE;  // the driver's rule
    // The driver's rule for copies: the memory must come from the same contexts (and kinds) as the
    // instantiated node's ("the memory operands' mappings changed").
    if (!kernel && (home_of(updated.dest) != home_of(e->nodes[i].dest) ||
                    home_of(updated.src) != home_of(e->nodes[i].src)))
      return CUDA_ERROR_INVALID_VALUE;
    updated.deps = e->nodes[i].deps;  // a patch changes parameters, not edges
    e->nodes[i] = std::move(updated);
    return CUDA_SUCCESS;
  }
  return CUDA_ERROR_INVALID_VALUE;
}
}  // namespace

extern "C" {

CUresult CUDAAPI cuGraphCreate(CUgraph* graph, unsigned int flags) {
  FAKE_INJECT(cuGraphCreate);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  *graph = reinterpret_cast<CUgraph>(new FakeGraph);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphDestroy(CUgraph graph) {
  count_call("cuGraphDestroy");  // counted, never failed: tests check what is still alive
  delete reinterpret_cast<FakeGraph*>(graph);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphAddKernelNode(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps, size_t count,
                                      const CUDA_KERNEL_NODE_PARAMS* params) {
  FAKE_INJECT(cuGraphAddKernelNode);
  return add_node(node, graph, deps, count, params, &kernel_node);
}
CUresult CUDAAPI cuGraphAddMemcpyNode(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps, size_t count,
                                      const CUDA_MEMCPY3D* params, CUcontext) {
  FAKE_INJECT(cuGraphAddMemcpyNode);
  return add_node(node, graph, deps, count, params, &copy_node);
}
CUresult CUDAAPI cuGraphAddEmptyNode(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps, size_t count) {
  FAKE_INJECT(cuGraphAddEmptyNode);
  return add_node(node, graph, deps, count, static_cast<const void*>(nullptr), &empty_node);
}
CUresult CUDAAPI cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph, unsigned long long) {
  FAKE_INJECT(cuGraphInstantiateWithFlags);
  FAKE_STICKY();
  if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
  const auto* g = reinterpret_cast<const FakeGraph*>(graph);
  auto* e = new FakeGraphExec;
  e->device = t_current;
  long edges = 0;
  for (const auto& n : g->nodes) {
    e->handles.push_back(n.get());
    e->nodes.push_back(*n);
    edges += static_cast<long>(n->deps.size());
  }
  g_last_graph_edges.store(edges);
  *exec = reinterpret_cast<CUgraphExec>(e);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphExecDestroy(CUgraphExec exec) {
  count_call("cuGraphExecDestroy");
  delete reinterpret_cast<FakeGraphExec*>(exec);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphExecKernelNodeSetParams(CUgraphExec exec, CUgraphNode node,
                                                const CUDA_KERNEL_NODE_PARAMS* params) {
  FAKE_INJECT(cuGraphExecKernelNodeSetParams);
  return set_node(exec, node, params, true, &kernel_node);
}
CUresult CUDAAPI cuGraphExecMemcpyNodeSetParams(CUgraphExec exec, CUgraphNode node, const CUDA_MEMCPY3D* params,
                                                CUcontext) {
  FAKE_INJECT(cuGraphExecMemcpyNodeSetParams);
  return set_node(exec, node, params, false, &copy_node);
}
// What tests ask the fake: the dependencies of the graph instantiated last.
long fake_cuda_graph_edges() { return g_last_graph_edges.load(); }

CUresult CUDAAPI cuGraphLaunch(CUgraphExec exec, CUstream stream) {
  FAKE_INJECT(cuGraphLaunch);
  FAKE_STICKY();
  const auto* e = reinterpret_cast<const FakeGraphExec*>(exec);
  // A launch runs the parameters the exec has now; later patches affect later launches only. The
  // order: of the nodes whose dependencies ran, the latest added first (as unlike the order they
  // were added as the edges allow, so a missing edge shows).
  return submit(stream, [nodes = e->nodes, device = e->device] {
    std::vector<std::size_t> waiting_for(nodes.size());
    std::vector<std::vector<std::size_t>> dependents(nodes.size());
    std::priority_queue<std::size_t> ready;
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      waiting_for[i] = nodes[i].deps.size();
      for (const std::size_t d : nodes[i].deps) dependents[d].push_back(i);
      if (waiting_for[i] == 0) ready.push(i);
    }
    while (!ready.empty()) {
      const std::size_t i = ready.top();
      ready.pop();
      if (CUresult r = run_node(nodes[i], device); r != CUDA_SUCCESS) return r;
      for (const std::size_t d : dependents[i])
        if (--waiting_for[d] == 0) ready.push(d);
    }
    return CUDA_SUCCESS;
  });
}

}  // extern "C"
