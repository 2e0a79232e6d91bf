// tinydev/device.hpp: Compiled, the bundle a device name resolves to.
//
// Compiled is the one runtime-polymorphic boundary of tinydev: the registry returns it, and below
// it the hot paths are concrete. It owns its compiler and runtime and holds its allocator by
// shared pointer (Buffers keep it alive too). Devices live until the process exits.
//
// Thread safety: all members may be called concurrently.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "tinydev/compile.hpp"
#include "tinydev/graph.hpp"
#include "tinydev/memory.hpp"

namespace tinydev {

class Compiled {
 public:
  Compiled(std::string name, std::shared_ptr<Allocator> allocator, std::unique_ptr<Compiler> compiler,
           std::unique_ptr<Runtime> runtime, SourceLanguage language);
  virtual ~Compiled() = default;
  Compiled(const Compiled&) = delete;
  Compiled& operator=(const Compiled&) = delete;

  const std::string& name() const noexcept { return name_; }  // the seed's dname, canonical
  Allocator& allocator() const noexcept { return *allocator_; }
  const std::shared_ptr<Allocator>& shared_allocator() const noexcept { return allocator_; }
  Compiler& compiler() const noexcept { return *compiler_; }
  Runtime& runtime() const noexcept { return *runtime_; }
  // What the compiler takes (the seed's renderer slot).
  SourceLanguage source_language() const noexcept { return language_; }

  // Compiles (through the cache) and loads one kernel: compiler, then runtime.
  std::shared_ptr<Program> load_kernel(std::string_view kernel_name, std::string_view source);

  // Whether the device replays recorded graphs natively (HCQ devices); others replay eagerly.
  virtual bool supports_graph() const noexcept { return false; }
  // Records `nodes` as a graph for this device (tinydev/graph.hpp). The default replays eagerly.
  virtual std::unique_ptr<Graph> create_graph(std::vector<GraphNode> nodes);

  // Blocks until all work queued on this device has finished.
  virtual void synchronize() {}

  // Human-readable facts for `tinydev devices` (target, compiler, ...).
  virtual std::map<std::string, std::string> properties() const;

 private:
  std::string name_;
  std::shared_ptr<Allocator> allocator_;
  std::unique_ptr<Compiler> compiler_;
  std::unique_ptr<Runtime> runtime_;
  SourceLanguage language_;
};

}  // namespace tinydev
