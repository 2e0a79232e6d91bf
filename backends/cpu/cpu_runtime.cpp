#include "cpu_runtime.hpp"

#include "elf_loader.hpp"

#include <dlfcn.h>
#include <fmt/format.h>
#include <llvm/ExecutionEngine/Orc/ExecutionUtils.h>
#include <llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h>
#include <llvm/ExecutionEngine/Orc/LLJIT.h>
#include <llvm/Object/ObjectFile.h>
#include <llvm/Support/MemoryBuffer.h>
#include <llvm/Support/TargetSelect.h>
#include <llvm/TargetParser/Host.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <utility>

#include "tinydev/counters.hpp"
#include "tinydev/error.hpp"

extern "C" {
float tinydev_extendhfsf2(_Float16);
_Float16 tinydev_truncsfhf2(float);
_Float16 tinydev_truncdfhf2(double);
_Float16 tinydev_truncsfbf2(float);
_Float16 tinydev_truncdfbf2(double);
std::uint16_t tinydev_f2h_ieee(float);
float tinydev_h2f_ieee(std::uint16_t);
}

namespace tinydev::cpu {

namespace {

struct Helper {
  const char* name;
  void* address;
};
// The conversion helpers compiled kernels call (cpu_helpers.cpp), by their compiler-rt names.
const Helper kHelpers[] = {
    {"__extendhfsf2", reinterpret_cast<void*>(&tinydev_extendhfsf2)},
    {"__truncsfhf2", reinterpret_cast<void*>(&tinydev_truncsfhf2)},
    {"__truncdfhf2", reinterpret_cast<void*>(&tinydev_truncdfhf2)},
    {"__truncsfbf2", reinterpret_cast<void*>(&tinydev_truncsfbf2)},
    {"__truncdfbf2", reinterpret_cast<void*>(&tinydev_truncdfbf2)},
    {"__gnu_f2h_ieee", reinterpret_cast<void*>(&tinydev_f2h_ieee)},
    {"__gnu_h2f_ieee", reinterpret_cast<void*>(&tinydev_h2f_ieee)},
};

// Helpers first, then whatever the process has loaded (libm, libc).
void* resolve_external(std::string_view name) {
  for (const Helper& h : kHelpers)
    if (name == h.name) return h.address;
  return ::dlsym(RTLD_DEFAULT, std::string(name).c_str());
}

void init_llvm() {
  static std::once_flag once;
  std::call_once(once, [] {
    llvm::InitializeNativeTarget();
    llvm::InitializeNativeTargetAsmPrinter();
    llvm::InitializeNativeTargetAsmParser();
    // Kernels call libm; make sure it is in the process for the JIT's symbol search.
    ::dlopen("libm.so.6", RTLD_NOW | RTLD_GLOBAL);
  });
}

std::string take(llvm::Error err) { return llvm::toString(std::move(err)); }

// ORC reports the root cause of a failed link (e.g. "Symbols not found: [ foo ]") to the session's
// error reporter, and returns only "Failed to materialize symbols" from the lookup. Materialization
// runs on the thread that looks up (LLJIT's default in-place dispatcher), so the reporter stashes
// the cause here for that thread's load() to put in its error.
thread_local std::string t_link_error;

// Note [CPU kernel calls]
// The object code has no signature information, so a call passes every argument as a 64-bit
// integer: buffer addresses as they are, int32 values zero-extended. Under the x86-64 and AArch64
// SysV ABIs a pointer or int32 parameter occupies exactly one integer register or 8-byte stack
// slot and the callee reads only the low 32 bits of an int32, so `void(u64 x N)` is
// call-compatible with `void(T*..., int32_t...)`. A table of N-argument trampolines, built at
// compile time, dispatches on N in one indirect call.
template <std::size_t... I>
void call_n(void* fn, const std::uint64_t* a) {
  using Fn = void (*)(decltype(I, std::uint64_t{})...);
  reinterpret_cast<Fn>(fn)(a[I]...);
}
template <std::size_t... N>
constexpr auto make_table(std::index_sequence<N...>) {
  return std::array<void (*)(void*, const std::uint64_t*), sizeof...(N)>{
      []<std::size_t... I>(std::index_sequence<I...>) { return &call_n<I...>; }(
          std::make_index_sequence<N>{})...};
}
constexpr auto kCallTable = make_table(std::make_index_sequence<kMaxKernelArgs + 1>{});

}  // namespace

#if !(defined(__x86_64__) || defined(__aarch64__))
#error "CPU kernel calls assume the x86-64 or AArch64 SysV calling convention (Note [CPU kernel calls])"
#endif

void call_with_args(void* fn, const std::uint64_t* args, std::size_t count) {
  kCallTable[count](fn, args);
}

const HostTarget& host_target() {
  static const HostTarget target = [] {
    init_llvm();
    HostTarget t;
    t.triple = llvm::sys::getProcessTriple();
    t.cpu = std::string(llvm::sys::getHostCPUName());
    std::string features;
    for (const auto& [name, enabled] : llvm::sys::getHostCPUFeatures()) {
      if (!features.empty()) features += ',';
      features += (enabled ? "+" : "-") + name.str();
    }
    t.features = features;
    return t;
  }();
  return target;
}

std::map<std::string, std::string> host_properties() {
  const HostTarget& t = host_target();
  int enabled = 0;
  for (char c : t.features) enabled += c == '+';
  return {{"target", t.triple}, {"cpu", t.cpu}, {"cpu features", fmt::format("{} enabled", enabled)}};
}

std::vector<std::string> object_functions(std::span<const std::byte> blob) {
  init_llvm();
  std::vector<std::string> out;
  llvm::MemoryBufferRef ref(
      llvm::StringRef(reinterpret_cast<const char*>(blob.data()), blob.size()), "kernel");
  auto obj = llvm::object::ObjectFile::createObjectFile(ref);
  if (!obj) {
    llvm::consumeError(obj.takeError());
    return out;
  }
  for (const llvm::object::SymbolRef& sym : (*obj)->symbols()) {
    auto flags = sym.getFlags();
    auto type = sym.getType();
    auto name = sym.getName();
    if (!flags || !type || !name) {
      if (!flags) llvm::consumeError(flags.takeError());
      if (!type) llvm::consumeError(type.takeError());
      if (!name) llvm::consumeError(name.takeError());
      continue;
    }
    if ((*flags & llvm::object::SymbolRef::SF_Global) && !(*flags & llvm::object::SymbolRef::SF_Undefined) &&
        *type == llvm::object::SymbolRef::ST_Function)
      out.push_back(name->str());
  }
  return out;
}

// ---- the JIT --------------------------------------------------------------------------------------

struct ObjectRuntime::Impl {
  std::string device;
  std::unique_ptr<llvm::orc::LLJIT> jit;
  llvm::orc::JITDylib* helpers = nullptr;  // conversion helpers + the process's symbols
  std::atomic<std::uint64_t> counter{0};
};

namespace {

class CpuProgram final : public Program {
 public:
  // `code` owns the memory `fn` lives in: a LoadedObject, or an ORC dylib's removal.
  CpuProgram(std::string name, std::shared_ptr<ObjectRuntime::Impl> jit, std::shared_ptr<void> code, void* fn)
      : Program(std::move(name)), jit_(std::move(jit)), code_(std::move(code)), fn_(fn) {}

  std::optional<double> operator()(std::span<const Allocation> buffers,
                                   std::span<const std::int32_t> values,
                                   const LaunchParams& params) override {
    const std::size_t count = buffers.size() + values.size();
    if (count > kMaxKernelArgs) [[unlikely]]
      throw InvalidArgument(fmt::format("{}: {} buffers and {} values is more than the {} arguments "
                                        "a CPU kernel call takes",
                                        name(), buffers.size(), values.size(), kMaxKernelArgs));
    if ((params.global != std::array<std::uint32_t, 3>{1, 1, 1} ||
         params.local != std::array<std::uint32_t, 3>{1, 1, 1})) [[unlikely]]
      throw InvalidArgument(fmt::format(
          "{} on {}: CPU kernels run as one call, so global and local size must be (1,1,1), got "
          "({},{},{}) and ({},{},{}): loop inside the kernel",
          name(), jit_->device, params.global[0], params.global[1], params.global[2],
          params.local[0], params.local[1], params.local[2]));
    std::uint64_t args[kMaxKernelArgs];
    std::size_t n = 0;
    for (const Allocation& b : buffers) args[n++] = b.va_addr;
    for (std::int32_t v : values) args[n++] = static_cast<std::uint32_t>(v);
    const std::int64_t launched = GlobalCounters::kernel_count.fetch_add(1, std::memory_order_relaxed) + 1;
    if (!params.wait) [[likely]] {
      kCallTable[n](fn_, args);
      debug_log(2, "*** {:<7} {:>6} {:<40} arg {:>3}", jit_->device, launched, name(), count);
      return std::nullopt;
    }
    const auto start = std::chrono::steady_clock::now();
    kCallTable[n](fn_, args);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    GlobalCounters::time_sum.fetch_add(seconds, std::memory_order_relaxed);
    debug_log(2, "*** {:<7} {:>6} {:<40} arg {:>3} tm {:9.2f}us", jit_->device, launched, name(),
              count, seconds * 1e6);
    return seconds;
  }

  void* host_function() const noexcept override { return fn_; }

 private:
  std::shared_ptr<ObjectRuntime::Impl> jit_;  // the JIT outlives every program it loaded
  std::shared_ptr<void> code_;
  void* fn_;
};

}  // namespace

ObjectRuntime::ObjectRuntime(std::string device_name) : impl_(std::make_shared<Impl>()) {
  init_llvm();
  impl_->device = std::move(device_name);
  auto jtmb = llvm::orc::JITTargetMachineBuilder::detectHost();
  if (!jtmb)
    throw DeviceUnavailable(fmt::format("{}: LLVM cannot target this host: {}", impl_->device,
                                        take(jtmb.takeError())));
  auto jit = llvm::orc::LLJITBuilder().setJITTargetMachineBuilder(std::move(*jtmb)).create();
  if (!jit)
    throw DeviceUnavailable(fmt::format("{}: could not start LLVM's ORC JIT: {}", impl_->device,
                                        take(jit.takeError())));
  impl_->jit = std::move(*jit);
  // Link failures are returned to the caller of lookup as errors; don't also print them.
  std::string device = impl_->device;
  impl_->jit->getExecutionSession().setErrorReporter([device](llvm::Error err) {
    std::string what = take(std::move(err));
    debug_log(2, "tinydev: {} JIT: {}", device, what);
    t_link_error += (t_link_error.empty() ? "" : "; ") + what;
  });
  auto helpers = impl_->jit->createJITDylib("tinydev_helpers");
  if (!helpers)
    throw DeviceUnavailable(fmt::format("{}: {}", impl_->device, take(helpers.takeError())));
  impl_->helpers = &*helpers;
  auto& es = impl_->jit->getExecutionSession();
  llvm::orc::SymbolMap symbols;
  for (const Helper& h : kHelpers)
    symbols[es.intern(h.name)] = llvm::orc::ExecutorSymbolDef(llvm::orc::ExecutorAddr::fromPtr(h.address),
                                                               llvm::JITSymbolFlags::Exported);
  if (llvm::Error err = impl_->helpers->define(llvm::orc::absoluteSymbols(std::move(symbols))))
    throw DeviceUnavailable(fmt::format("{}: {}", impl_->device, take(std::move(err))));
  auto process = llvm::orc::DynamicLibrarySearchGenerator::GetForCurrentProcess(
      impl_->jit->getDataLayout().getGlobalPrefix());
  if (!process)
    throw DeviceUnavailable(fmt::format("{}: {}", impl_->device, take(process.takeError())));
  impl_->helpers->addGenerator(std::move(*process));
}

ObjectRuntime::~ObjectRuntime() = default;

std::shared_ptr<Program> ObjectRuntime::load(std::string_view kernel_name,
                                             std::span<const std::byte> blob) {
  std::optional<std::vector<std::string>> elf = elf_functions(blob);
  std::vector<std::string> defined = elf ? std::move(*elf) : object_functions(blob);
  if (defined.empty())
    throw InvalidArgument(fmt::format("{}: the blob for kernel '{}' ({} bytes) is not an object "
                                      "file defining any function: pass what compile() returned",
                                      impl_->device, kernel_name, blob.size()));
  if (std::find(defined.begin(), defined.end(), kernel_name) == defined.end())
    throw InvalidArgument(fmt::format("{}: kernel '{}' is not in the compiled object, which defines "
                                      "{}: check the kernel name",
                                      impl_->device, kernel_name, fmt::join(defined, ", ")));
#if defined(__x86_64__)
  // The fast path (Note [Two object loaders] in elf_loader.hpp); ORC below when it declines.
  ElfLoadResult fast = load_elf_x86_64(blob, kernel_name, &resolve_external);
  if (!fast.error.empty())
    throw InvalidArgument(fmt::format("{}: could not load kernel '{}': {}", impl_->device, kernel_name,
                                      fast.error));
  if (fast.object) {
    void* fn = fast.object->entry;
    return std::make_shared<CpuProgram>(std::string(kernel_name), impl_,
                                        std::shared_ptr<void>(std::move(fast.object)), fn);
  }
  debug_log(2, "tinydev: {}: the fast loader declined '{}' ({}); loading with ORC", impl_->device,
            kernel_name, fast.declined);
#endif
  return load_with_orc(kernel_name, blob);
}

std::shared_ptr<Program> ObjectRuntime::load_with_orc(std::string_view kernel_name,
                                                      std::span<const std::byte> blob) {
  auto& es = impl_->jit->getExecutionSession();
  auto dylib = impl_->jit->createJITDylib(
      fmt::format("{}_{}", kernel_name, impl_->counter.fetch_add(1)));
  if (!dylib) throw Error(fmt::format("{}: {}", impl_->device, take(dylib.takeError())));
  llvm::orc::JITDylib& jd = *dylib;
  jd.addToLinkOrder(*impl_->helpers);
  t_link_error.clear();
  auto fail = [&](std::string what) -> std::shared_ptr<Program> {
    if (!t_link_error.empty()) what = t_link_error + " (" + what + ")";
    t_link_error.clear();
    if (llvm::Error err = es.removeJITDylib(jd)) llvm::consumeError(std::move(err));
    throw InvalidArgument(fmt::format("{}: could not load kernel '{}': {}", impl_->device,
                                      kernel_name, what));
  };
  auto buffer = llvm::MemoryBuffer::getMemBufferCopy(
      llvm::StringRef(reinterpret_cast<const char*>(blob.data()), blob.size()),
      fmt::format("{}.o", kernel_name));
  if (llvm::Error err = impl_->jit->addObjectFile(jd, std::move(buffer))) return fail(take(std::move(err)));
  auto addr = impl_->jit->lookup(jd, llvm::StringRef(kernel_name.data(), kernel_name.size()));
  if (!addr) return fail(take(addr.takeError()));
  // Unloading frees the code; other programs (even of the same kernel name) live in other dylibs.
  std::shared_ptr<Impl> jit = impl_;
  std::shared_ptr<void> owner(&jd, [jit](void* p) {
    auto* dylib = static_cast<llvm::orc::JITDylib*>(p);
    if (llvm::Error err = jit->jit->getExecutionSession().removeJITDylib(*dylib))
      debug_log(1, "tinydev: unloading a kernel on {} failed: {}", jit->device, take(std::move(err)));
  });
  return std::make_shared<CpuProgram>(std::string(kernel_name), impl_, std::move(owner), addr->toPtr<void*>());
}

}  // namespace tinydev::cpu
