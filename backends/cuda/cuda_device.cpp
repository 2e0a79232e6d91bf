// The CUDA backend's device: one retained primary context per GPU, device memory behind the LRU
// cache, CUDA C++ compiled by NVRTC (cuda_compiler.cpp), modules loaded and kernels launched on
// one stream per device. Everything goes through the driver table of cuda_api.hpp (Note [CUDA at
// run time]): a build with this backend runs on machines without a GPU, where opening CUDA is a
// DeviceUnavailable saying why and the default-device probe moves on.
//
// Not yet here (issue 8): the HCQ queues (streams with stream memory operations, signals in mapped
// host memory), CUDA graphs, peer transfers, the staging ring with pinned slots.
#include <fmt/format.h>

#include <array>
#include <charconv>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "cuda_api.hpp"
#include "cuda_compiler.hpp"
#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/device.hpp"
#include "tinydev/error.hpp"
#include "tinydev/profile.hpp"

namespace tinydev {
namespace cuda {
namespace {

// What every object of one device shares. Lives as long as the device (the process), and as long
// as any Program or allocator that holds it.
struct DeviceState {
  DeviceState(const Driver& api, std::string name) : api(api), name(std::move(name)) {}
  const Driver& api;
  std::string name;
  CUdevice device = 0;
  CUcontext context = nullptr;
  CUstream stream = nullptr;
  CUevent start = nullptr, end = nullptr;  // for timed launches, under `timing`
  int major = 0, minor = 0;                // compute capability, read once at open
  std::mutex timing;

  // Driver calls act on the calling thread's current context.
  void make_current() const { check(api.cuCtxSetCurrent(context), "cuCtxSetCurrent", name); }
};

class CudaAllocator final : public LRUAllocator {
 public:
  explicit CudaAllocator(std::shared_ptr<DeviceState> state) : state_(std::move(state)) {}
  ~CudaAllocator() override { free_cache(); }

  // Host -> device. The device's stream is a blocking stream, so this synchronous copy on the
  // legacy stream is ordered after the kernels queued before it.
  void copyin(Allocation dest, std::span<const std::byte> src) override {
    detail::check_fits(src.size(), dest, "copyin", describe());
    state_->make_current();
    check(state_->api.cuMemcpyHtoD(dest.va_addr, src.data(), src.size()), "cuMemcpyHtoD", state_->name);
  }
  void copyout(std::span<std::byte> dest, Allocation src) override {
    detail::check_fits(dest.size(), src, "copyout", describe());
    state_->make_current();
    check(state_->api.cuMemcpyDtoH(dest.data(), src.va_addr, dest.size()), "cuMemcpyDtoH", state_->name);
  }
  bool supports_offset() const noexcept override { return true; }
  Allocation offset(Allocation base, std::size_t size, std::size_t offset) override {
    return detail::sub_allocation(base, size, offset, describe());
  }
  std::string describe() const override { return fmt::format("{} allocator (device memory)", state_->name); }

 protected:
  Allocation alloc_impl(std::size_t size, const BufferOptions& options) override {
    state_->make_current();
    if (options.host) {
      // Pinned, mapped into every context: what the staging ring and signals will use.
      void* p = nullptr;
      check(state_->api.cuMemHostAlloc(&p, size, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP),
            fmt::format("cuMemHostAlloc of {} bytes", size), state_->name);
      return Allocation{reinterpret_cast<std::uintptr_t>(p), size, nullptr};
    }
    CUdeviceptr p = 0;
    check(state_->api.cuMemAlloc(&p, size), fmt::format("cuMemAlloc of {} bytes", size), state_->name);
    return Allocation{static_cast<std::uintptr_t>(p), size, nullptr};
  }
  void free_impl(Allocation allocation, std::size_t, const BufferOptions& options) override {
    // Kernels queued earlier may still use the memory (the seed's allocator synchronizes too).
    state_->make_current();
    check(state_->api.cuCtxSynchronize(), "cuCtxSynchronize before a free", state_->name);
    if (options.host) check(state_->api.cuMemFreeHost(allocation.host_ptr()), "cuMemFreeHost", state_->name);
    else check(state_->api.cuMemFree(static_cast<CUdeviceptr>(allocation.va_addr)), "cuMemFree", state_->name);
  }

 private:
  std::shared_ptr<DeviceState> state_;
};

// The most bytes of packed arguments a launch takes (CUDA's own limit is 32 KiB of parameters).
constexpr std::size_t kMaxArgumentBytes = 32 * 1024;

class CudaProgram final : public Program {
 public:
  CudaProgram(std::string name, std::shared_ptr<DeviceState> state, CUmodule module, CUfunction function)
      : Program(std::move(name)), state_(std::move(state)), module_(module), function_(function) {}
  ~CudaProgram() override {
    if (state_->api.cuCtxSetCurrent(state_->context) == CUDA_SUCCESS) state_->api.cuModuleUnload(module_);
  }

  // The arguments go in one packed buffer, as the seed's fill_kernargs lays them out (8-byte
  // addresses, then 4-byte values), which is the kernel's own parameter layout for the kernel ABI.
  // `global` is the grid (blocks) and `local` the block (threads), as in the seed.
  std::optional<double> operator()(std::span<const Allocation> buffers, std::span<const std::int32_t> values,
                                   const LaunchParams& params) override {
    const Dim3& g = params.global;
    const Dim3& l = params.local;
    if (grid_size(g) == 0 || grid_size(l) == 0)
      throw InvalidArgument(fmt::format("{} on {}: global size ({},{},{}) and local size ({},{},{}) may have no zero "
                                        "dimension",
                                        name(), state_->name, g[0], g[1], g[2], l[0], l[1], l[2]));
    std::size_t size = buffers.size() * 8 + values.size() * 4;
    if (size > kMaxArgumentBytes)
      throw InvalidArgument(fmt::format("{} on {}: {} bytes of arguments is more than a CUDA launch takes ({})", name(),
                                        state_->name, size, kMaxArgumentBytes));
    std::array<std::byte, kMaxArgumentBytes> packed;
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      const std::uint64_t address = buffers[i].va_addr;
      std::memcpy(packed.data() + i * 8, &address, 8);
    }
    if (!values.empty()) std::memcpy(packed.data() + buffers.size() * 8, values.data(), values.size() * 4);
    void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, packed.data(), CU_LAUNCH_PARAM_BUFFER_SIZE, &size,
                     CU_LAUNCH_PARAM_END};
    state_->make_current();
    const auto launch = [&] {
      const CUresult r =
          state_->api.cuLaunchKernel(function_, g[0], g[1], g[2], l[0], l[1], l[2], 0, state_->stream, nullptr, extra);
      if (r != CUDA_SUCCESS) [[unlikely]]  // the message is only built for a failure: this is the hot path
        check(r, fmt::format("launching '{}'", name()), state_->name);
    };
    const std::int64_t launched = GlobalCounters::kernel_count.fetch_add(1, std::memory_order_relaxed) + 1;
    if (!params.wait) {
      launch();
      debug_log(2, "*** {:<7} {:>6} {:<40} arg {:>3}", state_->name, launched, name(), buffers.size() + values.size());
      return std::nullopt;
    }
    std::lock_guard lock(state_->timing);
    check(state_->api.cuEventRecord(state_->start, state_->stream), "cuEventRecord", state_->name);
    launch();
    check(state_->api.cuEventRecord(state_->end, state_->stream), "cuEventRecord", state_->name);
    check(state_->api.cuEventSynchronize(state_->end), fmt::format("running '{}'", name()), state_->name);
    float ms = 0;
    check(state_->api.cuEventElapsedTime(&ms, state_->start, state_->end), "cuEventElapsedTime", state_->name);
    const double seconds = ms / 1e3;
    GlobalCounters::time_sum.fetch_add(seconds, std::memory_order_relaxed);
    debug_log(2, "*** {:<7} {:>6} {:<40} arg {:>3} tm {:9.2f}us", state_->name, launched, name(),
              buffers.size() + values.size(), seconds * 1e6);
    return seconds;
  }

 private:
  std::shared_ptr<DeviceState> state_;
  CUmodule module_;
  CUfunction function_;
};

class CudaRuntime final : public Runtime {
 public:
  explicit CudaRuntime(std::shared_ptr<DeviceState> state) : state_(std::move(state)) {}

  std::shared_ptr<Program> load(std::string_view kernel_name, std::span<const std::byte> blob) override {
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
                                        state_->name, quote_for_message(kernel_name), blob.size()));
    std::vector<std::byte> image(blob.begin(), blob.end());
    image.push_back(std::byte{0});
    state_->make_current();
    CUmodule module = nullptr;
    if (const CUresult r = state_->api.cuModuleLoadData(&module, image.data()); r != CUDA_SUCCESS)
      throw InvalidArgument(fmt::format("{}: the driver could not load the module of kernel '{}': {}", state_->name,
                                        quote_for_message(kernel_name), describe(r)));
    CUfunction function = nullptr;
    const std::string name(kernel_name);
    if (const CUresult r = state_->api.cuModuleGetFunction(&function, module, name.c_str()); r != CUDA_SUCCESS) {
      state_->api.cuModuleUnload(module);
      throw InvalidArgument(fmt::format("{}: kernel '{}' is not in the compiled module ({}): check the kernel name, "
                                        "and that it is declared extern \"C\"",
                                        state_->name, quote_for_message(kernel_name), describe(r)));
    }
    return std::make_shared<CudaProgram>(name, state_, module, function);
  }

 private:
  std::shared_ptr<DeviceState> state_;
};

int attribute(const DeviceState& s, CUdevice_attribute which, std::string_view what) {
  int value = 0;
  check(s.api.cuDeviceGetAttribute(&value, which, s.device), fmt::format("cuDeviceGetAttribute({})", what), s.name);
  return value;
}

// The ordinal of "CUDA" (0) or "CUDA:3" (3); canonicalize has checked the form.
int ordinal_of(const std::string& canonical_name) {
  const auto colon = canonical_name.find(':');
  if (colon == std::string::npos) return 0;
  int ordinal = 0;
  std::from_chars(canonical_name.data() + colon + 1, canonical_name.data() + canonical_name.size(), ordinal);
  return ordinal;
}

std::shared_ptr<DeviceState> open_state(const std::string& name) {
  const Driver& api = driver();  // DeviceUnavailable: no driver, too old, cuInit failed
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
  check(api.cuDeviceGet(&state->device, ordinal), "cuDeviceGet", name);
  state->major = attribute(*state, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "compute capability");
  state->minor = attribute(*state, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "compute capability");
  check(api.cuDevicePrimaryCtxRetain(&state->context, state->device), "cuDevicePrimaryCtxRetain", name);
  try {
    state->make_current();
    check(api.cuStreamCreate(&state->stream, CU_STREAM_DEFAULT), "cuStreamCreate", name);
    check(api.cuEventCreate(&state->start, CU_EVENT_DEFAULT), "cuEventCreate", name);
    check(api.cuEventCreate(&state->end, CU_EVENT_DEFAULT), "cuEventCreate", name);
  } catch (...) {
    if (state->end) api.cuEventDestroy(state->end);
    if (state->start) api.cuEventDestroy(state->start);
    if (state->stream) api.cuStreamDestroy(state->stream);
    api.cuDevicePrimaryCtxRelease(state->device);
    throw;
  }
  return state;
}

class CudaDevice final : public Compiled {
 public:
  CudaDevice(const std::string& name, std::shared_ptr<DeviceState> state)
      : Compiled(name, std::make_shared<CudaAllocator>(state),
                 std::make_unique<CudaCompiler>(arch_for(state->major, state->minor), settings().cuda_ptx),
                 std::make_unique<CudaRuntime>(state), SourceLanguage::CUDA),
        state_(std::move(state)) {}

  void synchronize() override {
    state_->make_current();
    check(state_->api.cuStreamSynchronize(state_->stream), "cuStreamSynchronize", state_->name);
  }

  DeviceCapabilities capabilities() const override {
    return DeviceCapabilities{.compiles_source = true,
                              .rejects_invalid_source = true,
                              .caches_compiles = true,
                              .runs_kernels = true};
  }

  std::map<std::string, std::string> properties() const override {
    auto props = Compiled::properties();
    char gpu[256] = {};
    state_->api.cuDeviceGetName(gpu, sizeof(gpu) - 1, state_->device);
    std::size_t memory = 0;
    state_->api.cuDeviceTotalMem(&memory, state_->device);
    const auto& compiler = static_cast<const CudaCompiler&>(this->compiler());
    props["gpu"] = gpu;
    props["compute capability"] = fmt::format("{}.{}", state_->major, state_->minor);
    props["memory"] = fmt::format("{:.1f} GiB", static_cast<double>(memory) / (1ull << 30));
    props["multiprocessors"] = std::to_string(attribute(*state_, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SMs"));
    props["64-bit stream memory operations"] =
        attribute(*state_, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, "stream mem ops") ? "yes" : "no";
    props["compiler"] = fmt::format("NVRTC {} to {} for {}", compiler.nvrtc_version(),
                                    compiler.ptx() ? "PTX (driver JIT)" : "CUBIN", compiler.arch());
    props["driver"] = fmt::format("{}.{} ({})", state_->api.version / 1000, state_->api.version % 1000 / 10,
                                  state_->api.path);
    props["queues"] = "one stream per device (HCQ queues not yet)";
    return props;
  }

 private:
  std::shared_ptr<DeviceState> state_;
};

}  // namespace
}  // namespace cuda

std::unique_ptr<Compiled> open_cuda_device(const std::string& canonical_name) {
  return std::make_unique<cuda::CudaDevice>(canonical_name, cuda::open_state(canonical_name));
}

}  // namespace tinydev
