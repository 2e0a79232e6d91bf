// tinydev/graph.hpp: recorded lists of kernel launches and copies, replayed with new inputs.
//
// A graph is recorded once (nodes naming fixed allocations or numbered inputs, constant or
// numbered variable int32 values) and replayed any number of times with new input allocations and
// new variable values. HCQ devices replay natively by patching only what changed in recorded
// queues and kernel arguments (the seed's HCQGraph); other devices replay eagerly, node by node.
// Replay gives the same results as running the nodes eagerly in order.
//
// Ownership: a graph keeps its programs alive; fixed allocations must outlive it; input
// allocations must stay alive until the replay finished (replay with wait, or synchronize).
// Thread safety: one graph is replayed by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <variant>
#include <vector>

#include "tinydev/compile.hpp"
#include "tinydev/memory.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

// Bounds on what one graph may name: input and variable numbers below kMaxGraphIndex, at most
// kMaxGraphKernelArgs buffers and as many values per kernel node (InvalidArgument otherwise).
inline constexpr std::size_t kMaxGraphIndex = std::size_t{1} << 20;
inline constexpr std::size_t kMaxGraphKernelArgs = 4096;

// A buffer argument: a fixed allocation, or input number `input` of each replay.
struct GraphBuffer {
  std::optional<Allocation> fixed;
  std::size_t input = 0;
  static GraphBuffer of(Allocation a) { return GraphBuffer{a, 0}; }
  static GraphBuffer in(std::size_t index) { return GraphBuffer{std::nullopt, index}; }
};

// An int32 argument: a constant, or variable number `variable` of each replay.
struct GraphValue {
  std::optional<std::int32_t> constant;
  std::size_t variable = 0;
  static GraphValue of(std::int32_t v) { return GraphValue{v, 0}; }
  static GraphValue var(std::size_t index) { return GraphValue{std::nullopt, index}; }
};

struct GraphKernel {
  std::shared_ptr<Program> program;
  std::vector<GraphBuffer> buffers;
  std::vector<GraphValue> values;
  LaunchParams launch{};
  // The indices into `buffers` the kernel writes (tinygrad's ProgramSpec.outs); empty: any of
  // them. Native graphs let nodes that write nothing another node touches run at once (Note
  // [CUDA graph dependencies]); a kernel writing a buffer not listed here races with them.
  std::vector<std::size_t> writes{};
};

struct GraphCopy {
  GraphBuffer dest;
  GraphBuffer src;
  std::size_t size = 0;
};

using GraphNode = std::variant<GraphKernel, GraphCopy>;

class Graph {
 public:
  virtual ~Graph();  // out of line: the key function, so consumers' TUs do not instantiate the node vector
  // Runs every node in order with these inputs and variables. InvalidArgument (nothing run) on
  // a wrong count or an input smaller than a copy needs. Returns seconds when `wait`.
  virtual std::optional<double> replay(std::span<const Allocation> inputs,
                                       std::span<const std::int32_t> variables = {}, bool wait = false) = 0;
  std::size_t num_inputs() const noexcept { return num_inputs_; }
  // A number for this graph, unique in the process (per copy of tinydev): the profile's args.graph.
  std::uint64_t id() const noexcept { return id_; }
  std::size_t num_variables() const noexcept { return num_variables_; }
  const std::vector<GraphNode>& nodes() const noexcept { return nodes_; }

 protected:
  // Validates the nodes (program signatures, input/variable numbering).
  explicit Graph(std::vector<GraphNode> nodes);
  void check_replay(std::span<const Allocation> inputs, std::span<const std::int32_t> variables) const;
  Allocation resolve(const GraphBuffer& b, std::span<const Allocation> inputs) const {
    return b.fixed ? *b.fixed : inputs[b.input];
  }
  std::int32_t resolve(const GraphValue& v, std::span<const std::int32_t> variables) const {
    return v.constant ? *v.constant : variables[v.variable];
  }

  std::vector<GraphNode> nodes_;
  std::size_t num_inputs_ = 0, num_variables_ = 0;
  std::uint64_t id_ = 0;
};

class Compiled;
// The fallback for devices without native graphs: every replay runs the nodes one by one through
// Program calls and host round-trip copies.
std::unique_ptr<Graph> make_eager_graph(Compiled& device, std::vector<GraphNode> nodes);

}  // namespace tinydev

TINYDEV_API_END
