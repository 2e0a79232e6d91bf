// tinydev/hcq_concepts.hpp: the HCQ contract in code (layer 5). A backend's queues, programs and
// device must satisfy these concepts; HCQCompiled, HCQGraph and HCQAllocator check them with
// static_assert, so a missing piece is one error naming the requirement instead of pages of
// template instantiation. Each requirement says what the implementation must do; docs/hcq.md
// walks through writing a backend against them.
//
// Obligations a concept cannot check are listed under HCQDevice below.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>

#include "tinydev/compile.hpp"
#include "tinydev/device.hpp"
#include "tinydev/hcq_queue.hpp"
#include "tinydev/memory.hpp"
#include "tinydev/signal.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

template <class ComputeQueue, class CopyQueue>
class HCQCompiled;

// The primitives every queue supplies (called by HWCommandQueue; public, but only the templates
// call them). Each appends or patches the backend's command words, through mutable_commands() and
// command_words(cmd), which keep a submitted snapshot intact.
template <class Q>
concept HCQQueuePrimitives = requires(Q& q, const Signal& signal, std::uint64_t value, std::size_t cmd,
                                      const std::optional<Signal>& new_signal,
                                      const std::optional<std::uint64_t>& new_value, Compiled& device) {
  // Every queue runs its commands in order: each finishes, its writes visible to the next, before
  // the next starts (HCQGraph orders the nodes that share a queue by that alone: Note [HCQ graph
  // replay]; a backend whose hardware overlaps launches or copies adds its barrier to each).
  // Required: when the queue reaches it, set `signal` to `value` (after everything before it in
  // the queue finished) and wake host waiters.
  q._signal(signal, value);
  // Required: hold the commands after it until `signal` >= `value`.
  q._wait(signal, value);
  // Required: write the device's clock (ns, converted by device_to_cpu_ns) into `signal`.
  q._timestamp(signal);
  // Required: patch the signal and/or value of recorded signal / wait command `cmd`.
  q._update_signal(cmd, new_signal, new_value);
  q._update_wait(cmd, new_signal, new_value);
  // Required: hand a snapshot of the commands to `device`. Throw InvalidArgument (queueing
  // nothing) when the device is not of this backend or cannot reach a signal the queue uses
  // (HCQCompiled::can_reach on each of pools()).
  q._submit(device);
};

// A backend's compute queue (derives from HWComputeQueue<Q, Command, Program>).
template <class Q>
concept HCQComputeQueue = HCQQueuePrimitives<Q> && requires(Q& q, const typename Q::program_type& program,
                                                            const Kernargs& kernargs, Dim3 global, Dim3 local,
                                                            std::size_t cmd) {
  // Required: launch `program` over `global` x `local`, reading its arguments from `kernargs` when
  // it starts (the memory stays valid until the work finished: the caller's business).
  q._exec(program, kernargs, global, local);
  // Required: patch the sizes of recorded exec command `cmd`.
  q._update_exec(cmd, global, local);
  // Optional: _memory_barrier() (the template's default records nothing), for devices whose
  // caches need flushing between kernels.
  q._memory_barrier();
};

// A backend's copy queue (derives from HWCopyQueue<Q, Command>).
template <class Q>
concept HCQCopyQueue = HCQQueuePrimitives<Q> && requires(Q& q, const Allocation& dest, const Allocation& src,
                                                         std::size_t size, std::size_t cmd,
                                                         const std::optional<Allocation>& new_dest,
                                                         const std::optional<Allocation>& new_src) {
  // Required: copy `size` bytes from `src` to `dest` (either may be device or staging memory;
  // bounds are checked before this is called).
  q._copy(dest, src, size);
  // Required: patch the addresses of recorded copy command `cmd` (sizes stay).
  q._update_copy(cmd, new_dest, new_src);
};

// A backend's Program class, as its compute queue takes it.
template <class P>
concept HCQProgram = std::derived_from<P, Program> && requires(const P& p) {
  // Required: the canonical name of the device that loaded it (HCQGraph refuses other devices'
  // programs with it).
  { p.device() } -> std::convertible_to<const std::string&>;
};

// A backend's device class. Beyond what this checks, the class must:
//  1. build its allocator (an HCQAllocator<Device> subclass) from *this in the initializer list,
//     and pass it to HCQCompiled's constructor;
//  2. when its signals live in a pool other devices reach too, override can_reach() and
//     signal_users_now() together (Note [Deferred signal free]);
//  3. override on_timeline_wrapped() to call its allocator's reset_staging_timelines() (else a
//     staged copy after a wrap waits for a timeline value that never comes, then times out);
//  4. override supports_graph() (true) and create_graph() (an HCQGraph<Device>) where graphs are
//     native; capabilities() with the whole truth about the device;
//  5. optionally: override check_health() when failures are seen only by asking the hardware
//     (called while host threads wait on the timeline; poison the timeline there), and define
//     bool prepare_transfer(Device& dest), which HCQAllocator::transfer calls before a copy
//     between two devices (peer mappings): true when this device's copy queue reaches dest's
//     memory, false to stage the copy through dest's staging ring (Note [Staged transfers]).
// HCQCompiled itself registers the profiler's flush hook once the device is opened (on_opened)
// and detaches the allocator when a device is destroyed (only a failed open does that).
template <class D>
concept HCQDevice =
    std::derived_from<D, HCQCompiled<typename D::compute_queue_type, typename D::copy_queue_type>> &&
    HCQComputeQueue<typename D::compute_queue_type> && HCQCopyQueue<typename D::copy_queue_type> &&
    HCQProgram<typename D::compute_queue_type::program_type> &&
    requires(D& d, const D& cd, std::uint32_t count, std::size_t bytes, std::uint64_t ns, bool is_copy) {
      // Required: kernel-argument space for one launch, valid until the work submitted with it
      // finished; never blocks (the caller may hold an unsubmitted timeline value).
      { d.alloc_kernargs(count, count) } -> std::same_as<Kernargs>;
      // Required: memory the queues read kernel arguments from, owned by the caller (graphs).
      { cd.allocate_kernargs_block(bytes) } -> std::same_as<std::shared_ptr<std::byte[]>>;
      // Required: the device clock (a timestamp command's value) in host nanoseconds.
      { cd.device_to_cpu_ns(ns, is_copy) } -> std::same_as<std::uint64_t>;
    };

}  // namespace tinydev

TINYDEV_API_END
