// tinydev/hcq_allocator.hpp: HCQAllocator, the caching allocator of an HCQ device (layer 5), with
// the staging ring that moves host data through the device's copy queue, and transfers between
// devices.
//
// Thread safety: copies take the device's submit mutex; the LRU cache has its own lock.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tinydev/hcq_device.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

// ---- the allocator --------------------------------------------------------------------------------

// The seed's HCQCompatAllocator over a device `Device` (an HCQCompiled). The backend supplies
// alloc_impl/free_impl (device memory, and host memory for options.host) and `host_copy`, which
// copies between host pointers and host-visible device memory.
//
// Note [Staging ring]
// copyin goes through a ring of `batch_count` host buffers of `batch_size` bytes: each chunk is
// copied into the next slot on the caller's thread, then a copy queue moves it to the device and
// signals the timeline; the slot is tagged with that timeline value and reused only once the
// timeline has passed it (never by a device-wide synchronize), so copyin returns as soon as the
// caller's memory has been read. Where device memory is host-visible and the device is idle,
// copyin and copyout copy directly (nothing is in flight to order against).
template <class Device>
class HCQAllocator : public LRUAllocator {
 public:
  static constexpr std::size_t kDefaultBatchSize = 2u << 20;
  static constexpr std::size_t kDefaultBatchCount = 32;

  HCQAllocator(Device& device, std::size_t batch_size = kDefaultBatchSize,
               std::size_t batch_count = kDefaultBatchCount, bool host_visible = false)
      : device_(device), batch_size_(batch_size), batch_count_(batch_count), host_visible_(host_visible) {
    static_assert(HCQDevice<Device>, "HCQAllocator's Device must satisfy tinydev::HCQDevice (tinydev/hcq_concepts.hpp)");
    if (batch_size == 0 || batch_count == 0)
      throw InvalidArgument("an HCQ allocator's staging ring needs at least one slot of at least one byte");
  }

  // Forces every copyin/copyout through the staging ring (tests, benchmarks of the ring).
  void set_force_staging(bool force) noexcept { force_staging_.store(force, std::memory_order_relaxed); }
  // Whether the host reads and writes `allocation` directly (copies skip the ring, as_buffer
  // maps it): all of the device's memory when it was made host_visible, else what the backend
  // says (CUDA: pinned host buffers).
  virtual bool host_visible(const Allocation& allocation) const noexcept {
    (void)allocation;
    return host_visible_;
  }
  // Changes the ring's shape: waits for the device to finish what uses the old ring, frees it;
  // the new one is made at the next staged copy.
  void set_staging_shape(std::size_t batch_size, std::size_t batch_count) {
    if (batch_size == 0 || batch_count == 0)
      throw InvalidArgument("an HCQ allocator's staging ring needs at least one slot of at least one byte");
    std::lock_guard lock(device_.submit_mutex());
    // The default queue only (what uses the ring): a device-wide synchronize would take its
    // streams' locks while holding this one.
    device_.wait_timeline_reached(device_.last_submitted_value());
    release_ring();
    batch_size_ = batch_size;
    batch_count_ = batch_count;
    next_ = 0;
  }
  std::size_t staging_batch_size() const noexcept { return batch_size_; }
  std::size_t staging_batch_count() const noexcept { return batch_count_; }

  void copyin(Allocation dest, std::span<const std::byte> src) override {
    detail::check_fits(src.size(), dest, "copyin", describe());
    device_.check_usable();  // a faulted device would drop the bytes (docs/serving.md)
    device_.check_no_reservation_held("a copyin");
    std::lock_guard lock(device_.submit_mutex());
    if (host_visible(dest) && !force_staging_ && device_.idle()) {
      direct_copy(dest.host_ptr<std::byte>(), src.data(), src.size(), "CPU", device_.name());
      return;
    }
    ensure_ring();
    HCQProfileScope<Device, typename Device::copy_queue_type> prof(device_, fmt::format(TINYDEV_FMT("CPU -> {}"), device_.name()), true);
    for (std::size_t i = 0; i < src.size(); i += batch_size_) {
      const std::size_t n = std::min(batch_size_, src.size() - i);
      next_ = (next_ + 1) % ring_.size();
      device_.timeline_signal().wait(ring_timeline_[next_]);
      host_copy(ring_[next_].template host_ptr<std::byte>(), src.data() + i, n);
      const std::uint64_t value = device_.next_timeline_value();
      device_.copy_queue()
          .wait(device_.timeline_signal(), value - 1)
          .copy(Allocation{dest.va_addr + i, n, dest.backend}, ring_[next_], n)
          .signal(device_.timeline_signal(), value)
          .submit(device_);
      ring_timeline_[next_] = value;
    }
  }

  // Whether a staged copyin of `bytes` would take only ring slots that are free now, so that it
  // returns without waiting for the device (a stream's copyin must: Note [CPU stream copyin
  // captures] in tinydev/hcq_stream.hpp). The caller holds the submit mutex.
  bool ring_takes_without_waiting(std::size_t bytes) {
    ensure_ring();
    const std::size_t chunks = (bytes + batch_size_ - 1) / batch_size_;
    if (chunks > ring_.size()) return false;  // the copyin would wait for its own earlier chunks
    const std::uint64_t reached = device_.timeline_signal().slot().value.load(std::memory_order_acquire);
    for (std::size_t c = 1; c <= chunks; ++c)
      if (ring_timeline_[(next_ + c) % ring_.size()] > reached) return false;
    return true;
  }

  void copyout(std::span<std::byte> dest, Allocation src) override {
    detail::check_fits(dest.size(), src, "copyout", describe());
    device_.check_usable();
    device_.check_no_reservation_held("a copyout");
    std::lock_guard lock(device_.submit_mutex());
    // The device's default queue only: its streams' work is ordered through events, not here.
    device_.wait_submitted();
    if (host_visible(src) && !force_staging_) {
      direct_copy(dest.data(), src.host_ptr<std::byte>(), dest.size(), device_.name(), "CPU");
      return;
    }
    ensure_ring();
    HCQProfileScope<Device, typename Device::copy_queue_type> prof(device_, fmt::format(TINYDEV_FMT("{} -> CPU"), device_.name()), true);
    // Note [Pipelined copyout]: the device fills up to every slot of the ring ahead while the host
    // drains the oldest, so the device's copy of chunk i+1 overlaps the host's copy of chunk i.
    const std::size_t chunks = (dest.size() + batch_size_ - 1) / batch_size_;
    std::vector<std::uint64_t> done(chunks);
    const auto submit_chunk = [&](std::size_t c) {
      const std::size_t i = c * batch_size_, n = std::min(batch_size_, dest.size() - i);
      const std::uint64_t value = device_.next_timeline_value();
      device_.copy_queue()
          .wait(device_.timeline_signal(), value - 1)
          .copy(ring_[c % ring_.size()], Allocation{src.va_addr + i, n, src.backend}, n)
          .signal(device_.timeline_signal(), value)
          .submit(device_);
      done[c] = value;
      // The slot is the device's until then: a copyin after this copyout threw (a timed-out wait
      // below) waits for the chunk queued into it instead of filling it under the device's write.
      ring_timeline_[c % ring_.size()] = value;
    };
    std::size_t submitted = 0;
    for (std::size_t c = 0; c < chunks; ++c) {
      while (submitted < chunks && submitted < c + ring_.size()) submit_chunk(submitted++);
      const std::size_t i = c * batch_size_, n = std::min(batch_size_, dest.size() - i);
      device_.timeline_signal().wait(done[c]);
      host_copy(dest.data() + i, ring_[c % ring_.size()].template host_ptr<std::byte>(), n);
    }
    // The slots are free again (nothing in flight reads them): copyin may take any of them.
    std::fill(ring_timeline_.begin(), ring_timeline_.end(), 0);
  }

  // Copies `size` bytes from `src` on src_device to `dest` on dest_device, ordered after the work
  // already submitted to both, on src_device's copy queue (the seed's transfer); src_device's
  // timeline covers the copy. With mark_dest false (a stream's transfer, ordered through its
  // Event), dest_device's later work is not ordered after the copy, except where the copy is
  // staged (prepare_transfer said src_device cannot reach dest_device's memory): then
  // dest_device's copy queue and timeline carry half of it (Note [Staged transfers]).
  static void transfer(Allocation dest, Allocation src, std::size_t size, Device& src_device, Device& dest_device,
                       bool mark_dest = true) {
    // Checked before a timeline value is taken: a value taken and never signalled hangs the device.
    Device::copy_queue_type::check_copy(dest, src, size);
    src_device.check_usable();
    dest_device.check_usable();
    src_device.check_no_reservation_held("a transfer from it");
    dest_device.check_no_reservation_held("a transfer to it");
    // Optional hook: a device that must set up a path first (a GPU enabling peer access); false
    // when src_device's copy queue cannot reach dest_device's memory at all.
    bool direct = true;
    if constexpr (requires { src_device.prepare_transfer(dest_device); }) {
      static_assert(std::is_same_v<decltype(src_device.prepare_transfer(dest_device)), bool>,
                    "prepare_transfer(dest) returns whether the copy queue reaches dest's memory (Note [Staged transfers])");
      if (&src_device != &dest_device) direct = src_device.prepare_transfer(dest_device);
    }
    std::scoped_lock lock(src_device.submit_mutex(), dest_device.submit_mutex());
    using Queue = typename Device::copy_queue_type;
    const bool same = &src_device == &dest_device;
    if (direct) {
      Queue q;
      const std::uint64_t dest_done = dest_device.last_submitted_value();  // read before taking a value
      const std::uint64_t value = src_device.next_timeline_value();
      {
        HCQProfileScope<Device, Queue> prof(src_device, fmt::format(TINYDEV_FMT("{} -> {}"), src_device.name(), dest_device.name()),
                                            true, &q);
        q.wait(src_device.timeline_signal(), value - 1);
        if (!same) q.wait(dest_device.timeline_signal(), dest_done);
        q.copy(dest, src, size);
      }
      q.signal(src_device.timeline_signal(), value).submit(src_device);
    } else {
      staged_transfer(dest, src, size, src_device, dest_device);
    }
    if (!same && mark_dest) {
      const std::uint64_t dest_value = dest_device.next_timeline_value();
      dest_device.compute_queue()
          .wait(src_device.timeline_signal(), src_device.timeline_value() - 1)
          .wait(dest_device.timeline_signal(), dest_value - 1)
          .signal(dest_device.timeline_signal(), dest_value)
          .submit(dest_device);
    }
  }

  // The seed's transfer through the Allocator interface (tinydev::copy between two devices of
  // this backend): InvalidArgument unless both devices are this allocator's Device type.
  bool supports_transfer() const noexcept override { return true; }
  void transfer(Allocation dest, Allocation src, std::size_t size, Compiled& src_device,
                Compiled& dest_device) override {
    auto* from = dynamic_cast<Device*>(&src_device);
    auto* to = dynamic_cast<Device*>(&dest_device);
    if (!from || !to)
      throw InvalidArgument(fmt::format(TINYDEV_FMT("transfer from {} to {}: both devices must be of {}'s backend; copy through "
                                        "host memory instead (tinydev::copy does)"),
                                        src_device.name(), dest_device.name(), describe()));
    transfer(dest, src, size, *from, *to);
  }

  // Note [Disk reads into the staging ring]
  // The seed's copy_from_disk: the file's reader (the DISK allocator) keeps several reads in
  // flight, each into a free slot of the staging ring; as soon as one completes, the slot goes to
  // the copy queue and is tagged with that copy's timeline value, so it is reused only once the
  // copy ran (as copyin's slots). A slot being read is tagged kSlotTaken. Where device memory is
  // host-visible and the device idle, the reader reads straight into the destination instead
  // (one copy, not two; as copyin's direct path).
  bool supports_copy_from_disk() const noexcept override { return true; }
  void copy_from_disk(Allocation dest, FileReader& reader, const Allocation& src, std::size_t size) override {
    detail::check_fits(size, dest, "copy_from_disk", describe());
    device_.check_usable();
    device_.check_no_reservation_held("a copy_from_disk");
    std::lock_guard lock(device_.submit_mutex());
    const std::string what = fmt::format(TINYDEV_FMT("DISK -> {}"), device_.name());
    if (host_visible(dest) && !force_staging_ && device_.idle()) {
      const std::uint64_t start = device_.profiling() ? Profiler::now_ns() : 0;
      reader.read_into(dest.host_ptr<std::byte>(), src, size);
      if (start) Profiler::global().add({what, start, Profiler::now_ns(), device_.name(), "DMA"});
      return;
    }
    ensure_ring();
    HCQProfileScope<Device, typename Device::copy_queue_type> prof(device_, what, true);
    RingSink sink(*this, dest);
    reader.read_sharded(src, size, sink);
  }

  bool supports_offset() const noexcept override { return true; }
  Allocation offset(Allocation base, std::size_t size, std::size_t offset) override {
    return detail::sub_allocation(base, size, offset, describe());
  }
  std::optional<std::span<std::byte>> as_buffer(Allocation allocation) override {
    if (!host_visible(allocation)) return std::nullopt;
    device_.synchronize();  // zero-copy readers must see finished work
    return std::span<std::byte>(allocation.host_ptr<std::byte>(), allocation.size);
  }

  // Note [Cache reuse after queued work] (tinydev/memory.hpp): the last value taken on the
  // timeline while work is in flight, or, with direct calls not yet covered by one (Note [Lazy
  // timeline signals]), the value that will cover them (the flag is read first: a signal in
  // between only makes the mark one later). Done once the timeline reached it, once the device
  // is idle, or once the mark is past every value handed out (a wrap restarted the numbers after
  // everything finished).
  std::uint64_t queued_work_mark() const noexcept override {
    if (!device_alive_ || device_.idle()) return 0;
    const bool lazy = device_.has_lazy_work();
    return lazy ? device_.timeline_value() : device_.timeline_value() - 1;
  }
  bool queued_work_done(std::uint64_t mark) const noexcept override {
    if (mark == 0 || !device_alive_) return true;
    return device_.timeline_slot()->value.load(std::memory_order_acquire) >= mark || mark > device_.timeline_value() ||
           device_.idle();
  }

  // Called by the device when its timeline wraps (Note [Timeline wrap]).
  void reset_staging_timelines() {
    std::fill(ring_timeline_.begin(), ring_timeline_.end(), 0);
  }

 protected:
  // Copies between host pointers / host-visible memory.
  virtual void host_copy(std::byte* dest, const std::byte* src, std::size_t size) { std::memcpy(dest, src, size); }
  // Backends call this in free_impl before memory really goes: a staged copy or a queued kernel
  // submitted earlier may still write it (the seed's allocators synchronize in _free likewise).
  // Returns false when the memory must not be freed: the work did not finish in time (a hung
  // kernel) or the device belongs to the parent of this forked process. The caller then leaks it
  // (and says so at TINYDEV_DEBUG=1): freeing memory a kernel still writes would corrupt whatever
  // reuses it. The wait lasts TINYDEV_WAIT_TIMEOUT_MS, or at most 1 s on a device whose wait
  // already timed out once, so a process with a hung kernel still exits in reasonable time.
  bool wait_before_free(std::size_t bytes) const {
    if (!device_alive_) return true;
    if (!device_.opened_in_this_process()) return false;  // the parent's memory, even when idle
    if (device_.idle()) return true;
    try {
      device_.wait_timeline_reached(device_.last_submitted_value(), device_.free_wait_timeout());
    } catch (const Timeout& e) {
      debug_log(1, device_.name(), TINYDEV_FMT("leaking {} bytes instead of freeing them under running work: {}"), bytes,
                e.what());
      return false;
    } catch (const Error&) {
      // The work failed (a poisoned timeline). A CPU queue stops at the failure, but a GPU's
      // queue goes on past it and its kernels still touch the memory (Note [CUDA waits on failed
      // signals]): the queues drain first, within the same time.
      if (!device_.wait_queues_drained(device_.free_wait_timeout())) {
        debug_log(1, device_.name(), TINYDEV_FMT("leaking {} bytes instead of freeing them under work still queued "
                                                 "after a failure"), bytes);
        return false;
      }
    }
    return true;
  }

 public:
  // HCQCompiled's destructor (only a failed open destroys a device) calls this: frees from then on
  // do not look at its timeline.
  void detach_device() noexcept override { device_alive_ = false; }

 protected:
  // Derived destructors must call this before their own memory goes (see LRUAllocator).
  void release_ring() {
    for (Allocation& b : ring_) free_impl(b, batch_size_, BufferOptions{.host = true});
    ring_.clear();
    ring_timeline_.clear();
  }
  Device& device_;

 private:
  // A copy on the caller's thread (host-visible memory, nothing in flight), traced like a queue's.
  void direct_copy(std::byte* dest, const std::byte* src, std::size_t size, std::string_view from, std::string_view to) {
    const std::uint64_t start = device_.profiling() ? Profiler::now_ns() : 0;
    host_copy(dest, src, size);
    if (start) Profiler::global().add({fmt::format(TINYDEV_FMT("{} -> {}"), from, to), start, Profiler::now_ns(), device_.name(), "DMA"});
  }
  void ensure_ring() {
    if (!ring_.empty()) return;
    std::vector<Allocation> ring;
    try {
      for (std::size_t i = 0; i < batch_count_; ++i) ring.push_back(alloc_impl(batch_size_, BufferOptions{.host = true}));
    } catch (...) {
      for (Allocation& b : ring) free_impl(b, batch_size_, BufferOptions{.host = true});
      throw;
    }
    ring_timeline_.assign(batch_count_, 0);
    ring_ = std::move(ring);
  }

  // Note [Staged transfers]
  // Where src_device's copy queue cannot reach dest_device's memory (two GPUs without peer
  // access), a transfer goes through the destination's staging ring, a slot per chunk, and no
  // host thread waits for the ring: src_device's copy queue copies chunk c into a slot once the
  // destination's timeline says the slot's last reader ran (a device-side wait on the other
  // device's timeline signal, which both reach) and signals its own timeline; the destination's
  // copy queue waits for that value, copies the slot into `dest` and signals its timeline, whose
  // value tags the slot as a copyin's do. So the source fills slot c+1 while the destination
  // drains slot c. A last command on src_device waits for the destination's last copy, so the
  // source timeline covers the whole transfer as it covers a direct one (a stream's Event, the
  // source buffer's free). Unlike a direct transfer, the destination's timeline and copy queue
  // carry the copy, so its later work is behind it even for a stream's transfer (mark_dest
  // false). Each chunk takes a value on both timelines, so a transfer of more chunks than a
  // device lets be in flight (CUDA: 1000) waits on the host for the first ones. Both values of a
  // chunk are reserved before either queue is submitted (a throw completes them empty, Note
  // [Timeline reservations]), the slot tagged first; a slot whose fill may have gone in without
  // its drain is given up (left out of the ring, not freed: the source may still write it).
  // A driver's own staging of such a copy (CUDA's cuMemcpyAsync between GPUs without peer
  // access) returns only once it ran. Caller holds both submit mutexes.
  static void staged_transfer(Allocation dest, Allocation src, std::size_t size, Device& src_device,
                              Device& dest_device) {
    auto* ring = dynamic_cast<HCQAllocator*>(&dest_device.allocator());
    if (!ring)
      throw InvalidArgument(fmt::format(TINYDEV_FMT("transfer from {} to {}: the destination's allocator has no staging "
                                                    "ring to stage it through"),
                                        src_device.name(), dest_device.name()));
    if (size == 0) return;
    ring->ensure_ring();
    using Queue = typename Device::copy_queue_type;
    const std::size_t chunk = ring->batch_size_;
    debug_log(2, src_device.name(), TINYDEV_FMT("transfer {} -> {}: {} bytes staged through {}'s staging ring ({} "
                                                "chunks of at most {} bytes)"),
              src_device.name(), dest_device.name(), size, dest_device.name(), (size + chunk - 1) / chunk, chunk);
    HCQProfileScope<Device, Queue> prof(src_device,
                                        fmt::format(TINYDEV_FMT("{} -> {} (staged)"), src_device.name(), dest_device.name()),
                                        true);
    for (std::size_t i = 0; i < size; i += chunk) {
      const std::size_t n = std::min(chunk, size - i);
      const std::size_t index = (ring->next_ + 1) % ring->ring_.size();
      const Allocation slot = ring->ring_[index];
      auto filled = src_device.reserve_timeline_value();
      auto drained = dest_device.reserve_timeline_value();
      const std::uint64_t slot_free = ring->ring_timeline_[index];
      ring->next_ = index;
      ring->ring_timeline_[index] = drained.value();
      try {
        src_device.copy_queue()
            .wait(src_device.timeline_signal(), filled.value() - 1)
            .wait(dest_device.timeline_signal(), slot_free)
            .copy(slot, Allocation{src.va_addr + i, n, src.backend}, n)
            .signal(src_device.timeline_signal(), filled.value())
            .submit(src_device);
        filled.submitted();
        dest_device.copy_queue()
            .wait(dest_device.timeline_signal(), drained.value() - 1)
            .wait(src_device.timeline_signal(), filled.value())
            .copy(Allocation{dest.va_addr + i, n, dest.backend}, slot, n)
            .signal(dest_device.timeline_signal(), drained.value())
            .submit(dest_device);
        drained.submitted();
      } catch (...) {
        ring->give_up_slot(index);
        throw;
      }
    }
    auto last = src_device.reserve_timeline_value();
    src_device.copy_queue()
        .wait(src_device.timeline_signal(), last.value() - 1)
        .wait(dest_device.timeline_signal(), dest_device.timeline_value() - 1)
        .signal(src_device.timeline_signal(), last.value())
        .submit(src_device);
    last.submitted();
  }
  // A slot the device may still write, whose tag says nothing of when: left out of the ring and
  // never freed (Note [Staged transfers]). An emptied ring is made anew at the next staged copy.
  void give_up_slot(std::size_t index) noexcept {
    ring_.erase(ring_.begin() + static_cast<std::ptrdiff_t>(index));
    ring_timeline_.erase(ring_timeline_.begin() + static_cast<std::ptrdiff_t>(index));
    next_ = ring_.empty() ? 0 : (index + ring_.size() - 1) % ring_.size();
    try {
      debug_log(1, device_.name(), TINYDEV_FMT("left a staging slot of {} bytes out of the ring: a failed staged "
                                               "transfer may still write it"), batch_size_);
    } catch (...) {
    }
  }

  static constexpr std::uint64_t kSlotTaken = ~0ull;  // Note [Disk reads into the staging ring]

  // The staging ring as a FileReader's sink, for one copy_from_disk (the submit lock held).
  class RingSink final : public StagingSink {
   public:
    RingSink(HCQAllocator& allocator, Allocation dest) : a_(allocator), dest_(dest) {}
    // A reader that broke off without landing or abandoning a slot (an exception it did not
    // expect) has finished its reads by now: free such slots, or every later copy would wait on them.
    ~RingSink() {
      for (std::uint64_t& tag : a_.ring_timeline_)
        if (tag == kSlotTaken) tag = 0;
    }
    RingSink(const RingSink&) = delete;
    RingSink& operator=(const RingSink&) = delete;
    std::size_t slot_bytes() const noexcept override { return a_.batch_size_; }
    std::optional<Slot> try_take() override {
      const std::size_t i = (a_.next_ + 1) % a_.ring_.size();
      const std::uint64_t tag = a_.ring_timeline_[i];
      if (tag == kSlotTaken || tag > a_.device_.timeline_slot()->value.load(std::memory_order_acquire))
        return std::nullopt;
      return reserve(i);
    }
    Slot take() override {
      const std::size_t i = (a_.next_ + 1) % a_.ring_.size();
      if (a_.ring_timeline_[i] == kSlotTaken)
        throw InvalidArgument("copy_from_disk: the file reader asked to wait for a staging slot it still reads into");
      a_.device_.timeline_signal().wait(a_.ring_timeline_[i]);
      return reserve(i);
    }
    void landed(Slot slot, std::size_t dest_offset, std::size_t data_offset, std::size_t size) override {
      const Allocation& staged = a_.ring_[slot.index];
      const std::uint64_t value = a_.device_.next_timeline_value();
      a_.device_.copy_queue()
          .wait(a_.device_.timeline_signal(), value - 1)
          .copy(Allocation{dest_.va_addr + dest_offset, size, dest_.backend},
                Allocation{staged.va_addr + data_offset, size, staged.backend}, size)
          .signal(a_.device_.timeline_signal(), value)
          .submit(a_.device_);
      a_.ring_timeline_[slot.index] = value;
    }
    void abandon(Slot slot) noexcept override { a_.ring_timeline_[slot.index] = 0; }

   private:
    Slot reserve(std::size_t i) {
      a_.ring_timeline_[i] = kSlotTaken;
      a_.next_ = i;
      return Slot{a_.ring_[i].template host_ptr<std::byte>(), i};
    }
    HCQAllocator& a_;
    Allocation dest_;
  };

  std::size_t batch_size_, batch_count_;
  bool host_visible_;
  bool device_alive_ = true;
  std::atomic<bool> force_staging_{false};  // set by tests while copies may run
  std::vector<Allocation> ring_;
  std::vector<std::uint64_t> ring_timeline_;
  std::size_t next_ = 0;
};

}  // namespace tinydev

TINYDEV_API_END
