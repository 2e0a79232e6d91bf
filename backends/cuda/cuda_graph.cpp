// Native CUDA graphs for CudaHCQDevice::create_graph.
//
// Note [CUDA graph replay]
// The first replay builds a CUDA graph from the nodes with the replay's inputs: a kernel node per
// kernel (its arguments packed as a direct launch packs them) and a 1-D memcpy node per copy, each
// depending on the earlier nodes its memory conflicts with (Note [CUDA graph dependencies]), so
// the graph computes what eager execution in order would; then instantiates it. A later replay
// with inputs no instance holds (Note [CUDA graph instances]) packs every node's arguments again
// and patches, in the instance, only the nodes whose arguments or addresses changed
// (cuGraphExecKernelNodeSetParams, cuGraphExecMemcpyNodeSetParams; a patch affects later launches
// only, so one still running is safe), then launches it with one cuGraphLaunch on the compute
// stream, ordered on the device's timeline like a direct call (CudaHCQDevice::run_ordered). A
// replay with unchanged inputs patches nothing. The driver refuses some patches
// (CUDA_ERROR_INVALID_VALUE): a copy whose memory now belongs to another context, or is host
// memory where it was device memory; then a CUDA graph is built and instantiated for these inputs
// and replaces the executable graph that refused (the driver frees that one once a launch still
// running finished; Note [CUDA graph instances]).
// A copy of 0 bytes is an empty node (the driver takes no zero-length copy node), and a kernel
// without parameters gets no argument buffer.
//
// Note [CUDA graph instances]
// Patching costs a driver call per changed node, which on a GPU can cost more than the launch.
// Servers often replay with a few input sets that come back (double-buffered inputs, buffers the
// LRU cache hands out again), so a graph keeps up to kMaxInstances executable graphs, each
// remembering the inputs and variables it was last patched for. A replay whose inputs an
// instance holds launches that instance and patches nothing. Otherwise it patches the least
// recently launched instance, unless its inputs were among the last kRecentInputSets replays'
// (they come back) and there is room: then it instantiates one more for them. Inputs seen once
// are patched in, never instantiated (unless the driver refuses the patch, below), so a stream of
// new buffers costs no instantiation and no memory. Each instance is patched through the node handles of the CUDA graph it was
// instantiated from (a Built), so a refused patch (memory the driver cannot patch into that
// graph's nodes: pinned host memory where it had device memory) builds a CUDA graph for these
// inputs and replaces only the instance that refused: inputs of either kind that come back keep
// an instance each, where dropping every instance would build again at every change of kind.
// New instances come from the newest Built; one no instance uses is destroyed. Inputs that
// overlap other buffers differently drop every instance (the dependencies change).
//
// Note [CUDA graph dependencies]
// Each node depends only on the earlier nodes its memory conflicts with, as in tinygrad's CUDA
// graph, so the GPU may run nodes that share no memory at once. A copy writes its destination and
// reads its source; a kernel writes the buffers GraphKernel::writes lists (all of them when it is
// empty) and reads the others. Per buffer the graph tracks the last writer and the readers since:
// a node that reads depends on the last writer of every buffer overlapping it, a node that writes
// also on those readers. Buffers are compared by address range, not identity (a view overlaps its
// base), and ranges depend on the replay's inputs: the graph remembers which input ranges
// overlapped which buffers when it was built, and a replay whose inputs overlap differently (an
// input passed twice, a view of a fixed buffer) builds the graph again with the dependencies that
// now hold; a replay with the same overlaps only patches. While profiling, replays run node by node (each
// through run_ordered), so every kernel and copy has its own span in the trace.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <string>
#include <memory>
#include <vector>

#include "cuda_hcq.hpp"
#include "cuda_state.hpp"
#include "tinydev/graph.hpp"

namespace tinydev::cuda {
namespace {

class CudaGraph final : public Graph {
 public:
  CudaGraph(CudaHCQDevice& device, std::vector<GraphNode> nodes) : Graph(std::move(nodes)), device_(device) {
    instances_.reserve(kMaxInstances);
    find_uses();
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      const auto* k = std::get_if<GraphKernel>(&nodes_[i]);
      if (!k) continue;
      const auto* program = dynamic_cast<const CudaProgram*>(k->program.get());
      const std::string& owner = device.programs_device().name();  // a stream's lane runs its device's
      if (!program || program->device() != owner)
        throw InvalidArgument(fmt::format("graph node {}: kernel '{}' {}, not by {}'s runtime: load it "
                                          "with Device[\"{}\"].load_kernel",
                                          i, k->program->name(),
                                          program ? fmt::format("was loaded by {}", program->device())
                                                  : std::string("is another backend's program"),
                                          owner, owner));
      const Dim3& g = k->launch.global;
      const Dim3& l = k->launch.local;
      if (grid_size(g) == 0 || grid_size(l) == 0)
        throw InvalidArgument(fmt::format("graph node {}: '{}' has a zero dimension in global size ({},{},{}) or "
                                          "local size ({},{},{})",
                                          i, k->program->name(), g[0], g[1], g[2], l[0], l[1], l[2]));
    }
  }

  const CudaHCQDevice& device() const noexcept { return device_; }

  ~CudaGraph() override {
    const DeviceState& s = device_.state();
    if (s.released.load()) return;  // at exit the context took the graph along
    // A forked child's copy is the parent's: no wait (the child sees no progress) and no driver
    // call (Note [Devices and fork]); the child's memory goes with it.
    if (!device_.opened_in_this_process()) return;
    try {
      // The last replay may still run: wait for the timeline value covering it (signalled by now,
      // or by last_submitted_value(): Note [Lazy timeline signals]), not for the device's later
      // work, which may wait for something this thread is yet to do.
      if (last_replay_value_ != 0 &&
          device_.timeline_slot()->value.load(std::memory_order_acquire) < last_replay_value_)
        device_.wait_timeline_reached(std::min(last_replay_value_, device_.last_submitted_value()),
                                      device_.free_wait_timeout());
    } catch (const std::exception&) {
      // The device failed, but a replay queued before may still run (Note [CUDA waits on failed
      // signals]), and the programs this graph holds go with it: wait for the queues to drain
      // (past TINYDEV_WAIT_TIMEOUT_MS the instances are left to the context, as a hung replay's are).
      if (!device_.wait_queues_drained(device_.free_wait_timeout()))
        return;
    }
    if (s.api.cuCtxSetCurrent(s.context) != CUDA_SUCCESS) return;
    destroy();
  }

  std::optional<double> replay(std::span<const Allocation> inputs, std::span<const std::int32_t> variables,
                               bool wait) override {
    check_replay(inputs, variables);
    device_.check_usable();  // before the lock: a forked child's may be held by a parent's thread
    device_.check_no_reservation_held("a graph replay");
    std::lock_guard lock(device_.submit_mutex());
    device_.throw_if_failed();
    const DeviceState& s = device_.state();
    s.make_current();
    if (device_.profiling()) return replay_node_by_node(inputs, variables, wait);
    Instance& instance = instance_for(inputs, variables);
    const CUgraphExec exec = instance.exec;
    auto work = [&](void* stream) { return static_cast<int>(s.api.cuGraphLaunch(exec, static_cast<CUstream>(stream))); };
    instance.launched = ++launches_;
    const ReplayMark mark(*this);  // also when a timed replay's wait throws: it was launched
    return device_.run_ordered(work, launch_what_, wait);
  }

 private:
  // Profiling: each node on its own, so each kernel and copy gets its own span in the trace.
  std::optional<double> replay_node_by_node(std::span<const Allocation> inputs, std::span<const std::int32_t> variables,
                                            bool wait) {
    const DeviceState& s = device_.state();
    const ReplayMark mark(*this);
    double seconds = 0;
    for (const GraphNode& node : nodes_) {
      std::optional<double> t;
      if (const auto* k = std::get_if<GraphKernel>(&node)) {
        const std::vector<std::byte> args = pack(*k, inputs, variables);
        const auto function = static_cast<CUfunction>(static_cast<const CudaProgram&>(*k->program).function());
        auto work = [&](void* stream) {
          return static_cast<int>(launch(s, function, static_cast<CUstream>(stream), args.data(), args.size(),
                                         k->launch.global, k->launch.local));
        };
        t = device_.run_ordered(work, fmt::format("launching '{}' of a graph", k->program->name()), wait,
                                k->program->name());
      } else {
        const auto& c = std::get<GraphCopy>(node);
        const auto dest = static_cast<CUdeviceptr>(resolve(c.dest, inputs).va_addr);
        const auto src = static_cast<CUdeviceptr>(resolve(c.src, inputs).va_addr);
        auto work = [&](void* stream) {
          return static_cast<int>(s.api.cuMemcpyAsync(dest, src, c.size, static_cast<CUstream>(stream)));
        };
        t = device_.run_ordered(work, fmt::format("a copy of {} bytes of a graph", c.size), wait,
                                fmt::format("copy {} bytes", c.size));
      }
      seconds += t.value_or(0);
    }
    if (!wait) return std::nullopt;
    return seconds;
  }

  // ---- Note [CUDA graph instances] ----
  static constexpr std::size_t kMaxInstances = 4;
  static constexpr std::size_t kRecentInputSets = 8;

  // A CUDA graph as built for one replay's inputs: its node handles (what patches name) and the
  // arguments and addresses its nodes hold.
  struct Built {
    CUgraph graph = nullptr;
    std::vector<CUgraphNode> handles;
    std::vector<std::vector<std::byte>> args;                     // per kernel node
    std::vector<std::pair<std::uint64_t, std::uint64_t>> copies;  // per copy node: (dest, src)
  };

  struct Instance {
    CUgraphExec exec = nullptr;
    const Built* built = nullptr;                                 // instantiated from it; in builts_
    std::vector<std::vector<std::byte>> args;                     // per kernel node, as patched last
    std::vector<std::pair<std::uint64_t, std::uint64_t>> copies;  // per copy node: (dest, src)
    // The inputs (address, size: overlaps depend on sizes too) and variables it was patched for;
    // `complete` false while a patch has not fully landed (it then describes no inputs).
    std::vector<std::pair<std::uint64_t, std::uint64_t>> inputs;
    std::vector<std::int32_t> variables;
    bool complete = false;
    std::uint64_t launched = 0;  // launches_ when it was last launched
  };

  static bool describes(const Instance& instance, std::span<const Allocation> inputs,
                        std::span<const std::int32_t> variables) {
    if (!instance.complete || inputs.size() != instance.inputs.size() ||
        !std::equal(variables.begin(), variables.end(), instance.variables.begin(), instance.variables.end()))
      return false;
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].va_addr != instance.inputs[i].first || inputs[i].size != instance.inputs[i].second) return false;
    return true;
  }
  static void remember(Instance& instance, std::span<const Allocation> inputs, std::span<const std::int32_t> variables) {
    instance.inputs.resize(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) instance.inputs[i] = {inputs[i].va_addr, inputs[i].size};
    instance.variables.assign(variables.begin(), variables.end());
    instance.complete = true;
  }
  static std::uint64_t key_of(std::span<const Allocation> inputs, std::span<const std::int32_t> variables) {
    std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the words; a collision only instantiates early
    const auto mix = [&](std::uint64_t v) { h = (h ^ v) * 0x100000001b3ull; };
    for (const Allocation& a : inputs) {
      mix(a.va_addr);
      mix(a.size);
    }
    for (const std::int32_t v : variables) mix(static_cast<std::uint32_t>(v));
    return h;
  }

  // The instance to launch for these inputs: one that holds them, or one patched or made for them
  // (the graph built first or again when the overlaps changed; an instance of a graph built for
  // them where the driver refused a patch).
  Instance& instance_for(std::span<const Allocation> inputs, std::span<const std::int32_t> variables) {
    const DeviceState& s = device_.state();
    // Every replay is remembered, those an instance serves too, so sets that alternate stay
    // recognized while other inputs pass between them.
    const std::uint64_t key = key_of(inputs, variables);
    const bool recurring = std::find(recent_.begin(), recent_.end(), key) != recent_.end();
    recent_[recent_next_] = key;
    recent_next_ = (recent_next_ + 1) % recent_.size();
    for (Instance& instance : instances_)
      if (describes(instance, inputs, variables)) return instance;
    if (instances_.empty()) {  // the first replay, or a build whose instantiation failed
      build(inputs, variables);
      return instances_.front();
    }
    if (overlaps(inputs) != overlaps_) {
      debug_log(2, s.name, "graph replay: the inputs overlap other buffers differently than when the graph was "
                           "built: building it again (Note [CUDA graph dependencies])");
      build(inputs, variables);
      return instances_.front();
    }
    Instance* target = nullptr;
    if (recurring && instances_.size() < kMaxInstances) {
      try {
        target = &instantiate();
        debug_log(2, s.name, "graph replay: inputs seen again: a graph instance of their own ({} of at most {})",
                  instances_.size(), kMaxInstances);
      } catch (const Error& e) {
        // Out of memory, say: an extra instance is an optimization, patching still works.
        debug_log(1, s.name, "graph replay: no extra graph instance ({}): patching one", e.what());
      }
    }
    if (!target)
      target = &*std::min_element(instances_.begin(), instances_.end(),
                                  [](const Instance& a, const Instance& b) { return a.launched < b.launched; });
    if (!patch(*target, inputs, variables)) {
      rebuild(*target, inputs, variables);
      return *target;
    }
    remember(*target, inputs, variables);
    return *target;
  }

  // Replaces `instance`, whose graph's nodes the driver cannot patch these inputs into, with an
  // instance of a CUDA graph built for them (Note [CUDA graph instances]). Throws what the
  // driver says, leaving `instance` in place (describing no inputs) and every other instance.
  void rebuild(Instance& instance, std::span<const Allocation> inputs, std::span<const std::int32_t> variables) {
    const DeviceState& s = device_.state();
    Built& built = build_graph(inputs, variables);
    Instance fresh = make_instance(built);
    s.api.cuGraphExecDestroy(instance.exec);  // freed once a launch still running finished
    instance = std::move(fresh);
    remember(instance, inputs, variables);
    drop_unused_builts();
  }

  // The node's arguments for this replay, packed (8-byte addresses, then 4-byte values).
  std::vector<std::byte> pack(const GraphKernel& k, std::span<const Allocation> inputs,
                              std::span<const std::int32_t> variables) const {
    std::vector<std::byte> packed;
    pack_into(packed, k, inputs, variables);
    return packed;
  }
  // The same into `packed`, reusing its memory (a patch packs every node: no allocation each).
  void pack_into(std::vector<std::byte>& packed, const GraphKernel& k, std::span<const Allocation> inputs,
                 std::span<const std::int32_t> variables) const {
    packed.resize(Kernargs::bytes_for(k.buffers.size(), k.values.size()));
    const Kernargs args{packed.data(), static_cast<std::uint32_t>(k.buffers.size()),
                        static_cast<std::uint32_t>(k.values.size())};
    for (std::size_t i = 0; i < k.buffers.size(); ++i) args.set_buffer(i, resolve(k.buffers[i], inputs).va_addr);
    for (std::size_t i = 0; i < k.values.size(); ++i) args.set_value(i, resolve(k.values[i], variables));
  }

  // ---- Note [CUDA graph dependencies] ----
  struct Use {
    std::uint32_t resource;  // a fixed buffer (index into fixed_), or fixed_.size() + input index
    bool writes;
  };

  // The distinct fixed buffers and each node's uses of buffers.
  void find_uses() {
    std::map<std::pair<std::uintptr_t, std::size_t>, std::uint32_t> ids;
    const auto resource = [&](const GraphBuffer& b) -> std::uint32_t {
      if (!b.fixed) return static_cast<std::uint32_t>(b.input);  // offset by fixed_.size() below
      const auto [it, added] = ids.try_emplace({b.fixed->va_addr, b.fixed->size},
                                               static_cast<std::uint32_t>(fixed_.size()));
      if (added) fixed_.push_back(*b.fixed);
      return it->second;
    };
    std::vector<std::vector<std::pair<const GraphBuffer*, bool>>> raw(nodes_.size());
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      if (const auto* k = std::get_if<GraphKernel>(&nodes_[i])) {
        for (std::size_t b = 0; b < k->buffers.size(); ++b)
          raw[i].emplace_back(&k->buffers[b],
                              k->writes.empty() || std::find(k->writes.begin(), k->writes.end(), b) != k->writes.end());
      } else if (const auto& c = std::get<GraphCopy>(nodes_[i]); c.size != 0) {
        raw[i].emplace_back(&c.dest, true);
        raw[i].emplace_back(&c.src, false);
      }
      for (const auto& [buffer, writes] : raw[i]) resource(*buffer);
    }
    uses_.resize(nodes_.size());
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      for (const auto& [buffer, writes] : raw[i])
        uses_[i].push_back(Use{buffer->fixed ? resource(*buffer)
                                             : static_cast<std::uint32_t>(fixed_.size() + buffer->input),
                               writes});
  }

  // The memory of resource `r` in this replay, as [begin, end).
  std::pair<std::uint64_t, std::uint64_t> range(std::uint32_t r, std::span<const Allocation> inputs) const {
    const Allocation& a = r < fixed_.size() ? fixed_[r] : inputs[r - fixed_.size()];
    return {a.va_addr, a.va_addr + std::max<std::size_t>(a.size, 1)};
  }
  static bool overlap(std::pair<std::uint64_t, std::uint64_t> a, std::pair<std::uint64_t, std::uint64_t> b) {
    return a.first < b.second && b.first < a.second;
  }

  // The pairs (a, b), a < b and b an input, whose memory overlaps in this replay.
  std::vector<std::pair<std::uint32_t, std::uint32_t>> overlaps(std::span<const Allocation> inputs) const {
    std::vector<std::pair<std::uint32_t, std::uint32_t>> pairs;
    const auto first_input = static_cast<std::uint32_t>(fixed_.size());
    const auto all = static_cast<std::uint32_t>(fixed_.size() + inputs.size());
    for (std::uint32_t b = first_input; b < all; ++b)
      for (std::uint32_t a = 0; a < b; ++a)
        if (overlap(range(a, inputs), range(b, inputs))) pairs.emplace_back(a, b);
    return pairs;
  }

  // Each node's dependencies (indices of earlier nodes) for this replay's inputs, whose overlaps()
  // are `input_overlaps`.
  std::vector<std::vector<std::size_t>> dependencies(
      std::span<const Allocation> inputs, const std::vector<std::pair<std::uint32_t, std::uint32_t>>& input_overlaps) const {
    const std::size_t all = fixed_.size() + inputs.size();
    std::vector<std::vector<std::uint32_t>> overlapping(all);
    for (std::uint32_t r = 0; r < all; ++r) overlapping[r].push_back(r);
    const auto link = [&](std::uint32_t a, std::uint32_t b) {
      overlapping[a].push_back(b);
      overlapping[b].push_back(a);
    };
    for (std::uint32_t b = 0; b < fixed_.size(); ++b)
      for (std::uint32_t a = 0; a < b; ++a)
        if (overlap(range(a, inputs), range(b, inputs))) link(a, b);
    for (const auto& [a, b] : input_overlaps) link(a, b);
    constexpr std::size_t kNone = ~std::size_t{0};
    std::vector<std::size_t> last_writer(all, kNone);
    std::vector<std::vector<std::size_t>> readers(all);
    std::vector<std::vector<std::size_t>> deps(nodes_.size());
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      for (const Use& use : uses_[i]) {
        for (const std::uint32_t other : overlapping[use.resource]) {
          if (last_writer[other] != kNone) deps[i].push_back(last_writer[other]);
          if (use.writes) deps[i].insert(deps[i].end(), readers[other].begin(), readers[other].end());
        }
      }
      std::sort(deps[i].begin(), deps[i].end());
      deps[i].erase(std::unique(deps[i].begin(), deps[i].end()), deps[i].end());
      for (const Use& use : uses_[i]) {
        if (use.writes) {
          last_writer[use.resource] = i;
          readers[use.resource].clear();
        }
      }
      for (const Use& use : uses_[i])
        if (!use.writes) readers[use.resource].push_back(i);
    }
    return deps;
  }

  // Destroys the instantiated graphs and the graphs (a launch still running finishes first).
  void destroy() {
    const DeviceState& s = device_.state();
    for (const Instance& instance : instances_) s.api.cuGraphExecDestroy(instance.exec);
    instances_.clear();
    for (const std::unique_ptr<Built>& built : builts_) s.api.cuGraphDestroy(built->graph);
    builts_.clear();
  }

  // Destroys the CUDA graphs no instance was made from, but the newest (new instances come from it).
  void drop_unused_builts() {
    if (builts_.empty()) return;
    const DeviceState& s = device_.state();
    const Built* newest = builts_.back().get();
    std::erase_if(builts_, [&](const std::unique_ptr<Built>& built) {
      const bool used = built.get() == newest ||
                        std::ranges::any_of(instances_, [&](const Instance& i) { return i.built == built.get(); });
      if (!used) s.api.cuGraphDestroy(built->graph);
      return !used;
    });
  }

  // An executable graph of `built`, holding the arguments it was built with (then patched by the
  // caller). Throws what the driver says.
  Instance make_instance(const Built& built) {
    const DeviceState& s = device_.state();
    Instance instance;
    instance.built = &built;
    instance.args = built.args;  // first: nothing after the driver call may throw
    instance.copies = built.copies;
    check_call(s.api.cuGraphInstantiate(&instance.exec, built.graph, 0),
               fmt::format("cuGraphInstantiate of a graph of {} nodes (with {} executable graphs of at most {})",
                           nodes_.size(), instances_.size(), kMaxInstances));
    return instance;
  }
  // One more executable graph, of the newest CUDA graph.
  Instance& instantiate() {
    Instance instance = make_instance(*builts_.back());
    instances_.push_back(std::move(instance));  // reserved: no allocation
    return instances_.back();
  }

  // check(), after marking the device failed if the error is sticky (Note [CUDA failures]): a
  // graph call that sees the context broken says so as a launch would.
  void check_call(CUresult r, std::string_view what) const {
    if (r == CUDA_SUCCESS) [[likely]]
      return;
    device_.note_if_sticky(static_cast<int>(r), fmt::format("{}: {} failed: {}", device_.name(), what, describe(r)));
    check(r, what, device_.state().name);
  }

  // Fills `p` for kernel node `i` with arguments `args`; `extra` and `size` must outlive the
  // driver call that reads it.
  void kernel_params(std::size_t i, const std::vector<std::byte>& args, CUDA_KERNEL_NODE_PARAMS& p,
                     void* (&extra)[5], std::size_t& size) {
    const auto& k = std::get<GraphKernel>(nodes_[i]);
    size = args.size();
    extra[0] = CU_LAUNCH_PARAM_BUFFER_POINTER;
    extra[1] = const_cast<std::byte*>(args.data());
    extra[2] = CU_LAUNCH_PARAM_BUFFER_SIZE;
    extra[3] = &size;
    extra[4] = CU_LAUNCH_PARAM_END;
    p = {};
    p.extra = size ? extra : nullptr;  // no parameters: no buffer (a null one is an error)
    p.func = static_cast<CUfunction>(static_cast<const CudaProgram&>(*k.program).function());
    p.gridDimX = k.launch.global[0];
    p.gridDimY = k.launch.global[1];
    p.gridDimZ = k.launch.global[2];
    p.blockDimX = k.launch.local[0];
    p.blockDimY = k.launch.local[1];
    p.blockDimZ = k.launch.local[2];
  }

  static CUDA_MEMCPY3D copy_params(std::uint64_t dest, std::uint64_t src, std::size_t size) {
    CUDA_MEMCPY3D c{};
    c.srcMemoryType = CU_MEMORYTYPE_UNIFIED;
    c.srcDevice = static_cast<CUdeviceptr>(src);
    c.dstMemoryType = CU_MEMORYTYPE_UNIFIED;
    c.dstDevice = static_cast<CUdeviceptr>(dest);
    // A 1-D copy as tinygrad's graph writes it: pitch and height given for both ends too (the
    // driver checks them against the width where they are set), the pitch only up to the largest
    // one a device takes (CU_DEVICE_ATTRIBUTE_MAX_PITCH, 2^31 - 1). Beyond, neither is given
    // (pitch and height 0): exactly the form the driver itself gives a 1-D copy captured from a
    // stream (its node's parameters read back so), not a mix of the two forms. Unverified on a GPU
    // past 2 GiB: the GPU test of such a node will say.
    const bool pitched = size < (std::size_t{1} << 31);
    c.srcPitch = pitched ? size : 0;
    c.srcHeight = pitched ? 1 : 0;
    c.dstPitch = pitched ? size : 0;
    c.dstHeight = pitched ? 1 : 0;
    c.WidthInBytes = size;
    c.Height = 1;
    c.Depth = 1;
    return c;
  }

  // The first build, or one for inputs that overlap other buffers differently: every instance
  // goes, and one instance of a CUDA graph built for these inputs is left.
  void build(std::span<const Allocation> inputs, std::span<const std::int32_t> variables) {
    destroy();
    overlaps_ = overlaps(inputs);
    build_graph(inputs, variables);
    remember(instantiate(), inputs, variables);
  }

  // A CUDA graph of the nodes for these inputs (whose overlaps() are overlaps_), added to
  // builts_ as the newest. Throws what the driver says, having destroyed what it made.
  Built& build_graph(std::span<const Allocation> inputs, std::span<const std::int32_t> variables) {
    const DeviceState& s = device_.state();
    auto built = std::make_unique<Built>();
    built->args.assign(nodes_.size(), {});
    built->copies.assign(nodes_.size(), {0, 0});
    built->handles.assign(nodes_.size(), nullptr);
    const std::vector<std::vector<std::size_t>> dependencies = this->dependencies(inputs, overlaps_);
    std::size_t edges = 0;
    drop_unused_builts();  // so that the reserve below holds every Built that can be
    check_call(s.api.cuGraphCreate(&built->graph, 0), "cuGraphCreate");
    try {
      std::vector<CUgraphNode> before;
      for (std::size_t i = 0; i < nodes_.size(); ++i) {
        before.clear();
        for (const std::size_t d : dependencies[i]) before.push_back(built->handles[d]);
        const CUgraphNode* after = before.empty() ? nullptr : before.data();
        const std::size_t deps = before.size();
        edges += deps;
        CUgraphNode* node = &built->handles[i];
        if (const auto* k = std::get_if<GraphKernel>(&nodes_[i])) {
          built->args[i] = pack(*k, inputs, variables);
          CUDA_KERNEL_NODE_PARAMS p;
          void* extra[5];
          std::size_t size;
          kernel_params(i, built->args[i], p, extra, size);
          check_call(s.api.cuGraphAddKernelNode(node, built->graph, after, deps, &p),
                     fmt::format("adding kernel '{}' with grid ({},{},{}) and block ({},{},{}) to a graph (node {})",
                                 k->program->name(), k->launch.global[0], k->launch.global[1], k->launch.global[2],
                                 k->launch.local[0], k->launch.local[1], k->launch.local[2], i));
        } else if (const auto& c = std::get<GraphCopy>(nodes_[i]); c.size == 0) {
          check_call(s.api.cuGraphAddEmptyNode(node, built->graph, after, deps),
                     fmt::format("adding an empty node for a copy of 0 bytes to a graph (node {})", i));
        } else {
          built->copies[i] = {resolve(c.dest, inputs).va_addr, resolve(c.src, inputs).va_addr};
          const CUDA_MEMCPY3D params = copy_params(built->copies[i].first, built->copies[i].second, c.size);
          check_call(s.api.cuGraphAddMemcpyNode(node, built->graph, after, deps, &params, s.context),
                     fmt::format("adding a copy of {} bytes to a graph (node {})", c.size, i));
        }
      }
      builts_.reserve(kMaxInstances + 2);  // first: nothing after it may throw
    } catch (...) {
      s.api.cuGraphDestroy(built->graph);
      throw;
    }
    debug_log(2, s.name, "graph of {} nodes built with {} dependencies (Note [CUDA graph dependencies])",
              nodes_.size(), edges);
    builts_.push_back(std::move(built));
    return *builts_.back();
  }

  // Patches the nodes of `instance` whose inputs changed. False when the driver refuses a patch
  // (CUDA_ERROR_INVALID_VALUE, Note [CUDA graph replay]): the caller replaces the instance.
  bool patch(Instance& instance, std::span<const Allocation> inputs, std::span<const std::int32_t> variables) {
    instance.complete = false;  // until every patch landed, it describes no inputs
    const DeviceState& s = device_.state();
    const auto refused = [&](CUresult r, std::size_t i, std::string_view what) {
      if (r == CUDA_ERROR_INVALID_VALUE) {
        debug_log(2, s.name,
                  "graph node {} ({}): the driver refuses the patch ({}): a graph built for these inputs replaces "
                  "that executable graph (Note [CUDA graph instances])",
                  i, what, describe(r));
        return true;
      }
      check_call(r, fmt::format("patching {} of a graph (node {})", what, i));
      return false;
    };
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      if (const auto* k = std::get_if<GraphKernel>(&nodes_[i])) {
        pack_into(scratch_, *k, inputs, variables);
        if (scratch_ == instance.args[i]) continue;
        instance.args[i].assign(scratch_.begin(), scratch_.end());
        CUDA_KERNEL_NODE_PARAMS p;
        void* extra[5];
        std::size_t size;
        kernel_params(i, instance.args[i], p, extra, size);
        if (const CUresult r = s.api.cuGraphExecKernelNodeSetParams(instance.exec, instance.built->handles[i], &p);
            r != CUDA_SUCCESS) {
          instance.args[i].clear();  // unknown now: the next patch sets it again
          if (refused(r, i, fmt::format("kernel '{}'", k->program->name()))) return false;
        }
      } else {
        const auto& c = std::get<GraphCopy>(nodes_[i]);
        if (c.size == 0) continue;  // an empty node
        const std::pair<std::uint64_t, std::uint64_t> now{resolve(c.dest, inputs).va_addr,
                                                          resolve(c.src, inputs).va_addr};
        if (now == instance.copies[i]) continue;
        const CUDA_MEMCPY3D params = copy_params(now.first, now.second, c.size);
        if (const CUresult r = s.api.cuGraphExecMemcpyNodeSetParams(instance.exec, instance.built->handles[i], &params, s.context);
            r != CUDA_SUCCESS) {
          if (refused(r, i, fmt::format("a copy of {} bytes", c.size))) return false;
        }
        instance.copies[i] = now;
      }
    }
    return true;
  }

  CudaHCQDevice& device_;
  std::vector<Allocation> fixed_;      // the distinct fixed buffers (Note [CUDA graph dependencies])
  std::vector<std::vector<Use>> uses_;  // per node
  std::vector<std::pair<std::uint32_t, std::uint32_t>> overlaps_;  // overlaps() when built
  // The CUDA graphs the instances were made from, newest last (Note [CUDA graph instances]): at
  // most one per instance and the newest, and one more while a graph is being built.
  std::vector<std::unique_ptr<Built>> builts_;
  std::vector<Instance> instances_;  // Note [CUDA graph instances]; references stay valid: reserved
  std::uint64_t launches_ = 0;
  std::vector<std::byte> scratch_;  // patch's packing buffer
  std::array<std::uint64_t, kRecentInputSets> recent_{};  // the last replays' key_of
  std::size_t recent_next_ = 0;
  // A timeline value at or after the last replay's work (0: never replayed); the submit mutex
  // is held when it is written. The destructor waits for it.
  std::uint64_t last_replay_value_ = 0;
  struct ReplayMark {
    CudaGraph& graph;
    // Read once the replay's work was given to the driver (or failed): at least the value covering it.
    ~ReplayMark() { graph.last_replay_value_ = graph.device_.timeline_value(); }
  };
  std::string launch_what_ = fmt::format("launching a graph of {} nodes", nodes_.size());
};

}  // namespace

bool is_cuda_graph_of(const Graph& graph, const CudaHCQDevice& device) noexcept {
  const auto* cuda = dynamic_cast<const CudaGraph*>(&graph);
  return cuda && &cuda->device() == &device;
}

std::unique_ptr<Graph> CudaHCQDevice::create_graph(std::vector<GraphNode> nodes) {
  return std::make_unique<CudaGraph>(*this, std::move(nodes));
}

}  // namespace tinydev::cuda
