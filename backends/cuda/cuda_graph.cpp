// Native CUDA graphs for CudaHCQDevice::create_graph.
//
// Note [CUDA graph replay]
// The first replay builds a CUDA graph from the nodes with the replay's inputs: a kernel node per
// kernel (its arguments packed as a direct launch packs them) and a 1-D memcpy node per copy, each
// depending on the node before it, so the graph runs the nodes in order as eager execution would;
// then instantiates it. Each later replay packs every node's arguments again and patches, in the
// instantiated graph, only the nodes whose arguments or addresses changed
// (cuGraphExecKernelNodeSetParams, cuGraphExecMemcpyNodeSetParams; a patch affects later launches
// only, so one still running is safe), then launches it with one cuGraphLaunch on the compute
// stream, ordered on the device's timeline like a direct call (CudaHCQDevice::run_ordered). A
// replay with unchanged inputs patches nothing. The driver refuses some patches
// (CUDA_ERROR_INVALID_VALUE): a copy whose memory now belongs to another context, or is host
// memory where it was device memory; then the graph is built and instantiated again for these
// inputs (the old executable graph is freed by the driver once a launch still running finished).
// A copy of 0 bytes is an empty node (the driver takes no zero-length copy node), and a kernel
// without parameters gets no argument buffer. While profiling, replays run node by node (each
// through run_ordered), so every kernel and copy has its own span in the trace.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
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
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      const auto* k = std::get_if<GraphKernel>(&nodes_[i]);
      if (!k) continue;
      const auto* program = dynamic_cast<const CudaProgram*>(k->program.get());
      if (!program || program->device() != device.name())
        throw InvalidArgument(fmt::format("graph node {}: kernel '{}' was not loaded by {}'s runtime: load it "
                                          "with Device[\"{}\"].load_kernel",
                                          i, k->program->name(), device.name(), device.name()));
      const Dim3& g = k->launch.global;
      const Dim3& l = k->launch.local;
      if (grid_size(g) == 0 || grid_size(l) == 0)
        throw InvalidArgument(fmt::format("graph node {}: '{}' has a zero dimension in global size ({},{},{}) or "
                                          "local size ({},{},{})",
                                          i, k->program->name(), g[0], g[1], g[2], l[0], l[1], l[2]));
    }
  }

  ~CudaGraph() override {
    const DeviceState& s = device_.state();
    if (s.released.load()) return;  // at exit the context took the graph along
    try {
      // A replay may still run: wait for it.
      if (replayed_) device_.wait_timeline_reached(device_.last_submitted_value());
    } catch (const std::exception&) {
      // The device failed: its work will not run any more.
    }
    if (s.api.cuCtxSetCurrent(s.context) != CUDA_SUCCESS) return;
    destroy();
  }

  std::optional<double> replay(std::span<const Allocation> inputs, std::span<const std::int32_t> variables,
                               bool wait) override {
    check_replay(inputs, variables);
    std::lock_guard lock(device_.submit_mutex());
    device_.throw_if_failed();
    const DeviceState& s = device_.state();
    s.make_current();
    if (device_.profiling()) return replay_node_by_node(inputs, variables, wait);
    if (!exec_) {
      build(inputs, variables);
    } else if (!same_as_last(inputs, variables) && !patch(inputs, variables)) {
      destroy();
      build(inputs, variables);
    }
    remember(inputs, variables);
    auto work = [&](void* stream) { return static_cast<int>(s.api.cuGraphLaunch(exec_, static_cast<CUstream>(stream))); };
    const std::optional<double> seconds = device_.run_ordered(work, launch_what_, wait);
    replayed_ = true;
    return seconds;
  }

 private:
  // Profiling: each node on its own, so each kernel and copy gets its own span in the trace.
  std::optional<double> replay_node_by_node(std::span<const Allocation> inputs, std::span<const std::int32_t> variables,
                                            bool wait) {
    const DeviceState& s = device_.state();
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
      replayed_ = true;
    }
    if (!wait) return std::nullopt;
    return seconds;
  }

  // Whether this replay's inputs and variables are the last replay's (then nothing is patched).
  bool same_as_last(std::span<const Allocation> inputs, std::span<const std::int32_t> variables) const {
    if (inputs.size() != last_inputs_.size() || !std::equal(variables.begin(), variables.end(), last_variables_.begin(),
                                                            last_variables_.end()))
      return false;
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].va_addr != last_inputs_[i]) return false;
    return true;
  }
  void remember(std::span<const Allocation> inputs, std::span<const std::int32_t> variables) {
    last_inputs_.resize(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) last_inputs_[i] = inputs[i].va_addr;
    last_variables_.assign(variables.begin(), variables.end());
  }

  // The node's arguments for this replay, packed (8-byte addresses, then 4-byte values).
  std::vector<std::byte> pack(const GraphKernel& k, std::span<const Allocation> inputs,
                              std::span<const std::int32_t> variables) const {
    std::vector<std::byte> packed(Kernargs::bytes_for(k.buffers.size(), k.values.size()));
    const Kernargs args{packed.data(), static_cast<std::uint32_t>(k.buffers.size()),
                        static_cast<std::uint32_t>(k.values.size())};
    for (std::size_t i = 0; i < k.buffers.size(); ++i) args.set_buffer(i, resolve(k.buffers[i], inputs).va_addr);
    for (std::size_t i = 0; i < k.values.size(); ++i) args.set_value(i, resolve(k.values[i], variables));
    return packed;
  }

  // Destroys the instantiated graph and the graph (a launch still running finishes first).
  void destroy() {
    const DeviceState& s = device_.state();
    if (exec_) s.api.cuGraphExecDestroy(exec_);
    if (graph_) s.api.cuGraphDestroy(graph_);
    exec_ = nullptr;
    graph_ = nullptr;
  }

  // Fills `p` for kernel node `i`; `extra` and `size` must outlive the driver call that reads it.
  void kernel_params(std::size_t i, CUDA_KERNEL_NODE_PARAMS& p, void* (&extra)[5], std::size_t& size) {
    const auto& k = std::get<GraphKernel>(nodes_[i]);
    size = args_[i].size();
    extra[0] = CU_LAUNCH_PARAM_BUFFER_POINTER;
    extra[1] = args_[i].data();
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
    c.WidthInBytes = size;
    c.Height = 1;
    c.Depth = 1;
    return c;
  }

  void build(std::span<const Allocation> inputs, std::span<const std::int32_t> variables) {
    const DeviceState& s = device_.state();
    args_.assign(nodes_.size(), {});
    copies_.assign(nodes_.size(), {0, 0});
    handles_.assign(nodes_.size(), nullptr);
    check(s.api.cuGraphCreate(&graph_, 0), "cuGraphCreate", s.name);
    try {
      for (std::size_t i = 0; i < nodes_.size(); ++i) {
        const CUgraphNode* after = i ? &handles_[i - 1] : nullptr;
        const std::size_t deps = i ? 1 : 0;
        if (const auto* k = std::get_if<GraphKernel>(&nodes_[i])) {
          args_[i] = pack(*k, inputs, variables);
          CUDA_KERNEL_NODE_PARAMS p;
          void* extra[5];
          std::size_t size;
          kernel_params(i, p, extra, size);
          check(s.api.cuGraphAddKernelNode(&handles_[i], graph_, after, deps, &p),
                fmt::format("adding kernel '{}' to a graph (node {})", k->program->name(), i), s.name);
        } else if (const auto& c = std::get<GraphCopy>(nodes_[i]); c.size == 0) {
          check(s.api.cuGraphAddEmptyNode(&handles_[i], graph_, after, deps),
                fmt::format("adding an empty node for a copy of 0 bytes to a graph (node {})", i), s.name);
        } else {
          copies_[i] = {resolve(c.dest, inputs).va_addr, resolve(c.src, inputs).va_addr};
          const CUDA_MEMCPY3D params = copy_params(copies_[i].first, copies_[i].second, c.size);
          check(s.api.cuGraphAddMemcpyNode(&handles_[i], graph_, after, deps, &params, s.context),
                fmt::format("adding a copy of {} bytes to a graph (node {})", c.size, i), s.name);
        }
      }
      check(s.api.cuGraphInstantiate(&exec_, graph_, 0), "cuGraphInstantiate", s.name);
    } catch (...) {
      destroy();
      throw;
    }
  }

  // Patches the nodes whose inputs changed. False when the driver refuses a patch
  // (CUDA_ERROR_INVALID_VALUE, Note [CUDA graph replay]): the caller builds the graph again.
  bool patch(std::span<const Allocation> inputs, std::span<const std::int32_t> variables) {
    const DeviceState& s = device_.state();
    const auto refused = [&](CUresult r, std::size_t i, std::string_view what) {
      if (r == CUDA_ERROR_INVALID_VALUE) {
        debug_log(2, s.name, "graph node {} ({}): the driver refuses the patch ({}): building the graph again", i,
                  what, describe(r));
        return true;
      }
      check(r, fmt::format("patching {} of a graph (node {})", what, i), s.name);
      return false;
    };
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      if (const auto* k = std::get_if<GraphKernel>(&nodes_[i])) {
        std::vector<std::byte> packed = pack(*k, inputs, variables);
        if (packed == args_[i]) continue;
        args_[i] = std::move(packed);
        CUDA_KERNEL_NODE_PARAMS p;
        void* extra[5];
        std::size_t size;
        kernel_params(i, p, extra, size);
        if (const CUresult r = s.api.cuGraphExecKernelNodeSetParams(exec_, handles_[i], &p); r != CUDA_SUCCESS) {
          args_[i].clear();  // unknown now: the next replay patches it again
          if (refused(r, i, fmt::format("kernel '{}'", k->program->name()))) return false;
        }
      } else {
        const auto& c = std::get<GraphCopy>(nodes_[i]);
        if (c.size == 0) continue;  // an empty node
        const std::pair<std::uint64_t, std::uint64_t> now{resolve(c.dest, inputs).va_addr,
                                                          resolve(c.src, inputs).va_addr};
        if (now == copies_[i]) continue;
        const CUDA_MEMCPY3D params = copy_params(now.first, now.second, c.size);
        if (const CUresult r = s.api.cuGraphExecMemcpyNodeSetParams(exec_, handles_[i], &params, s.context);
            r != CUDA_SUCCESS) {
          if (refused(r, i, fmt::format("a copy of {} bytes", c.size))) return false;
        }
        copies_[i] = now;
      }
    }
    return true;
  }

  CudaHCQDevice& device_;
  CUgraph graph_ = nullptr;
  CUgraphExec exec_ = nullptr;
  std::vector<CUgraphNode> handles_;
  std::vector<std::vector<std::byte>> args_;                         // per kernel node, as patched last
  std::vector<std::pair<std::uint64_t, std::uint64_t>> copies_;      // per copy node: (dest, src)
  bool replayed_ = false;
  std::vector<std::uintptr_t> last_inputs_;   // the last replay's input addresses
  std::vector<std::int32_t> last_variables_;  // and variables
  std::string launch_what_ = fmt::format("launching a graph of {} nodes", nodes_.size());
};

}  // namespace

std::unique_ptr<Graph> CudaHCQDevice::create_graph(std::vector<GraphNode> nodes) {
  return std::make_unique<CudaGraph>(*this, std::move(nodes));
}

}  // namespace tinydev::cuda
