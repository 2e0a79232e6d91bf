#include "cuda_api.hpp"

#include <dlfcn.h>
#include <unistd.h>
#include <fmt/format.h>

#include <filesystem>
#include <mutex>
#include <vector>

#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/error.hpp"

namespace tinydev::cuda {

namespace {

// The symbol a name resolves to after the headers' macros: cuMemAlloc -> "cuMemAlloc_v2".
#define TINYDEV_CUDA_STR2(x) #x
#define TINYDEV_CUDA_SYMBOL(x) TINYDEV_CUDA_STR2(x)

// Opens the first library of `candidates` that loads; "" and the dlerror of each try otherwise.
void* open_first(const std::vector<std::string>& candidates, std::string& opened, std::string& errors) {
  for (const std::string& name : candidates) {
    if (void* handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      opened = name;
      return handle;
    }
    const char* why = ::dlerror();  // names the file itself
    errors += fmt::format("\n  {}", why ? std::string(why) : name + ": not found");
  }
  return nullptr;
}

// Note [Older driver symbols]
// The table takes the symbols the headers select, and with the CUDA 13 headers every one of them
// is in drivers of CUDA 12.0 and later (the newest are cuGraphAddKernelNode_v2 and
// cuGraphExecKernelNodeSetParams_v2 of 12.0) except cuEventElapsedTime_v2, which drivers export
// from CUDA 12.8 on. Datacenter machines keep long-lived driver branches (CUDA 12.2, 12.4), so
// where a driver lacks it the symbol of CUDA 2.0 is taken: the same parameters and results, except
// that it may also report an error of earlier asynchronous work, which tinydev's only caller (a
// timed direct call) has already seen in the cuEventSynchronize before it.
struct OlderSymbol {
  std::string_view header_symbol;  // what the headers select
  const char* older;               // the same function's older symbol, of the same type
  const char* header_symbol_since;  // the first CUDA whose drivers export header_symbol
};
constexpr OlderSymbol kOlderSymbols[] = {{"cuEventElapsedTime_v2", "cuEventElapsedTime", "12.8"}};

// The driver the table needs: checked symbol by symbol for headers up to CUDA 13.0; newer
// headers may select newer symbols, and then the note is to be checked again.
#if CUDA_VERSION <= 13000
constexpr const char* kDriverNeeded = "CUDA 12.0 or later";
#else
constexpr const char* kDriverNeeded = "a CUDA version with every symbol these headers select";
#endif

// dlsym of `symbol`, else of its older symbol where Note [Older driver symbols] lists one.
void* find_driver_symbol(void* handle, const char* symbol) {
  if (void* found = ::dlsym(handle, symbol)) return found;
  for (const OlderSymbol& older : kOlderSymbols) {
    if (older.header_symbol != symbol) continue;
    void* found = ::dlsym(handle, older.older);
    if (found)
      debug_log(1, "CUDA", "the driver has no {} (CUDA {} and later): using {}", symbol, older.header_symbol_since,
                older.older);
    return found;
  }
  return nullptr;
}

// Resolves every function of a table; the first missing one is named in the error.
template <class Table>
std::string resolve(void* handle, Table& table, std::string_view library);

template <>
std::string resolve(void* handle, Driver& d, std::string_view library) {
#define TINYDEV_CUDA_RESOLVE(name)                                                                  \
  d.name = reinterpret_cast<decltype(d.name)>(find_driver_symbol(handle, TINYDEV_CUDA_SYMBOL(name))); \
  if (!d.name)                                                                                      \
    return fmt::format("{} has no {}: tinydev (built with the CUDA {}.{} headers) needs a driver of {}; " \
                       "update the NVIDIA driver",                                                  \
                       library, TINYDEV_CUDA_SYMBOL(name), CUDA_VERSION / 1000, CUDA_VERSION % 1000 / 10, \
                       kDriverNeeded);
  TINYDEV_CUDA_DRIVER_FUNCTIONS(TINYDEV_CUDA_RESOLVE)
#undef TINYDEV_CUDA_RESOLVE
#define TINYDEV_CUDA_RESOLVE_OPTIONAL(name) \
  d.name = reinterpret_cast<decltype(d.name)>(::dlsym(handle, TINYDEV_CUDA_SYMBOL(name)));
  TINYDEV_CUDA_OPTIONAL_DRIVER_FUNCTIONS(TINYDEV_CUDA_RESOLVE_OPTIONAL)
#undef TINYDEV_CUDA_RESOLVE_OPTIONAL
  return "";
}

template <>
std::string resolve(void* handle, Nvrtc& n, std::string_view library) {
#define TINYDEV_CUDA_RESOLVE(name)                                                        \
  n.name = reinterpret_cast<decltype(n.name)>(::dlsym(handle, TINYDEV_CUDA_SYMBOL(name))); \
  if (!n.name)                                                                           \
    return fmt::format("{} has no {}: it is not CUDA 12's or 13's NVRTC; install one, or point " \
                       "TINYDEV_CUDA_NVRTC at its libnvrtc.so",                               \
                       library, TINYDEV_CUDA_SYMBOL(name));
  TINYDEV_NVRTC_FUNCTIONS(TINYDEV_CUDA_RESOLVE)
#undef TINYDEV_CUDA_RESOLVE
  return "";
}

// Loaded once; a failure is not remembered, so a later call (after the driver is installed, or
// TINYDEV_CUDA_DRIVER is changed) tries again, as the registry retries a failed open.
struct DriverState {
  std::mutex mutex;
  bool loaded = false;
  Driver driver;
};

struct NvrtcState {
  std::mutex mutex;
  bool loaded = false;
  Nvrtc nvrtc;
};

// "CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected", from `api`'s own tables.
std::string describe_with(const Driver& api, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  api.cuGetErrorName(result, &name);
  api.cuGetErrorString(result, &text);
  return fmt::format("{}: {}", name ? name : fmt::format("CUresult {}", static_cast<int>(result)),
                     text ? text : "no description");
}

}  // namespace

std::string describe(CUresult result) {
  try {
    return describe_with(driver(), result);
  } catch (const Error&) {
    return fmt::format("CUresult {}", static_cast<int>(result));
  }
}

void check(CUresult result, std::string_view what, std::string_view device) {
  if (result == CUDA_SUCCESS) [[likely]]
    return;
  if (result == CUDA_ERROR_OUT_OF_MEMORY)
    throw OutOfMemory(fmt::format("{}: {} failed: {}", device, what, describe(result)));
  throw Error(fmt::format("{}: {} failed: {}", device, what, describe(result)));
}

namespace {
DriverState& driver_state() {
  static DriverState* state = new DriverState;  // never destroyed: the driver outlives static destructors
  return *state;
}
}  // namespace

const Driver& driver() {
  DriverState* state = &driver_state();
  std::lock_guard lock(state->mutex);
  if (state->loaded) return state->driver;
  const std::string configured = settings().cuda_driver;
  std::string opened, errors;
  void* handle = open_first(configured.empty() ? std::vector<std::string>{"libcuda.so.1"}
                                               : std::vector<std::string>{configured},
                            opened, errors);
  if (!handle)
    throw DeviceUnavailable(configured.empty()
                                ? fmt::format("CUDA: no NVIDIA driver: libcuda.so.1 cannot be opened ({}): install the "
                                              "NVIDIA driver, or set TINYDEV_CUDA_DRIVER to the driver library",
                                              errors.substr(3))
                                : fmt::format("CUDA: TINYDEV_CUDA_DRIVER='{}' cannot be opened ({})",
                                              quote_for_message(configured), errors.substr(3)));
  Driver loaded;
  if (std::string missing = resolve(handle, loaded, opened); !missing.empty()) {
    ::dlclose(handle);  // not the driver: nothing of it is kept
    throw DeviceUnavailable("CUDA: " + missing);
  }
  loaded.path = opened;
  if (const CUresult r = loaded.cuInit(0); r != CUDA_SUCCESS) {
    throw DeviceUnavailable(fmt::format("CUDA: the driver ({}) did not initialize: cuInit: {}{}", opened,
                                        describe_with(loaded, r),
                                        r == CUDA_ERROR_NO_DEVICE ? " (this machine has no NVIDIA GPU, or "
                                                                    "CUDA_VISIBLE_DEVICES hides them all)"
                                                                  : ""));
  }
  loaded.cuDriverGetVersion(&loaded.version);
  debug_log(1, "CUDA", "CUDA driver {} from {}", loaded.version, opened);
  state->driver = loaded;
  state->loaded = true;
  return state->driver;
}

namespace {
// The lowest compute capability among the driver's GPUs (75 for 7.5), or 0 with no GPU.
int lowest_compute_capability(const Driver& api) {
  int count = 0;
  if (api.cuDeviceGetCount(&count) != CUDA_SUCCESS) return 0;
  int lowest = 0;
  for (int i = 0; i < count; ++i) {
    CUdevice device = 0;
    int major = 0, minor = 0;
    if (api.cuDeviceGet(&device, i) != CUDA_SUCCESS ||
        api.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device) != CUDA_SUCCESS ||
        api.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device) != CUDA_SUCCESS)
      continue;
    const int capability = major * 10 + minor;
    if (lowest == 0 || capability < lowest) lowest = capability;
  }
  return lowest;
}
}  // namespace

namespace {
// The driver's CUDA version (13000 for 13.0), 0 where there is none, without initializing it: a
// process that only compiles (to warm the cache) may fork workers that use the GPU afterwards, and
// CUDA initialized before a fork is unusable in the child. cuDriverGetVersion needs no cuInit.
// The library stays loaded (driver() finds it again).
int driver_version_without_init() {
  const std::string configured = settings().cuda_driver;
  void* handle = ::dlopen(configured.empty() ? "libcuda.so.1" : configured.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) return 0;
  using GetVersion = CUresult (*)(int*);
  const auto get = reinterpret_cast<GetVersion>(::dlsym(handle, "cuDriverGetVersion"));
  int version = 0;
  if (!get || get(&version) != CUDA_SUCCESS) version = 0;
  return version;
}

// Note [NVRTC builtins]
// NVRTC opens its builtins library, libnvrtc-builtins.so.MAJOR.MINOR, by bare name at its first
// compile, and libnvrtc has no RUNPATH: the loader's cache and LD_LIBRARY_PATH decide where it is
// found. Where NVRTC itself was opened by a path (TINYDEV_CUDA_NVRTC, or the toolkit's folder when
// the loader's cache does not list it), every compile would then fail with "failed to open
// libnvrtc-builtins", or take the builtins of another toolkit that is in the cache. So the
// builtins beside the library opened are loaded first: the loader hands NVRTC's own dlopen the
// library already loaded under that name (its soname). Never unloaded, as NVRTC is not.
// CUDA 13's second NVRTC, libnvrtc.alt.so, has builtins of its own: libnvrtc-builtins.alt.so.M.m.
// Looked for beside the path opened, then beside the file it links to (a TINYDEV_CUDA_NVRTC that
// is a link into a toolkit).
void preload_builtins_beside(const std::string& library, int major, int minor) {
  const auto candidate = [&](const std::string& path) {
    const std::size_t slash = path.rfind('/');
    const std::string file = path.substr(slash + 1);
    return fmt::format("{}/libnvrtc-builtins{}.so.{}.{}", path.substr(0, slash),
                       file.starts_with("libnvrtc.alt.") ? ".alt" : "", major, minor);
  };
  std::string builtins = candidate(library);
  if (::access(builtins.c_str(), F_OK) != 0) {
    std::error_code error;
    const std::string target = std::filesystem::canonical(library, error).string();
    if (!error) builtins = candidate(target);
  }
  if (::access(builtins.c_str(), F_OK) != 0) {
    debug_log(2, "CUDA", "no {} beside NVRTC: NVRTC looks for its builtins through the loader's path", builtins);
    return;
  }
  if (::dlopen(builtins.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr) {
    const char* why = ::dlerror();
    debug_log(1, "CUDA", "NVRTC's builtins {} cannot be loaded ({}): NVRTC looks for them through the loader's path",
              builtins, why ? why : "no reason given");
    return;
  }
  debug_log(2, "CUDA", "NVRTC's builtins from {}", builtins);
}

}  // namespace

const Nvrtc& nvrtc() {
  static NvrtcState* state = new NvrtcState;
  std::lock_guard lock(state->mutex);
  if (state->loaded) return state->nvrtc;
  std::string opened, errors;
  const std::string configured = settings().cuda_nvrtc;
  std::vector<std::string> candidates;
  if (!configured.empty()) {
    candidates = {configured};
  } else {
    // NVRTC's output needs a driver of at least its major version (PTX 9.x does not JIT on a 12.x
    // driver), and NVRTC 13 compiles for compute capability 7.5 and newer only: with a 12.x driver
    // or an older GPU, NVRTC 12 first. The driver is asked even on the compile-only path (the
    // choice is made once); a machine without one compiles with the newest NVRTC.
    const std::vector<std::string> newest_first{"libnvrtc.so.13", "libnvrtc.so.12",
                                                "/usr/local/cuda/lib64/libnvrtc.so.13",
                                                "/usr/local/cuda/lib64/libnvrtc.so.12"};
    const std::vector<std::string> twelve_first{"libnvrtc.so.12", "/usr/local/cuda/lib64/libnvrtc.so.12",
                                                "libnvrtc.so.13", "/usr/local/cuda/lib64/libnvrtc.so.13"};
    candidates = newest_first;
    bool driver_loaded = false;
    {
      DriverState& loaded_driver = driver_state();
      std::lock_guard driver_lock(loaded_driver.mutex);  // the only order: NVRTC's mutex, then the driver's
      driver_loaded = loaded_driver.loaded;
    }
    if (driver_loaded) {
      // A device opened first: its driver and GPUs decide.
      const Driver& api = driver();
      const int lowest = lowest_compute_capability(api);
      if (api.version / 1000 < 13 || (lowest != 0 && lowest < 75)) {
        candidates = twelve_first;
        debug_log(1, "CUDA", "NVRTC 12 first: the driver is {}.{}, the oldest GPU compute capability {}.{}",
                  api.version / 1000, api.version % 1000 / 10, lowest / 10, lowest % 10);
      }
    } else if (const int version = driver_version_without_init(); version != 0 && version / 1000 < 13) {
      // A compiler without a device: the driver's version only (the GPUs need cuInit).
      candidates = twelve_first;
      debug_log(1, "CUDA", "NVRTC 12 first: the driver is {}.{}", version / 1000, version % 1000 / 10);
    }
  }
  void* handle = open_first(candidates, opened, errors);
  if (!handle)
    throw DeviceUnavailable(
        configured.empty()
            ? fmt::format("CUDA: NVRTC cannot be opened ({}): install the CUDA toolkit's NVRTC (13 or 12), or set "
                          "TINYDEV_CUDA_NVRTC to the library",
                          errors.substr(3))
            : fmt::format("CUDA: TINYDEV_CUDA_NVRTC='{}' cannot be opened ({}): point it at a libnvrtc.so of CUDA "
                          "12 or 13, or unset it",
                          quote_for_message(configured), errors.substr(3)));
  Nvrtc loaded;
  if (std::string missing = resolve(handle, loaded, opened); !missing.empty()) {
    ::dlclose(handle);
    throw DeviceUnavailable("CUDA: " + missing);
  }
  loaded.path = opened;
  // The version is in the compile cache's key and decides the choices above: one that cannot be
  // read, or an NVRTC older than 12 (whose output and options tinydev does not know), is refused.
  if (const nvrtcResult r = loaded.nvrtcVersion(&loaded.major, &loaded.minor); r != NVRTC_SUCCESS || loaded.major < 12) {
    const std::string found = r != NVRTC_SUCCESS ? fmt::format("nvrtcVersion failed ({})", static_cast<int>(r))
                                                 : fmt::format("it is NVRTC {}.{}", loaded.major, loaded.minor);
    ::dlclose(handle);
    throw DeviceUnavailable(fmt::format("CUDA: {} cannot be used: {}; tinydev needs CUDA 12's or 13's NVRTC: install "
                                        "one, or point TINYDEV_CUDA_NVRTC at its libnvrtc.so",
                                        opened, found));
  }
  int count = 0;
  if (loaded.nvrtcGetNumSupportedArchs(&count) == NVRTC_SUCCESS && count > 0 && count < 1000) {
    loaded.archs.resize(static_cast<std::size_t>(count));
    if (loaded.nvrtcGetSupportedArchs(loaded.archs.data()) != NVRTC_SUCCESS) loaded.archs.clear();
  }
  debug_log(1, "CUDA", "NVRTC {}.{} from {}", loaded.major, loaded.minor, opened);
  if (opened.find('/') != std::string::npos) preload_builtins_beside(opened, loaded.major, loaded.minor);
  state->nvrtc = loaded;
  state->loaded = true;
  return state->nvrtc;
}

}  // namespace tinydev::cuda
