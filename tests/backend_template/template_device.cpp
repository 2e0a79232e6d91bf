// The @NAME@ backend: a starting point. It opens, holds host memory (so buffers, views and copies
// work) and compiles nothing yet; fill in, in this order:
//   1. the Allocator (device memory: alloc_impl / free_impl / copyin / copyout; an LRUAllocator
//      subclass caches freed memory for reuse),
//   2. the Compiler (compile(); a cache key and identity() so compile_cached uses the disk cache),
//   3. the Runtime and its Program (load(); operator() launches),
//   4. capabilities(), saying truthfully what the device does: the conformance suite runs every
//      test whose needs they meet.
// For queues, signals and native graphs, derive from HCQCompiled instead (docs/hcq.md).
#include <fmt/format.h>

#include <memory>
#include <string>

#include "tinydev/device.hpp"
#include "tinydev/error.hpp"

namespace tinydev {
namespace {

class @NAME@Compiler final : public Compiler {
 public:
  Blob compile(std::string_view source) override {
    throw CompileError("the @NAME@ backend has no compiler yet",
                       fmt::format("@name@: cannot compile {} bytes of source", source.size()));
  }
};

class @NAME@Device final : public Compiled {
 public:
  explicit @NAME@Device(const std::string& name)
      : Compiled(name, std::make_shared<MallocAllocator>(), std::make_unique<@NAME@Compiler>(),
                 /*runtime=*/nullptr, SourceLanguage::None) {}
  DeviceCapabilities capabilities() const override { return DeviceCapabilities{.host_visible_memory = true}; }
};

}  // namespace

// The factory tinydev_add_backend looks for: throw DeviceUnavailable (saying what to install or
// set) when the backend cannot work on this machine.
std::unique_ptr<Compiled> open_@name@_device(const std::string& canonical_name) {
  return std::make_unique<@NAME@Device>(canonical_name);
}

}  // namespace tinydev
