// Compiled (tinydev/device.hpp): the bundle a device name resolves to.
#include <fmt/format.h>

#include "tinydev/device.hpp"
#include "tinydev/error.hpp"

namespace tinydev {

Compiled::Compiled(std::string name, std::shared_ptr<Allocator> allocator,
                   std::shared_ptr<Compiler> compiler, std::shared_ptr<Runtime> runtime,
                   SourceLanguage language)
    : name_(std::move(name)),
      allocator_(std::move(allocator)),
      compiler_(compiler ? std::move(compiler) : std::make_shared<Compiler>()),
      runtime_(std::move(runtime)),
      language_(language) {}

std::shared_ptr<Program> Compiled::load_kernel(std::string_view kernel_name, std::string_view source) {
  if (!runtime_)
    throw InvalidArgument(fmt::format("{} runs no kernels: it has no runtime", name_));
  try {
    Blob blob = compiler_->compile_cached(source);
    return runtime_->load(kernel_name, blob);
  } catch (Error& e) {
    e.add_context(name_, kernel_name);  // the compiler knows neither (tinydev/error.hpp)
    throw;
  }
}

std::unique_ptr<Graph> Compiled::create_graph(std::vector<GraphNode> nodes) {
  return make_eager_graph(*this, std::move(nodes));
}

std::shared_ptr<Stream> Compiled::create_stream(const StreamOptions&) {
  throw InvalidArgument(fmt::format("{} has no streams: its work runs in one queue (capabilities().streams is false); "
                                    "use the device directly, or a CPU device (LLVM, CLANG) for streams",
                                    name_));
}

Event Compiled::record() {
  // A device without a timeline: once synchronize() returned, everything queued so far finished.
  synchronize();
  if (const std::string f = fault(); !f.empty())
    throw DeviceFault(fmt::format("{} cannot record an event: {}. Call recover() on it to go on (docs/serving.md)",
                                  name_, f));
  return Event();
}

std::map<std::string, std::string> Compiled::properties() const {
  return {{"source language", std::string(to_string(language_))},
          {"allocator", allocator_->describe()}};
}

DeviceCapabilities Compiled::capabilities() const {
  return DeviceCapabilities{.compiles_source = language_ != SourceLanguage::None,
                            .caches_compiles = compiler_->cache_key().has_value(),
                            .native_graphs = supports_graph()};
}

}  // namespace tinydev
