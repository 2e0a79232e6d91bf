#include "tinydev/config.hpp"
#include "tinydev/log.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <type_traits>
#include <atomic>
#include <charconv>
#include <cstdlib>
#include <map>
#include <set>
#include <memory>
#include <mutex>

#include "tinydev/counters.hpp"
#include "tinydev/error.hpp"
#include "tinydev/registry.hpp"

extern char** environ;

namespace tinydev {

namespace {

constexpr std::string_view kVariables[] = {
    "TINYDEV_DEVICE",         "TINYDEV_DEBUG",           "TINYDEV_LRU",
    "TINYDEV_LRU_MAX_BYTES",  "TINYDEV_DISABLE_COMPILER_CACHE",
    "TINYDEV_ASSERT_COMPILE", "TINYDEV_CACHE_DIR",       "TINYDEV_CACHE_MAX_BYTES",
    "TINYDEV_PROFILE",        "TINYDEV_CPU_THREADS",     "TINYDEV_FATAL_SIGNALS",     "TINYDEV_COMPILE_TIMEOUT",
    "TINYDEV_CUDA_DRIVER",    "TINYDEV_CUDA_PTX",        "TINYDEV_DISK_IO",           "TINYDEV_PROFILE_MAX_EVENTS",
    "TINYDEV_CUDA_NVRTC",     "TINYDEV_WAIT_TIMEOUT_MS",
};
constexpr std::string_view kPrefix = "TINYDEV_";

using RawValues = std::map<std::string, std::optional<std::string>, std::less<>>;

// Note [Settings snapshots]
// Readers are on hot paths (every LRU alloc and free calls settings()), so they take no lock:
// they load one atomic pointer to an immutable snapshot (detail::current_settings, read inline by
// settings()). Writers (first use, overrides, reload) build a new snapshot under the mutex and
// publish it. Old snapshots are kept alive forever so a reference a reader still holds never
// dangles; there are only as many as there were overrides.
struct State {
  std::mutex mutex;
  bool loaded = false;
  RawValues environment;  // as read from the process environment
  RawValues overrides;    // active ScopedOverride values (nullopt = forced unset)
  std::vector<std::unique_ptr<Settings>> snapshots;
  std::set<std::string, std::less<>> warned_unknown;  // unknown TINYDEV_* names already reported
  std::vector<std::string> pending_warnings;          // logged once the mutex is released
};

State& state() {
  // Never destroyed: exit handlers (the profile writer) and other static destructors read settings.
  static State* s = new State;
  return *s;
}

bool parse_flag(std::string_view var, const std::string& v) {
  if (v == "0") return false;
  if (v == "1") return true;
  throw InvalidArgument(fmt::format("{}='{}' is not a valid flag: set it to 0 or 1", var, quote_for_message(v)));
}

int parse_int(std::string_view var, const std::string& v, int lo, int hi) {
  int out = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || p != v.data() + v.size() || out < lo || out > hi)
    throw InvalidArgument(
        fmt::format("{}='{}' is not valid: set it to an integer from {} to {}", var, quote_for_message(v), lo, hi));
  return out;
}

std::optional<std::string> lookup(const State& s, std::string_view var) {
  if (auto it = s.overrides.find(var); it != s.overrides.end()) return it->second;
  if (auto it = s.environment.find(var); it != s.environment.end()) return it->second;
  return std::nullopt;
}

// A path setting: any bytes but NUL and control characters, which a C path would truncate at (NUL)
// or which no sane file name has; either way a silent change of meaning.
std::string parse_path(std::string_view var, const std::string& v) {
  if (has_control_characters(v))
    throw InvalidArgument(fmt::format(
        "{}='{}' holds a NUL or control character: set it to a plain path", var, quote_for_message(v)));
  return v;
}

template <class Get>
Settings parse_with(Get get) {
  Settings out;
  if (auto v = get("TINYDEV_DEVICE"); v && !v->empty()) {
    try {
      out.device = canonicalize(*v);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("TINYDEV_DEVICE is not a device name: {}", e.what()));
    }
  }
  if (auto v = get("TINYDEV_DEBUG"); v && !v->empty()) out.debug = parse_int("TINYDEV_DEBUG", *v, 0, 7);
  if (auto v = get("TINYDEV_LRU"); v && !v->empty()) out.lru = parse_flag("TINYDEV_LRU", *v);
  if (auto v = get("TINYDEV_LRU_MAX_BYTES"); v && !v->empty())
    out.lru_max_bytes = parse_byte_count(*v, "TINYDEV_LRU_MAX_BYTES");
  if (auto v = get("TINYDEV_DISABLE_COMPILER_CACHE"); v && !v->empty())
    out.disable_compiler_cache = parse_flag("TINYDEV_DISABLE_COMPILER_CACHE", *v);
  if (auto v = get("TINYDEV_ASSERT_COMPILE"); v && !v->empty())
    out.assert_compile = parse_flag("TINYDEV_ASSERT_COMPILE", *v);
  if (auto v = get("TINYDEV_CACHE_MAX_BYTES"); v && !v->empty())
    out.cache_max_bytes = parse_byte_count(*v, "TINYDEV_CACHE_MAX_BYTES");
  if (auto v = get("TINYDEV_PROFILE"); v && !v->empty()) out.profile = parse_path("TINYDEV_PROFILE", *v);
  if (auto v = get("TINYDEV_PROFILE_MAX_EVENTS"); v && !v->empty())
    out.profile_max_events = static_cast<std::uint64_t>(parse_int("TINYDEV_PROFILE_MAX_EVENTS", *v, 1, 1'000'000'000));
  if (auto v = get("TINYDEV_CPU_THREADS"); v && !v->empty())
    out.cpu_threads = parse_int("TINYDEV_CPU_THREADS", *v, 1, 1024);
  if (auto v = get("TINYDEV_COMPILE_TIMEOUT"); v && !v->empty())
    out.compile_timeout_s = parse_int("TINYDEV_COMPILE_TIMEOUT", *v, 1, 86400);
  if (auto v = get("TINYDEV_WAIT_TIMEOUT_MS"); v && !v->empty())
    out.wait_timeout_ms = parse_int("TINYDEV_WAIT_TIMEOUT_MS", *v, 1, 86'400'000);
  if (auto v = get("TINYDEV_CUDA_DRIVER"); v && !v->empty())
    out.cuda_driver = parse_path("TINYDEV_CUDA_DRIVER", *v);
  if (auto v = get("TINYDEV_CUDA_NVRTC"); v && !v->empty())
    out.cuda_nvrtc = parse_path("TINYDEV_CUDA_NVRTC", *v);
  if (auto v = get("TINYDEV_CUDA_PTX"); v && !v->empty()) out.cuda_ptx = parse_flag("TINYDEV_CUDA_PTX", *v);
  if (auto v = get("TINYDEV_FATAL_SIGNALS"); v && !v->empty())
    out.fatal_signal_messages = parse_flag("TINYDEV_FATAL_SIGNALS", *v);
  if (auto v = get("TINYDEV_DISK_IO"); v && !v->empty()) {
    if (*v == "auto") out.disk_io_uring = true;
    else if (*v == "pread") out.disk_io_uring = false;
    else
      throw InvalidArgument(fmt::format("TINYDEV_DISK_IO is {}; expected auto (io_uring where the kernel allows it, "
                                        "else pread) or pread (never io_uring)",
                                        quote_for_message(*v)));
  }
  if (auto v = get("TINYDEV_CACHE_DIR"); v && !v->empty()) {
    out.cache_dir = parse_path("TINYDEV_CACHE_DIR", *v);
  } else {
    // XDG_CACHE_HOME and HOME are not ours to override: read from the environment whenever a
    // snapshot is built (first use, overrides, reload_environment).
    const char* xdg = std::getenv("XDG_CACHE_HOME");
    const char* home = std::getenv("HOME");
    if (xdg && *xdg) out.cache_dir = std::string(xdg) + "/tinydev";
    else if (home && *home) out.cache_dir = std::string(home) + "/.cache/tinydev";
  }
  return out;
}

Settings parse(const State& s) {
  return parse_with([&](std::string_view var) { return lookup(s, var); });
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// Note [Unknown variables]
// A typo (TINYDEV_DEBGU=1) would otherwise be ignored without a word. Every TINYDEV_* name in the
// environment that tinydev does not read gets one warning line on stderr, once per process per
// name, naming the closest known variable. It is a warning, not an error: a newer tinydev's
// variable in a shared environment must not stop an older one from running.
void warn_unknown(State& s) {
  for (char** e = environ; e && *e; ++e) {
    std::string_view entry(*e);
    if (!entry.starts_with(kPrefix)) continue;
    std::string_view name = entry.substr(0, entry.find('='));
    if (std::find(std::begin(kVariables), std::end(kVariables), name) != std::end(kVariables)) continue;
    if (!s.warned_unknown.emplace(name).second) continue;
    s.pending_warnings.push_back(fmt::format("{} is not a tinydev variable and is ignored; did you mean {}?",
                                             quote_for_message(name), closest_known_variable(name)));
  }
}

void read_environment(State& s) {
  s.environment.clear();
  for (std::string_view var : kVariables) {
    const char* v = std::getenv(std::string(var).c_str());
    if (v) s.environment[std::string(var)] = std::string(v);
  }
  s.loaded = true;
  warn_unknown(s);
}

// Logs what read_environment queued, outside the mutex (a log sink may read settings). Declared
// before the caller's lock_guard, so it runs after the lock is released.
struct LogWarningsAfterUnlock {
  State& s;
  ~LogWarningsAfterUnlock() {
    std::vector<std::string> pending;
    {
      std::lock_guard lock(s.mutex);
      pending.swap(s.pending_warnings);
    }
    for (const std::string& warning : pending) log_message(LogLevel::warning, "config", warning);
  }
};

// Builds and publishes a snapshot; on a parse error nothing changes. Caller holds the mutex.
void publish(State& s) {
  // Kept alive before it is published: a bad_alloc leaves nothing published.
  s.snapshots.push_back(std::make_unique<Settings>(parse(s)));
  detail::current_settings.store(s.snapshots.back().get(), std::memory_order_release);
}

void check_known(std::string_view var) {
  if (std::find(std::begin(kVariables), std::end(kVariables), var) != std::end(kVariables)) return;
  throw InvalidArgument(fmt::format("'{}' is not a tinydev variable (did you mean {}?): known are {}",
                                    quote_for_message(var), closest_known_variable(var),
                                    fmt::join(kVariables, ", ")));
}

}  // namespace

std::string_view closest_known_variable(std::string_view name) {
  std::string_view best = kVariables[0];
  std::size_t best_distance = SIZE_MAX;
  for (std::string_view known : kVariables) {
    const std::size_t d = edit_distance(name.substr(0, 64), known);
    if (d < best_distance) {
      best_distance = d;
      best = known;
    }
  }
  return best;
}

Settings detail::parse_settings(const std::map<std::string, std::string, std::less<>>& values) {
  return parse_with([&](std::string_view var) -> std::optional<std::string> {
    if (auto it = values.find(var); it != values.end()) return it->second;
    return std::nullopt;
  });
}

constinit std::atomic<const Settings*> detail::current_settings{nullptr};
static_assert(std::atomic<const Settings*>::is_always_lock_free &&
                  std::is_trivially_destructible_v<std::atomic<const Settings*>>,
              "settings() must be a plain load, and the pointer must outlive every static destructor");

const Settings& detail::load_settings() {
  State& s = state();
  LogWarningsAfterUnlock log_after{s};
  std::lock_guard lock(s.mutex);
  if (!s.loaded) read_environment(s);
  if (!detail::current_settings.load(std::memory_order_relaxed)) publish(s);
  return *detail::current_settings.load(std::memory_order_relaxed);
}

std::chrono::milliseconds detail::load_wait_timeout() noexcept {
  try {
    return std::chrono::milliseconds(load_settings().wait_timeout_ms);
  } catch (...) {
    return std::chrono::milliseconds(Settings{}.wait_timeout_ms);
  }
}

std::vector<std::string_view> known_variables() {
  return {std::begin(kVariables), std::end(kVariables)};
}

void reload_environment() {
  State& s = state();
  LogWarningsAfterUnlock log_after{s};
  std::lock_guard lock(s.mutex);
  RawValues previous = s.environment;
  read_environment(s);
  try {
    publish(s);
  } catch (...) {
    s.environment = std::move(previous);
    throw;
  }
}

ScopedOverride::ScopedOverride(std::string_view variable, std::optional<std::string> value)
    : variable_(variable), had_previous_(false) {
  check_known(variable);
  State& s = state();
  LogWarningsAfterUnlock log_after{s};
  std::lock_guard lock(s.mutex);
  if (!s.loaded) read_environment(s);
  auto it = s.overrides.find(variable_);
  if (it != s.overrides.end()) {
    had_previous_ = true;
    previous_ = it->second;
  }
  s.overrides[variable_] = std::move(value);
  try {
    publish(s);
  } catch (...) {
    if (had_previous_) s.overrides[variable_] = previous_;
    else s.overrides.erase(variable_);
    throw;
  }
}

ScopedOverride::~ScopedOverride() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (had_previous_) s.overrides[variable_] = previous_;
  else s.overrides.erase(variable_);
  try {
    publish(s);
  } catch (...) {
    // Restoring a state that was valid before cannot fail unless the environment was reloaded
    // with bad values in between; keep the last good snapshot rather than throw from a destructor.
  }
}

std::uint64_t parse_byte_count(std::string_view text, std::string_view what) {
  std::uint64_t value = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  std::string_view suffix(p, text.data() + text.size() - p);
  std::uint64_t mult = 0;
  if (suffix.empty()) mult = 1;
  else if (suffix == "K" || suffix == "KiB") mult = 1ull << 10;
  else if (suffix == "M" || suffix == "MiB") mult = 1ull << 20;
  else if (suffix == "G" || suffix == "GiB") mult = 1ull << 30;
  if (ec != std::errc() || mult == 0 || value > UINT64_MAX / mult)
    throw InvalidArgument(fmt::format(
        "{}='{}' is not a byte count: write an integer, optionally followed by K, M or G", what,
        quote_for_message(text)));
  return value * mult;
}

}  // namespace tinydev
