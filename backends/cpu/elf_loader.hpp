// backends/cpu/elf_loader.hpp: a small loader for x86-64 ELF relocatable objects, the fast path of
// the CPU backends' ObjectRuntime (installed with the CPU headers; few users need it directly).
//
// Note [Two object loaders]
// ORC's JITLink loads any object LLVM can link, on any host, but spends ~100-250 us per object
// (dylib set-up, graph building, per-link memory mapping). Kernels are small, self-contained
// objects with a handful of relocation kinds, so on x86-64 this loader places the allocatable
// sections in one mapping, builds a GOT and call stubs for external symbols, applies the
// relocations and seals the code read+execute: a few microseconds. Anything it does not handle
// (another machine, an unknown relocation, initializers, common symbols) makes it decline with a
// reason, and ObjectRuntime falls back to ORC, so the set of loadable objects is ORC's.
//
// Thread safety: the functions here are reentrant. A LoadedObject is immutable after loading.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tinydev::cpu {

// The global function symbols an ELF64 object defines, or nullopt when `blob` is not a
// little-endian ELF64 relocatable object.
std::optional<std::vector<std::string>> elf_functions(std::span<const std::byte> blob);

// Executable memory holding one loaded object. Unmapped on destruction.
class LoadedObject {
 public:
  LoadedObject(void* base, std::size_t size) : base_(base), size_(size) {}
  ~LoadedObject();
  LoadedObject(const LoadedObject&) = delete;
  LoadedObject& operator=(const LoadedObject&) = delete;
  void* entry = nullptr;  // the requested function

 private:
  void* base_;
  std::size_t size_;
};

// Returns an external symbol's address, or nullptr when nothing defines it.
using SymbolResolver = std::function<void*(std::string_view name)>;

struct ElfLoadResult {
  std::unique_ptr<LoadedObject> object;  // set on success
  std::string declined;                  // why the fast path cannot load it (then use ORC)
  std::string error;                     // a real error (e.g. an undefined symbol): report it
};

// Loads `blob` and finds `function`. Exactly one of object / declined / error is set.
ElfLoadResult load_elf_x86_64(std::span<const std::byte> blob, std::string_view function,
                              const SymbolResolver& resolve);

}  // namespace tinydev::cpu
