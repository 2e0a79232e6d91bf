// include/tinydev/cpu/elf_loader.hpp: a small loader for x86-64 ELF relocatable objects, the fast path of
// the CPU backends' ObjectRuntime (installed with the CPU headers; few users need it directly).
//
// Note [Two object loaders]
// ORC's JITLink loads any object LLVM can link, on any host, but spends ~100-250 us per object
// (dylib set-up, graph building, per-link memory mapping). Kernels are small, self-contained
// objects with a handful of relocation kinds, so on x86-64 this loader places the allocatable
// sections in one mapping, builds a GOT and call stubs for external symbols, applies the
// relocations and seals the code read+execute: a few microseconds. A well-formed object it does not
// handle (an unknown relocation kind, initializers, TLS, common symbols, a reference out of 32-bit
// range) makes it decline with a reason, and ObjectRuntime hands it to its ObjectLinker: ORC's
// JITLink (backends/llvm/orc_linker.hpp) in builds with LLVM. A build without LLVM has no linker,
// and such an object is an InvalidArgument that says so.
//
// Note [Object validation]
// Blobs come from outside the process (the compile cache, a caller), and neither loader may crash,
// hang or allocate without bound on any input. So every blob passes check_elf_object first: the
// header, the section table and every section's bytes in bounds, sane alignments, string tables
// NUL-terminated, one symbol table whose symbols point into their sections, relocation tables
// whose entries name real symbols (never the null symbol) and stay inside their target sections
// with a known relocation kind, group sections naming real sections, and a bounded loaded size. A blob that fails is an
// InvalidArgument saying what is wrong; ORC only ever sees objects that passed (the fuzzers in
// tests/fuzz/ run both loaders on mutated objects).
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
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::cpu {

// The most bytes the allocatable sections of one object may take once loaded (code, data, bss).
inline constexpr std::uint64_t kMaxLoadedObjectBytes = 256ull << 20;

// Why `blob` is not a well-formed ELF64 little-endian relocatable object for `machine` (EM_X86_64,
// EM_AARCH64) that the CPU loaders can take (Note [Object validation]), or "" when it is one.
std::string check_elf_object(std::span<const std::byte> blob, std::uint16_t machine);

// A copy of a checked object whose unwind tables (.eh_frame, SHT_X86_64_UNWIND) are no longer
// marked to be loaded, so a linker leaves them out (Note [No unwind tables for ORC]).
std::vector<std::byte> without_unwind_tables(std::span<const std::byte> checked_object);

// The ELF machine of this host (EM_X86_64 or EM_AARCH64).
std::uint16_t host_elf_machine() noexcept;

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
  std::string declined;                  // a well-formed object the fast path cannot load (then use ORC)
  std::string error;                     // a malformed object or a real error (an undefined symbol): report it
};

// Checks `blob` with check_elf_object, loads it and finds `function`. Exactly one of object /
// declined / error is set.
ElfLoadResult load_elf_x86_64(std::span<const std::byte> blob, std::string_view function,
                              const SymbolResolver& resolve);

}  // namespace tinydev::cpu

TINYDEV_API_END
