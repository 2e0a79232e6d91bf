#include "cpu_runtime.hpp"

#include "cpu_blob.hpp"
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
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#include "tinydev/counters.hpp"
#include "tinydev/profile.hpp"
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

// ---- the JIT --------------------------------------------------------------------------------------

struct ObjectRuntime::Impl {
  std::string device;
  CallOrdering* ordering = nullptr;
  std::unique_ptr<llvm::orc::LLJIT> jit;
  llvm::orc::JITDylib* helpers = nullptr;  // conversion helpers + the process's symbols
  std::atomic<std::uint64_t> counter{0};
};

// ---- CpuThreadPool --------------------------------------------------------------------------------

struct CpuThreadPool::Impl {
  struct Job {
    void (*fn)(void*, std::uint64_t, std::uint64_t);
    void* ctx;
    std::uint64_t n, chunk;
    std::atomic<std::uint64_t> next{0};
    int active = 0;  // pool threads inside the job (guarded by mutex)
  };
  std::mutex job_mutex;  // one grid at a time
  std::mutex mutex;
  std::condition_variable wake, done;
  Job* job = nullptr;
  std::uint64_t generation = 0;
  std::vector<std::thread> threads;

  static void work(Job& job) {
    while (true) {
      const std::uint64_t begin = job.next.fetch_add(job.chunk, std::memory_order_relaxed);
      if (begin >= job.n) return;
      job.fn(job.ctx, begin, std::min(job.n, begin + job.chunk));
    }
  }
  void run() {
    std::uint64_t seen = 0;
    std::unique_lock lock(mutex);
    while (true) {
      wake.wait(lock, [&] { return generation != seen; });
      seen = generation;
      Job* j = job;
      if (!j) continue;
      j->active += 1;
      lock.unlock();
      work(*j);
      lock.lock();
      if (--j->active == 0) done.notify_all();
    }
  }
};

CpuThreadPool::CpuThreadPool(std::size_t threads) : threads_(std::max<std::size_t>(1, threads)), impl_(new Impl) {
  for (std::size_t i = 1; i < threads_; ++i) {
    impl_->threads.emplace_back([impl = impl_] { impl->run(); });
    impl_->threads.back().detach();  // the pool lives as long as the process
  }
}

CpuThreadPool& CpuThreadPool::global() {
  static CpuThreadPool* pool = [] {
    const int configured = settings().cpu_threads;
    const unsigned cores = std::thread::hardware_concurrency();
    return new CpuThreadPool(configured > 0 ? static_cast<std::size_t>(configured) : std::max(1u, cores));
  }();
  return *pool;
}

void CpuThreadPool::parallel_for(std::uint64_t n, void (*fn)(void*, std::uint64_t, std::uint64_t), void* ctx) {
  if (threads_ == 1 || n < 2) {
    fn(ctx, 0, n);
    return;
  }
  std::lock_guard one_job(impl_->job_mutex);
  Impl::Job job;
  job.fn = fn;
  job.ctx = ctx;
  job.n = n;
  job.chunk = std::max<std::uint64_t>(1, n / (threads_ * 8));
  {
    std::lock_guard lock(impl_->mutex);
    impl_->job = &job;
    impl_->generation += 1;
  }
  impl_->wake.notify_all();
  Impl::work(job);
  std::unique_lock lock(impl_->mutex);
  impl_->done.wait(lock, [&] { return job.active == 0; });
  impl_->job = nullptr;  // late threads see no job; none can still be inside this one
}

// ---- CpuProgram -----------------------------------------------------------------------------------

CpuProgram::CpuProgram(std::string name, std::string device, std::shared_ptr<void> code, void* fn,
                       std::optional<KernelSignature> signature, CallOrdering* ordering)
    : Program(std::move(name)),
      device_(std::move(device)),
      code_(std::move(code)),
      fn_(fn),
      signature_(signature),
      ordering_(ordering) {}

void CpuProgram::check_launch(std::size_t buffers, std::size_t values, const Dim3& global) const {
  if (global[0] == 0 || global[1] == 0 || global[2] == 0) [[unlikely]]
    throw InvalidArgument(fmt::format("{} on {}: global size ({},{},{}) has a zero dimension", name(), device_,
                                      global[0], global[1], global[2]));
  const std::uint64_t n = grid_size(global);
  if (signature_ && !signature_->accepts(buffers, values, n > 1)) [[unlikely]]
    throw InvalidArgument(fmt::format(
        "{} on {}: the kernel takes {} buffers and {} values, got {} and {}{}", name(), device_,
        signature_->num_buffers, signature_->num_values, buffers, values,
        n > 1 ? " plus the grid index (Note [CPU grid ABI]: a grid launch appends it as the last value)" : ""));
  if (n > 0x7fffffffull) [[unlikely]]
    throw InvalidArgument(fmt::format("{} on {}: a grid of {} indices does not fit the int32 index argument",
                                      name(), device_, n));
  const std::size_t count = buffers + values + (n > 1 ? 1 : 0);
  if (count > kMaxKernelArgs) [[unlikely]]
    throw InvalidArgument(fmt::format("{}: {} buffers and {} values{} is more than the {} arguments a CPU kernel "
                                      "call takes",
                                      name(), buffers, values, n > 1 ? " plus the grid index" : "", kMaxKernelArgs));
}

namespace {
struct GridCall {
  void* fn;
  const std::uint64_t* args;
  std::size_t count;
};
void run_grid(void* ctx, std::uint64_t begin, std::uint64_t end) {
  const auto& call = *static_cast<const GridCall*>(ctx);
  std::uint64_t args[kMaxKernelArgs];
  std::copy(call.args, call.args + call.count, args);
  for (std::uint64_t i = begin; i < end; ++i) {
    args[call.count] = static_cast<std::uint32_t>(i);
    kCallTable[call.count + 1](call.fn, args);
  }
}
}  // namespace

// Note [CPU grid ABI]
// A kernel launched with global size (x, y, z), N = x*y*z > 1, is called N times, with the linear
// index i = gx + x*(gy + y*gz) appended as one more int32 argument after the values; the calls are
// spread over CpuThreadPool in chunks and may run in any order and concurrently. N = 1 is one call
// without the index. The local size has no meaning on the CPU and is ignored.
void CpuProgram::launch(const std::uint64_t* args, std::size_t count, const Dim3& global) const {
  const std::uint64_t n = grid_size(global);
  if (n == 1) {
    kCallTable[count](fn_, args);
    return;
  }
  GridCall call{fn_, args, count};
  CpuThreadPool::global().parallel_for(n, &run_grid, &call);
}

std::optional<double> CpuProgram::operator()(std::span<const Allocation> buffers, std::span<const std::int32_t> values,
                                             const LaunchParams& params) {
  check_launch(buffers.size(), values.size(), params.global);
  if (ordering_) ordering_->before_direct_call();
  std::uint64_t args[kMaxKernelArgs];
  std::size_t n = 0;
  for (const Allocation& b : buffers) args[n++] = b.va_addr;
  for (std::int32_t v : values) args[n++] = static_cast<std::uint32_t>(v);
  const std::int64_t launched = GlobalCounters::kernel_count.fetch_add(1, std::memory_order_relaxed) + 1;
  if (!params.wait) [[likely]] {
    launch(args, n, params.global);
    debug_log(2, "*** {:<7} {:>6} {:<40} arg {:>3}", device_, launched, name(), n);
    return std::nullopt;
  }
  const std::uint64_t start = Profiler::now_ns();
  launch(args, n, params.global);
  const std::uint64_t end = Profiler::now_ns();
  const double seconds = static_cast<double>(end - start) / 1e9;
  GlobalCounters::time_sum.fetch_add(seconds, std::memory_order_relaxed);
  if (Profiler::global().enabled()) Profiler::global().add(ProfileEvent{name(), start, end, device_, "COMPUTE"});
  debug_log(2, "*** {:<7} {:>6} {:<40} arg {:>3} tm {:9.2f}us", device_, launched, name(), n, seconds * 1e6);
  return seconds;
}

// ---- ObjectRuntime --------------------------------------------------------------------------------

ObjectRuntime::ObjectRuntime(std::string device_name, CallOrdering* ordering) : impl_(std::make_shared<Impl>()) {
  init_llvm();
  impl_->device = std::move(device_name);
  impl_->ordering = ordering;
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
                                             std::span<const std::byte> wrapped) {
  const UnwrappedBlob unwrapped = unwrap_object(wrapped);
  const std::span<const std::byte> blob = unwrapped.object;
  const std::optional<KernelSignature> signature = unwrapped.signature_of(kernel_name);
  check_loadable(kernel_name, blob);
  std::vector<std::string> defined = elf_functions(blob).value_or(std::vector<std::string>{});
  if (defined.empty())
    throw InvalidArgument(fmt::format("{}: the blob for kernel '{}' ({} bytes) is an object file that "
                                      "defines no function: pass what compile() returned",
                                      impl_->device, quote_for_message(kernel_name), blob.size()));
  if (std::find(defined.begin(), defined.end(), kernel_name) == defined.end())
    throw InvalidArgument(fmt::format("{}: kernel '{}' is not in the compiled object, which defines "
                                      "{}: check the kernel name",
                                      impl_->device, quote_for_message(kernel_name),
                                      quote_for_message(fmt::format("{}", fmt::join(defined, ", ")), 400)));
#if defined(__x86_64__)
  // The fast path (Note [Two object loaders] in elf_loader.hpp); ORC below when it declines.
  ElfLoadResult fast = load_elf_x86_64(blob, kernel_name, &resolve_external);
  if (!fast.error.empty())
    throw InvalidArgument(fmt::format("{}: could not load kernel '{}': {}", impl_->device,
                                      quote_for_message(kernel_name), fast.error));
  if (fast.object) {
    void* fn = fast.object->entry;
    return std::make_shared<CpuProgram>(std::string(kernel_name), impl_->device,
                                        std::shared_ptr<void>(std::move(fast.object)), fn, signature,
                                        impl_->ordering);
  }
  debug_log(2, "tinydev: {}: the fast loader declined '{}' ({}); loading with ORC", impl_->device,
            kernel_name, fast.declined);
#endif
  return load_unwrapped_with_orc(kernel_name, unwrapped);
}

std::shared_ptr<Program> ObjectRuntime::load_with_orc(std::string_view kernel_name,
                                                      std::span<const std::byte> wrapped) {
  const UnwrappedBlob unwrapped = unwrap_object(wrapped);
  check_loadable(kernel_name, unwrapped.object);
  return load_unwrapped_with_orc(kernel_name, unwrapped);
}

void ObjectRuntime::check_loadable(std::string_view kernel_name, std::span<const std::byte> object) const {
  if (std::string why = check_elf_object(object, host_elf_machine()); !why.empty())
    throw InvalidArgument(fmt::format(
        "{}: the blob for kernel '{}' ({} bytes) is not a loadable object: {}; pass what this device's "
        "compile() returned",
        impl_->device, quote_for_message(kernel_name), object.size(), why));
}

std::shared_ptr<Program> ObjectRuntime::load_unwrapped_with_orc(std::string_view kernel_name,
                                                                const UnwrappedBlob& unwrapped) {
  // Note [No unwind tables for ORC] in elf_loader.cpp.
  const std::vector<std::byte> blob = without_unwind_tables(unwrapped.object);
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
  // The dylib's removal also needs the JIT alive: the deleter holds it.
  return std::make_shared<CpuProgram>(std::string(kernel_name), impl_->device, std::move(owner),
                                      addr->toPtr<void*>(), unwrapped.signature_of(kernel_name), impl_->ordering);
}

}  // namespace tinydev::cpu
