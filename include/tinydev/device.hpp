// tinydev/device.hpp: Compiled, the bundle a device name resolves to.
//
// Compiled is the one runtime-polymorphic boundary of tinydev: the registry returns it, and below
// it the hot paths are concrete. It owns its compiler and runtime and holds its allocator by
// shared pointer (Buffers keep it alive too). Devices live until the process exits.
//
// Thread safety: all members may be called concurrently.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include "tinydev/compile.hpp"
#include "tinydev/graph.hpp"
#include "tinydev/memory.hpp"
#include "tinydev/stream.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

// What a device can do, declared by its backend, for callers that adapt to it (frameworks, the
// conformance suite, whose tests each ask for what they need). Every field false is a device that
// can only hold memory.
struct DeviceCapabilities {
  bool compiles_source = false;         // compile() turns source text into a blob (DISK: no compiler)
  bool rejects_invalid_source = false;  // compile() of invalid source is a CompileError with the log (NULL takes anything)
  bool caches_compiles = false;         // compile_cached keeps blobs in the disk cache (the compiler has a cache key)
  bool runs_kernels = false;            // Programs compute their results (NULL's return at once, doing nothing)
  bool checks_signatures = false;       // Programs know their argument counts and reject launches that differ
  bool host_objects = false;            // blobs are host object files, run by the CPU object runtime
  bool native_graphs = false;           // create_graph records a native graph; otherwise graphs replay eagerly
  bool host_visible_memory = false;     // allocations are host memory: as_buffer is zero copy, views share it
  bool hcq = false;                     // an HCQCompiled device: queues, signals, a timeline (tinydev/hcq.hpp)
  bool streams = false;                 // create_stream gives independent streams (tinydev/stream.hpp)
  friend bool operator==(const DeviceCapabilities&, const DeviceCapabilities&) = default;
};

class Compiled {
 public:
  Compiled(std::string name, std::shared_ptr<Allocator> allocator, std::shared_ptr<Compiler> compiler,
           std::shared_ptr<Runtime> runtime, SourceLanguage language);
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

  // What this device can do. The default says what the base class can tell (a source language, a
  // cache key, a runtime); backends override it with the whole truth.
  virtual DeviceCapabilities capabilities() const;

  // Whether the device replays recorded graphs natively (the CPU HCQ devices); others replay eagerly.
  virtual bool supports_graph() const noexcept { return false; }
  // Records `nodes` as a graph for this device (tinydev/graph.hpp). The default replays eagerly.
  virtual std::unique_ptr<Graph> create_graph(std::vector<GraphNode> nodes);

  // Blocks until all work queued on this device has ended: its default queue and every stream
  // created from it (as cudaDeviceSynchronize). A stream whose work failed is skipped: its
  // failure is reported by the stream (Stream::fault), not here.
  virtual void synchronize() {}

  // Streams (tinydev/stream.hpp, docs/serving.md): an independent in-order stream of work with
  // its own queues and timeline, ordered with the device's default queue and other streams only
  // through Events. InvalidArgument on devices without streams (capabilities().streams).
  virtual std::shared_ptr<Stream> create_stream(const StreamOptions& options = {});
  // An Event completed once everything queued on the default queue so far (the plain
  // Buffer::copyin, Program calls, Compiled::create_graph replays, hand-made HCQ queues that
  // signal the timeline) has finished: what a stream waits for (Stream::wait) before it reads
  // what the default queue wrote. A Buffer::copyin may still be landing when it returns (CUDA's
  // staged copies), and nothing else orders a stream after it. HCQ devices do not wait for the
  // work (a completed Event if it finished, else one more small submission: Note [Recorded
  // events] in tinydev/hcq_device.hpp), though they take the device's submit lock, which another
  // thread's synchronize or staged copy may hold a while. The Event stays valid for the life of
  // the process. The default synchronizes the device and returns a completed Event. DeviceFault
  // on a faulted device.
  virtual Event record();

  // Sticky faults (docs/serving.md): "" while the device works; once one of its queues failed,
  // the first failure's explanation, and every call that would queue or copy throws a
  // DeviceFault naming it until recover().
  virtual std::string fault() const { return {}; }
  // Brings a faulted device back: drains its queues (waiting at most `timeout`; Timeout when a
  // kernel still runs), marks everything submitted as finished and clears the fault. Buffers
  // written by failed work hold whatever that work left. Returns the fault it cleared ("" if
  // none).
  virtual std::string recover(std::chrono::milliseconds timeout = default_wait_timeout()) {
    (void)timeout;
    return {};
  }

  // Human-readable facts for `tinydev devices` (target, compiler, ...).
  virtual std::map<std::string, std::string> properties() const;

  // Called once by the registry after the backend's factory returned the device, before anyone
  // else sees it. From then on the device lives until the process exits, so this is where it
  // registers process-wide hooks that point at it (HCQCompiled: the profiler's flush hook). A
  // device the factory throws out of, or one built outside the registry, never gets the call.
  virtual void on_opened() {}

 protected:
  // For devices made of parts shared with another (a CPU stream's lane shares its device's).
  const std::shared_ptr<Compiler>& shared_compiler() const noexcept { return compiler_; }
  const std::shared_ptr<Runtime>& shared_runtime() const noexcept { return runtime_; }

 private:
  std::string name_;
  std::shared_ptr<Allocator> allocator_;
  std::shared_ptr<Compiler> compiler_;  // shared with the device's streams
  std::shared_ptr<Runtime> runtime_;
  SourceLanguage language_;
};

}  // namespace tinydev

TINYDEV_API_END
