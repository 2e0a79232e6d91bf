// backends/cpu/cpu_runtime.hpp (installed as <tinydev/cpu/cpu_runtime.hpp>): what the two CPU
// backends (LLVM, CLANG) share. Public for CpuProgram and the thread pool; // no LLVM types appear here, so the backends' device code compiles without LLVM's headers.
//
//  - ObjectRuntime loads relocatable object files (ELF, as `compile` returns) and hands out
//    Programs: with the fast ELF loader on x86-64, else (or when it declines) with ORC's JITLink
//    (Note [Two object loaders] in elf_loader.hpp). Each load gets its own memory (a mapping, or
//    an ORC dylib), so programs with the same kernel name coexist and each is freed when its last
//    Program handle goes. Undefined symbols resolve to the
//    half/bfloat16 conversion helpers (cpu_helpers.cpp), then to the process (libm, libc).
//  - host_target(): the host's triple, CPU name and feature string, detected once.
//
// Thread safety: load() and Program calls may run concurrently from any threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tinydev/compile.hpp"
#include "tinydev/hcq.hpp"

namespace tinydev::cpu {

struct UnwrappedBlob;  // cpu_blob.hpp

// Worker threads for kernels launched with a global size N > 1 (Note [CPU grid ABI]), shared by
// every CPU device: TINYDEV_CPU_THREADS threads in all, the caller counting as one. One grid runs
// at a time; concurrent callers queue.
class CpuThreadPool {
 public:
  static CpuThreadPool& global();
  std::size_t threads() const noexcept { return threads_; }
  // Calls fn(begin, end) over [0, n) in chunks, on the pool and the calling thread; returns when
  // every index ran. fn must not throw.
  void parallel_for(std::uint64_t n, void (*fn)(void* ctx, std::uint64_t begin, std::uint64_t end), void* ctx);

 private:
  explicit CpuThreadPool(std::size_t threads);
  struct Impl;
  std::size_t threads_;
  Impl* impl_;
};

// Lets a device order direct Program calls after its queued work.
class CallOrdering {
 public:
  virtual void before_direct_call() = 0;

 protected:
  ~CallOrdering() = default;
};

struct HostTarget {
  std::string triple;
  std::string cpu;
  std::string features;  // "+avx2,+fma,..." as LLVM spells them
};
const HostTarget& host_target();

// A loaded CPU kernel. Direct calls (operator()) run on the caller's thread once the device's
// queued work finished; queues launch it on their workers through launch().
class CpuProgram final : public Program {
 public:
  CpuProgram(std::string name, std::string device, std::shared_ptr<void> code, void* fn,
             std::optional<KernelSignature> signature, CallOrdering* ordering);

  std::optional<double> operator()(std::span<const Allocation> buffers, std::span<const std::int32_t> values = {},
                                   const LaunchParams& params = {}) override;
  void* host_function() const noexcept override { return fn_; }
  std::optional<KernelSignature> signature() const noexcept override { return signature_; }
  const std::string& device() const noexcept { return device_; }

  // Throws InvalidArgument when these counts and grid cannot be launched.
  void check_launch(std::size_t buffers, std::size_t values, const Dim3& global) const;
  // Runs the kernel on `count` packed arguments, once per grid index (Note [CPU grid ABI]).
  void launch(const std::uint64_t* args, std::size_t count, const Dim3& global) const;

 private:
  std::string device_;
  std::shared_ptr<void> code_;  // owns the memory fn_ lives in
  void* fn_;
  std::optional<KernelSignature> signature_;
  CallOrdering* ordering_;
};

class ObjectRuntime final : public Runtime {
 public:
  explicit ObjectRuntime(std::string device_name, CallOrdering* ordering = nullptr);
  ~ObjectRuntime() override;
  // Throws InvalidArgument saying what is wrong for a blob that is not a well-formed object for
  // this host (Note [Object validation] in elf_loader.hpp), or that lacks the kernel.
  std::shared_ptr<Program> load(std::string_view kernel_name, std::span<const std::byte> blob) override;
  // The general path: ORC's JITLink (any object LLVM links, on any host). load() uses it when the
  // fast ELF loader declines a well-formed object; public so tests can compare the two. The same
  // validation runs first.
  std::shared_ptr<Program> load_with_orc(std::string_view kernel_name, std::span<const std::byte> blob);

  struct Impl;

 private:
  std::shared_ptr<Program> load_unwrapped_with_orc(std::string_view kernel_name, const UnwrappedBlob& unwrapped);
  void check_loadable(std::string_view kernel_name, std::span<const std::byte> object) const;
  std::shared_ptr<Impl> impl_;
};

// The most arguments (buffers + values, + the grid index) a CPU kernel call takes.
inline constexpr std::size_t kMaxKernelArgs = 64;

// The CPU devices' properties (target triple, cpu, features) for `tinydev devices`.
std::map<std::string, std::string> host_properties();

}  // namespace tinydev::cpu
