// backends/cpu/cpu_runtime.hpp: what the two CPU backends (LLVM, CLANG) share. Internal header:
// no LLVM types appear here, so the backends' device code compiles without LLVM's headers.
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

namespace tinydev::cpu {

struct HostTarget {
  std::string triple;
  std::string cpu;
  std::string features;  // "+avx2,+fma,..." as LLVM spells them
};
const HostTarget& host_target();

class ObjectRuntime final : public Runtime {
 public:
  explicit ObjectRuntime(std::string device_name);
  ~ObjectRuntime() override;
  std::shared_ptr<Program> load(std::string_view kernel_name, std::span<const std::byte> blob) override;
  // The general path: ORC's JITLink (any object LLVM links, on any host). load() uses it when the
  // fast ELF loader declines; public so tests can compare the two.
  std::shared_ptr<Program> load_with_orc(std::string_view kernel_name, std::span<const std::byte> blob);

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// The names of the global functions an object file defines (for error messages and tools).
std::vector<std::string> object_functions(std::span<const std::byte> blob);

// The most arguments (buffers + values) a CPU kernel call takes.
inline constexpr std::size_t kMaxKernelArgs = 64;

// Calls `fn` with `count` 64-bit integer-class arguments. On x86-64 and AArch64 SysV every pointer
// and int32 argument travels in its own 64-bit register or stack slot, so a call through this
// signature matches `void fn(T* ..., int32_t ...)` (Note [CPU kernel calls] in cpu_runtime.cpp).
void call_with_args(void* fn, const std::uint64_t* args, std::size_t count);

// The CPU devices' properties (target triple, cpu, features) for `tinydev devices`.
std::map<std::string, std::string> host_properties();

}  // namespace tinydev::cpu
