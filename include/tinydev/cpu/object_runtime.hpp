// include/tinydev/cpu/object_runtime.hpp: the runtime of the
// CPU backends, which loads relocatable objects (ELF, as their compilers return them) and hands
// out CpuPrograms. Includes and links no LLVM.
//
//  - Every blob is validated first (Note [Object validation] in elf_loader.hpp).
//  - On x86-64 the fast ELF loader (elf_loader.hpp) loads it in microseconds. An object it
//    declines (initializers, TLS, an unknown relocation kind), and every object on other hosts,
//    goes to the runtime's ObjectLinker when it has one: ORC's JITLink, in backends/llvm
//    (Note [Two object loaders]). A build without LLVM has no linker, and such objects are errors
//    that say why.
//  - Each load gets its own memory, so programs with the same kernel name coexist and each is freed
//    when its last Program handle goes. Undefined symbols resolve to the half/bfloat16 conversion
//    helpers (cpu_helpers.cpp), then to the process (libm, libc).
//
// Thread safety: load() and Program calls may run concurrently from any threads.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "cpu_program.hpp"
#include "tinydev/compile.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::cpu {

struct UnwrappedBlob;  // cpu_blob.hpp

// Where kernels' undefined symbols go: the conversion helpers first (by their compiler-rt names,
// "__truncsfhf2"), then the process (dlsym). nullptr when nothing defines `name`.
void* resolve_external(std::string_view name);
// The conversion helpers, for linkers that define them up front: name and address.
std::span<const std::pair<const char*, void*>> kernel_helpers() noexcept;

// A general object linker, for what the fast ELF loader declines. Implementations: ORC's JITLink
// (backends/llvm/orc_linker.hpp).
class ObjectLinker {
 public:
  virtual ~ObjectLinker() = default;
  struct Linked {
    std::shared_ptr<void> owner;  // keeps the code mapped; the code goes with the last copy
    void* function = nullptr;
  };
  // Links a validated object (check_elf_object passed) and returns `function` in it. Throws
  // InvalidArgument saying why (an undefined symbol, a link error).
  virtual Linked link(std::string_view function, std::span<const std::byte> checked_object) = 0;
  // "ORC JITLink (LLVM 19.1.7)": for properties and messages.
  virtual std::string describe() const = 0;
};

class ObjectRuntime final : public Runtime {
 public:
  // `ordering` (may be null) is told before each direct Program call; `linker` (may be null) takes
  // the objects the fast loader declines. Throws DeviceUnavailable on a host without the fast
  // loader when no linker is given.
  ObjectRuntime(std::string device_name, CallOrdering* ordering, std::shared_ptr<ObjectLinker> linker);
  // Throws InvalidArgument saying what is wrong for a blob that is not a well-formed object for
  // this host (Note [Object validation] in elf_loader.hpp), or that lacks the kernel.
  std::shared_ptr<Program> load(std::string_view kernel_name, std::span<const std::byte> blob) override;
  // The general path only (the linker), after the same validation; InvalidArgument without a
  // linker. For tests and fuzzers that compare the two loaders.
  std::shared_ptr<Program> load_with_linker(std::string_view kernel_name, std::span<const std::byte> blob);

  const std::shared_ptr<ObjectLinker>& linker() const noexcept { return linker_; }
  // "fast ELF loader, then ORC JITLink (LLVM 19.1.7)" or "fast ELF loader only (built without LLVM)".
  std::string describe() const;

 private:
  std::shared_ptr<Program> link(std::string_view kernel_name, const UnwrappedBlob& unwrapped);
  void check_loadable(std::string_view kernel_name, std::span<const std::byte> object) const;
  std::string device_;
  CallOrdering* ordering_;
  std::shared_ptr<ObjectLinker> linker_;
};

}  // namespace tinydev::cpu

TINYDEV_API_END
