#include "tinydev/hcq.hpp"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

namespace tinydev {

void fill_kernargs(const Program& program, const Kernargs& kernargs, std::span<const Allocation> buffers,
                   std::span<const std::int32_t> values) {
  if (auto sig = program.signature(); sig && !sig->accepts_either(buffers.size(), values.size()))
    throw InvalidArgument(fmt::format("kernel '{}' takes {} buffers and {} values, got {} and {}", program.name(),
                                      sig->num_buffers, sig->num_values, buffers.size(), values.size()));
  if (kernargs.num_buffers != buffers.size() || kernargs.num_values != values.size())
    throw InvalidArgument(fmt::format("kernargs for '{}' were allocated for {} buffers and {} values, got {} and {}",
                                      program.name(), kernargs.num_buffers, kernargs.num_values, buffers.size(),
                                      values.size()));
  for (std::size_t i = 0; i < buffers.size(); ++i) kernargs.set_buffer(i, buffers[i].va_addr);
  for (std::size_t i = 0; i < values.size(); ++i) kernargs.set_value(i, values[i]);
}

KernargsPages::KernargsPages(std::string device_name) : device_(std::move(device_name)) {
  pages_.emplace_back(new std::byte[kPageBytes]);
}

Kernargs KernargsPages::alloc(std::uint32_t num_buffers, std::uint32_t num_values,
                              const std::atomic<std::uint64_t>& reached, std::uint64_t next_value) {
  const std::size_t bytes = (Kernargs::bytes_for(num_buffers, num_values) + 15) / 16 * 16;
  if (bytes > kPageBytes)
    throw InvalidArgument(fmt::format("{}: {} bytes of kernel arguments do not fit a {}-byte kernargs page", device_,
                                      bytes, kPageBytes));
  if (next_ + bytes > kPageBytes) {
    std::size_t next;
    if (!retired_.empty() && retired_.front().second <= reached.load(std::memory_order_acquire)) {
      next = retired_.front().first;
      retired_.erase(retired_.begin());
    } else {
      pages_.emplace_back(new std::byte[kPageBytes]);
      next = pages_.size() - 1;
    }
    // Tagged with the next value to be taken: covers work whose value is taken after this call.
    retired_.emplace_back(page_, next_value);
    page_ = next;
    next_ = 0;
  }
  Kernargs k{pages_[page_].get() + next_, num_buffers, num_values};
  next_ += bytes;
  return k;
}

void KernargsPages::timeline_wrapped() noexcept {
  for (auto& [page, tag] : retired_) tag = 0;
}

}  // namespace tinydev

// ---- fork (Note [Devices and fork] in tinydev/hcq_device.hpp) --------------------------------------

namespace tinydev::detail {

namespace {
std::atomic<std::uint64_t> g_fork_generation{0};
void on_fork_child() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

std::uint64_t watch_forks() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, &on_fork_child); });
  return g_fork_generation.load(std::memory_order_relaxed);
}

std::uint64_t fork_generation() noexcept { return g_fork_generation.load(std::memory_order_relaxed); }

void throw_forked_device(const std::string& device) {
  throw ForkedDevice(fmt::format("{} was opened before this process forked (this is the child, pid {}): its queue "
                                 "threads did not survive the fork, so it cannot be used here. Open a device of "
                                 "your own in the child under another name (Device[\"{}:1\"]), or start the child "
                                 "with exec/posix_spawn (docs/serving.md)",
                                 device, static_cast<long>(::getpid()), device.substr(0, device.find(':'))));
}

}  // namespace tinydev::detail
