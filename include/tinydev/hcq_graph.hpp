// tinydev/hcq_graph.hpp: native graph replay on HCQ devices (the seed's HCQGraph).
//
// Note [HCQ graph replay]
// Recording builds one compute queue and one copy queue holding every node, with its own block of
// kernel arguments: a copy of the graph. Nodes run in recorded order: a queue runs its own in
// order, and where the nodes change queues the graph's own signal orders them: the last node
// before the switch sets it to the next node's position and the first after it waits for that
// (tinygrad's graph, too, waits only for the other queues). Nodes between pass no signal, which
// relies on a queue running its commands in order (hcq_concepts.hpp): a graph of 1,000 kernels
// and no copies has two graph-signal stores (the prologue's and the last node's), and a replay
// patches a handful of commands, not 2,000 (each a store into words the worker just read, on
// another core): a replay of 1,000 CPU kernels went from 58-104 ns per node to 17-29
// (docs/performance.md). The last node always sets the signal to the replay's base plus the node
// count, which is how a copy's replay is known to be finished.
// The compute queue starts by waiting for the device timeline (work submitted before the replay)
// and ends by signalling it. A replay patches one copy in place: the signal values (every replay
// uses fresh ones), the kernel-argument slots of inputs and variables that differ from what that copy
// last ran with, and the copy commands whose inputs differ; then it submits both queues, the compute
// queue first (submit_both says why; a submit snapshots the commands, so patching a queue whose
// last run has not ended is safe). Kernel
// arguments, though, are read by the kernels when they run: a copy's are only rewritten once the
// replay that last used them finished. So a replay takes, in this order: a copy whose kernel
// arguments already hold this replay's inputs and variables (nothing to rewrite; it may still
// run); the least recently replayed copy, if its replay finished (replays finish in order, so if
// it has not, none has); a new copy, recorded now, while the graph has fewer than kMaxCopies; and
// only past that, waits for the least recently replayed one. The graph starts with two copies, so
// alternating input sets rewrite nothing and a replay with new inputs does not wait for the
// previous one (double buffering); replays with new inputs queued behind work not yet run (a
// stream held behind an event) get a copy each and return at once, up to kMaxCopies of them. A
// store that bumps the graph's signal wakes only a waiter whose value it reaches (Note [Signal
// waits]): no futex call per switch between queues.
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
    for (const GraphNode& node : nodes_) {
      kernarg_offsets_.push_back(kernarg_bytes_);
      if (const auto* k = std::get_if<GraphKernel>(&node))
        kernarg_bytes_ += (Kernargs::bytes_for(k->buffers.size(), k->values.size()) + 15) / 16 * 16;
    }
    kernarg_bytes_ = std::max<std::size_t>(kernarg_bytes_, 16);
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
      copies_.reserve(kMaxCopies);
      for (int i = 0; i < 2; ++i) add_copy();
    } catch (...) {
      device.free_signal(signal_);
      throw;
    }
  }

  // At most this many copies of the graph's queues and kernel arguments (Note [HCQ graph replay]):
  // a replay with new inputs while this many replays are queued and not finished waits for the
  // oldest.
  static constexpr std::size_t kMaxCopies = 16;

  // Queued work reads our kernel arguments and runs our programs: wait for the last replay's end
  // (a poisoned signal means that work will never run). After TINYDEV_WAIT_TIMEOUT_MS (at most 1 s
  // once a wait on the device timed out), the work is left running with what it uses leaked, never
  // freed under it, and the destructor returns.
  ~HCQGraph() override {
    bool finished = true;
    if (replays_ && device_.opened_in_this_process()) {
      const std::chrono::milliseconds timeout = device_.free_wait_timeout();
      try {
        signal_.wait(last_replay_end(), timeout);
      } catch (const Timeout& e) {
        finished = false;
        log_message(LogLevel::warning, device_.name(),
                    fmt::format(TINYDEV_FMT("a graph destroyed while its replay still runs after {} ms; leaking its "
                                "kernel arguments and programs instead of freeing them under it: {}"),
                                timeout.count(), e.what()));
      } catch (...) {
      }
    }
    if (!finished || !device_.opened_in_this_process()) {
      struct Leaked {
        std::vector<GraphNode> nodes;
        std::vector<std::unique_ptr<Copy>> copies;
      };
      new Leaked{std::move(nodes_), std::move(copies_)};
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
    std::uint64_t last_replay = 0;              // the graph's replay number of the last (valid once replays > 0)
    std::vector<Allocation> last_inputs;
    std::vector<std::int32_t> last_variables;
  };

  // Records one more copy; the graph is unchanged if this throws.
  Copy& add_copy() {
    auto copy = std::make_unique<Copy>();
    copy->kernargs_block = device_.allocate_kernargs_block(kernarg_bytes_);
    record(*copy);
    copies_.push_back(std::move(copy));  // capacity reserved in the constructor: no throw
    return *copies_.back();
  }

  void record(Copy& copy) {
    Device& device = device_;
    std::lock_guard lock(device.submit_mutex());
    ProfileGraphScope graph_scope(id());  // the execs recorded here are this graph's in the trace
    // The node layout (uses, command indices) is the same in every copy: note it once.
    const bool first_copy = copies_.empty();
    ComputeQueue& compute_q = copy.compute;
    CopyQueue& copy_q = copy.copy;
    compute_q.wait(device.timeline_signal(), 0).signal(signal_, 0);
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      NodeCommands cmds;
      // Graph-signal commands only where the nodes change queues (Note [HCQ graph replay]): the
      // first node on a queue after the other queue's waits, the last before the other queue's
      // (and the graph's last node) signals. Node 0 follows the prologue, on the compute queue.
      const bool here = on_compute(i);
      const bool needs_wait = here != (i == 0 || on_compute(i - 1));
      const bool needs_signal = i + 1 == nodes_.size() || here != on_compute(i + 1);
      // The node's command on its queue (either queue type), between those wait and signal.
      const auto record_on = [&](auto& queue, auto&& command) {
        if (needs_wait) {
          cmds.wait = queue.size();
          queue.wait(signal_, 0);
        }
        cmds.op = queue.size();
        command(queue);
        if (needs_signal) {
          cmds.signal = queue.size();
          queue.signal(signal_, 0);
        }
      };
      if (auto* k = std::get_if<GraphKernel>(&nodes_[i])) {
        const auto* program = static_cast<const ProgramT*>(k->program.get());  // checked above
        Kernargs args{copy.kernargs_block.get() + kernarg_offsets_[i], static_cast<std::uint32_t>(k->buffers.size()),
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
        record_on(compute_q, [&](ComputeQueue& q) { q.exec(*program, args, k->launch.global, k->launch.local); });
        cmds.kernargs = copy.kernargs.size() - 1;
      } else {
        auto& c = std::get<GraphCopy>(nodes_[i]);
        if (first_copy && !c.dest.fixed) input_uses_.push_back({c.dest.input, i, 0, Use::copy_dest});
        if (first_copy && !c.src.fixed) input_uses_.push_back({c.src.input, i, 0, Use::copy_src});
        // Inputs are patched in before the first replay; record with placeholders of the right size.
        Allocation placeholder{0, c.size, nullptr};
        record_on(copy_q, [&](CopyQueue& q) {
          q.copy(c.dest.fixed ? *c.dest.fixed : placeholder, c.src.fixed ? *c.src.fixed : placeholder, c.size);
        });
      }
      if (first_copy) commands_.push_back(cmds);
    }
    // The compute queue ends the replay: after the copy queue's last node, if that is the last.
    if (!nodes_.empty() && !on_compute(nodes_.size() - 1)) {
      epilogue_wait_ = compute_q.size();
      compute_q.wait(signal_, 0);
    }
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
    Copy& copy = pick_copy(inputs, variables);
    ComputeQueue& compute_q = copy.compute;
    CopyQueue& copy_q = copy.copy;
    const bool first = copy.replays == 0;
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
      const auto patch = [&](auto& queue) {  // either queue type
        if (cmds.wait != kNone) queue.update_wait(cmds.wait, std::nullopt, base + i);
        if (cmds.signal != kNone) queue.update_signal(cmds.signal, std::nullopt, base + i + 1);
      };
      if (cmds.on_compute) patch(compute_q);
      else patch(copy_q);
    }
    if (epilogue_wait_ != kNone) compute_q.update_wait(epilogue_wait_, std::nullopt, base + nodes_.size());
    compute_q.update_signal(epilogue_signal_, device_.timeline_signal(), timeline);
    // Note [Inline replay] (src/cpu/cpu_hcq.cpp): a device may run a waited-for replay on the caller.
    bool ran_inline = false;
    if constexpr (requires(Device& d) { d.run_inline_if_idle(compute_q, copy_q, timeline - 1, lock); }) {
      if (wait) ran_inline = device_.run_inline_if_idle(compute_q, copy_q, timeline - 1, lock);
    }
    const auto spend_values = [&] {  // this replay's graph-signal values are used up
      copy.last_replay = replays_;
      replays_ += 1;
      copy.replays += 1;
      copy.last_final = base + nodes_.size();
      last_replay_end_ = copy.last_final;
    };
    if (!ran_inline) submit_both(compute_q, copy_q, timeline, spend_values);
    spend_values();
    if (!wait) return std::nullopt;
    device_.wait_timeline(timeline);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

 private:
  // The graph signal's value at the end of the last replay (0 before the first).
  std::uint64_t last_replay_end() const noexcept { return last_replay_end_; }

  // Submits a replay's two queues, the compute queue first: if its submit throws, nothing of the
  // replay went in, and the taken timeline value is completed empty (Note [Timeline reservations])
  // so later work does not wait for it. If the copy queue's then throws, the compute queue is in,
  // waiting for graph-signal values only the copy queue would write: the device is faulted (a
  // DeviceFault for every call until recover(), which waits for its queues to drain) and the
  // graph's signal poisoned, so that queue fails at that wait instead of waiting for good, as does
  // the device's other queued work, as after any queue failure; the replay's signal values are
  // spent (`spend_values`), so none is used again after the recovery. Either way the caller gets
  // the submit's error. (Submitting the copy queue first would leave a queued copy waiting on the
  // graph's signal and no fault to drain it.)
  template <class SpendValues>
  void submit_both(ComputeQueue& compute_q, CopyQueue& copy_q, std::uint64_t timeline, SpendValues& spend_values) {
    try {
      compute_q.submit(device_);
    } catch (...) {
      device_.abandon_timeline_value(timeline);
      throw;
    }
    if (!copy_q.size()) return;
    try {
      copy_q.submit(device_);
    } catch (...) {
      std::string why = "an unknown exception";
      try {
        throw;
      } catch (const std::exception& e) {
        why = e.what();
      } catch (...) {
      }
      const std::string reason = fmt::format(
          TINYDEV_FMT("{}: a graph replay's copy queue could not be submitted after its compute queue was: {}"),
          device_.name(), why);
      spend_values();
      device_.fault_device(reason);
      signal_.poison(reason);
      throw;
    }
  }

  // Whether `copy`'s kernel arguments hold these inputs and variables already.
  bool holds_kernargs_for(const Copy& copy, std::span<const Allocation> inputs,
                          std::span<const std::int32_t> variables) const noexcept {
    if (copy.replays == 0) return false;
    for (const Use& u : input_uses_)
      if (u.kind == Use::kernarg && !(inputs[u.input] == copy.last_inputs[u.input])) return false;
    for (const VarUse& u : variable_uses_)
      if (variables[u.variable] != copy.last_variables[u.variable]) return false;
    return true;
  }

  // The copy a replay with these inputs patches (Note [HCQ graph replay]). Under the submit mutex.
  Copy& pick_copy(std::span<const Allocation> inputs, std::span<const std::int32_t> variables) {
    Copy* oldest = nullptr;
    for (const auto& c : copies_) {
      if (holds_kernargs_for(*c, inputs, variables)) return *c;
      if (!oldest || c->replays == 0 || (oldest->replays != 0 && c->last_replay < oldest->last_replay))
        oldest = c.get();
    }
    if (oldest->replays == 0 || signal_.slot().value.load(std::memory_order_acquire) >= oldest->last_final)
      return *oldest;
    if (copies_.size() < kMaxCopies) return add_copy();
    try {
      signal_.wait(oldest->last_final);
    } catch (const Timeout& e) {
      throw Timeout(fmt::format(TINYDEV_FMT("{}: a graph replay with new inputs waited for replay {} to finish reading "
                                            "its kernel arguments: {} replays of this graph are queued and not "
                                            "finished, the most it holds kernel arguments for (a stream held "
                                            "behind an event not yet complete?): {}"),
                                device_.name(), oldest->last_replay, kMaxCopies, e.what()));
    }
    return *oldest;
  }

  // The device name the graph's programs must have been loaded on (a stream's lane runs its
  // device's programs).
  static const std::string& kernels_device(const Device& device) {
    if constexpr (requires { device.kernels_device(); }) return device.kernels_device();
    else return device.name();
  }

  // A node's command indices in its queue; kNone: it has no such command (Note [HCQ graph replay]).
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  struct NodeCommands {
    bool on_compute = false;
    std::size_t wait = kNone, op = 0, signal = kNone, kernargs = 0;
  };
  bool on_compute(std::size_t node) const noexcept { return std::holds_alternative<GraphKernel>(nodes_[node]); }
  struct Use {
    std::size_t input, node, slot;
    enum Kind { kernarg, copy_dest, copy_src } kind;
  };
  struct VarUse {
    std::size_t variable, kernargs, slot;
  };

  Device& device_;
  Signal signal_;
  std::vector<std::size_t> kernarg_offsets_;  // per node, into a copy's kernel-argument block
  std::size_t kernarg_bytes_ = 0;             // a copy's kernel-argument block
  std::vector<std::unique_ptr<Copy>> copies_;  // 2 to kMaxCopies, each recorded once (Note [HCQ graph replay])
  std::vector<NodeCommands> commands_;
  std::vector<Use> input_uses_;
  std::vector<VarUse> variable_uses_;
  std::size_t epilogue_wait_ = kNone, epilogue_signal_ = 0;
  std::uint64_t replays_ = 0;
  std::uint64_t last_replay_end_ = 0;
};

}  // namespace tinydev

TINYDEV_API_END
