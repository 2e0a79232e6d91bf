// tinydev/config.hpp: the TINYDEV_* environment, read once and overridable in code.
//
// The environment is read on first use and parsed into an immutable Settings snapshot; every
// invalid value is an InvalidArgument naming the variable (never a silent default). Code can
// override any variable for a scope with ScopedOverride (tests, embedding servers); overrides are
// validated before they take effect.
//
// Thread safety: settings() is lock-free and may be called from any thread; the reference it
// returns stays valid for the life of the process (snapshots are never freed). Overrides are
// process-wide, so tests that use them must not run concurrently with code that expects the
// previous values. docs/environment.md lists every variable.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

struct Settings {
  std::string device;                           // TINYDEV_DEVICE, canonicalized; "" when unset
  int debug = 0;                                // TINYDEV_DEBUG, 0..7
  bool lru = true;                              // TINYDEV_LRU
  // TINYDEV_LRU_MAX_BYTES: the bound on each LRUAllocator's cache; nullopt = unset (each allocator
  // applies its default rule, Note [Default LRU bound] in src/memory.cpp); 0 = no bound.
  std::optional<std::uint64_t> lru_max_bytes;
  bool disable_compiler_cache = false;          // TINYDEV_DISABLE_COMPILER_CACHE
  bool assert_compile = false;                  // TINYDEV_ASSERT_COMPILE
  std::string cache_dir;                        // TINYDEV_CACHE_DIR, resolved; "" = no folder
  std::uint64_t cache_max_bytes = 1ull << 30;   // TINYDEV_CACHE_MAX_BYTES
  std::string profile;                          // TINYDEV_PROFILE: trace file written at exit
  std::uint64_t profile_max_events = 1'000'000; // TINYDEV_PROFILE_MAX_EVENTS: events kept; the rest counted
  int cpu_threads = 0;                          // TINYDEV_CPU_THREADS; 0 = the core count
  int compile_timeout_s = 300;                  // TINYDEV_COMPILE_TIMEOUT: a compiler subprocess's limit
  // TINYDEV_WAIT_TIMEOUT_MS: how long a host wait for device work lasts when the caller gives no
  // timeout (synchronize, copyout, Signal::wait, Event::wait, frees under running work), 1 ms to
  // one day. tinygrad's HCQDEV_WAIT_TIMEOUT_MS: raise it for kernels that run longer.
  int wait_timeout_ms = 30'000;
  std::string cuda_driver;                      // TINYDEV_CUDA_DRIVER: the driver library; "" = libcuda.so.1
  std::string cuda_nvrtc;                       // TINYDEV_CUDA_NVRTC: the NVRTC library; "" = 13 or 12 by the driver and GPUs
  bool cuda_ptx = false;                        // TINYDEV_CUDA_PTX: compile CUDA to PTX (driver JIT), not CUBIN
  bool fatal_signal_messages = true;            // TINYDEV_FATAL_SIGNALS: name the kernel a fatal signal hit
  bool disk_io_uring = true;                    // TINYDEV_DISK_IO: auto (io_uring, else pread) or pread
};

namespace detail {
// The published snapshot (Note [Settings snapshots] in src/config.cpp): nullptr until the first
// snapshot is published (the first settings(), ScopedOverride or reload_environment()). Constant-
// initialized and never destroyed, so static constructors and destructors may read it. Written
// only by src/config.cpp.
extern constinit std::atomic<const Settings*> current_settings;
// settings()'s first call: reads the environment and publishes the snapshot (or throws).
const Settings& load_settings();
// default_wait_timeout()'s first call: load_settings(), or 30 s where that throws.
std::chrono::milliseconds load_wait_timeout() noexcept;
}  // namespace detail

// The current settings (environment + active overrides). Throws InvalidArgument on the first call
// if the environment holds an invalid value. Inline because hot paths (every LRU alloc and free)
// read it: once the environment was read it is one atomic load.
inline const Settings& settings() {
  if (const Settings* current = detail::current_settings.load(std::memory_order_acquire)) return *current;
  return detail::load_settings();
}

// TINYDEV_WAIT_TIMEOUT_MS as a duration: the default of every `timeout` parameter of a wait for
// device work, read at each call (so a ScopedOverride or reload_environment() applies to the next
// wait). Never throws, so destructors and frees may call it: before any snapshot could be
// published (an invalid environment, which the first settings() call reports) it is 30 s.
inline std::chrono::milliseconds default_wait_timeout() noexcept {
  if (const Settings* current = detail::current_settings.load(std::memory_order_acquire))
    return std::chrono::milliseconds(current->wait_timeout_ms);
  return detail::load_wait_timeout();
}

// The names of every variable tinydev reads.
std::vector<std::string_view> known_variables();

// The known variable nearest to `name` by edit distance (for "did you mean" messages).
std::string_view closest_known_variable(std::string_view name);

// Re-reads the process environment (after setenv in a test or a launcher). Overrides stay active.
void reload_environment();

// Overrides one variable until destruction; std::nullopt means "as if unset". Throws
// InvalidArgument for an unknown variable or an invalid value, leaving the settings unchanged.
// Overrides must be destroyed in reverse order of creation (they are scoped objects).
class ScopedOverride {
 public:
  ScopedOverride(std::string_view variable, std::optional<std::string> value);
  ~ScopedOverride();
  ScopedOverride(const ScopedOverride&) = delete;
  ScopedOverride& operator=(const ScopedOverride&) = delete;

 private:
  std::string variable_;
  bool had_previous_;
  std::optional<std::string> previous_;
};

// Parses "123", "64K", "512M", "1G" (binary multiples) as bytes; throws InvalidArgument naming
// `what` on anything else.
std::uint64_t parse_byte_count(std::string_view text, std::string_view what);

namespace detail {
// Parses `values` (variable name -> value) as if they were the whole TINYDEV_* environment,
// changing no process state (XDG_CACHE_HOME and HOME are still read for the default cache folder):
// for tools and the settings fuzzer. Throws InvalidArgument as settings() does.
Settings parse_settings(const std::map<std::string, std::string, std::less<>>& values);
}  // namespace detail

}  // namespace tinydev

TINYDEV_API_END
