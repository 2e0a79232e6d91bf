// Event (tinydev/stream.hpp): a point in a stream's work.
#include "tinydev/stream.hpp"

#include <fmt/format.h>

#include "tinydev/error.hpp"

namespace tinydev {

namespace {
[[noreturn]] void throw_failed(const Event& event, const SignalSlot& slot) {
  const std::string reason = slot.poison_text();
  throw DeviceFault(fmt::format("the work before {} failed: {}", event.describe(),
                                reason.empty() ? std::string("no reason recorded") : reason));
}
}  // namespace

bool Event::query() const {
  if (!signal_.valid()) return true;
  const SignalSlot& slot = signal_.slot();
  if (slot.value.load(std::memory_order_acquire) >= value_) return true;
  if (slot.poisoned.load(std::memory_order_acquire)) throw_failed(*this, slot);
  return false;
}

void Event::wait(std::chrono::milliseconds timeout) const {
  if (!signal_.valid()) return;
  SignalSlot& slot = signal_.slot();
  if (slot.value.load(std::memory_order_acquire) >= value_) return;
  try {
    wait_signal_slot(slot, value_, timeout, &signal_);
  } catch (const Timeout& e) {
    throw Timeout(fmt::format("waiting for {} timed out after {} ms: {}", describe(), timeout.count(), e.what()));
  } catch (const Error&) {
    if (slot.value.load(std::memory_order_acquire) >= value_) return;
    throw_failed(*this, slot);
  }
}

std::string Event::describe() const {
  if (!signal_.valid()) return "a complete event";
  return fmt::format("the event at {} of {}", value_, source_ ? *source_ : signal_.describe());
}

}  // namespace tinydev
