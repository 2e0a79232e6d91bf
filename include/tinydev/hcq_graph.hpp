// tinydev/hcq_graph.hpp: native graph replay on HCQ devices (the seed's HCQGraph).
//
// Note [HCQ graph replay]
// Recording builds, twice, one compute queue and one copy queue holding every node, each pair with
// its own block of kernel arguments; replays alternate between the two copies. Each node waits on
// the graph's own signal reaching its position and bumps it when done, so nodes run in recorded
// order across the two queues; the compute queue starts by waiting for the device timeline (work
// submitted before the replay) and ends by signalling it. A replay patches its copy in place: the
// signal values (every replay uses fresh ones), the kernel-argument slots of inputs and variables
// that differ from what that copy last ran with, and the copy commands whose inputs differ; then
// it submits both queues. Kernel arguments are only rewritten after the replay that last used
// them finished reading them: with two copies that is the replay before the previous one, so a
// replay with new inputs does not wait for the previous replay (double buffering), and patching a
// queue whose last run ended copies nothing. A store that bumps the graph's signal wakes only a
// waiter whose value it reaches (Note [Signal waits]): no futex call per node.
//
// Requirements on Device: tinydev::HCQDevice (tinydev/hcq_concepts.hpp).
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "tinydev/graph.hpp"
#include "tinydev/hcq.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

template <class Device>
class HCQGraph final : public Graph {
  using ComputeQueue = typename Device::compute_queue_type;
  using CopyQueue = typename Device::copy_queue_type;
  using ProgramT = typename ComputeQueue::program_type;

 public:
  HCQGraph(Device& device, std::vector<GraphNode> nodes) : Graph(std::move(nodes)), device_(device) {
    static_assert(HCQDevice<Device>, "HCQGraph's Device must satisfy tinydev::HCQDevice (tinydev/hcq_concepts.hpp)");
    std::size_t kernarg_bytes = 0;
    std::vector<std::size_t> offsets;
    for (const GraphNode& node : nodes_) {
      offsets.push_back(kernarg_bytes);
      if (const auto* k = std::get_if<GraphKernel>(&node))
        kernarg_bytes += (Kernargs::bytes_for(k->buffers.size(), k->values.size()) + 15) / 16 * 16;
    }
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      const auto* k = std::get_if<GraphKernel>(&nodes_[i]);
      const auto* program = k ? dynamic_cast<const ProgramT*>(k->program.get()) : nullptr;
      if (k && (!program || program->device() != kernels_device(device)))
        throw InvalidArgument(fmt::format(TINYDEV_FMT("graph node {}: kernel '{}' {}, not by {}'s runtime: load it "
                                          "with Device[\"{}\"].load_kernel"),
                                          i, k->program->name(),
                                          program ? fmt::format(TINYDEV_FMT("was loaded by {}"), program->device())
                                                  : std::string("is another backend's program"),
                                          device.name(), device.name()));
    }
    signal_ = device.alloc_signal(0);
    try {
      for (Copy& copy : copies_) {
        copy.kernargs_block = device.allocate_kernargs_block(std::max<std::size_t>(kernarg_bytes, 16));
        record(copy, offsets);
      }
    } catch (...) {
      device.free_signal(signal_);
      throw;
    }
  }

  // Queued work reads our kernel arguments and runs our programs: wait for the last replay's end
  // (a poisoned signal means that work will never run). After kDestroyWait, the work is left
  // running with what it uses leaked, never freed under it, and the destructor returns.
  static constexpr std::chrono::seconds kDestroyWait{30};
  ~HCQGraph() override {
    bool finished = true;
    if (replays_ && device_.opened_in_this_process()) {
      try {
        signal_.wait(last_replay_end(), kDestroyWait);
      } catch (const Timeout& e) {
        finished = false;
        log_message(LogLevel::warning, device_.name(),
                    fmt::format(TINYDEV_FMT("a graph destroyed while its replay still runs after {} s; leaking its kernel "
                                "arguments and programs instead of freeing them under it: {}"),
                                kDestroyWait.count(), e.what()));
      } catch (...) {
      }
    }
    if (!finished || !device_.opened_in_this_process()) {
      struct Leaked {
        std::vector<GraphNode> nodes;
        std::shared_ptr<std::byte[]> kernargs[2];
      };
      new Leaked{std::move(nodes_), {copies_[0].kernargs_block, copies_[1].kernargs_block}};
      return;
    }
    try {
      device_.free_signal(signal_);
    } catch (...) {
    }
  }

  Device& device() const noexcept { return device_; }

 private:
  // One copy of the graph's queues and kernel arguments (Note [HCQ graph replay]).
  struct Copy {
    std::shared_ptr<std::byte[]> kernargs_block;
    std::vector<Kernargs> kernargs;
    ComputeQueue compute;
    CopyQueue copy;
    std::uint64_t replays = 0, last_final = 0;  // replays that used this copy; the signal value ending the last
    std::vector<Allocation> last_inputs;
    std::vector<std::int32_t> last_variables;
  };

  void record(Copy& copy, const std::vector<std::size_t>& offsets) {
    Device& device = device_;
    std::lock_guard lock(device.submit_mutex());
    ProfileGraphScope graph_scope(id());  // the execs recorded here are this graph's in the trace
    // The node layout (uses, command indices) is the same in both copies: note it once.
    const bool first_copy = &copy == &copies_[0];
    ComputeQueue& compute_q = copy.compute;
    CopyQueue& copy_q = copy.copy;
    compute_q.wait(device.timeline_signal(), 0).signal(signal_, 0);
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      NodeCommands cmds;
      if (auto* k = std::get_if<GraphKernel>(&nodes_[i])) {
        const auto* program = static_cast<const ProgramT*>(k->program.get());  // checked above
        Kernargs args{copy.kernargs_block.get() + offsets[i], static_cast<std::uint32_t>(k->buffers.size()),
                      static_cast<std::uint32_t>(k->values.size())};
        copy.kernargs.push_back(args);
        for (std::size_t j = 0; j < k->buffers.size(); ++j) {
          if (k->buffers[j].fixed) args.set_buffer(j, k->buffers[j].fixed->va_addr);
          else if (first_copy) input_uses_.push_back({k->buffers[j].input, i, j, Use::kernarg});
        }
        for (std::size_t j = 0; j < k->values.size(); ++j) {
          if (k->values[j].constant) args.set_value(j, *k->values[j].constant);
          else if (first_copy) variable_uses_.push_back({k->values[j].variable, copy.kernargs.size() - 1, j});
        }
        cmds.on_compute = true;
        cmds.wait = compute_q.size();
        compute_q.wait(signal_, 0);
        cmds.op = compute_q.size();
        compute_q.exec(*program, args, k->launch.global, k->launch.local);
        cmds.signal = compute_q.size();
        compute_q.signal(signal_, 0);
        cmds.kernargs = copy.kernargs.size() - 1;
      } else {
        auto& c = std::get<GraphCopy>(nodes_[i]);
        if (first_copy && !c.dest.fixed) input_uses_.push_back({c.dest.input, i, 0, Use::copy_dest});
        if (first_copy && !c.src.fixed) input_uses_.push_back({c.src.input, i, 0, Use::copy_src});
        // Inputs are patched in before the first replay; record with placeholders of the right size.
        Allocation placeholder{0, c.size, nullptr};
        cmds.wait = copy_q.size();
        copy_q.wait(signal_, 0);
        cmds.op = copy_q.size();
        copy_q.copy(c.dest.fixed ? *c.dest.fixed : placeholder, c.src.fixed ? *c.src.fixed : placeholder, c.size);
        cmds.signal = copy_q.size();
        copy_q.signal(signal_, 0);
      }
      if (first_copy) commands_.push_back(cmds);
    }
    epilogue_wait_ = compute_q.size();
    compute_q.wait(signal_, 0);
    epilogue_signal_ = compute_q.size();
    compute_q.signal(device.timeline_signal(), 0);
  }

 public:
  std::optional<double> replay(std::span<const Allocation> inputs, std::span<const std::int32_t> variables,
                               bool wait) override {
    check_replay(inputs, variables);
    device_.check_usable();
    device_.check_no_reservation_held("a graph replay");
    const auto start = std::chrono::steady_clock::now();
    std::unique_lock lock(device_.submit_mutex());
    if (signal_.slot().poisoned.load(std::memory_order_acquire)) [[unlikely]] {
      // A replay failed, and the device has recovered since (check_usable passed, so its queues
      // drained): the graph goes on from its last replay's end.
      signal_.slot().clear_poison();
      signal_.set(last_replay_end());
    }
    Copy& copy = copies_[replays_ % std::size(copies_)];
    ComputeQueue& compute_q = copy.compute;
    CopyQueue& copy_q = copy.copy;
    const bool first = copy.replays == 0;
    // Kernel arguments of this copy's last replay (the one before the previous): wait for it to
    // finish reading them before rewriting any (usually it has).
    bool kernargs_change = first;
    for (const Use& u : input_uses_)
      if (u.kind == Use::kernarg && (first || !(inputs[u.input] == copy.last_inputs[u.input]))) kernargs_change = true;
    for (const VarUse& u : variable_uses_)
      if (first || variables[u.variable] != copy.last_variables[u.variable]) kernargs_change = true;
    if (kernargs_change && !first) signal_.wait(copy.last_final);
    for (const Use& u : input_uses_) {
      if (!first && inputs[u.input] == copy.last_inputs[u.input]) continue;
      const NodeCommands& cmds = commands_[u.node];
      if (u.kind == Use::kernarg) copy.kernargs[cmds.kernargs].set_buffer(u.slot, inputs[u.input].va_addr);
      else if (u.kind == Use::copy_dest) copy_q.update_copy(cmds.op, inputs[u.input], std::nullopt);
      else copy_q.update_copy(cmds.op, std::nullopt, inputs[u.input]);
    }
    for (const VarUse& u : variable_uses_)
      if (first || variables[u.variable] != copy.last_variables[u.variable])
        copy.kernargs[u.kernargs].set_value(u.slot, variables[u.variable]);
    copy.last_inputs.assign(inputs.begin(), inputs.end());
    copy.last_variables.assign(variables.begin(), variables.end());

    // Fresh signal values for this replay (Note [HCQ graph replay]).
    const std::uint64_t base = replays_ * (nodes_.size() + 1) + 1;
    const std::uint64_t timeline = device_.next_timeline_value();
    compute_q.update_wait(0, device_.timeline_signal(), timeline - 1).update_signal(1, std::nullopt, base);
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      const NodeCommands& cmds = commands_[i];
      if (cmds.on_compute)
        compute_q.update_wait(cmds.wait, std::nullopt, base + i).update_signal(cmds.signal, std::nullopt, base + i + 1);
      else
        copy_q.update_wait(cmds.wait, std::nullopt, base + i).update_signal(cmds.signal, std::nullopt, base + i + 1);
    }
    compute_q.update_wait(epilogue_wait_, std::nullopt, base + nodes_.size())
        .update_signal(epilogue_signal_, device_.timeline_signal(), timeline);
    // Note [Inline replay] (src/cpu/cpu_hcq.cpp): a device may run a waited-for replay on the caller.
    bool ran_inline = false;
    if constexpr (requires(Device& d) { d.run_inline_if_idle(compute_q, copy_q, timeline - 1, lock); }) {
      if (wait) ran_inline = device_.run_inline_if_idle(compute_q, copy_q, timeline - 1, lock);
    }
    if (!ran_inline) {
      if (copy_q.size()) copy_q.submit(device_);
      compute_q.submit(device_);
    }
    replays_ += 1;
    copy.replays += 1;
    copy.last_final = base + nodes_.size();
    if (!wait) return std::nullopt;
    device_.wait_timeline(timeline);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

 private:
  // The graph signal's value at the end of the last replay (0 before the first).
  std::uint64_t last_replay_end() const noexcept {
    return replays_ ? copies_[(replays_ - 1) % std::size(copies_)].last_final : 0;
  }

  // The device name the graph's programs must have been loaded on (a stream's lane runs its
  // device's programs).
  static const std::string& kernels_device(const Device& device) {
    if constexpr (requires { device.kernels_device(); }) return device.kernels_device();
    else return device.name();
  }

  struct NodeCommands {
    bool on_compute = false;
    std::size_t wait = 0, op = 0, signal = 0, kernargs = 0;
  };
  struct Use {
    std::size_t input, node, slot;
    enum Kind { kernarg, copy_dest, copy_src } kind;
  };
  struct VarUse {
    std::size_t variable, kernargs, slot;
  };

  Device& device_;
  Signal signal_;
  Copy copies_[2];
  std::vector<NodeCommands> commands_;
  std::vector<Use> input_uses_;
  std::vector<VarUse> variable_uses_;
  std::size_t epilogue_wait_ = 0, epilogue_signal_ = 0;
  std::uint64_t replays_ = 0;
};

}  // namespace tinydev

TINYDEV_API_END
