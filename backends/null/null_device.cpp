// The NULL backend, tinygrad's null device: the smallest complete backend, and the reference for
// writing one (docs/architecture.md, "Adding a backend"). Any source "compiles" (to its own bytes,
// never cached), programs return at once without touching
// memory, and memory is real host memory, so buffers copy in and out like on any device. Tests use
// it as a backend that computes nothing; benchmarks use it to measure the library's fixed costs.
#include <fmt/format.h>

#include <memory>
#include <string>

#include "tinydev/counters.hpp"
#include "tinydev/device.hpp"
#include "tinydev/error.hpp"
#include "tinydev/profile.hpp"

namespace tinydev {
namespace {

// A kernel that does nothing. Launches are still checked for what every device rejects (an empty
// grid), counted like real ones, and timed when asked (the time of doing nothing).
class NullProgram final : public Program {
 public:
  NullProgram(std::string name, std::string device) : Program(std::move(name)), device_(std::move(device)) {}
  std::optional<double> operator()(std::span<const Allocation>, std::span<const std::int32_t>,
                                   const LaunchParams& params) override {
    if (grid_size(params.global) == 0)
      throw InvalidArgument(fmt::format("{} on {}: global size ({},{},{}) has a zero dimension", name(), device_,
                                        params.global[0], params.global[1], params.global[2]));
    GlobalCounters::kernel_count.fetch_add(1, std::memory_order_relaxed);
    if (!params.wait) return std::nullopt;
    const std::uint64_t start = Profiler::now_ns();
    const double seconds = static_cast<double>(Profiler::now_ns() - start) / 1e9;
    GlobalCounters::time_sum.fetch_add(seconds, std::memory_order_relaxed);
    return seconds;
  }

 private:
  std::string device_;
};

// Any source is its own binary (tinygrad's NULL device takes its renderer's output the same way).
// No cache key: there is nothing worth caching.
class NullCompiler final : public Compiler {
 public:
  Blob compile(std::string_view source) override {
    const auto bytes = std::as_bytes(std::span(source.data(), source.size()));
    return Blob(bytes.begin(), bytes.end());
  }
  std::string identity() const override { return "null"; }
};

class NullRuntime final : public Runtime {
 public:
  explicit NullRuntime(std::string device) : device_(std::move(device)) {}
  std::shared_ptr<Program> load(std::string_view kernel_name, std::span<const std::byte>) override {
    if (kernel_name.empty()) throw InvalidArgument(fmt::format("{}: a kernel needs a name", device_));
    return std::make_shared<NullProgram>(std::string(kernel_name), device_);
  }

 private:
  std::string device_;
};

class NullDevice final : public Compiled {
 public:
  explicit NullDevice(const std::string& name)
      : Compiled(name, std::make_shared<MallocAllocator>(), std::make_unique<NullCompiler>(),
                 std::make_unique<NullRuntime>(name), SourceLanguage::None) {}

  DeviceCapabilities capabilities() const override {
    return DeviceCapabilities{.compiles_source = true, .host_visible_memory = true};
  }
  std::map<std::string, std::string> properties() const override {
    auto props = Compiled::properties();
    props["compiler"] = "none: any source is accepted as is";
    props["programs"] = "do nothing and return at once";
    return props;
  }
};

}  // namespace

std::unique_ptr<Compiled> open_null_device(const std::string& canonical_name) {
  return std::make_unique<NullDevice>(canonical_name);
}

}  // namespace tinydev
