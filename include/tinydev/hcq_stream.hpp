// tinydev/hcq_stream.hpp: what the streams of HCQ backends share (docs/serving.md). A backend's
// stream runs on a lane, a device of the backend's own type made for streams (Note [CPU streams],
// Note [CUDA streams]); StreamLanes keeps a device's lanes, and HCQLaneStream is the part of a
// Stream that is the same for every backend: the lane's bookkeeping, event waits, transfers,
// record, synchronize, faults, and what queued work holds. The backend adds copyin, copyout,
// launch, create_graph and replay, each one submission on the lane (flush_waits, finish).
//
// Requirements on `Lane` (an HCQCompiled): reserve_timeline_value, last_submitted_value,
// wait_submitted, compute_queue (whose submit takes the lane), can_reach, check_usable, fault,
// recover, opened_in_this_process, idle, forget_timeouts; the parent device has return_lane(Lane*) and
// abandon_lane(Lane*).
//
// Ownership: lanes live as long as the process (events keep pointing at their timelines); a
// stream holds the Buffers and Programs its queued work uses until the work finished. Thread
// safety: StreamLanes is internally synchronized; an HCQLaneStream's operations serialize on the
// lane's submit mutex.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <optional>
#include <span>
#include <variant>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tinydev/error.hpp"
#include "tinydev/export.hpp"
#include "tinydev/hcq_allocator.hpp"
#include "tinydev/log.hpp"
#include "tinydev/registry.hpp"
#include "tinydev/stream.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

namespace detail {

// Note [Spare captures]
// A stream's copyin that cannot run at once captures its bytes in memory of the stream's until its
// queued copy ran (Note [CPU stream copyin captures], Note [CUDA copyin captures]). Fresh memory
// costs its page faults at every copyin (a fresh MiB costs milliseconds on a VM), so captures
// whose copies ran are kept as spares for the next copyins, within the budget the queued captures
// share with them: take() hands out the smallest spare that fits, is at most twice the size a
// new block would have (a small copyin does not tie up, and count, a large block) and keeps the
// queued captures within the budget; else it unmaps spares, oldest first, until the queued
// captures, the spares and a new block fit (spares of sizes no copyin asks for any more do not
// stay for the life of the stream), and the caller makes the new block. `Block` is movable, has
// size() (its bytes) and frees its memory when destroyed. Thread safety: none (the stream's lock).
template <class Block>
class SpareCaptures {
 public:
  // A spare for a new block of `wanted` bytes while `queued` bytes of captures are queued, or
  // nullopt after making room for a new one. `budget` is the most queued + spares may hold; one
  // block larger than it is allowed alone.
  std::optional<Block> take(std::size_t wanted, std::size_t queued, std::size_t budget) {
    budget = std::max(budget, wanted);
    auto best = spares_.end();
    for (auto it = spares_.begin(); it != spares_.end(); ++it)
      if (it->size() >= wanted && it->size() <= 2 * wanted && queued + it->size() <= budget &&
          (best == spares_.end() || it->size() < best->size()))
        best = it;
    if (best != spares_.end()) {
      std::optional<Block> block(std::move(*best));
      spares_.erase(best);
      bytes_ -= block->size();
      return block;
    }
    std::size_t dropped = 0;
    while (dropped < spares_.size() && queued + bytes_ + wanted > budget) bytes_ -= spares_[dropped++].size();
    spares_.erase(spares_.begin(), spares_.begin() + static_cast<std::ptrdiff_t>(dropped));
    return std::nullopt;
  }
  // A capture whose copy ran: kept if `queued` + the spares + it stay within `budget`, else freed
  // (and freed too when keeping it would need memory there is none of).
  void keep(Block&& block, std::size_t queued, std::size_t budget) noexcept {
    const std::size_t size = block.size();
    if (size == 0 || queued + bytes_ + size > budget) return;
    try {
      spares_.push_back(std::move(block));
      bytes_ += size;
    } catch (const std::bad_alloc&) {  // push_back left the block as it was: the caller frees it
    }
  }
  // Frees every spare.
  void clear() noexcept {
    spares_.clear();
    bytes_ = 0;
  }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  std::vector<Block> spares_;  // oldest first
  std::size_t bytes_ = 0;      // their sizes, summed
};

}  // namespace detail

// A device's stream lanes: made on first use, kept when their stream is dropped and handed to the
// next one; at most `max` alive at once. A lane dropped with work that did not finish in time is
// abandoned, and taken back once that work finished: without a fault, or with one its recover()
// clears at once (its queues drained; not a CUDA context's sticky error).
template <class Lane>
class StreamLanes {
 public:
  // A free lane, or one `make(number)` makes (numbered from 1). InvalidArgument naming `device`
  // when `max` lanes are taken.
  template <class Make>
  Lane* take(std::size_t max, std::string_view device, Make&& make) {
    reclaim_abandoned();
    std::unique_lock lock(mutex_);
    // At the limit, lanes another thread is recovering may come free: wait for them first
    // (recover() with no wait is quick; the bound only guards against a lane's submit mutex held).
    if (free_.empty() && lanes_.size() >= max && recovering_ > 0)
      recovered_.wait_for(lock, std::chrono::seconds(5), [&] { return recovering_ == 0 || !free_.empty(); });
    if (!free_.empty()) {
      Lane* lane = free_.back();
      free_.pop_back();
      return lane;
    }
    if (lanes_.size() >= max)
      throw InvalidArgument(fmt::format(
          TINYDEV_FMT("{}: {} streams are alive already, the most one device runs at once{}: drop streams you no "
                      "longer use, or share them between requests"),
          device, max,
          abandoned_.empty()
              ? std::string()
              : fmt::format(TINYDEV_FMT(" ({} of them dropped with work that has not finished or failed; their "
                                        "lanes come back once it finished and any fault it left is recovered)"),
                            abandoned_.size())));
    // Room for every lane in either list: give_back and abandon (from destructors) never allocate.
    lanes_.reserve(lanes_.size() + 1);
    free_.reserve(lanes_.size() + 1);
    abandoned_.reserve(lanes_.size() + 1);
    lanes_.push_back(make(made_ + 1));
    ++made_;
    return lanes_.back().get();
  }
  void give_back(Lane* lane) {
    {
      std::lock_guard lock(mutex_);
      free_.push_back(lane);
    }
    recovered_.notify_all();  // a take() at the limit may wait for a lane
  }
  // A lane whose stream was dropped before its work finished (or with a fault it could not
  // recover from): not handed out until that work finished and the fault is recovered.
  void abandon(Lane* lane) {
    std::lock_guard lock(mutex_);
    abandoned_.push_back(lane);
  }
  // Calls f(lane) for every lane made so far (taken or free).
  template <class F>
  void for_each(F&& f) {
    std::lock_guard lock(mutex_);
    for (const auto& lane : lanes_) f(*lane);
  }
  // Waits for every stream's work; a stream's failure is the stream's to report (Stream::fault),
  // not the device's, so a faulted lane is skipped.
  void synchronize_all() {
    std::vector<Lane*> lanes;
    {
      std::lock_guard lock(mutex_);
      for (const auto& lane : lanes_) lanes.push_back(lane.get());
    }
    for (Lane* lane : lanes) {
      if (!lane->fault().empty()) continue;
      try {
        lane->synchronize();
      } catch (const Error&) {
        if (lane->fault().empty()) throw;
      }
    }
  }

 private:
  // Abandoned lanes whose work has finished since are free again; a faulted one once recover()
  // succeeds with no wait (its queues drained). recover() takes the lane's submit mutex, so it runs
  // outside mutex_; meanwhile the lane is in neither list, and a take() at the limit waits for it.
  void reclaim_abandoned() {
    std::vector<Lane*> faulted;
    {
      std::lock_guard lock(mutex_);
      if (abandoned_.empty()) return;
      faulted.reserve(abandoned_.size());  // before anything moves: no allocation below
      std::erase_if(abandoned_, [&](Lane* lane) {
        if (!lane->fault().empty()) {
          faulted.push_back(lane);
          return true;
        }
        if (!lane->idle()) return false;
        lane->forget_timeouts();  // the drop's wait timed out on work that finished since
        free_.push_back(lane);
        return true;
      });
      recovering_ += faulted.size();
    }
    for (Lane* lane : faulted) {
      bool recovered = false;
      try {
        lane->recover(std::chrono::milliseconds(0));
        recovered = lane->fault().empty();
        if (recovered) {
          lane->forget_timeouts();
          log_message(LogLevel::info, lane->name(), "a dropped stream's lane recovered and is free again");
        }
      } catch (const std::exception&) {
        // Still running, or a fault recover() cannot clear: left abandoned.
      }
      {
        std::lock_guard lock(mutex_);
        (recovered ? free_ : abandoned_).push_back(lane);
        --recovering_;
      }
      recovered_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable recovered_;  // a lane is free, or one taken out of abandoned_ to recover is back in a list
  std::size_t recovering_ = 0;         // lanes in neither list while they recover
  std::vector<std::unique_ptr<Lane>> lanes_;  // never destroyed: events point at their timelines
  std::vector<Lane*> free_;
  std::vector<Lane*> abandoned_;
  std::size_t made_ = 0;
};

template <class Lane>
class HCQLaneStream : public Stream {
 public:
  HCQLaneStream(Lane& device, Lane& lane, const StreamOptions& options)
      : device_(device), lane_(lane), name_(&lane.name()), drop_timeout_(options.drop_timeout) {}

  // Waits (at most StreamOptions::drop_timeout) for the work, which reads buffers held here, then
  // gives the lane back. A lane whose work does not finish in time, or that cannot recover from a
  // fault, is abandoned (taken back once its work finished: StreamLanes), and what its work holds
  // is leaked rather than freed under it.
  ~HCQLaneStream() override {
    bool reusable = lane_.opened_in_this_process();
    if (reusable && lane_.fault().empty()) {
      try {
        synchronize(drop_timeout_);
      } catch (const Timeout& e) {
        log_message(LogLevel::warning, *name_,
                    fmt::format(TINYDEV_FMT("dropped while its work still runs ({}); its lane is taken back once "
                                            "that work finished"),
                                e.what()));
        reusable = false;
      } catch (const std::exception&) {
        // The work failed: recovered below.
      }
    }
    if (reusable && !lane_.fault().empty()) {
      try {
        lane_.recover(std::chrono::seconds(5));
      } catch (const std::exception&) {
        reusable = false;
      }
    }
    if (!reusable) {
      keep_for_ever(std::move(held_));
      // A forked child's lane is the parent's: never handed out here again.
      if (lane_.opened_in_this_process()) device_.abandon_lane(&lane_);
      return;
    }
    held_.clear();
    device_.return_lane(&lane_);
  }

  const std::string& name() const noexcept override { return *name_; }
  Compiled& device() const noexcept override { return device_; }

  // A graph of the lane's (replayed by the backend's replay).
  std::unique_ptr<Graph> create_graph(std::vector<GraphNode> nodes) override {
    for (const GraphNode& node : nodes)
      if (const auto* k = std::get_if<GraphKernel>(&node); k && !k->program)
        throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: a graph kernel node has no program"), *name_));
    return lane_.create_graph(std::move(nodes));
  }

  // Replays a graph this stream's create_graph made (made_here), after the stream's work and waits.
  Event replay(Graph& graph, std::span<const Buffer> inputs, std::span<const std::int32_t> variables) override {
    if (!made_here(graph))
      throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: this graph was not made by this stream's create_graph: a "
                                                    "graph replays on the stream that made it"),
                                        *name_));
    std::vector<Allocation> allocations(inputs.size());
    allocations_of(inputs, allocations, "replay");
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    flush_waits();
    graph.replay(allocations, variables, /*wait=*/false);
    return finish(inputs, nullptr);
  }

  Event transfer(const Buffer& dest, const Buffer& src) override {
    check_buffer(src, "transfer");
    if (!dest.is_allocated())
      throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: transfer into an unallocated buffer: allocate it first"),
                                        *name_));
    if (dest.nbytes() != src.nbytes())
      throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: transfer of {} bytes into a buffer of {} bytes: the sizes "
                                                    "must match"),
                                        *name_, src.nbytes(), dest.nbytes()));
    auto* dest_device = dynamic_cast<Lane*>(&Device[dest.device()]);
    if (!dest_device)
      throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: transfer to {}: a stream transfers to devices of its own "
                                                    "backend only"),
                                        *name_, dest.device()));
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    flush_waits();
    // Ordered through the Event: the destination device's default queue is not tied to this stream.
    HCQAllocator<Lane>::transfer(dest.allocation(), src.allocation(), src.nbytes(), lane_, *dest_device,
                                 /*mark_dest=*/false);
    const Buffer both[] = {dest, src};
    return finish(both, nullptr);
  }

  void wait(const Event& event) override {
    lane_.check_usable();  // a faulted stream takes no waits (recover() first)
    if (event.query()) return;  // complete (or DeviceFault: the work it stands for failed)
    if (!lane_.can_reach(*event.signal().pool())) {
      event.wait();  // another backend's event: waited for here, on the host
      return;
    }
    std::lock_guard lock(lane_.submit_mutex());
    waits_.emplace_back(event.signal(), event.value());
  }

  Event record() override {
    std::lock_guard lock(lane_.submit_mutex());
    prepare();
    flush_waits();
    return Event(lane_.timeline_signal(), lane_.last_submitted_value(), name_);
  }

  void synchronize(std::chrono::milliseconds timeout) override {
    std::lock_guard lock(lane_.submit_mutex());
    lane_.check_usable();
    flush_waits();
    lane_.wait_submitted(timeout);
    release_finished();
  }

  std::string fault() const override { return lane_.fault(); }
  std::string recover(std::chrono::milliseconds timeout) override {
    std::lock_guard lock(lane_.submit_mutex());
    std::string was = lane_.recover(timeout);
    if (!was.empty()) waits_.clear();  // they were part of what failed; a healthy stream keeps its waits
    release_finished();
    return was;
  }

 protected:
  // A capture's memory on the heap (Note [Spare captures]); empty: size() 0.
  struct HeapCapture {
    std::unique_ptr<std::byte[]> data;
    std::size_t bytes = 0;  // what it holds, and what the budget counts (a reused block may be up to twice that)
    std::size_t size() const noexcept { return bytes; }
  };
  struct Held {
    std::uint64_t value;
    std::vector<Buffer> buffers;
    std::shared_ptr<Program> program;
    HeapCapture capture{};  // a queued copyin's bytes (Note [CPU stream copyin captures])
  };

  // Note [CPU stream copyin captures]
  // A copyin returns once the caller's bytes are read (stream.hpp). On a busy CPU lane they go
  // through the lane's staging ring, whose 4 slots stay taken until the lane's copy worker reached
  // them: the fifth copyin behind a wait for an event not yet complete blocked its caller until the
  // event came (30 s and a Timeout when the caller was to complete it). So a copyin that does not
  // run on the caller takes the ring only while its slots are free now
  // (HCQAllocator::ring_takes_without_waiting); otherwise it copies the bytes into memory of the
  // stream's (a capture) and queues a copy from it; the capture is held with the copy's timeline
  // value and let go once the lane passed it, as the stream's buffers are. A stream holds at most kMaxCapturedBytes (64 MiB) of queued
  // captures: a copyin past that waits for the earliest ones to be copied (bounded memory, as
  // CUDA's Note [CUDA queue depth] bounds a queue), and is a Timeout after TINYDEV_WAIT_TIMEOUT_MS saying so; one copyin larger than that is
  // taken once nothing else is held. Captures whose copies ran are kept for the next copyins while
  // the queued ones and they stay within the same 64 MiB (memory already faulted in: a fresh
  // 64 MiB costs its page faults at every copyin), smallest fitting first. For lanes whose copy
  // queue reads host memory (the CPU's); CUDA's lanes have their own (Note [CUDA copyin captures]).
  static constexpr std::size_t kMaxCapturedBytes = std::size_t{64} << 20;
  Event copyin_captured(const Buffer& dest, std::span<const std::byte> src) {
    const std::size_t n = src.size();
    make_room_for_capture(n);
    HeapCapture capture = take_capture(n);
    std::memcpy(capture.data.get(), src.data(), n);
    auto reservation = lane_.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    auto q = lane_.copy_queue();
    q.wait(lane_.timeline_signal(), value - 1);
    for (const auto& [signal, wanted] : waits_) q.wait(signal, wanted);
    q.copy(dest.allocation(), Allocation{reinterpret_cast<std::uintptr_t>(capture.data.get()), n, nullptr}, n);
    q.signal(lane_.timeline_signal(), value);
    q.submit(lane_);
    waits_.clear();
    reservation.submitted();
    Event done;
    try {
      done = finish(std::span(&dest, 1), nullptr);
    } catch (...) {
      (void)capture.data.release();  // out of memory holding it: leaked, never freed under the copy
      throw;
    }
    if (!held_.empty() && held_.back().value == value) {
      held_.back().capture = std::move(capture);
      queued_capture_bytes_ += n;
    } else {
      keep_capture(std::move(capture));  // copied already
    }
    return done;
  }

  void check_buffer(const Buffer& b, std::string_view what) const {
    if (b.device() != device_.name())
      throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: {} of a buffer on {}: a stream of {} uses {}'s buffers"),
                                        *name_, what, b.device(), device_.name(), device_.name()));
    if (!b.is_allocated())
      throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: {} of an unallocated buffer: allocate it first"), *name_,
                                        what));
  }
  // Checks each buffer (check_buffer, as `what`) and writes its allocation into `out`, which has
  // room for all of them.
  void allocations_of(std::span<const Buffer> buffers, std::span<Allocation> out, std::string_view what) const {
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      check_buffer(buffers[i], what);
      out[i] = buffers[i].allocation();
    }
  }
  // Whether `graph` is one the lane's create_graph made (the backend's own graph type).
  virtual bool made_here(const Graph& graph) const noexcept = 0;

  // A copyin through the lane's allocator (its staging ring, ordered after the lane's work and the
  // waits; the caller's bytes are read before it returns). The lane's submit mutex is held.
  Event copyin_through_lane(const Buffer& dest, std::span<const std::byte> src) {
    flush_waits();
    lane_.allocator().copyin(dest.allocation(), src);
    return finish(std::span(&dest, 1), nullptr);
  }

  // What a dropped stream's unfinished work may still read: kept for the life of the process, where
  // leak checkers see it kept on purpose (reachable from a static), not freed under the work.
  static void keep_for_ever(std::deque<Held> held) {
    static auto* kept = new std::pair<std::mutex, std::vector<std::deque<Held>>>();
    std::lock_guard lock(kept->first);
    kept->second.push_back(std::move(held));
  }

  // copyin's and copyout's checks: an allocated buffer of this device, exactly its size of bytes.
  void check_copyin(const Buffer& dest, std::size_t bytes) const {
    check_buffer(dest, "copyin");
    if (bytes != dest.nbytes())
      throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: copyin of {} bytes into a buffer of {} bytes: give exactly "
                                                    "the buffer's size"),
                                        *name_, bytes, dest.nbytes()));
  }
  void check_copyout(std::size_t bytes, const Buffer& src) const {
    check_buffer(src, "copyout");
    if (bytes != src.nbytes())
      throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: copyout of a buffer of {} bytes into {} bytes: give exactly "
                                                    "the buffer's size"),
                                        *name_, src.nbytes(), bytes));
  }
  // The program as the backend's, loaded on this stream's device; InvalidArgument otherwise.
  template <class LaneProgram>
  const LaneProgram& program_of(const std::shared_ptr<Program>& program) const {
    const auto* own = dynamic_cast<const LaneProgram*>(program.get());
    if (!own || own->device() != device_.name())
      throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: kernel '{}' was not loaded on {}: load it with "
                                                    "Device[\"{}\"].load_kernel"),
                                        *name_, program ? program->name() : std::string("(null)"), device_.name(),
                                        device_.name()));
    return *own;
  }
  // Records and submits the lane's copy queue for reserved value `reservation`: after the lane's
  // previous value and the waits, `src` into host memory `dest`.
  template <class Reservation>
  Event submit_copyout(Reservation& reservation, std::span<std::byte> dest, const Buffer& src) {
    const std::uint64_t value = reservation.value();
    auto q = lane_.copy_queue();
    q.wait(lane_.timeline_signal(), value - 1);
    for (const auto& [signal, wanted] : waits_) q.wait(signal, wanted);
    q.copy(Allocation{reinterpret_cast<std::uintptr_t>(dest.data()), dest.size(), nullptr}, src.allocation(),
           dest.size());
    q.signal(lane_.timeline_signal(), value);
    q.submit(lane_);
    waits_.clear();  // after the submit: one that throws leaves them for the stream's next work
    reservation.submitted();
    return finish(std::span(&src, 1), nullptr);
  }
  // The same for a kernel on the lane's compute queue, its arguments in the lane's kernargs pages.
  template <class Reservation, class LaneProgram>
  Event submit_launch(Reservation& reservation, const LaneProgram& program, const std::shared_ptr<Program>& holder,
                      std::span<const Buffer> buffers, std::span<const Allocation> allocations,
                      std::span<const std::int32_t> values, const LaunchParams& params) {
    const std::uint64_t value = reservation.value();
    const Kernargs kernargs = lane_.alloc_kernargs(static_cast<std::uint32_t>(allocations.size()),
                                                   static_cast<std::uint32_t>(values.size()));
    fill_kernargs(program, kernargs, allocations, values);
    auto q = lane_.compute_queue();
    q.wait(lane_.timeline_signal(), value - 1);
    for (const auto& [signal, wanted] : waits_) q.wait(signal, wanted);
    q.exec(program, kernargs, params.global, params.local).signal(lane_.timeline_signal(), value);
    q.submit(lane_);
    waits_.clear();  // after the submit: one that throws leaves them for the stream's next work
    reservation.submitted();
    return finish(buffers, holder);
  }

  // Before an operation (the lane's submit mutex held): usable, and what finished work held let go.
  void prepare() {
    lane_.check_usable();
    release_finished();
  }
  void release_finished() {
    if (held_.empty()) return;
    const std::uint64_t reached = lane_.timeline_signal().value();
    while (!held_.empty() && held_.front().value <= reached) {
      Held& h = held_.front();
      if (h.capture.size()) {
        queued_capture_bytes_ -= h.capture.size();  // before keep_capture, which counts it as a spare
        keep_capture(std::move(h.capture));
      }
      held_.pop_front();
    }
  }
  // Note [CPU stream copyin captures]: the bytes of the queued captures.
  std::size_t queued_capture_bytes() const noexcept { return queued_capture_bytes_; }
  // Waits until a capture of `bytes` fits the budget beside the queued ones (the submit mutex held).
  void make_room_for_capture(std::size_t bytes) {
    const std::chrono::milliseconds timeout = default_wait_timeout();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (std::size_t queued = queued_capture_bytes(); queued > 0 && queued + bytes > kMaxCapturedBytes;
         queued = queued_capture_bytes()) {
      const auto earliest = std::find_if(held_.begin(), held_.end(), [](const Held& h) { return h.capture.size() > 0; });
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      try {
        lane_.wait_timeline_reached(earliest->value, std::max(left, std::chrono::milliseconds(1)));
      } catch (const Timeout&) {
        throw Timeout(fmt::format(TINYDEV_FMT("{}: a copyin of {} bytes waited {} ms for the stream's earlier copyins "
                                              "({} bytes of theirs are queued, at most {}) to be copied; the stream "
                                              "waits for work that has not come (an event not yet complete?); such a wait lasts "
                                              "TINYDEV_WAIT_TIMEOUT_MS"),
                                  *name_, bytes, timeout.count(), queued, kMaxCapturedBytes));
      }
      release_finished();
    }
  }
  // A block of at least `bytes`, holding `bytes` (Note [Spare captures]).
  HeapCapture take_capture(std::size_t bytes) {
    if (auto spare = spare_captures_.take(bytes, queued_capture_bytes(), kMaxCapturedBytes))
      return HeapCapture{std::move(spare->data), bytes};
    return HeapCapture{std::make_unique_for_overwrite<std::byte[]>(bytes), bytes};
  }
  // A capture whose copy ran: kept for the next copyins if it fits the budget, else freed.
  void keep_capture(HeapCapture capture) noexcept {
    spare_captures_.keep(std::move(capture), queued_capture_bytes(), kMaxCapturedBytes);
  }
  // Drops the event waits that passed (the caller may then run work on itself, ordered by
  // nothing). A wait whose signal reached its value only after a poison did not pass (Note [Events
  // after a poison]): it stays, so the submission it goes into fails as a queued wait would, and
  // the stream's work after it does too. The value is read before the poison flag. The submit
  // mutex is held.
  void drop_passed_waits() {
    std::erase_if(waits_, [](const std::pair<Signal, std::uint64_t>& wait) {
      const SignalSlot& slot = wait.first.slot();
      return slot.value.load(std::memory_order_acquire) >= wait.second && !poison_failed(slot, wait.second);
    });
  }
  // Event waits not yet part of a submission go in one of their own (before work that records its
  // own queues: staged copies, graphs, transfers).
  void flush_waits() {
    if (waits_.empty()) return;
    auto reservation = lane_.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    auto q = lane_.compute_queue();
    q.wait(lane_.timeline_signal(), value - 1);
    for (const auto& [signal, wanted] : waits_) q.wait(signal, wanted);
    q.signal(lane_.timeline_signal(), value);
    q.submit(lane_);
    waits_.clear();  // after the submit: one that throws leaves them for the stream's next work
    reservation.submitted();
  }
  // The event ending everything submitted so far (lazy timeline work is signalled first: Note
  // [Lazy timeline signals]); what the work used is held until then.
  Event finish(std::span<const Buffer> buffers, std::shared_ptr<Program> program) {
    const std::uint64_t value = lane_.last_submitted_value();
    if (lane_.timeline_signal().slot().value.load(std::memory_order_acquire) < value)
      held_.push_back(Held{value, std::vector<Buffer>(buffers.begin(), buffers.end()), std::move(program), HeapCapture{}});
    return Event(lane_.timeline_signal(), value, name_);
  }

  Lane& device_;
  Lane& lane_;
  const std::string* name_;  // the lane's: lives as long as the process
  std::chrono::milliseconds drop_timeout_;
  // The lane's submit mutex serializes this stream's operations and guards these two.
  std::vector<std::pair<Signal, std::uint64_t>> waits_;  // events to wait for in the next submission
  std::deque<Held> held_;
  // Note [CPU stream copyin captures]: blocks whose copies ran (Note [Spare captures]).
  detail::SpareCaptures<HeapCapture> spare_captures_;
  std::size_t queued_capture_bytes_ = 0;  // the held_ entries' captures' sizes, summed
};

}  // namespace tinydev

TINYDEV_API_END
