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
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace tinydev {

class Compiled;

// "cuda" -> "CUDA", "cuda:0" -> "CUDA", "cuda:1" -> "CUDA:1", "disk:/dev/shm/x" -> "DISK:/dev/shm/x".
// Uppercases the part before the first ':', keeps the rest verbatim, drops one trailing ":0".
// Throws InvalidArgument for an empty name, an empty or non-alphanumeric type, or an empty suffix.
std::string canonicalize(std::string_view name);

// Opens the device of a canonical name whose type is this backend's ("CUDA:1" for CUDA).
// Throws DeviceUnavailable when the backend cannot work on this machine.
using BackendFactory = std::function<std::unique_ptr<Compiled>(const std::string& canonical_name)>;

// One row of the generated table of the backends this build has (src/builtin_backends.cpp.in).
struct BackendEntry {
  const char* name;
  std::unique_ptr<Compiled> (*open)(const std::string& canonical_name);
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

  // Canonical names of the devices opened so far.
  std::vector<std::string> opened() const;

  // Adds a backend type at run time (tests, out-of-tree backends). Throws InvalidArgument if the
  // type exists or is not a valid name.
  void register_backend(std::string type, BackendFactory factory);

 private:
  struct Slot;
  void ensure_builtins() const;
  BackendFactory factory_for(const std::string& type, const std::string& asked) const;

  mutable std::mutex mutex_;
  mutable bool builtins_loaded_ = false;
  mutable std::vector<std::pair<std::string, BackendFactory>> factories_{};
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
