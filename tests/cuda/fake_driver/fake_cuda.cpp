// A fake CUDA driver for CI machines without a GPU (TINYDEV_CUDA_DRIVER points the backend at it).
// It exports the driver functions the CUDA backend resolves (backends/cuda/cuda_api.hpp), under
// the same versioned names, and emulates them on the CPU:
//  - FAKE_CUDA_DEVICES GPUs (default 2) of compute capability 9.0, each with FAKE_CUDA_MEMORY
//    bytes (default 256 MiB) of "device memory" (host memory the fake tracks: frees and copies of
//    memory it did not hand out, or past an allocation's end, are errors, as a driver's are);
//  - modules are the real CUBIN/PTX NVRTC produced; a kernel is found by name in the image and run
//    by a host implementation registered here (only `add`, the backend's test kernel, for now);
//  - streams and events complete at once (work runs when it is queued), events carry host time;
//  - FAKE_CUDA_FAIL="cuLaunchKernel=719,cuMemAlloc_v2=2" makes those functions return that
//    CUresult (read on every call), so the backend's error paths run in CI.
// Not a general emulator: what the backend does not call is not here.
#include <cuda.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace {

struct FakeDevice {
  int ordinal = 0;
  std::size_t capacity = 0, used = 0;
  std::map<std::uintptr_t, std::size_t> allocations;  // device "pointers" and their sizes
};

struct FakeModule {
  std::string image;  // the bytes loaded, searched for kernel names
};

using HostKernel = void (*)(const std::byte* params, std::size_t size);

struct FakeFunction {
  std::string name;
  HostKernel run;
};

struct FakeEvent {
  std::chrono::steady_clock::time_point at{};
  bool recorded = false;
};

std::mutex g_mutex;
bool g_initialized = false;
std::vector<FakeDevice>& devices() {
  static auto* d = new std::vector<FakeDevice>;
  return *d;
}
std::map<std::uintptr_t, std::size_t>& host_allocations() {
  static auto* h = new std::map<std::uintptr_t, std::size_t>;
  return *h;
}
thread_local FakeDevice* t_current = nullptr;

std::size_t env_number(const char* name, std::size_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

// The result FAKE_CUDA_FAIL asks `function` to return, or CUDA_SUCCESS.
CUresult injected(std::string_view function) {
  const char* spec = std::getenv("FAKE_CUDA_FAIL");
  if (!spec) return CUDA_SUCCESS;
  std::string_view rest(spec);
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const auto eq = item.find('=');
    if (eq != std::string_view::npos && item.substr(0, eq) == function)
      return static_cast<CUresult>(std::strtol(std::string(item.substr(eq + 1)).c_str(), nullptr, 10));
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return CUDA_SUCCESS;
}
#define FAKE_INJECT(name)                                  \
  if (CUresult r = injected(#name); r != CUDA_SUCCESS) return r

// The allocation of `device` that holds [address, address + size), or false.
bool inside(const FakeDevice& device, std::uintptr_t address, std::size_t size) {
  auto it = device.allocations.upper_bound(address);
  if (it == device.allocations.begin()) return false;
  --it;
  return address >= it->first && address + size <= it->first + it->second;
}
bool inside_any(std::uintptr_t address, std::size_t size) {
  for (const FakeDevice& d : devices())
    if (inside(d, address, size)) return true;
  auto it = host_allocations().upper_bound(address);
  if (it == host_allocations().begin()) return false;
  --it;
  return address >= it->first && address + size <= it->first + it->second;
}

// out[i] = a[i] + b[i] for i < n, whatever the grid (the backend's add is a grid-stride loop).
void add_kernel(const std::byte* params, std::size_t size) {
  if (size < 28) return;
  std::uint64_t out, a, b;
  std::int32_t n;
  std::memcpy(&out, params, 8);
  std::memcpy(&a, params + 8, 8);
  std::memcpy(&b, params + 16, 8);
  std::memcpy(&n, params + 24, 4);
  auto* o = reinterpret_cast<float*>(out);
  const auto* x = reinterpret_cast<const float*>(a);
  const auto* y = reinterpret_cast<const float*>(b);
  for (std::int32_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

const std::map<std::string, HostKernel, std::less<>>& kernels() {
  static const auto* k = new std::map<std::string, HostKernel, std::less<>>{{"add", &add_kernel}};
  return *k;
}

}  // namespace

extern "C" {

CUresult CUDAAPI cuInit(unsigned int) {
  FAKE_INJECT(cuInit);
  std::lock_guard lock(g_mutex);
  if (!g_initialized) {
    const std::size_t count = env_number("FAKE_CUDA_DEVICES", 2);
    if (count == 0) return CUDA_ERROR_NO_DEVICE;
    for (std::size_t i = 0; i < count; ++i)
      devices().push_back(FakeDevice{static_cast<int>(i), env_number("FAKE_CUDA_MEMORY", 256u << 20), 0, {}});
    g_initialized = true;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDriverGetVersion(int* version) {
  *version = 13000;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorName(CUresult error, const char** out) {
  switch (error) {
    case CUDA_SUCCESS: *out = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *out = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *out = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NO_DEVICE: *out = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_INVALID_DEVICE: *out = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_IMAGE: *out = "CUDA_ERROR_INVALID_IMAGE"; break;
    case CUDA_ERROR_NOT_FOUND: *out = "CUDA_ERROR_NOT_FOUND"; break;
    case CUDA_ERROR_LAUNCH_FAILED: *out = "CUDA_ERROR_LAUNCH_FAILED"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *out = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
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
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 132; break;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS: *value = 1; break;
    default: *value = 0; break;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceTotalMem(size_t* bytes, CUdevice device) {
  std::lock_guard lock(g_mutex);
  *bytes = devices().at(static_cast<std::size_t>(device)).capacity;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceCanAccessPeer(int* can, CUdevice, CUdevice) {
  *can = 1;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  FAKE_INJECT(cuDevicePrimaryCtxRetain);
  std::lock_guard lock(g_mutex);
  *context = reinterpret_cast<CUcontext>(&devices().at(static_cast<std::size_t>(device)));
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice) { return CUDA_SUCCESS; }

CUresult CUDAAPI cuCtxSetCurrent(CUcontext context) {
  t_current = reinterpret_cast<FakeDevice*>(context);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSynchronize() {
  FAKE_INJECT(cuCtxSynchronize);
  return t_current ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult CUDAAPI cuCtxEnablePeerAccess(CUcontext, unsigned int) { return CUDA_SUCCESS; }

CUresult CUDAAPI cuMemGetInfo(size_t* free, size_t* total) {
  std::lock_guard lock(g_mutex);
  if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
  *total = t_current->capacity;
  *free = t_current->capacity - t_current->used;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr* pointer, size_t size) {
  FAKE_INJECT(cuMemAlloc);
  std::lock_guard lock(g_mutex);
  if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  if (size > t_current->capacity - t_current->used) return CUDA_ERROR_OUT_OF_MEMORY;
  void* p = std::malloc(size);
  if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  t_current->allocations[reinterpret_cast<std::uintptr_t>(p)] = size;
  t_current->used += size;
  *pointer = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFree(CUdeviceptr pointer) {
  FAKE_INJECT(cuMemFree);
  std::lock_guard lock(g_mutex);
  for (FakeDevice& d : devices()) {
    auto it = d.allocations.find(static_cast<std::uintptr_t>(pointer));
    if (it == d.allocations.end()) continue;
    d.used -= it->second;
    d.allocations.erase(it);
    std::free(reinterpret_cast<void*>(pointer));
    return CUDA_SUCCESS;
  }
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuMemHostAlloc(void** pointer, size_t size, unsigned int) {
  FAKE_INJECT(cuMemHostAlloc);
  std::lock_guard lock(g_mutex);
  void* p = std::malloc(size ? size : 1);
  if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  host_allocations()[reinterpret_cast<std::uintptr_t>(p)] = size;
  *pointer = p;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFreeHost(void* pointer) {
  std::lock_guard lock(g_mutex);
  if (host_allocations().erase(reinterpret_cast<std::uintptr_t>(pointer)) == 0) return CUDA_ERROR_INVALID_VALUE;
  std::free(pointer);
  return CUDA_SUCCESS;
}

namespace {
CUresult device_copy(void* dest, const void* src, std::size_t size, bool dest_device, bool src_device) {
  std::lock_guard lock(g_mutex);
  if (dest_device && !inside_any(reinterpret_cast<std::uintptr_t>(dest), size)) return CUDA_ERROR_INVALID_VALUE;
  if (src_device && !inside_any(reinterpret_cast<std::uintptr_t>(src), size)) return CUDA_ERROR_INVALID_VALUE;
  std::memmove(dest, src, size);
  return CUDA_SUCCESS;
}
}  // namespace

CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dest, const void* src, size_t size) {
  FAKE_INJECT(cuMemcpyHtoD);
  return device_copy(reinterpret_cast<void*>(dest), src, size, true, false);
}
CUresult CUDAAPI cuMemcpyDtoH(void* dest, CUdeviceptr src, size_t size) {
  FAKE_INJECT(cuMemcpyDtoH);
  return device_copy(dest, reinterpret_cast<const void*>(src), size, false, true);
}
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dest, const void* src, size_t size, CUstream) {
  return device_copy(reinterpret_cast<void*>(dest), src, size, true, false);
}
CUresult CUDAAPI cuMemcpyDtoHAsync(void* dest, CUdeviceptr src, size_t size, CUstream) {
  return device_copy(dest, reinterpret_cast<const void*>(src), size, false, true);
}
CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr dest, CUdeviceptr src, size_t size, CUstream) {
  return device_copy(reinterpret_cast<void*>(dest), reinterpret_cast<const void*>(src), size, true, true);
}
CUresult CUDAAPI cuMemcpyPeerAsync(CUdeviceptr dest, CUcontext, CUdeviceptr src, CUcontext, size_t size, CUstream) {
  return device_copy(reinterpret_cast<void*>(dest), reinterpret_cast<const void*>(src), size, true, true);
}

CUresult CUDAAPI cuModuleLoadData(CUmodule* module, const void* image) {
  FAKE_INJECT(cuModuleLoadData);
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
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleUnload(CUmodule module) {
  delete reinterpret_cast<FakeModule*>(module);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleGetFunction(CUfunction* function, CUmodule module, const char* name) {
  const auto* m = reinterpret_cast<const FakeModule*>(module);
  // The name must be in the image (as a NUL-terminated symbol name) and have a host version here.
  const std::string symbol = std::string(name) + '\0';
  const auto kernel = kernels().find(std::string_view(name));
  if (m->image.find(symbol) == std::string::npos || kernel == kernels().end()) return CUDA_ERROR_NOT_FOUND;
  static std::mutex functions_mutex;
  static auto* functions = new std::map<std::string, FakeFunction>;
  std::lock_guard lock(functions_mutex);
  auto [it, added] = functions->try_emplace(name, FakeFunction{name, kernel->second});
  *function = reinterpret_cast<CUfunction>(&it->second);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLaunchKernel(CUfunction function, unsigned int gx, unsigned int gy, unsigned int gz,
                                unsigned int bx, unsigned int by, unsigned int bz, unsigned int, CUstream, void**,
                                void** extra) {
  FAKE_INJECT(cuLaunchKernel);
  if (gx * gy * gz == 0 || bx * by * bz == 0 || bx * by * bz > 1024) return CUDA_ERROR_INVALID_VALUE;
  const std::byte* params = nullptr;
  std::size_t size = 0;
  for (void** e = extra; e && *e != CU_LAUNCH_PARAM_END; e += 2) {
    if (*e == CU_LAUNCH_PARAM_BUFFER_POINTER) params = static_cast<const std::byte*>(e[1]);
    if (*e == CU_LAUNCH_PARAM_BUFFER_SIZE) size = *static_cast<const std::size_t*>(e[1]);
  }
  if (!params) return CUDA_ERROR_INVALID_VALUE;
  // A kernel touching memory the fake did not hand out would be an illegal address on a GPU.
  for (std::size_t i = 0; i + 8 <= size && i < 24; i += 8) {
    std::uint64_t address = 0;
    std::memcpy(&address, params + i, 8);
    std::lock_guard lock(g_mutex);
    if (!inside_any(address, 1)) return CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  reinterpret_cast<FakeFunction*>(function)->run(params, size);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreate(CUstream* stream, unsigned int) {
  FAKE_INJECT(cuStreamCreate);
  *stream = reinterpret_cast<CUstream>(new int(0));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamDestroy(CUstream stream) {
  delete reinterpret_cast<int*>(stream);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamSynchronize(CUstream) {
  FAKE_INJECT(cuStreamSynchronize);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventCreate(CUevent* event, unsigned int) {
  *event = reinterpret_cast<CUevent>(new FakeEvent);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventDestroy(CUevent event) {
  delete reinterpret_cast<FakeEvent*>(event);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventRecord(CUevent event, CUstream) {
  auto* e = reinterpret_cast<FakeEvent*>(event);
  e->at = std::chrono::steady_clock::now();
  e->recorded = true;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventSynchronize(CUevent) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
  const auto* s = reinterpret_cast<FakeEvent*>(start);
  const auto* e = reinterpret_cast<FakeEvent*>(end);
  if (!s->recorded || !e->recorded) return CUDA_ERROR_INVALID_HANDLE;
  *ms = std::chrono::duration<float, std::milli>(e->at - s->at).count();
  return CUDA_SUCCESS;
}

}  // extern "C"
