#include "tinydev/signal.hpp"

#include <fmt/format.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <ctime>
#include <memory>
#include <new>
#include <thread>

#include "tinydev/error.hpp"

namespace tinydev {

namespace {

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::nanoseconds timeout) {
  const auto ns = timeout.count() > 0 ? timeout.count() : 0;
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}


}  // namespace

void SignalSlot::store(std::uint64_t v) noexcept {
  value.store(v, std::memory_order_seq_cst);
  if (waiters.load(std::memory_order_seq_cst) != 0 && v >= wake_at.load(std::memory_order_seq_cst)) {
    // Woken sleepers whose value is not reached yet register again (Note [Signal waits]).
    wake_at.store(~std::uint64_t{0}, std::memory_order_seq_cst);
    wake_seq.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&wake_seq);
  }
}

namespace detail {
SpinBudget& this_thread_spin_budget() noexcept {
  thread_local SpinBudget budget;
  return budget;
}
void spin_yield() noexcept { ::sched_yield(); }
}  // namespace detail

// Note [Signal waits]
// A waiter spins briefly (Note [Adaptive spinning]: most waits in a pipelined queue end within
// microseconds, and a futex round trip costs more than that), then sleeps on `wake_seq`. A store
// writes the value and, only if someone is registered in `waiters` and the value reaches
// `wake_at` (the smallest value a sleeper wants), resets wake_at, bumps wake_seq and wakes: the
// common store (nobody asleep, or nobody whose value is reached) is one store and two loads, and
// a graph bumping its signal at each switch between its queues wakes its waiter once, at the
// value it waits for.
// A sleeper registers in `waiters`, reads wake_seq, lowers wake_at to its value, re-checks the
// value, and sleeps only while wake_seq is unchanged. All of these are seq_cst, so (Dekker) either
// the store sees the registration (its wake_at load follows the sleeper's lowering) and wakes, or
// the sleeper's re-check sees the value. A store that resets wake_at after a sleeper lowered it
// bumps wake_seq after that, and the sleeper read wake_seq before lowering, so its futex call
// returns at once and it registers again. No wakeup is lost; a woken sleeper whose value is not
// reached yet registers again.
void wait_signal_slot(SignalSlot& slot, std::uint64_t wanted, std::chrono::nanoseconds timeout,
                      const Signal* handle) {
  auto poisoned = [&] {
    const std::string reason = slot.poison_text();
    return Error(fmt::format("{} was poisoned by a device-side failure while waiting for value {}: {}",
                             handle ? handle->describe() : "signal", wanted,
                             reason.empty() ? std::string("no reason recorded") : reason));
  };
  // Polled slots spin on a fixed time budget below instead (Note [Polled signals]).
  // A poisoned slot decides by the value it held when poisoned, not by what came after
  // (poison_failed); the value is read first, so one written after the poison comes with the flag.
  if (!slot.polled && detail::adaptive_spin([&] {
        return slot.value.load(std::memory_order_acquire) >= wanted || poison_failed(slot, wanted);
      })) {
    if (poison_failed(slot, wanted)) throw poisoned();
    return;
  }
  const auto now0 = std::chrono::steady_clock::now();
  const auto deadline = timeout >= std::chrono::steady_clock::time_point::max() - now0
                            ? std::chrono::steady_clock::time_point::max()
                            : now0 + timeout;
  const auto timed_out = [&] {
    return Timeout(fmt::format(
        "timed out after {} ms waiting for {} to reach {}: it is at {}. Is the queue that signals "
        "it submitted, and not itself waiting on something that never comes? (A wait given no timeout "
        "lasts TINYDEV_WAIT_TIMEOUT_MS.)",
        std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count(),
        handle ? handle->describe() : "a signal", wanted, slot.value.load()));
  };
  if (slot.polled) {
    // Note [Polled signals]: spin for 50 us, then sleep 1, 2, 4 ... 128 us between looks.
    const auto spin_until = now0 + std::chrono::microseconds(50);
    auto pause = std::chrono::microseconds(1);
    while (true) {
      const bool reached = slot.value.load(std::memory_order_acquire) >= wanted;
      if (poison_failed(slot, wanted)) throw poisoned();
      if (reached) return;  // reached before the poison
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) throw timed_out();
      if (now < spin_until) {
        for (int i = 0; i < 64; ++i) detail::cpu_relax();
        continue;
      }
      std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(pause, deadline - now));
      pause = std::min(pause * 2, std::chrono::microseconds(128));
    }
  }
  while (true) {
    slot.waiters.fetch_add(1, std::memory_order_seq_cst);
    const std::uint32_t seq = slot.wake_seq.load(std::memory_order_seq_cst);
    // Lower wake_at only when about to sleep: a waiter already satisfied would leave it below
    // every remaining sleeper's value, and stores would wake them for nothing. The value is
    // read again after lowering (Note [Signal waits]).
    bool ready = slot.value.load(std::memory_order_seq_cst) >= wanted;
    if (!ready) {
      for (std::uint64_t at = slot.wake_at.load(std::memory_order_seq_cst);
           wanted < at && !slot.wake_at.compare_exchange_weak(at, wanted, std::memory_order_seq_cst);) {
      }
      ready = slot.value.load(std::memory_order_seq_cst) >= wanted;
    }
    const bool failed = slot.poisoned.load(std::memory_order_seq_cst) != 0 && poison_failed(slot, wanted);
    const auto now = std::chrono::steady_clock::now();
    if (ready || failed || now >= deadline) {
      slot.waiters.fetch_sub(1, std::memory_order_seq_cst);
      if (failed) throw poisoned();
      if (ready) return;
      throw timed_out();
    }
    futex_wait(&slot.wake_seq, seq, std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(100)));
    slot.waiters.fetch_sub(1, std::memory_order_seq_cst);
  }
}

// ---- Signal -------------------------------------------------------------------------------------

SignalSlot& Signal::slot() const {
  if (!pool_) throw InvalidArgument("use of an empty Signal handle: allocate one from a device");
  return pool_->slot(*this);
}

std::uint64_t Signal::value() const { return slot().value.load(std::memory_order_acquire); }
void Signal::set(std::uint64_t v) const { slot().store(v); }
std::uint64_t Signal::timestamp() const { return slot().timestamp_ns.load(std::memory_order_acquire); }

void Signal::wait(std::uint64_t wanted, std::chrono::milliseconds timeout) const {
  // milliseconds::max() ("forever") does not fit in nanoseconds: clamp instead of overflowing.
  const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::nanoseconds::max() / 4);
  wait_signal_slot(slot(), wanted, std::min(timeout, limit), this);
}

void SignalSlot::poison(std::string_view reason) noexcept {
  // The first reason is the root cause; later poisoners leave it (and the flag) to the first.
  if (poison_claim.exchange(1, std::memory_order_acq_rel) != 0) return;
  const std::size_t n = std::min(reason.size(), sizeof poison_reason - 1);
  std::memcpy(poison_reason, reason.data(), n);
  poison_reason[n] = '\0';
  poisoned_at.store(value.load(std::memory_order_acquire), std::memory_order_relaxed);
  poisoned.store(1, std::memory_order_seq_cst);
  wake_seq.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&wake_seq);
  if (on_poison) on_poison(*this);
}

void Signal::poison(const std::string& reason) const { slot().poison(reason); }

void SignalSlot::clear_poison() noexcept {
  poisoned.store(0, std::memory_order_seq_cst);
  poison_reason[0] = '\0';
  poison_claim.store(0, std::memory_order_release);
}

std::string SignalSlot::poison_text() const {
  return std::string(poison_reason, ::strnlen(poison_reason, sizeof poison_reason));
}

std::string Signal::describe() const {
  return pool_ ? fmt::format("{} signal #{}", pool_->name(), index_) : "an empty signal";
}

// ---- SignalPool ---------------------------------------------------------------------------------

namespace {
SignalMemory host_signal_memory() {
  return SignalMemory{
      .allocate = [](std::size_t bytes) -> void* { return ::operator new(bytes, std::align_val_t{alignof(SignalSlot)}); },
      .release = [](void* memory, std::size_t) { ::operator delete(memory, std::align_val_t{alignof(SignalSlot)}); },
      .device_writes_without_wake = false};
}
}  // namespace

SignalPool::SignalPool(std::string name) : SignalPool(std::move(name), host_signal_memory()) {}

SignalPool::SignalPool(std::string name, SignalMemory memory)
    : name_(std::move(name)), chunk_table_(new std::atomic<SignalSlot*>[kMaxChunks]), memory_(std::move(memory)) {
  if (!memory_.allocate || !memory_.release)
    throw InvalidArgument(fmt::format("signal pool '{}': SignalMemory needs both allocate and release", name_));
  for (std::size_t i = 0; i < kMaxChunks; ++i) chunk_table_[i].store(nullptr, std::memory_order_relaxed);
}

SignalPool::~SignalPool() {
  for (SignalSlot* chunk : chunks_) {
    std::destroy_n(chunk, kChunk);
    memory_.release(chunk, kChunk * sizeof(SignalSlot));
  }
}

Signal SignalPool::alloc(std::uint64_t initial) {
  std::lock_guard lock(mutex_);
  if (free_.empty()) {
    if (chunks_.size() == kMaxChunks)
      throw OutOfMemory(fmt::format("{}'s signal pool is full ({} live signals): free signals you no longer use",
                                    name_, live_));
    const std::size_t capacity = capacity_.load(std::memory_order_relaxed);
    void* memory = memory_.allocate(kChunk * sizeof(SignalSlot));
    if (reinterpret_cast<std::uintptr_t>(memory) % alignof(SignalSlot) != 0) {
      memory_.release(memory, kChunk * sizeof(SignalSlot));
      throw InvalidArgument(fmt::format("signal pool '{}': its memory is not {}-byte aligned", name_,
                                        alignof(SignalSlot)));
    }
    auto* chunk = static_cast<SignalSlot*>(memory);
    std::uninitialized_default_construct_n(chunk, kChunk);
    for (std::size_t i = 0; i < kChunk; ++i) {
      chunk[i].polled = memory_.device_writes_without_wake ? 1 : 0;
      chunk[i].on_poison = memory_.on_poison;
    }
    chunks_.push_back(chunk);
    chunk_table_[chunks_.size() - 1].store(chunk, std::memory_order_release);
    for (std::size_t i = kChunk; i-- > 0;) free_.push_back(static_cast<std::uint32_t>(capacity + i));
    capacity_.store(capacity + kChunk, std::memory_order_release);
  }
  const std::uint32_t index = free_.back();
  free_.pop_back();
  SignalSlot& s = chunks_[index / kChunk][index % kChunk];
  s.value.store(initial);
  s.wake_at.store(~std::uint64_t{0});
  s.timestamp_ns.store(0);
  s.poisoned.store(0);
  s.poisoned_at.store(0);
  s.poison_claim.store(0);
  s.poison_reason[0] = '\0';
  s.reuses.fetch_add(1, std::memory_order_release);
  live_ += 1;
  return Signal(this, index, s.generation.load());
}

void SignalPool::free(const Signal& signal) { recycle(retire(signal)); }

std::uint32_t SignalPool::retire(const Signal& signal) {
  std::lock_guard lock(mutex_);
  if (signal.pool_ != this || signal.index_ >= capacity_.load())
    throw InvalidArgument(fmt::format("cannot free {} into {}'s signal pool: it belongs elsewhere",
                                      signal.describe(), name_));
  SignalSlot& s = chunks_[signal.index_ / kChunk][signal.index_ % kChunk];
  if (s.generation.load() != signal.generation_)
    throw InvalidArgument(fmt::format("{} was freed twice", signal.describe()));
  s.generation.fetch_add(1);
  live_ -= 1;
  return signal.index_;
}

void SignalPool::recycle(std::uint32_t index) {
  std::lock_guard lock(mutex_);
  free_.push_back(index);
}

std::size_t SignalPool::live() const {
  std::lock_guard lock(mutex_);
  return live_;
}

SignalSlot& SignalPool::slot(const Signal& signal) {
  if (signal.pool_ != this || signal.index_ >= capacity_.load(std::memory_order_acquire))
    throw InvalidArgument(fmt::format("{} does not belong to {}'s signal pool", signal.describe(), name_));
  SignalSlot& s = chunk_table_[signal.index_ / kChunk].load(std::memory_order_acquire)[signal.index_ % kChunk];
  if (s.generation.load() != signal.generation_)
    throw InvalidArgument(fmt::format(
        "{} was freed: allocate a new signal instead of reusing a freed handle", signal.describe()));
  return s;
}

}  // namespace tinydev

namespace tinydev {

std::optional<std::uint32_t> SignalPool::index_of(const SignalSlot* slot) const {
  const std::size_t chunks = capacity_.load(std::memory_order_acquire) / kChunk;
  for (std::size_t c = 0; c < chunks; ++c) {
    const SignalSlot* base = chunk_table_[c].load(std::memory_order_acquire);
    if (base && slot >= base && slot < base + kChunk) return static_cast<std::uint32_t>(c * kChunk + (slot - base));
  }
  return std::nullopt;
}

}  // namespace tinydev
