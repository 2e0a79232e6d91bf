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

// Note [Events after a poison]
// A stream's timeline is poisoned when a submission on it fails, and the Events of its work not
// finished by then report the failure (their callers may then free the memory that work would
// have used). Work queued before the failure may still run later, and a device then writes the
// timeline past those Events' values: the CUDA copy-outs among it deliberately copy nothing once
// the timeline is poisoned (Note [CUDA copyout without blocking]). So an Event past the value its
// timeline held when poisoned stays failed, whatever value the slot reaches afterwards; an Event
// at or before it had completed already. The value is read before the poison flag: a value a
// device wrote after the poison comes with the flag.
bool Event::query() const {
  if (!signal_.valid()) return true;
  const SignalSlot& slot = signal_.slot();
  const std::uint64_t reached = slot.value.load(std::memory_order_acquire);
  if (slot.poisoned.load(std::memory_order_acquire) && value_ > slot.poisoned_at.load(std::memory_order_relaxed))
    throw_failed(*this, slot);
  return reached >= value_;
}

void Event::wait(std::chrono::milliseconds timeout) const {
  if (!signal_.valid()) return;
  SignalSlot& slot = signal_.slot();
  if (query()) return;
  try {
    wait_signal_slot(slot, value_, timeout, &signal_);
  } catch (const Timeout& e) {
    throw Timeout(fmt::format("waiting for {} timed out after {} ms: {}", describe(), timeout.count(), e.what()));
  } catch (const Error&) {
    // Poisoned while waiting: complete only if it was reached before (Note [Events after a poison]).
  }
  if (!query()) throw_failed(*this, slot);
}

std::string Event::describe() const {
  if (!signal_.valid()) return "a complete event";
  return fmt::format("the event at {} of {}", value_, source_ ? *source_ : signal_.describe());
}

}  // namespace tinydev
