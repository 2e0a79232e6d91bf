// tinydev/memory.hpp: allocation options, the Allocator interface, the caching LRUAllocator and the
// host MallocAllocator (layer 3).
//
// An allocator hands out opaque Allocation handles, not host pointers: on CUDA `va_addr` is a
// device address the host cannot touch, on DISK a range of a file, on the CPU backends host memory.
// Only an allocator whose `as_buffer` answers may be read by the host directly.
//
// Ownership: whoever receives an Allocation from `alloc` owns it until it passes it back to `free`
// on the same allocator with the same size and options. An allocator remembers what it handed
// out: freeing anything else (an allocation of another allocator, a view, one freed already, or
// with another size or options) is InvalidArgument and changes nothing. An allocator must outlive
// every Allocation it handed out (device allocators live as long as the process).
//
// Thread safety: every Allocator method may be called concurrently from any thread. An allocator
// holds one mutex (its record of live allocations and, for LRUAllocator, its cache) and never
// calls into the backend (alloc_impl/free_impl) under it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

class Compiled;

// How a buffer should be allocated (the seed's BufferOptions; its `image` field is omitted: tinydev
// has no image dtypes). A hashable, comparable value.
struct BufferOptions {
  static BufferOptions from_bits(std::uint8_t bits) noexcept {
    return BufferOptions{static_cast<bool>(bits & 1), static_cast<bool>(bits & 2),
                         static_cast<bool>(bits & 4), static_cast<bool>(bits & 8)};
  }
  bool uncached = false;    // device memory the host should not cache (write-combined)
  bool cpu_access = false;  // the host must be able to map it
  bool host = false;        // pinned host memory the device can reach (staging buffers)
  bool nolru = false;       // free for real instead of keeping it in the allocator's cache

  friend bool operator==(const BufferOptions&, const BufferOptions&) = default;
  std::uint8_t bits() const noexcept {
    return static_cast<std::uint8_t>(uncached | cpu_access << 1 | host << 2 | nolru << 3);
  }
};

// One allocation as its allocator sees it. `va_addr` is an address in the device's address space,
// `size` its length in bytes, `backend` an optional backend-owned pointer (a DISK mapping, a
// driver object). Views made by `Allocator::offset` share the backend pointer of their base.
struct Allocation {
  std::uint64_t va_addr = 0;
  std::uint64_t size = 0;
  void* backend = nullptr;

  friend bool operator==(const Allocation&, const Allocation&) = default;
  template <class T = void>
  T* host_ptr() const noexcept {  // only meaningful where the allocator is host memory
    return reinterpret_cast<T*>(static_cast<std::uintptr_t>(va_addr));
  }
};

namespace detail {
// The allocations an allocator handed out and has not taken back, keyed by (va_addr, backend),
// with the size and options they were allocated with. Open addressing with linear probing and
// backward-shift deletion: insert, find and erase are a hash and a probe or two, and nothing is
// allocated except when the table doubles. Not synchronized: the owning allocator's mutex guards it.
class LiveAllocations {
 public:
  struct Record {
    std::uint64_t va_addr = 0;
    void* backend = nullptr;
    std::uint64_t size = 0;  // 0 marks an empty slot (allocations are never empty)
    std::uint8_t options = 0;
    bool adopted = false;    // owned by a Buffer that adopted it: only that Buffer frees it
  };
  LiveAllocations() = default;
  LiveAllocations(const LiveAllocations&) = delete;
  LiveAllocations& operator=(const LiveAllocations&) = delete;

  // Defined below, inline: an LRU cache hit does one insert, a cached free one find and one erase
  // (out of line they were a fifth of the pair's time).
  void insert(const Allocation& a, std::uint64_t size, std::uint8_t options);  // may throw bad_alloc
  // The record of `a`, or nullptr when it is not live. Valid until the next insert or erase.
  const Record* find(const Allocation& a) const noexcept;
  Record* find(const Allocation& a) noexcept {
    return const_cast<Record*>(static_cast<const LiveAllocations*>(this)->find(a));
  }
  void erase(const Record* record) noexcept;
  std::size_t size() const noexcept { return count_; }

 private:
  static std::size_t home_slot(std::uint64_t va_addr, const void* backend, std::size_t mask) noexcept {
    const std::uint64_t h = (va_addr ^ reinterpret_cast<std::uintptr_t>(backend)) * 0x9e3779b97f4a7c15ull;
    return static_cast<std::size_t>(h >> 32) & mask;
  }
  void grow();  // doubles the table (64 slots at first); bad_alloc leaves it as it was
  static void place(std::vector<Record>& slots, const Record& r) noexcept;
  std::vector<Record> slots_;
  std::size_t count_ = 0;
};

inline void LiveAllocations::place(std::vector<Record>& slots, const Record& r) noexcept {
  const std::size_t mask = slots.size() - 1;
  std::size_t i = home_slot(r.va_addr, r.backend, mask);
  while (slots[i].size) i = (i + 1) & mask;
  slots[i] = r;
}

inline void LiveAllocations::insert(const Allocation& a, std::uint64_t size, std::uint8_t options) {
  if ((count_ + 1) * 2 > slots_.size()) [[unlikely]] grow();  // at most half full: probes stay short
  place(slots_, Record{a.va_addr, a.backend, size, options, false});
  ++count_;
}

inline const LiveAllocations::Record* LiveAllocations::find(const Allocation& a) const noexcept {
  if (slots_.empty()) return nullptr;
  const std::size_t mask = slots_.size() - 1;
  for (std::size_t i = home_slot(a.va_addr, a.backend, mask);; i = (i + 1) & mask) {
    const Record& r = slots_[i];
    if (!r.size) return nullptr;
    if (r.va_addr == a.va_addr && r.backend == a.backend) return &r;
  }
}

inline void LiveAllocations::erase(const Record* record) noexcept {
  // Backward-shift deletion: move later members of the probe run into the hole, so lookups never
  // need tombstones and the table never degrades under churn.
  const std::size_t mask = slots_.size() - 1;
  std::size_t hole = static_cast<std::size_t>(record - slots_.data());
  for (std::size_t i = (hole + 1) & mask; slots_[i].size; i = (i + 1) & mask) {
    const std::size_t home = home_slot(slots_[i].va_addr, slots_[i].backend, mask);
    // Move it if its home is not in the cyclic range (hole, i].
    if (((i - home) & mask) >= ((i - hole) & mask)) {
      slots_[hole] = slots_[i];
      hole = i;
    }
  }
  slots_[hole] = Record{};
  --count_;
}
}  // namespace detail

// ---- reading files into device memory (DISK, docs/disk.md) ---------------------------------------

// Host memory a FileReader reads into, slot by slot: the staging ring of an HCQ allocator (Note
// [Disk reads into the staging ring] in tinydev/hcq_allocator.hpp). Used by one reader on one
// thread at a time (the caller of copy_from_disk holds the device's submit lock).
class StagingSink {
 public:
  struct Slot {
    std::byte* data = nullptr;  // slot_bytes() bytes of host memory
    std::size_t index = 0;      // the sink's own number for it
  };
  virtual ~StagingSink() = default;
  virtual std::size_t slot_bytes() const noexcept = 0;
  // A slot nothing uses any more, reserved for the caller; nullopt when the next one is still
  // read by queued copies. Never blocks.
  virtual std::optional<Slot> try_take() = 0;
  // The next slot, waiting for the copies that still read it. Only called while the reader has
  // no read in flight (every slot it took has landed or been abandoned).
  virtual Slot take() = 0;
  // The `size` bytes at `data_offset` of `slot` are the destination's bytes at `dest_offset`:
  // queue their copy. The slot is free again once that copy has run.
  virtual void landed(Slot slot, std::size_t dest_offset, std::size_t data_offset, std::size_t size) = 0;
  // A slot taken and never landed (its read failed): free at once.
  virtual void abandon(Slot slot) noexcept = 0;
};

// The reading side of an allocator whose allocations are ranges of a file (the DISK allocator):
// what copy() and copy_from_disk use to move its bytes without a detour through a mapping.
// Thread safety: concurrent reads are allowed (each keeps its own reads in flight).
class FileReader {
 public:
  virtual ~FileReader() = default;
  // Reads the `size` bytes of `src` (an allocation of this reader's allocator, or a view of one)
  // into host memory at `dest`. IoError when the file is shorter than the range, or a read fails;
  // `dest` then holds part of the bytes.
  virtual void read_into(std::byte* dest, const Allocation& src, std::size_t size) = 0;
  // Reads the `size` bytes of `src` through `sink`'s slots, handing each slot to `sink.landed` as
  // soon as its read completes, several reads in flight. On IoError every read has finished and
  // every slot taken has landed or been abandoned.
  virtual void read_sharded(const Allocation& src, std::size_t size, StagingSink& sink) = 0;
  // How reads go right now, for messages: "io_uring, O_DIRECT where the range is not cached".
  virtual std::string describe_reads() const = 0;
};

// The seed's Allocator: `alloc` validates and forwards to the backend's `alloc_impl`; `free`
// checks the allocation against the record of what was handed out, then calls `free_impl`.
// An allocator's counters, read together under its lock: Compiled::allocator().stats(), no cast
// needed. Allocators without a cache report only live_allocations and rejected_frees.
struct AllocatorStats {
  std::uint64_t hits = 0;          // allocs served from the cache
  std::uint64_t misses = 0;        // allocs that went to the backend
  std::uint64_t bytes_cached = 0;  // bytes currently held in the cache
  std::uint64_t entries_cached = 0;
  std::uint64_t evictions = 0;     // cached allocations freed to respect the byte bound
  std::uint64_t oom_retries = 0;   // out-of-memory failures answered by dropping the cache
  std::uint64_t max_bytes = 0;     // the cache's byte bound now in force; 0 = no bound
  std::uint64_t live_allocations = 0;  // handed out and not freed yet
  std::uint64_t rejected_frees = 0;    // frees refused (unknown allocation, twice, wrong size)
};
using LRUStats = AllocatorStats;  // its name before every allocator had stats

class Allocator {
 public:
  virtual ~Allocator() = default;

  // Allocates `size` bytes (> 0, else InvalidArgument). Throws OutOfMemory when the backend has
  // no memory left.
  virtual Allocation alloc(std::size_t size, const BufferOptions& options = {});
  // Returns an allocation; `size` and `options` must be those it was allocated with. Freeing an
  // allocation this allocator did not hand out, freeing one twice, or with another size or
  // options, is InvalidArgument, and nothing is freed or cached.
  virtual void free(Allocation allocation, std::size_t size, const BufferOptions& options = {});
  // The size and options `allocation` was handed out with, when this allocator handed it out
  // and it is not freed yet (views never are); else nullopt.
  struct LiveInfo {
    std::uint64_t size;
    BufferOptions options;
  };
  std::optional<LiveInfo> live_info(const Allocation& allocation) const;

  // Ownership by a Buffer (its own allocations, and Buffer::Params::adopt). `adopt` marks a live allocation as
  // owned by its adopter and returns what it was allocated with; InvalidArgument when it is not
  // live or already adopted. From then on a plain free of it is InvalidArgument (the adopter owns
  // it), and the adopter gives it back with `release_adopted` (a free that expects the mark).
  LiveInfo adopt(const Allocation& allocation);
  void release_adopted(Allocation allocation, std::size_t size, const BufferOptions& options);

  // Host -> device and device -> host copies of exactly `src.size()` / `dest.size()` bytes.
  virtual void copyin(Allocation dest, std::span<const std::byte> src) = 0;
  virtual void copyout(std::span<std::byte> dest, Allocation src) = 0;

  // Sub-allocations (views). Allocators without them return false from supports_offset and throw
  // InvalidArgument from offset.
  virtual bool supports_offset() const noexcept { return false; }
  virtual Allocation offset(Allocation base, std::size_t size, std::size_t offset);

  // Zero-copy host access to an allocation, where the memory is host memory; else nullopt.
  virtual std::optional<std::span<std::byte>> as_buffer(Allocation allocation);

  // Files (DISK, docs/disk.md). A file-backed allocator returns its reader, the others nullptr.
  virtual FileReader* file_reader() noexcept { return nullptr; }
  // The seed's copy_from_disk: an allocator that can take `size` bytes of a file allocation
  // (`reader`'s `src`) straight into `dest`, through its staging memory. Others return false and
  // throw InvalidArgument from copy_from_disk.
  virtual bool supports_copy_from_disk() const noexcept { return false; }
  virtual void copy_from_disk(Allocation dest, FileReader& reader, const Allocation& src, std::size_t size);

  // The seed's transfer: a device-to-device copy between two devices of this allocator's kind
  // (`src` on src_device, `dest` on dest_device, both opened from this backend). Others return
  // false and throw InvalidArgument.
  virtual bool supports_transfer() const noexcept { return false; }
  virtual void transfer(Allocation dest, Allocation src, std::size_t size, Compiled& src_device,
                        Compiled& dest_device);

  // A short name for messages ("LLVM allocator").
  virtual std::string describe() const { return "allocator"; }
  // The counters (AllocatorStats). Thread-safe.
  virtual AllocatorStats stats() const;
  // Called by a device being destroyed that owns this allocator (HCQCompiled's destructor): frees
  // from then on must not wait on the device. Others ignore it.
  virtual void detach_device() noexcept {}

 protected:
  virtual Allocation alloc_impl(std::size_t size, const BufferOptions& options) = 0;
  virtual void free_impl(Allocation allocation, std::size_t size, const BufferOptions& options) = 0;

  // Caller holds mutex_. The record of `allocation`, which the caller then erases; throws
  // InvalidArgument (changing nothing but the count of rejected frees) unless `allocation` is
  // live with this size and these options (and adopted or not, as `adopted` says).
  const detail::LiveAllocations::Record* check_free(const Allocation& allocation, std::size_t size,
                                                    const BufferOptions& options, bool adopted = false) {
    const detail::LiveAllocations::Record* r = live_.find(allocation);
    if (!r || r->size != size || r->options != options.bits() || r->adopted != adopted) [[unlikely]]
      refuse_free(r, allocation, size, options);
    return r;
  }
  // check_free's refusal, out of line: counts it and throws the InvalidArgument saying which check
  // failed (`record` is the allocation's record, nullptr when it is not live).
  [[noreturn]] void refuse_free(const detail::LiveAllocations::Record* record, const Allocation& allocation,
                                std::size_t size, const BufferOptions& options);

  mutable std::mutex mutex_;         // guards live_ (and, in LRUAllocator, its cache)
  detail::LiveAllocations live_;
  std::uint64_t rejected_frees_ = 0;  // frees refused by check_free
};

namespace detail {
// Host memory, never zero-filled: 64-byte aligned, page aligned from one page up (so that O_DIRECT
// file reads can land in it); OutOfMemory naming `who` when it fails.
Allocation alloc_host_memory(std::size_t size, std::string_view who);
void free_host_memory(const Allocation& allocation) noexcept;
// Note [Streaming copies] (src/memory.cpp): copies `size` bytes with non-temporal stores and a
// closing store fence (plain memcpy off x86-64). The ranges must not overlap. For large copies of
// memory nobody reads soon: the CPU copy queue's blocks, DISK reads of cached pages.
void streaming_copy(std::byte* dest, const std::byte* src, std::size_t size) noexcept;
// `base` narrowed to `size` bytes at `offset` (a view); InvalidArgument naming `who` if it does not
// fit.
Allocation sub_allocation(const Allocation& base, std::size_t size, std::size_t offset, std::string_view who);
// InvalidArgument naming `who` when a `what` ("copyin", "copyout") of `bytes` exceeds `allocation`.
void check_fits(std::size_t bytes, const Allocation& allocation, std::string_view what, std::string_view who);
}  // namespace detail


// Note [Default LRU bound]: without TINYDEV_LRU_MAX_BYTES, a cache of host memory holds at most
// 1/16 of the machine's physical memory, and never more than 2 GiB.
std::uint64_t default_host_cache_bound() noexcept;

// The seed's LRUAllocator: frees are kept in a cache keyed by (size, options) and handed back
// last-in-first-out to the next alloc of the same key.
//  - Out of memory: the whole cache is freed and the alloc retried once; a second failure is
//    OutOfMemory.
//  - TINYDEV_LRU=0, or options.nolru: free for real.
//  - A byte bound: the cache never holds more; the least recently freed go first. The bound is
//    TINYDEV_LRU_MAX_BYTES when set (0 = no bound), else the allocator's default
//    (default_host_cache_bound(), or what the backend set with set_default_max_bytes).
class LRUAllocator : public Allocator {
 public:
  LRUAllocator();
  ~LRUAllocator() override;

  Allocation alloc(std::size_t size, const BufferOptions& options = {}) override;
  void free(Allocation allocation, std::size_t size, const BufferOptions& options = {}) override;

  // Frees every cached allocation to the backend.
  void free_cache();
  AllocatorStats stats() const override;
  // The byte bound in force: TINYDEV_LRU_MAX_BYTES if set, else this allocator's default.
  // InvalidArgument naming the variable while the environment holds an invalid setting.
  std::uint64_t max_bytes() const;

 protected:
  // The bound used when TINYDEV_LRU_MAX_BYTES is unset (a device allocator sizes it by its memory).
  void set_default_max_bytes(std::uint64_t bytes) noexcept { default_max_bytes_ = bytes; }

  // Note [Cache reuse after queued work]
  // Memory freed while the device's default queue still has work queued (a staged copyin that
  // has not landed yet) may still be written by that work. Reuse by later default-queue work is
  // ordered after it anyway, but a stream is not ordered with the default queue. So a free
  // records queued_work_mark() with the entry, and a cache hit takes an entry only once
  // queued_work_done(mark); otherwise it looks at a few older entries, then allocates fresh. Both
  // are called under the cache's lock and must not block. The defaults (no queues) always reuse.
  virtual std::uint64_t queued_work_mark() const noexcept { return 0; }
  virtual bool queued_work_done(std::uint64_t mark) const noexcept { return mark == 0; }

 // Derived classes must call free_cache() in their own destructor: cached allocations are
 // returned through free_impl, which is gone by the time ~LRUAllocator runs.

 private:
  struct Entry;
  struct Key {
    std::size_t size;
    std::uint8_t options;
    friend bool operator==(const Key&, const Key&) = default;
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const noexcept {
      return std::hash<std::size_t>()(k.size * 16 + k.options);
    }
  };
  struct Bucket {
    Entry* newest = nullptr;  // per-key list, newest first (LIFO reuse)
  };
  // The bucket of `key` (Note [Bucket cache]): nullptr if none / made if none (may throw bad_alloc).
  // These four are inline, defined in src/memory.cpp (its only user): a cache hit and a cached
  // free are a few of them and two lock pairs.
  inline Bucket* find_bucket(Key key);
  inline Bucket& bucket_for(Key key);
  inline Entry* new_entry();  // fields unset: the caller sets every one (may throw bad_alloc)
  inline void unlink(Entry* e);
  void add_slab();  // new_entry's refill: 64 more spare entries
  void evict_over_cap(std::uint64_t cap, std::vector<Entry>& out);
  void release(std::vector<Entry>& entries);

  std::uint64_t default_max_bytes_;
  std::unordered_map<Key, Bucket, KeyHash> buckets_;  // never erased from: Bucket addresses are stable
  struct CachedBucket {
    Key key{0, 0};  // no allocation has size 0: an empty slot matches no key
    Bucket* bucket = nullptr;
  };
  std::array<CachedBucket, 64> bucket_cache_{};
  Entry* lru_oldest_ = nullptr;  // global list of every cached entry, by time of free
  Entry* lru_newest_ = nullptr;
  Entry* spare_ = nullptr;       // recycled Entry nodes: no heap allocation in steady state
  std::vector<std::unique_ptr<Entry[]>> slabs_;
  AllocatorStats stats_;
};

// Host memory (the seed's MallocAllocator): 64-byte aligned, never zero-filled, host-readable
// (zero-copy as_buffer), with views. MallocAllocator::shared() is one process-wide instance for
// host-side users; the CPU devices have HCQ allocators of their own (include/tinydev/cpu/cpu_hcq.hpp).
class MallocAllocator final : public LRUAllocator {
 public:
  MallocAllocator() = default;
  ~MallocAllocator() override;

  void copyin(Allocation dest, std::span<const std::byte> src) override;
  void copyout(std::span<std::byte> dest, Allocation src) override;
  bool supports_offset() const noexcept override { return true; }
  Allocation offset(Allocation base, std::size_t size, std::size_t offset) override;
  std::optional<std::span<std::byte>> as_buffer(Allocation allocation) override;
  std::string describe() const override { return "host (malloc) allocator"; }

  static std::shared_ptr<MallocAllocator> shared();

 protected:
  Allocation alloc_impl(std::size_t size, const BufferOptions& options) override;
  void free_impl(Allocation allocation, std::size_t size, const BufferOptions& options) override;
};

}  // namespace tinydev

template <>
struct std::hash<tinydev::BufferOptions> {
  std::size_t operator()(const tinydev::BufferOptions& o) const noexcept { return o.bits(); }
};

TINYDEV_API_END
