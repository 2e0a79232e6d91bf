#include "cpu_program.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <utility>

#include "fatal_signals.hpp"
#include "thread_pool.hpp"
#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/error.hpp"
#include "tinydev/profile.hpp"

namespace tinydev::cpu {

namespace {

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
  try {
    check_launch(buffers.size(), values.size(), params.global);
    if (ordering_) ordering_->before_direct_call();
  } catch (Error& e) {
    e.add_context(device_, name());
    throw;
  }
  std::uint64_t args[kMaxKernelArgs];
  std::size_t n = 0;
  for (const Allocation& b : buffers) args[n++] = b.va_addr;
  for (std::int32_t v : values) args[n++] = static_cast<std::uint32_t>(v);
  const std::int64_t launched = GlobalCounters::kernel_count.fetch_add(1, std::memory_order_relaxed) + 1;
  RunningKernel running{name().c_str(), device_.c_str(), "a direct call"};  // Note [Fatal signals in kernels]
  RunningKernelScope scope(&running);
  if (!params.wait) [[likely]] {
    // A direct call runs on the caller's thread: with profiling on it is timed and traced whether
    // or not the caller waits for the time (the trace must show eager work too).
    const bool profiling = Profiler::global().enabled();
    const std::uint64_t start = profiling ? Profiler::now_ns() : 0;
    launch(args, n, params.global);
    if (profiling) Profiler::global().add(ProfileEvent{name(), start, Profiler::now_ns(), device_, "COMPUTE"});
    debug_log(2, device_, "*** {:<7} {:>6} {:<40} arg {:>3}", device_, launched, name(), n);
    return std::nullopt;
  }
  const std::uint64_t start = Profiler::now_ns();
  launch(args, n, params.global);
  const std::uint64_t end = Profiler::now_ns();
  const double seconds = static_cast<double>(end - start) / 1e9;
  GlobalCounters::time_sum.fetch_add(seconds, std::memory_order_relaxed);
  if (Profiler::global().enabled()) Profiler::global().add(ProfileEvent{name(), start, end, device_, "COMPUTE"});
  debug_log(2, device_, "*** {:<7} {:>6} {:<40} arg {:>3} tm {:9.2f}us", device_, launched, name(), n, seconds * 1e6);
  return seconds;
}
}  // namespace tinydev::cpu
