// tinydev/hcq_queue.hpp: HCQ command queues (layer 5), as CRTP templates over a backend's queues.
//
// A backend defines its command word type and two queue classes deriving (CRTP) from
// HWComputeQueue / HWCopyQueue, supplying only the primitives (_signal, _wait, _timestamp,
// _memory_barrier, _exec, _copy, their _update_* twins and _submit; the list, with what each must
// do, is the concepts in tinydev/hcq_concepts.hpp). The templates record the seed's per-command
// metadata (offset, length, kind) so a recorded queue can be patched in place and submitted any
// number of times; no virtual call happens per command.
//
// Ownership: a queue owns its recorded commands. Submitting hands the device a reference-counted
// snapshot, so a queue may be patched or destroyed right after submit: patching a queue whose
// snapshot is still queued switches to a spare copy whose run ended, bringing over only the
// commands patched since that copy was current (Note [Queue resubmission]).
// Thread safety: one queue object is used by one thread at a time.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tinydev/compile.hpp"
#include "tinydev/error.hpp"
#include "tinydev/memory.hpp"
#include "tinydev/signal.hpp"
#include "tinydev/export.hpp"

#if defined(__SANITIZE_THREAD__)
#define TINYDEV_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TINYDEV_TSAN 1
#endif
#endif
#ifdef TINYDEV_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

TINYDEV_API_BEGIN

namespace tinydev {

namespace detail {
// Note [Snapshot release ordering]
// A device drops its reference to a submitted snapshot once the snapshot's run ended; the queue
// that recorded it writes those words in place once it sees them unshared (use_count() == 1, a
// relaxed load, then an acquire fence: the drop's release decrement happens before the writes).
// ThreadSanitizer does not model standalone fences, so it would report the device's last read of
// the words against the queue's next patch. Under TSan the pair is told to it directly: a device
// calls release_snapshot(words) before dropping them, and the queue acquires the same address.
// Without TSan both are empty.
inline void tsan_acquire([[maybe_unused]] const void* address) noexcept {
#ifdef TINYDEV_TSAN
  __tsan_acquire(const_cast<void*>(address));
#endif
}
inline void tsan_release([[maybe_unused]] const void* address) noexcept {
#ifdef TINYDEV_TSAN
  __tsan_release(const_cast<void*>(address));
#endif
}
}  // namespace detail

// Drops a device's reference to a queue's submitted words after their run (Note [Snapshot release
// ordering]): whatever the device read of them happens before the queue's next patch.
template <class Words>
void release_snapshot(std::shared_ptr<Words>& words) noexcept {
  detail::tsan_release(words.get());
  words.reset();
}

enum class CommandKind : std::uint8_t { signal, wait, timestamp, memory_barrier, exec, copy };
constexpr std::string_view to_string(CommandKind kind) noexcept {
  constexpr std::string_view names[] = {"signal", "wait", "timestamp", "memory_barrier", "exec", "copy"};
  return names[static_cast<int>(kind)];
}

// A block of kernel arguments in memory the device reads when the kernel starts: 8-byte buffer
// addresses, then 4-byte values (the seed's fill_kernargs layout). Owned by whoever allocated it
// (a device's kernargs ring, a graph).
struct Kernargs {
  std::byte* ptr = nullptr;
  std::uint32_t num_buffers = 0;
  std::uint32_t num_values = 0;
  static constexpr std::size_t bytes_for(std::size_t buffers, std::size_t values) noexcept {
    return buffers * 8 + values * 4;
  }
  std::size_t size() const noexcept { return bytes_for(num_buffers, num_values); }
  void set_buffer(std::size_t i, std::uint64_t address) const noexcept { std::memcpy(ptr + i * 8, &address, 8); }
  void set_value(std::size_t i, std::int32_t value) const noexcept {
    std::memcpy(ptr + num_buffers * 8 + i * 4, &value, 4);
  }
  std::uint64_t buffer(std::size_t i) const noexcept {
    std::uint64_t a;
    std::memcpy(&a, ptr + i * 8, 8);
    return a;
  }
  std::int32_t value(std::size_t i) const noexcept {
    std::int32_t v;
    std::memcpy(&v, ptr + num_buffers * 8 + i * 4, 4);
    return v;
  }
};

// Note [Kernargs pages]
// Kernel arguments for one launch are bump-allocated from 1 MiB pages of host memory. A full page
// is retired, tagged with the next timeline value to be taken, so it covers work submitted already
// and work whose value is taken right after (take it in the same submit_mutex section as the
// allocation); the page is reused once the timeline has passed that tag, and a new page is made
// while none has. Nothing blocks here, so allocating while holding an unsubmitted timeline value
// cannot deadlock. Devices whose queues read arguments from host memory (the CPU's workers, and
// CUDA, whose driver copies them at launch) use this.
// Thread safety: none; the device calls it under its submit mutex.
class KernargsPages {
 public:
  static constexpr std::size_t kPageBytes = 1u << 20;
  explicit KernargsPages(std::string device_name);
  // Space for one launch. `reached` holds the timeline value the device has reached (its timeline
  // signal's value), `next_value` is the next one it will hand out. InvalidArgument when the
  // arguments do not fit a page. `reached` is read only when a page fills: the device's worker
  // writes that line at every signal, and reading it at every launch made each eager submit wait
  // for the line to come back from the worker's core.
  Kernargs alloc(std::uint32_t num_buffers, std::uint32_t num_values, const std::atomic<std::uint64_t>& reached,
                 std::uint64_t next_value);
  // The timeline wrapped (nothing is in flight): every retired page is free again.
  void timeline_wrapped() noexcept;

 private:
  std::string device_;
  std::vector<std::unique_ptr<std::byte[]>> pages_;
  std::vector<std::pair<std::size_t, std::uint64_t>> retired_;  // (page, timeline value), oldest first
  std::size_t page_ = 0, next_ = 0;
};

// Checks the counts against the program's signature (when it declares one), then writes the
// arguments (the seed's HCQCompatProgram.fill_kernargs).
void fill_kernargs(const Program& program, const Kernargs& kernargs, std::span<const Allocation> buffers,
                   std::span<const std::int32_t> values);

namespace detail {
// A vector of trivially copyable values keeping its first N in place: what a queue keeps per
// signal and per signal pool is one or two entries for nearly every queue (an eager one: a wait
// and a signal on one pool), and a heap block for each was an allocation and a free per queue.
// Not a general container: append, drop the last, insert, index and iterate are all the queue needs.
template <class T, std::size_t N>
class SmallVector {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  SmallVector() = default;
  SmallVector(const SmallVector& other) { *this = other; }
  SmallVector& operator=(const SmallVector& other) {
    if (this == &other) return *this;
    if (other.heap_.empty()) {
      heap_.clear();
      heap_.shrink_to_fit();
      std::copy_n(other.local_, other.size_, local_);
    } else {
      heap_ = other.heap_;
    }
    size_ = other.size_;
    return *this;
  }
  SmallVector(SmallVector&& other) noexcept { *this = std::move(other); }
  SmallVector& operator=(SmallVector&& other) noexcept {
    if (this == &other) return *this;
    heap_ = std::move(other.heap_);
    std::copy_n(other.local_, heap_.empty() ? other.size_ : 0, local_);
    size_ = other.size_;
    other.heap_.clear();
    other.size_ = 0;
    return *this;
  }

  T* begin() noexcept { return heap_.empty() ? local_ : heap_.data(); }
  T* end() noexcept { return begin() + size_; }
  const T* begin() const noexcept { return heap_.empty() ? local_ : heap_.data(); }
  const T* end() const noexcept { return begin() + size_; }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  T& operator[](std::size_t i) noexcept { return begin()[i]; }
  const T& operator[](std::size_t i) const noexcept { return begin()[i]; }

  void insert(const T* at, const T& given) {  // strong guarantee: unchanged if it throws
    const T value = given;  // `given` may be one of the values about to move
    const std::size_t index = static_cast<std::size_t>(at - begin());
    if (heap_.empty() && size_ < N) {
      std::copy_backward(local_ + index, local_ + size_, local_ + size_ + 1);
      local_[index] = value;
    } else {
      if (heap_.empty()) {  // the first spill: everything moves to the heap
        std::vector<T> heap;
        heap.reserve(2 * N);
        heap.assign(local_, local_ + size_);
        heap_ = std::move(heap);
      }
      heap_.insert(heap_.begin() + static_cast<std::ptrdiff_t>(index), value);
    }
    ++size_;
  }
  void push_back(const T& value) { insert(end(), value); }
  void pop_back() noexcept {  // not empty
    --size_;
    if (!heap_.empty()) heap_.pop_back();  // an emptied heap holds nothing, as an empty local_ does
  }

 private:
  T local_[N];
  std::vector<T> heap_;  // non-empty exactly when it holds the values (they outgrew local_)
  std::size_t size_ = 0;
};
}  // namespace detail

// ---- queues ---------------------------------------------------------------------------------------

template <class Derived, class Command>
class HWCommandQueue {
 public:
  using command_type = Command;

  std::size_t size() const noexcept { return recorded_.size(); }  // number of commands (seed: len)
  CommandKind kind(std::size_t cmd) const { return recorded_.at(cmd).kind; }

  Derived& signal(const Signal& signal, std::uint64_t value) {
    return record(CommandKind::signal, signal, [&] { self()._signal(signal, value); });
  }
  Derived& wait(const Signal& signal, std::uint64_t value) {
    return record(CommandKind::wait, signal, [&] { self()._wait(signal, value); });
  }
  Derived& timestamp(const Signal& signal) {
    return record(CommandKind::timestamp, signal, [&] { self()._timestamp(signal); });
  }

  Derived& update_signal(std::size_t cmd, std::optional<Signal> signal = {}, std::optional<std::uint64_t> value = {}) {
    check(cmd, CommandKind::signal, "update_signal");
    if (signal) note_pool(*signal);
    self()._update_signal(cmd, signal, value);
    if (signal) note_signal_use(cmd, *signal);
    return self();
  }
  Derived& update_wait(std::size_t cmd, std::optional<Signal> signal = {}, std::optional<std::uint64_t> value = {}) {
    check(cmd, CommandKind::wait, "update_wait");
    if (signal) note_pool(*signal);
    self()._update_wait(cmd, signal, value);
    if (signal) note_signal_use(cmd, *signal);
    return self();
  }

  // Hands a snapshot of the commands to `device`. Throws InvalidArgument (nothing queued) when the
  // device is of another kind, cannot reach a signal the queue uses, or a signal a command uses was
  // freed since it was recorded (its slot may be another signal's by now: Note [Signals of a
  // recorded queue]).
  template <class Device>
  Derived& submit(Device& device) {
    check_signals_live();
    self()._submit(device);
    return self();
  }

  // The signal pools this queue's commands reference (devices check they can reach them).
  std::span<const SignalPool* const> pools() const noexcept { return {pools_.begin(), pools_.size()}; }

 protected:
  HWCommandQueue() : q_(std::make_shared<std::vector<Command>>()) {}

  Derived& self() noexcept { return static_cast<Derived&>(*this); }

  // Records one command: `emit` appends its words; if it throws, nothing stays recorded.
  template <class Emit>
  Derived& record(CommandKind kind, Emit&& emit) {
    std::vector<Command>& q = mutable_commands();
    // Room for the record first, growing as push_back would: once the words are in, recording
    // them cannot fail (words without a record would still be submitted). Both vectors start at
    // 8: most queues are a handful of commands recorded once (eager exec: wait, exec, signal),
    // so one allocation each instead of one per doubling.
    if (recorded_.size() == recorded_.capacity()) recorded_.reserve(std::max<std::size_t>(8, 2 * recorded_.capacity()));
    if (q.capacity() == 0) q.reserve(8);
    const std::size_t before = q.size();
    try {
      emit();
    } catch (...) {
      mutable_commands().resize(before);
      throw;
    }
    recorded_.push_back(Recorded{static_cast<std::uint32_t>(before),
                                 static_cast<std::uint32_t>(mutable_commands().size() - before), kind});
    return self();
  }
  template <class Emit>
  Derived& record(CommandKind kind, const Signal& signal, Emit&& emit) {
    signal.slot();  // throws for a freed or empty handle, before anything is recorded
    note_pool(signal);
    // The signal's use before the words: once they are recorded nothing may fail, or the command
    // would be submitted without the liveness check (Note [Signals of a recorded queue]). A new
    // command is the last, so its use goes at the end.
    signal_uses_.push_back(SignalUse{static_cast<std::uint32_t>(recorded_.size()), signal});
    try {
      record(kind, std::forward<Emit>(emit));
    } catch (...) {
      signal_uses_.pop_back();
      throw;
    }
    return self();
  }

  void check(std::size_t cmd, CommandKind want, std::string_view what) const {
    if (cmd >= recorded_.size())
      throw InvalidArgument(fmt::format(TINYDEV_FMT("{}: command index {} is out of range: the queue has {} commands"),
                                        what, cmd, recorded_.size()));
    if (recorded_[cmd].kind != want)
      throw InvalidArgument(fmt::format(TINYDEV_FMT("called {} not on a {} command: command {} is a {}"), what,
                                        to_string(want), cmd, to_string(recorded_[cmd].kind)));
  }

  // The words of command `cmd`, writable (Note [Queue resubmission]: a queued snapshot is never
  // written; the queue moves to a spare copy first).
  Command* command_words(std::size_t cmd) {
    exclusive();
    for (Spare& spare : spares_) {
      if (spare.all_stale) continue;
      spare.stale.push_back(static_cast<std::uint32_t>(cmd));
      if (spare.stale.size() > recorded_.size() / 4 + 16) spare.all_stale = true;  // a full copy is cheaper
    }
    return q_->data() + recorded_[cmd].offset;
  }
  // The command words for recording (appending): every spare is stale afterwards.
  std::vector<Command>& mutable_commands() {
    exclusive();
    for (Spare& spare : spares_) spare.all_stale = true;
    return *q_;
  }
  std::shared_ptr<const std::vector<Command>> snapshot() const { return q_; }

 private:
  // Note [Queue resubmission]
  // A submitted snapshot is shared with the device until its run ends, and must not change. The
  // queue keeps up to kMaxSpares earlier copies of its words; each knows which commands were
  // patched since it was last current (or that it is wholly stale, after recording). Patching a
  // queue whose current words are still queued switches to a spare whose run ended and copies over
  // only those commands: resubmitting a recorded queue with new signal values costs a few command
  // copies, not the whole vector. With every spare still queued (deep pipelining), a new spare is
  // made by a full copy, up to kMaxSpares of them.
  struct Spare {
    std::shared_ptr<std::vector<Command>> words;
    std::vector<std::uint32_t> stale;  // commands patched since these words were current
    bool all_stale = false;
  };
  static constexpr std::size_t kMaxSpares = 4;

  void exclusive() {
    if (q_.use_count() == 1) {
      // The device's release of its snapshot happens before our writes (Note [Snapshot release
      // ordering]).
      std::atomic_thread_fence(std::memory_order_acquire);
      detail::tsan_acquire(q_.get());
      return;
    }
    for (Spare& spare : spares_) {
      if (spare.words.use_count() != 1) continue;
      std::atomic_thread_fence(std::memory_order_acquire);
      detail::tsan_acquire(spare.words.get());
      if (spare.all_stale) {
        *spare.words = *q_;  // same size: no allocation
      } else {
        for (std::uint32_t cmd : spare.stale)
          std::copy_n(q_->data() + recorded_[cmd].offset, recorded_[cmd].words,
                      spare.words->data() + recorded_[cmd].offset);
      }
      // The queued words become a spare that is current as of now.
      std::swap(q_, spare.words);
      spare.stale.clear();
      spare.all_stale = false;
      return;
    }
    auto copy = std::make_shared<std::vector<Command>>(*q_);
    if (spares_.size() < kMaxSpares) spares_.push_back(Spare{q_, {}, false});  // q_ intact if this throws
    q_ = std::move(copy);
  }

 protected:
  void note_pool(const Signal& signal) {
    if (std::find(pools_.begin(), pools_.end(), signal.pool()) == pools_.end()) pools_.push_back(signal.pool());
  }

  // Note [Signals of a recorded queue]
  // A backend's command holds its signal's slot, not the handle: a recorded queue submitted again
  // after the signal was freed would write, or wait on, whatever signal took the slot since
  // (slots are handed out again, newest first). So the queue keeps the handle of each command's
  // signal, in command order, and submit checks every one is still live: a generation compare per
  // signal command, no allocation.
  void note_signal_use(std::size_t cmd, const Signal& signal) {
    const auto at = std::lower_bound(signal_uses_.begin(), signal_uses_.end(), cmd,
                                     [](const SignalUse& use, std::size_t c) { return use.cmd < c; });
    if (at != signal_uses_.end() && at->cmd == cmd) at->signal = signal;
    else signal_uses_.insert(at, SignalUse{static_cast<std::uint32_t>(cmd), signal});
  }
  void check_signals_live() const {
    for (const SignalUse& use : signal_uses_) {
      try {
        use.signal.slot();
      } catch (const InvalidArgument& e) {
        const CommandKind kind = recorded_[use.cmd].kind;
        throw InvalidArgument(fmt::format(TINYDEV_FMT("cannot submit the queue: its command {} (a {}) uses a signal "
                                                      "freed since it was recorded ({}); record the queue again{}"),
                                          use.cmd, to_string(kind), e.what(),
                                          kind == CommandKind::wait     ? ", or give it a live signal with update_wait"
                                          : kind == CommandKind::signal ? ", or give it a live signal with update_signal"
                                                                        : ""));
      }
    }
  }

 private:
  std::shared_ptr<std::vector<Command>> q_;
  std::vector<Spare> spares_;
  // Per command: where its words start, how many there are, its kind. One vector, not three: an
  // eager queue is made and dropped per kernel, and each vector was an allocation and a free.
  struct Recorded {
    std::uint32_t offset, words;
    CommandKind kind;
  };
  std::vector<Recorded> recorded_;
  detail::SmallVector<const SignalPool*, 2> pools_;
  struct SignalUse {
    std::uint32_t cmd;
    Signal signal;
  };
  detail::SmallVector<SignalUse, 4> signal_uses_;  // by command, ascending (Note [Signals of a recorded queue])
};

template <class Derived, class Command, class ProgramT>
class HWComputeQueue : public HWCommandQueue<Derived, Command> {
  using Base = HWCommandQueue<Derived, Command>;

 public:
  using program_type = ProgramT;

  Derived& memory_barrier() {
    return this->record(CommandKind::memory_barrier, [&] { this->self()._memory_barrier(); });
  }
  // Launches `program` reading its arguments from `kernargs` when it starts.
  Derived& exec(const ProgramT& program, const Kernargs& kernargs, Dim3 global_size, Dim3 local_size) {
    return this->record(CommandKind::exec, [&] { this->self()._exec(program, kernargs, global_size, local_size); });
  }
  Derived& update_exec(std::size_t cmd, Dim3 global_size, Dim3 local_size) {
    this->check(cmd, CommandKind::exec, "update_exec");
    this->self()._update_exec(cmd, global_size, local_size);
    return this->self();
  }

  // The default primitive (tinydev/hcq_concepts.hpp): records nothing.
  void _memory_barrier() {}
};

template <class Derived, class Command>
class HWCopyQueue : public HWCommandQueue<Derived, Command> {
 public:
  // Copies `size` bytes; InvalidArgument (nothing recorded) if it runs past either allocation.
  Derived& copy(const Allocation& dest, const Allocation& src, std::size_t size) {
    check_copy(dest, src, size);
    return this->record(CommandKind::copy, [&] { this->self()._copy(dest, src, size); });
  }
  Derived& update_copy(std::size_t cmd, std::optional<Allocation> dest = {}, std::optional<Allocation> src = {}) {
    this->check(cmd, CommandKind::copy, "update_copy");
    this->self()._update_copy(cmd, dest, src);
    return this->self();
  }

  // InvalidArgument when a copy of `size` bytes runs past either allocation.
  static void check_copy(const Allocation& dest, const Allocation& src, std::size_t size) {
    const bool dest_short = size > dest.size, src_short = size > src.size;
    if (!dest_short && !src_short) return;
    throw InvalidArgument(fmt::format(TINYDEV_FMT("copy of {} bytes runs past the end of the {} ({} bytes): copy at "
                                                  "most {} bytes, or give {}"),
                                      size, dest_short ? "destination" : "source", dest_short ? dest.size : src.size,
                                      std::min(dest.size, src.size),
                                      dest_short && src_short ? "larger allocations"
                                      : dest_short            ? "a larger destination"
                                                              : "a larger source"));
  }
};

}  // namespace tinydev

TINYDEV_API_END
