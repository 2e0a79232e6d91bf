#include "tinydev/graph.hpp"

#include <atomic>

#include <fmt/format.h>

#include <chrono>

#include "tinydev/device.hpp"
#include "tinydev/error.hpp"

namespace tinydev {

namespace {
std::atomic<std::uint64_t> g_next_graph_id{1};
}  // namespace

Graph::~Graph() = default;

Graph::Graph(std::vector<GraphNode> nodes)
    : nodes_(std::move(nodes)), id_(g_next_graph_id.fetch_add(1, std::memory_order_relaxed)) {
  // Input and variable numbers index replay arguments and size the graph's tables: bound them, so
  // that `index + 1` cannot wrap and a stray number cannot make the graph allocate without end.
  auto check_index = [](std::size_t index, std::size_t node, std::string_view what) {
    if (index >= kMaxGraphIndex)
      throw InvalidArgument(fmt::format("graph node {}: {} number {} is out of range: numbers run from 0 to {}",
                                        node, what, index, kMaxGraphIndex - 1));
  };
  std::size_t node_index = 0;
  auto see = [&](const GraphBuffer& b) {
    if (b.fixed) return;
    check_index(b.input, node_index, "input");
    num_inputs_ = std::max(num_inputs_, b.input + 1);
  };
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    node_index = i;
    if (const auto* k = std::get_if<GraphKernel>(&nodes_[i])) {
      if (!k->program) throw InvalidArgument(fmt::format("graph node {}: a kernel node needs a program", i));
      if (k->buffers.size() > kMaxGraphKernelArgs || k->values.size() > kMaxGraphKernelArgs)
        throw InvalidArgument(fmt::format("graph node {}: kernel '{}' with {} buffers and {} values: a node takes "
                                          "at most {} of each",
                                          i, k->program->name(), k->buffers.size(), k->values.size(),
                                          kMaxGraphKernelArgs));
      const bool grid = grid_size(k->launch.global) > 1;
      if (auto sig = k->program->signature(); sig && !sig->accepts(k->buffers.size(), k->values.size(), grid))
        throw InvalidArgument(fmt::format("graph node {}: kernel '{}' takes {} buffers and {} values, the node "
                                          "gives {} and {}",
                                          i, k->program->name(), sig->num_buffers, sig->num_values,
                                          k->buffers.size(), k->values.size()));
      for (const GraphBuffer& b : k->buffers) see(b);
      for (const std::size_t w : k->writes)
        if (w >= k->buffers.size())
          throw InvalidArgument(fmt::format("graph node {}: kernel '{}' writes buffer {}, but it takes {} buffers", i,
                                            k->program->name(), w, k->buffers.size()));
      for (const GraphValue& v : k->values) {
        if (v.constant) continue;
        check_index(v.variable, i, "variable");
        num_variables_ = std::max(num_variables_, v.variable + 1);
      }
    } else {
      const auto& c = std::get<GraphCopy>(nodes_[i]);
      see(c.dest);
      see(c.src);
      for (const GraphBuffer* b : {&c.dest, &c.src})
        if (b->fixed && b->fixed->size < c.size)
          throw InvalidArgument(fmt::format("graph node {}: a copy of {} bytes runs past a {}-byte allocation", i,
                                            c.size, b->fixed->size));
    }
  }
}

void Graph::check_replay(std::span<const Allocation> inputs, std::span<const std::int32_t> variables) const {
  if (inputs.size() != num_inputs_ || variables.size() != num_variables_)
    throw InvalidArgument(fmt::format("graph replay with {} inputs and {} variables: the graph takes {} and {}",
                                      inputs.size(), variables.size(), num_inputs_, num_variables_));
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const auto* c = std::get_if<GraphCopy>(&nodes_[i]);
    if (!c) continue;
    for (const GraphBuffer* b : {&c->dest, &c->src})
      if (!b->fixed && inputs[b->input].size < c->size)
        throw InvalidArgument(fmt::format("graph replay: input {} has {} bytes, node {} copies {}", b->input,
                                          inputs[b->input].size, i, c->size));
  }
}

namespace {

class EagerGraph final : public Graph {
 public:
  EagerGraph(Compiled& device, std::vector<GraphNode> nodes) : Graph(std::move(nodes)), device_(device) {}

  std::optional<double> replay(std::span<const Allocation> inputs, std::span<const std::int32_t> variables,
                               bool wait) override {
    check_replay(inputs, variables);
    const auto start = std::chrono::steady_clock::now();
    std::vector<Allocation> bufs;
    std::vector<std::int32_t> vals;
    std::vector<std::byte> staging;
    for (const GraphNode& node : nodes_) {
      if (const auto* k = std::get_if<GraphKernel>(&node)) {
        bufs.clear();
        vals.clear();
        for (const GraphBuffer& b : k->buffers) bufs.push_back(resolve(b, inputs));
        for (const GraphValue& v : k->values) vals.push_back(resolve(v, variables));
        (*k->program)(bufs, vals, LaunchParams{k->launch.global, k->launch.local, false});
      } else {
        const auto& c = std::get<GraphCopy>(node);
        staging.resize(c.size);
        device_.allocator().copyout(staging, Allocation{resolve(c.src, inputs).va_addr, c.size, resolve(c.src, inputs).backend});
        device_.allocator().copyin(Allocation{resolve(c.dest, inputs).va_addr, c.size, resolve(c.dest, inputs).backend}, staging);
      }
    }
    if (!wait) return std::nullopt;
    device_.synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

 private:
  Compiled& device_;
};

}  // namespace

std::unique_ptr<Graph> make_eager_graph(Compiled& device, std::vector<GraphNode> nodes) {
  return std::make_unique<EagerGraph>(device, std::move(nodes));
}

}  // namespace tinydev
