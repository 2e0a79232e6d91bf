// tinydev/compile.hpp: compilers, the on-disk compile cache and loaded programs (layer 4).
//
// A Compiler turns source text into a binary blob (object code, cubin); `compile_cached` puts the
// on-disk cache (DiskCache) in front of it. A Runtime loads a blob and looks a kernel up by name,
// giving a Program, which launches it on buffers and integer values.
//
// Thread safety: Compiler::compile_cached, DiskCache and Runtime::load may be called concurrently.
// A Program may be called from any thread; concurrent calls of one Program run concurrently.
// Ownership: a Program keeps what it loaded alive until its last shared_ptr goes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tinydev/memory.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

using Blob = std::vector<std::byte>;

// The source language a device's compiler takes (the seed's renderer slot): what a framework's
// code generator must emit for it.
enum class SourceLanguage {
  None,     // the device compiles nothing (DISK)
  LLVMIR,   // LLVM IR text (opaque pointers), kernel ABI in docs/kernel-abi.md
  C,        // C (clang's default dialect), compiled freestanding
  CUDA,     // CUDA C++ for NVRTC
};
std::string_view to_string(SourceLanguage language) noexcept;

// The on-disk cache: one verified file per entry, published atomically, bounded in bytes.
// See docs/compile-cache.md and Note [Cache entry format] in src/disk_cache.cpp.
class DiskCache {
 public:
  struct Stats {
    std::uint64_t memory_hits = 0, disk_hits = 0, misses = 0, corrupt = 0, writes = 0,
                  write_failures = 0, evictions = 0;
    // Folders not used and entries not loaded because another user could have written them
    // (Note [Cache trust] in src/disk_cache.cpp): the process then caches in memory only / misses.
    std::uint64_t rejected_folders = 0, rejected_entries = 0;
    // Full scans of the folder for the size bound (the first write, then only past the bound).
    std::uint64_t scans = 0;
  };

  // The process-wide cache in settings().cache_dir.
  static DiskCache& global();

  // `key` is the compiler's cache key, `identity` the compiler's identity and version.
  std::optional<Blob> get(std::string_view key, std::string_view identity, std::string_view source);
  void put(std::string_view key, std::string_view identity, std::string_view source,
           std::span<const std::byte> blob);

  // The folder in use, or "" when the cache works in memory only (no usable folder).
  std::string folder();
  // Forgets the in-process layer (the next get reads the disk): for benchmarks and tests.
  void drop_memory_layer();
  Stats stats() const;
  // The entry file for a key (whether or not it exists): for tests and tools.
  std::string entry_path(std::string_view key, std::string_view identity, std::string_view source);

 private:
  struct Impl;
  DiskCache();
  ~DiskCache();
  Impl* impl_;
};

namespace detail {
enum class CacheEntryCheck { ok, corrupt, other_key };
// Verifies the bytes of one cache entry file against the full key it should hold (Note [Cache
// entry format]); on `ok`, `blob` is the stored blob inside `file`. Pure; for the cache and its fuzzer.
CacheEntryCheck check_cache_entry(std::span<const std::byte> file, std::string_view full_key,
                                  std::span<const std::byte>& blob);
// The full key of an entry ("tinydev-cache-v1" NUL key NUL identity NUL source).
std::string cache_full_key(std::string_view key, std::string_view identity, std::string_view source);
}  // namespace detail

// The seed's Compiler. `cache_key` names the compiler family ("compile_llvm"); a nullopt key
// never caches. TINYDEV_DISABLE_COMPILER_CACHE=1 bypasses the cache; TINYDEV_ASSERT_COMPILE=1
// makes any real compile a CompileError naming the source.
class Compiler {
 public:
  explicit Compiler(std::optional<std::string> cache_key = std::nullopt)
      : cache_key_(std::move(cache_key)) {}
  virtual ~Compiler() = default;

  // Compiles for real. Throws CompileError carrying the compiler's log.
  virtual Blob compile(std::string_view source);
  // Everything besides the source that changes the output (compiler version, target, flags).
  virtual std::string identity() const { return "none"; }

  Blob compile_cached(std::string_view source);
  const std::optional<std::string>& cache_key() const noexcept { return cache_key_; }

 private:
  std::optional<std::string> cache_key_;
};

// A launch's size in three dimensions (x, y, z).
using Dim3 = std::array<std::uint32_t, 3>;

// Launch geometry and options for a Program call.
struct LaunchParams {
  Dim3 global{1, 1, 1};
  Dim3 local{1, 1, 1};
  bool wait = false;  // block until the kernel finished and return its time in seconds
};

// How many buffers and int32 values a kernel's parameter list has, where the compiler (or the
// driver) could tell. A CPU kernel meant for grid launches counts its index parameter among the
// values (it is the last); a GPU kernel reads its index from the hardware (grid_index false).
struct KernelSignature {
  std::uint32_t num_buffers = 0;
  std::uint32_t num_values = 0;
  bool grid_index = true;  // a grid launch passes the instance index as one more value
  friend bool operator==(const KernelSignature&, const KernelSignature&) = default;
  // Whether a launch with these counts fits; `grid` launches pass the index as one more value
  // where the kernel takes it.
  bool accepts(std::size_t buffers, std::size_t values, bool grid) const noexcept {
    return buffers == num_buffers && values + (grid && grid_index ? 1 : 0) == num_values;
  }
  // Whether the counts fit with or without a grid (before the grid is known).
  bool accepts_either(std::size_t buffers, std::size_t values) const noexcept {
    return accepts(buffers, values, false) || accepts(buffers, values, true);
  }
};

// How many kernel instances a launch of this global size runs (x * y * z).
constexpr std::uint64_t grid_size(const Dim3& global) noexcept {
  return std::uint64_t{global[0]} * global[1] * global[2];
}

// A loaded kernel. Kernel ABI: `void name(T* buf0, ..., int32_t val0, ...)`.
class Program {
 public:
  virtual ~Program() = default;
  const std::string& name() const noexcept { return name_; }

  // Launches on `buffers` (allocations of this program's device) and `values`. Returns the
  // kernel's seconds when params.wait, else nullopt.
  virtual std::optional<double> operator()(std::span<const Allocation> buffers,
                                           std::span<const std::int32_t> values = {},
                                           const LaunchParams& params = {}) = 0;

  // The kernel's argument counts when known (calls and kernargs with other counts are rejected);
  // nullopt when the compiler could not tell (then the caller is trusted).
  virtual std::optional<KernelSignature> signature() const noexcept { return std::nullopt; }

 protected:
  explicit Program(std::string name) : name_(std::move(name)) {}

 private:
  std::string name_;
};

// Loads compiled blobs into Programs (the seed's `runtime(name, lib)`).
class Runtime {
 public:
  virtual ~Runtime() = default;
  // Throws InvalidArgument naming the kernel when the blob has no such symbol.
  virtual std::shared_ptr<Program> load(std::string_view kernel_name,
                                        std::span<const std::byte> blob) = 0;
};

}  // namespace tinydev

TINYDEV_API_END
