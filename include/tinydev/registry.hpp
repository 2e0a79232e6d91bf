// tinydev/registry.hpp: device names and the global `Device` registry (layer 2).
//
// `Device["llvm"]` canonicalizes the name, opens that backend on first use and returns the one
// Compiled for it for the rest of the process. Devices are never destroyed or re-built (a failed
// open is retried on the next request). Parsing a name never touches a driver.
//
// Thread safety: every member of DeviceRegistry may be called concurrently. Opening one device
// blocks only the callers that want that same device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

class Compiled;

// How a device type reads the part of a name after the first ':'.
enum class DeviceSuffix : std::uint8_t {
  ordinal,  // "CUDA:1", "LLVM:3": a plain decimal ordinal from 1 to kMaxDeviceOrdinal (":0" is dropped)
  path,     // "DISK:/dev/shm/x": kept verbatim
  verbatim, // a type this build does not know: kept verbatim
};
// The largest ordinal a device name may carry ("LLVM:63"). Each CPU ordinal is a separate device
// with its own worker threads, so the bound also bounds what a hostile name can make a process open.
inline constexpr unsigned kMaxDeviceOrdinal = 63;
// The longest device name accepted (a DISK path included).
inline constexpr std::size_t kMaxDeviceNameLength = 4096;

// "cuda" -> "CUDA", "cuda:0" -> "CUDA", "cuda:1" -> "CUDA:1", "disk:/dev/shm/x" -> "DISK:/dev/shm/x".
// Uppercases the part before the first ':' (ASCII letters, digits and '_', uppercased in ASCII
// whatever the locale: Note [ASCII device types]) and keeps the rest verbatim, except:
//  - ordinal types (CUDA, LLVM, CLANG, NULL and every backend registered as ordinal): the suffix
//    must be a plain decimal ordinal (no sign, no leading zero, at most kMaxDeviceOrdinal); ":0"
//    is dropped, so "cuda:0" is "CUDA";
//  - other types: trailing ":0"s are dropped ("disk:/tmp/a:0" -> "DISK:/tmp/a"; the seed drops
//    one, which would make canonicalize("x:a:0:0") a name that canonicalizes again to another).
// So canonicalize is idempotent: canonicalize(canonicalize(x)) == canonicalize(x).
// Throws InvalidArgument for an empty name, an empty or non-alphanumeric type, an empty suffix,
// a NUL or control character anywhere, a name over kMaxDeviceNameLength bytes, or an ordinal
// type with another suffix. Messages quote at most about 100 characters of the name.
std::string canonicalize(std::string_view name);

// Opens the device of a canonical name whose type is this backend's ("CUDA:1" for CUDA).
// Throws DeviceUnavailable when the backend cannot work on this machine.
using BackendFactory = std::function<std::unique_ptr<Compiled>(const std::string& canonical_name)>;

// One row of the generated table of the backends this build has (src/builtin_backends.cpp.in).
struct BackendEntry {
  const char* name;
  std::unique_ptr<Compiled> (*open)(const std::string& canonical_name);
  DeviceSuffix suffix;
  // How many devices of this type the machine has (CUDA: the driver's count; 0 when the backend
  // cannot work here), without opening any; nullptr for backends that have one device or cannot
  // tell, which available() probes by opening their first device. Never throws.
  unsigned (*count)() = nullptr;
};

class DeviceRegistry {
 public:
  // Constant-initialized, so `Device` works even from other static initializers.
  constexpr DeviceRegistry() = default;
  DeviceRegistry(const DeviceRegistry&) = delete;
  DeviceRegistry& operator=(const DeviceRegistry&) = delete;

  // The device for `name` (any spelling canonicalize accepts), opened on first use. Throws
  // InvalidArgument for a malformed name or a backend this build lacks (listing those it has),
  // DeviceUnavailable when the backend cannot open here.
  Compiled& operator[](std::string_view name);

  // The seed's DEFAULT: TINYDEV_DEVICE if set, else the first of CUDA, LLVM, CLANG that opens.
  // Throws DeviceUnavailable("no usable devices") listing why each candidate failed.
  std::string default_device();

  // The backend types this build has, in registration order ("LLVM", "CLANG", ...).
  std::vector<std::string> backends() const;

  // The devices usable on this machine, by canonical name in backend order: every device of a
  // backend that can count its devices without opening them ("CUDA", "CUDA:1" on a machine with two
  // GPUs; none without a driver), and the first device of each other backend if it opens ("LLVM",
  // "CLANG"; opening it is the test). Path backends (DISK) are not listed: each file is a device.
  // Never throws for a backend that cannot work here; it is just not listed.
  std::vector<std::string> available();

  // Canonical names of the devices opened so far.
  std::vector<std::string> opened() const;

  // Adds a backend type at run time (tests, out-of-tree backends). `suffix` says how canonicalize
  // reads names of this type (ordinal or path) from then on: register before naming devices of
  // it, since a name canonicalized earlier under the verbatim rule may be refused afterwards.
  // Throws InvalidArgument if the type exists or is not a valid name.
  void register_backend(std::string type, BackendFactory factory,
                        DeviceSuffix suffix = DeviceSuffix::ordinal);

  // How names of `type` (uppercase) are read: the built-in ordinal types, DISK, the backends of
  // this build and those registered; `verbatim` for any other type.
  DeviceSuffix suffix_kind(std::string_view type) const;

 private:
  struct Slot;
  void ensure_builtins() const;
  BackendFactory factory_for(const std::string& type, const std::string& asked) const;

  // Every member is trivially destructible, and what they point to is never freed, so that a
  // registry linked twice into one process is never destroyed twice (Note [Copies in one
  // process] in src/registry.cpp). std::mutex is trivially destructible on Linux.
  mutable std::mutex mutex_;
  struct Factory {
    std::string type;
    BackendFactory open;
    DeviceSuffix suffix;
    unsigned (*count)() = nullptr;
  };
  mutable std::vector<Factory>* factories_ = nullptr;  // the builtins first, on first use
  // Created on first use and never freed, on purpose: devices outlive every static destructor
  // that may still use them, and leak checkers see them reachable from this global.
  using SlotMap = std::map<std::string, std::shared_ptr<Slot>, std::less<>>;
  SlotMap& slots() const;
  mutable SlotMap* slots_ = nullptr;
  std::string_view default_probe_{};  // cached result of the CUDA/LLVM/CLANG probe (a literal)
};

// The process-wide registry (the seed's `Device`).
extern constinit DeviceRegistry Device;

}  // namespace tinydev

TINYDEV_API_END
