#include "tinydev/registry.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/device.hpp"
#include "tinydev/error.hpp"

// Note [Backend registration]
// Backends are static libraries. The classic way to register them, a static initializer in each
// backend's object file, silently does nothing in a consumer linked against the installed archives:
// the linker only takes archive members that resolve an undefined symbol, and nothing references
// the registering object. Instead each backend library holds one generated function,
// `tinydev_backend_<name>()` (tinydev_add_backend), returning its row: name, open function, suffix.
// The core's generated table (builtin_backends.cpp) refers to every backend of the build weakly
// and hidden, so it links alone with no backends, and each backend target carries
// `--undefined=tinydev_backend_<name>` in its link options, which makes the linker take that member,
// and through it the backend, into any program that links the target: tinydev::core plus
// tinydev::clang is a program with CLANG and no LLVM. pkg-config's Libs carry the same option.
//
// Note [Copies in one process]
// Two plugins that each link tinydev statically put two copies in one process. The archives define
// every symbol hidden (tinydev/export.hpp), so neither plugin exports tinydev and neither binds to
// the other's symbols, whether linked or loaded with RTLD_GLOBAL or
// RTLD_LOCAL: each copy has its own registry, devices, worker threads, caches in memory, settings,
// log sink and profiler, and shares only what the process has once: the environment, signal
// handlers (each copy chains to the handler before it and claims only faults in its own kernels),
// the compile cache on disk (safe between processes already) and the profile file (Note [Two
// copies, one profile] in src/profile.cpp). Every global of the library is trivially destructible
// or never destroyed, so that a copy whose globals end up interposed anyway (two libraries built
// with TINYDEV_EXPORT_API) is not destroyed twice at exit.
namespace tinydev::detail {
std::vector<BackendEntry> linked_backends();  // generated: builtin_backends.cpp
}

namespace tinydev {

constinit DeviceRegistry Device;
static_assert(std::is_trivially_destructible_v<DeviceRegistry>,
              "the registry must survive being linked twice: Note [Copies in one process]");

namespace {

constexpr std::size_t kMaxTypeLength = 32;

// Note [ASCII device types]
// A type is ASCII letters, digits and '_', and is uppercased in ASCII, whatever the process's
// locale: <cctype>'s isalnum/toupper follow it, and an application that calls setlocale (or a
// thread with uselocale) would change what a name means. Under tr_TR.ISO-8859-9 toupper('i') is
// 0xDD, so "disk:/x" became "D\xDDSK:/x", an unknown device; under a Latin-1 locale 0xE9 is a
// letter, so "cud\xE9" was a valid type.
constexpr bool ascii_letter(char c) noexcept { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
constexpr bool ascii_type_char(char c) noexcept { return ascii_letter(c) || (c >= '0' && c <= '9') || c == '_'; }
constexpr char ascii_upper(char c) noexcept { return c >= 'a' && c <= 'z' ? static_cast<char>(c - 'a' + 'A') : c; }

bool valid_type(std::string_view type) {
  if (type.empty() || type.size() > kMaxTypeLength || !ascii_letter(type.front())) return false;
  return std::all_of(type.begin(), type.end(), ascii_type_char);
}

std::string type_of(const std::string& canonical) {
  return canonical.substr(0, canonical.find(':'));
}

// Types whose suffix is an ordinal whether or not this build has them, so that a name means the
// same in every build ("cuda:0:0" is an error everywhere, not "CUDA:0" here and "CUDA" there).
constexpr std::string_view kOrdinalTypes[] = {"CUDA", "LLVM", "CLANG", "NULL"};
constexpr std::string_view kPathTypes[] = {"DISK"};

// The ordinal in `suffix`, or an InvalidArgument naming `name`.
unsigned parse_ordinal(std::string_view name, std::string_view type, std::string_view suffix) {
  const bool digits = std::all_of(suffix.begin(), suffix.end(),
                                  [](char c) { return c >= '0' && c <= '9'; });
  if (!digits || (suffix.size() > 1 && suffix.front() == '0') || suffix.size() > 3 ||
      std::stoul(std::string(suffix)) > kMaxDeviceOrdinal)
    throw InvalidArgument(fmt::format(
        "malformed device name '{}': a {} device is named by a plain decimal ordinal from 0 to {} "
        "after the ':' (as in \"{}:1\"), got '{}'",
        quote_for_message(name), type, kMaxDeviceOrdinal, type, quote_for_message(suffix, 40)));
  return static_cast<unsigned>(std::stoul(std::string(suffix)));
}

}  // namespace

std::string canonicalize(std::string_view name) {
  if (name.empty())
    throw InvalidArgument("empty device name: use a name such as \"LLVM\", \"CLANG\" or \"CUDA:1\"");
  if (has_control_characters(name))
    throw InvalidArgument(fmt::format(
        "malformed device name '{}': it holds a NUL or control character; device names are printable text",
        quote_for_message(name)));
  if (name.size() > kMaxDeviceNameLength)
    throw InvalidArgument(fmt::format("malformed device name '{}': longer than {} bytes",
                                      quote_for_message(name), kMaxDeviceNameLength));
  std::size_t colon = name.find(':');
  std::string_view type = name.substr(0, colon);
  if (!valid_type(type))
    throw InvalidArgument(fmt::format(
        "malformed device name '{}': the part before ':' must be a letter followed by at most {} "
        "letters, digits or '_' (as in \"CUDA:1\")",
        quote_for_message(name), kMaxTypeLength - 1));
  std::string out(type);
  std::transform(out.begin(), out.end(), out.begin(), ascii_upper);
  if (colon == std::string_view::npos) return out;
  std::string_view rest = name.substr(colon + 1);
  if (rest.empty())
    throw InvalidArgument(fmt::format(
        "malformed device name '{}': nothing after ':'; drop the ':' or name the device, as in "
        "\"{}:1\"",
        quote_for_message(name), out));
  if (Device.suffix_kind(out) == DeviceSuffix::ordinal) {
    if (parse_ordinal(name, out, rest) == 0) return out;
    return out + ':' + std::string(rest);
  }
  // Note [Trailing :0]
  // The seed drops ":0" (everywhere; the contract: once, at the end). Dropping only one would make
  // "x:a:0:0" canonicalize to "X:a:0" and that to "X:a": two names, two devices, for one request.
  // Dropping every trailing ":0" makes canonicalize idempotent.
  while (rest.size() >= 2 && rest.ends_with(":0")) rest.remove_suffix(2);
  if (rest == "0") return out;
  if (rest.empty())
    throw InvalidArgument(fmt::format("malformed device name '{}': nothing after ':' once ':0' is dropped",
                                      quote_for_message(name)));
  out += ':';
  out += rest;
  return out;
}

DeviceSuffix DeviceRegistry::suffix_kind(std::string_view type) const {
  for (std::string_view t : kOrdinalTypes)
    if (t == type) return DeviceSuffix::ordinal;
  for (std::string_view t : kPathTypes)
    if (t == type) return DeviceSuffix::path;
  std::lock_guard lock(mutex_);
  ensure_builtins();
  for (const Factory& f : *factories_)
    if (f.type == type) return f.suffix;
  return DeviceSuffix::verbatim;
}

struct DeviceRegistry::Slot {
  std::mutex open_mutex;                   // held while this one device opens
  std::atomic<Compiled*> device{nullptr};  // never freed: devices live as long as the process
};

DeviceRegistry::SlotMap& DeviceRegistry::slots() const {
  // Caller holds mutex_.
  if (!slots_) slots_ = new SlotMap();
  return *slots_;
}

void DeviceRegistry::ensure_builtins() const {
  // Caller holds mutex_.
  if (factories_) return;
  factories_ = new std::vector<Factory>();  // never freed: Note [Copies in one process]
  for (const BackendEntry& entry : detail::linked_backends())
    factories_->push_back(Factory{entry.name, entry.open, entry.suffix, entry.count});
}

std::vector<std::string> DeviceRegistry::backends() const {
  std::lock_guard lock(mutex_);
  ensure_builtins();
  std::vector<std::string> out;
  for (const Factory& f : *factories_) out.push_back(f.type);
  return out;
}

std::vector<std::string> DeviceRegistry::available() {
  std::vector<Factory> snapshot;
  {
    std::lock_guard lock(mutex_);
    ensure_builtins();
    snapshot = *factories_;
  }
  std::vector<std::string> out;
  for (const Factory& f : snapshot) {
    if (f.suffix == DeviceSuffix::path) continue;
    if (f.count) {
      const unsigned n = std::min(f.count(), kMaxDeviceOrdinal + 1);
      for (unsigned i = 0; i < n; ++i) out.push_back(i == 0 ? f.type : fmt::format("{}:{}", f.type, i));
      continue;
    }
    try {
      (*this)[f.type];
      out.push_back(f.type);
    } catch (const Error& e) {
      debug_log(1, f.type, "not available: {}", e.what());
    }
  }
  return out;
}

std::vector<std::string> DeviceRegistry::opened() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> out;
  for (const auto& [name, slot] : slots())
    if (slot->device.load()) out.push_back(name);
  return out;
}

BackendFactory DeviceRegistry::factory_for(const std::string& type, const std::string& asked) const {
  // Caller holds mutex_.
  ensure_builtins();
  for (const Factory& f : *factories_)
    if (f.type == type) return f.open;
  std::vector<std::string> have;
  for (const Factory& f : *factories_) have.push_back(f.type);
  throw InvalidArgument(fmt::format(
      "unknown device '{}' (type {}): this build of tinydev has {}", quote_for_message(asked), type,
      have.empty() ? std::string("no backends: link a backend target (tinydev::llvm, tinydev::clang, ...) or "
                                  "tinydev::tinydev, not tinydev::core alone; by hand, use "
                                  "`pkg-config --libs --static tinydev`")
                   : fmt::format("{}", fmt::join(have, ", "))));
}

void DeviceRegistry::register_backend(std::string type, BackendFactory factory, DeviceSuffix suffix) {
  if (!valid_type(type) || canonicalize(type) != type)
    throw InvalidArgument(fmt::format(
        "cannot register backend '{}': a backend type is uppercase letters, digits and '_'",
        quote_for_message(type)));
  if (suffix == DeviceSuffix::verbatim)
    throw InvalidArgument(fmt::format("cannot register backend '{}': say whether its names carry an "
                                      "ordinal or a path (DeviceSuffix::ordinal or ::path)", type));
  std::lock_guard lock(mutex_);
  ensure_builtins();
  for (const Factory& f : *factories_)
    if (f.type == type)
      throw InvalidArgument(fmt::format("cannot register backend '{}': it is already registered", type));
  factories_->push_back(Factory{std::move(type), std::move(factory), suffix});
}

Compiled& DeviceRegistry::operator[](std::string_view name) {
  // Note [Canonical names look up first]
  // Every key is a canonical name and canonicalize is idempotent, so a name equal to a key is that
  // device's canonical name: one lookup, no parsing. Buffers hold canonical names and look their
  // device up at every allocation, copy and transfer; parsing the name cost more than the rest of
  // an LRU-cached allocation. Any other spelling misses and takes the full path below.
  {
    std::lock_guard lock(mutex_);
    if (auto it = slots().find(name); it != slots().end())
      if (Compiled* dev = it->second->device.load(std::memory_order_acquire)) return *dev;
  }
  std::string canonical = canonicalize(name);
  std::shared_ptr<Slot> slot;
  BackendFactory factory;
  {
    std::lock_guard lock(mutex_);
    if (auto it = slots().find(canonical); it != slots().end()) {
      if (Compiled* dev = it->second->device.load(std::memory_order_acquire)) return *dev;
      slot = it->second;
    }
    factory = factory_for(type_of(canonical), std::string(name));
    if (!slot) slot = slots().emplace(canonical, std::make_shared<Slot>()).first->second;
  }
  // Open outside the registry lock: a slow driver init blocks only those who want this device.
  std::lock_guard open_lock(slot->open_mutex);
  if (Compiled* dev = slot->device.load(std::memory_order_acquire)) return *dev;
  std::unique_ptr<Compiled> opened;
  try {
    opened = factory(canonical);
  } catch (Error& e) {
    e.add_context(canonical);
    throw;
  }
  if (!opened)
    throw DeviceUnavailable(fmt::format("backend for '{}' returned no device", canonical));
  // The device is whole now and will live until exit: it may hand out pointers to itself.
  opened->on_opened();
  debug_log(1, canonical, "opened device {} from pid:{}", canonical, ::getpid());
  Compiled* dev = opened.release();
  slot->device.store(dev, std::memory_order_release);
  return *dev;
}

std::string DeviceRegistry::default_device() {
  const Settings& s = settings();
  if (!s.device.empty()) return s.device;
  {
    std::lock_guard lock(mutex_);
    if (!default_probe_.empty()) return std::string(default_probe_);
  }
  std::vector<std::string> have = backends();
  std::string reasons;
  for (std::string_view candidate : {"CUDA", "LLVM", "CLANG"}) {
    if (std::find(have.begin(), have.end(), candidate) == have.end()) {
      reasons += fmt::format("\n  {}: not in this build", candidate);
      continue;
    }
    try {
      (*this)[candidate];
      std::lock_guard lock(mutex_);
      default_probe_ = candidate;
      return std::string(candidate);
    } catch (const std::exception& e) {
      reasons += fmt::format("\n  {}: {}", candidate, e.what());
    }
  }
  throw DeviceUnavailable(fmt::format(
      "no usable devices:{}\nset TINYDEV_DEVICE to a device this machine can open", reasons));
}

}  // namespace tinydev
