#include "tinydev/memory.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <cstdlib>
#include <cstring>
#include <new>

#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "tinydev/config.hpp"
#include "tinydev/error.hpp"

namespace tinydev {

// ---- LiveAllocations ---------------------------------------------------------------------------

// place, insert, find and erase are inline in tinydev/memory.hpp.
void detail::LiveAllocations::grow() {
  // The new table is built aside and swapped in: if it cannot be allocated, nothing changed.
  std::vector<Record> fresh(slots_.empty() ? 64 : slots_.size() * 2);
  for (const Record& r : slots_)
    if (r.size) place(fresh, r);
  slots_.swap(fresh);
}

// ---- Allocator ---------------------------------------------------------------------------------

Allocation Allocator::alloc(std::size_t size, const BufferOptions& options) {
  if (size == 0)
    throw InvalidArgument(fmt::format(
        "{}: alloc size must be positive, got 0: allocate at least one element", describe()));
  Allocation a = alloc_impl(size, options);
  try {
    std::lock_guard lock(mutex_);
    live_.insert(a, size, options.bits());
  } catch (...) {
    free_impl(a, size, options);  // the record could not grow: hand nothing out
    throw;
  }
  return a;
}

void Allocator::refuse_free(const detail::LiveAllocations::Record* r, const Allocation& allocation,
                            std::size_t size, const BufferOptions& options) {
  ++rejected_frees_;
  if (!r)
    throw InvalidArgument(fmt::format(
        "{}: free of an allocation at {:#x} ({} bytes) that this allocator did not hand out or that "
        "was freed already: free each allocation once, on the allocator that made it (a view is "
        "never freed, its base is)",
        describe(), allocation.va_addr, size));
  if (r->size != size || r->options != options.bits())
    throw InvalidArgument(fmt::format(
        "{}: free of the allocation at {:#x} with {} bytes and options {:#x}, but it was allocated "
        "with {} bytes and options {:#x}: pass the size and options it was allocated with",
        describe(), allocation.va_addr, size, options.bits(), r->size, r->options));
  throw InvalidArgument(fmt::format(
      "{}: free of the allocation at {:#x}, which a Buffer adopted: the buffer owns it now and frees "
      "it when its last handle goes; drop the buffer instead",
      describe(), allocation.va_addr));
}

Allocator::LiveInfo Allocator::adopt(const Allocation& allocation) {
  std::lock_guard lock(mutex_);
  detail::LiveAllocations::Record* r = live_.find(allocation);
  if (!r)
    throw InvalidArgument(fmt::format(
        "{} did not hand out the allocation at {:#x} (or it was freed): a buffer frees what it adopts, so "
        "adopt only live allocations of this device's allocator",
        describe(), allocation.va_addr));
  if (r->adopted)
    throw InvalidArgument(fmt::format("the allocation at {:#x} is adopted by another buffer already: share "
                                      "that Buffer (copies of a Buffer share its memory) instead",
                                      allocation.va_addr));
  r->adopted = true;
  return LiveInfo{r->size, BufferOptions::from_bits(r->options)};
}

void Allocator::release_adopted(Allocation allocation, std::size_t size, const BufferOptions& options) {
  {
    std::lock_guard lock(mutex_);
    // Checked as the adopter's free, then unmarked: the free below is then an ordinary one.
    const detail::LiveAllocations::Record* r = check_free(allocation, size, options, true);
    live_.find(allocation)->adopted = false;
    (void)r;
  }
  free(allocation, size, options);
}

void Allocator::free(Allocation allocation, std::size_t size, const BufferOptions& options) {
  {
    std::lock_guard lock(mutex_);
    live_.erase(check_free(allocation, size, options));
  }
  free_impl(allocation, size, options);
}

std::optional<Allocator::LiveInfo> Allocator::live_info(const Allocation& allocation) const {
  std::lock_guard lock(mutex_);
  if (const detail::LiveAllocations::Record* r = live_.find(allocation))
    return LiveInfo{r->size, BufferOptions::from_bits(r->options)};
  return std::nullopt;
}

Allocation Allocator::offset(Allocation, std::size_t, std::size_t) {
  throw InvalidArgument(fmt::format(
      "{} has no sub-allocations, so a Buffer view cannot be made on it: copy the range instead",
      describe()));
}

std::optional<std::span<std::byte>> Allocator::as_buffer(Allocation) { return std::nullopt; }

void Allocator::copy_from_disk(Allocation, FileReader&, const Allocation&, std::size_t) {
  throw InvalidArgument(fmt::format("{} cannot read files into its memory (no copy_from_disk): use tinydev::copy, "
                                    "which falls back to a copy through host memory",
                                    describe()));
}

void Allocator::transfer(Allocation, Allocation, std::size_t, Compiled&, Compiled&) {
  throw InvalidArgument(fmt::format("{} has no device-to-device transfer: use tinydev::copy, which falls back to a "
                                    "copy through host memory",
                                    describe()));
}

// ---- LRUAllocator ------------------------------------------------------------------------------

// Note [LRU cache layout]
// Every cached allocation is one Entry on two intrusive lists: its key's list (newest first, so
// reuse is LIFO as in the seed: the most recently freed memory is the warmest) and one global list
// ordered by time of free (for TINYDEV_LRU_MAX_BYTES, which evicts the least recently freed).
// Entries come from slabs and are recycled through `spare_`, so a cache hit or a cached free does
// one bucket lookup (Note [Bucket cache]) and pointer swaps: no heap allocation and no backend
// call under the lock.
struct LRUAllocator::Entry {
  Allocation allocation;
  Key key{};
  std::uint64_t reuse_after = 0;  // Note [Cache reuse after queued work]
  Bucket* bucket = nullptr;
  Entry* key_newer = nullptr;
  Entry* key_older = nullptr;
  Entry* lru_newer = nullptr;
  Entry* lru_older = nullptr;
};

// Note [Default LRU bound]
// The seed's cache has no bound: freed memory stays cached until an allocation fails. A server
// whose request sizes vary keeps every size it ever saw (65 live buffers grew a process to 3.2 GB),
// and on the host an allocation rarely fails before the machine swaps. So a cache is bounded by
// default: 1/16 of physical memory, at most 2 GiB, which keeps the hot sizes of a serving loop
// cached and returns the rest. TINYDEV_LRU_MAX_BYTES overrides it (0: no bound, the seed's way).
std::uint64_t default_host_cache_bound() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  constexpr std::uint64_t kCeiling = 2ull << 30;
  if (pages <= 0 || page <= 0) return 256ull << 20;  // unknown machine: a modest bound
  return std::min<std::uint64_t>(kCeiling, static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) / 16);
}

LRUAllocator::LRUAllocator() : default_max_bytes_(default_host_cache_bound()) {}
LRUAllocator::~LRUAllocator() = default;

// Note [Bucket cache]
// A cache hit and the free that refills it each look a size's bucket up. std::unordered_map does
// that with a division by its prime bucket count and a walk of the bucket's chain: about a third
// of an alloc+free pair. Buckets are never erased, so their addresses are stable and a
// direct-mapped table of 64 (key, bucket) pairs, indexed by a multiplicative hash, answers for the
// sizes in use with one compare; the map is asked only on a miss, which fills the slot.
static std::size_t bucket_cache_slot(std::size_t size, std::uint8_t options) noexcept {
  return static_cast<std::size_t>(((static_cast<std::uint64_t>(size) * 16 + options) * 0x9e3779b97f4a7c15ull) >> 58);
}

inline LRUAllocator::Bucket* LRUAllocator::find_bucket(Key key) {
  CachedBucket& cached = bucket_cache_[bucket_cache_slot(key.size, key.options)];
  if (cached.key == key) return cached.bucket;
  const auto it = buckets_.find(key);
  if (it == buckets_.end()) return nullptr;
  cached = CachedBucket{key, &it->second};
  return cached.bucket;
}

inline LRUAllocator::Bucket& LRUAllocator::bucket_for(Key key) {
  CachedBucket& cached = bucket_cache_[bucket_cache_slot(key.size, key.options)];
  if (cached.key == key) return *cached.bucket;
  Bucket& bucket = buckets_[key];
  cached = CachedBucket{key, &bucket};
  return bucket;
}

void LRUAllocator::add_slab() {
  constexpr std::size_t kSlab = 64;
  // Owned by slabs_ before any spare entry points into it: a bad_alloc leaves nothing dangling.
  slabs_.push_back(std::make_unique<Entry[]>(kSlab));
  Entry* slab = slabs_.back().get();
  for (std::size_t i = 0; i < kSlab; ++i) {
    slab[i].key_older = spare_;
    spare_ = &slab[i];
  }
}

inline LRUAllocator::Entry* LRUAllocator::new_entry() {
  if (!spare_) [[unlikely]] add_slab();
  Entry* e = spare_;
  spare_ = e->key_older;
  return e;
}

inline void LRUAllocator::unlink(Entry* e) {
  if (e->key_newer) e->key_newer->key_older = e->key_older;
  else e->bucket->newest = e->key_older;
  if (e->key_older) e->key_older->key_newer = e->key_newer;
  if (e->lru_newer) e->lru_newer->lru_older = e->lru_older;
  else lru_newest_ = e->lru_older;
  if (e->lru_older) e->lru_older->lru_newer = e->lru_newer;
  else lru_oldest_ = e->lru_newer;
  stats_.bytes_cached -= e->key.size;
  stats_.entries_cached -= 1;
  e->key_older = spare_;
  spare_ = e;
}

void LRUAllocator::evict_over_cap(std::uint64_t cap, std::vector<Entry>& out) {
  while (lru_oldest_ && stats_.bytes_cached > cap) {
    Entry* victim = lru_oldest_;
    out.push_back(*victim);
    unlink(victim);
    stats_.evictions += 1;
  }
}

void LRUAllocator::release(std::vector<Entry>& entries) {
  // Every entry is given back even when one free fails (it is out of the cache either way); the
  // first failure is thrown once all were tried.
  std::exception_ptr first_failure;
  for (const Entry& e : entries) {
    try {
      free_impl(e.allocation, e.key.size, BufferOptions::from_bits(e.key.options));
    } catch (...) {
      if (!first_failure) first_failure = std::current_exception();
    }
  }
  entries.clear();
  if (first_failure) std::rethrow_exception(first_failure);
}

std::uint64_t LRUAllocator::max_bytes() const {
  const std::optional<std::uint64_t>& set = settings().lru_max_bytes;
  return set ? *set : default_max_bytes_;
}

Allocation LRUAllocator::alloc(std::size_t size, const BufferOptions& options) {
  if (size == 0) return Allocator::alloc(size, options);  // throws the seed's error
  // The free reads the settings (TINYDEV_LRU, the byte bound): an invalid environment is an
  // error here, before memory is handed out, not in the free, where the memory could not go back
  // (a Buffer's destructor would have to swallow it). One atomic load once they were read.
  (void)settings();
  {
    std::lock_guard lock(mutex_);
    const Bucket* bucket = find_bucket(Key{size, options.bits()});
    Entry* e = bucket ? bucket->newest : nullptr;
    // Note [Cache reuse after queued work]: the newest entry, or one of a few older ones, whose
    // queued writers are done.
    for (int looked = 0; e && e->reuse_after && !queued_work_done(e->reuse_after) && looked < 4; ++looked)
      e = e->key_older;
    if (e && e->reuse_after && !queued_work_done(e->reuse_after)) e = nullptr;
    if (e) {
      Allocation a = e->allocation;
      live_.insert(a, size, options.bits());  // may throw bad_alloc (growing): then nothing changed
      unlink(e);
      stats_.hits += 1;
      return a;
    }
    stats_.misses += 1;
  }
  // A fresh allocation from the backend, recorded as live; if recording fails it goes back.
  auto fresh = [&] {
    Allocation a = alloc_impl(size, options);
    try {
      std::lock_guard lock(mutex_);
      live_.insert(a, size, options.bits());
    } catch (...) {
      free_impl(a, size, options);
      throw;
    }
    return a;
  };
  try {
    return fresh();
  } catch (const OutOfMemory&) {
  } catch (const std::bad_alloc&) {
  }
  // Out of memory: give back everything we hold and try once more (the seed's ladder).
  std::uint64_t dropped;
  {
    std::lock_guard lock(mutex_);
    dropped = stats_.bytes_cached;
    stats_.oom_retries += 1;
  }
  // A free that failed while the cache emptied does not stop the retry (release gave the other
  // entries back, and they may be enough); it is told only if the retry fails too.
  std::string free_failure;
  try {
    free_cache();
  } catch (const std::exception& e) {
    free_failure = fmt::format("; a free while emptying the cache failed: {}", e.what());
  }
  try {
    return fresh();
  } catch (const OutOfMemory& e) {
    throw OutOfMemory(fmt::format(
        "{}: out of memory allocating {} bytes, even after handing {} cached bytes back to the "
        "backend and retrying: free buffers you no longer need or lower the batch size ({}){}",
        describe(), size, dropped, e.what(), free_failure));
  } catch (const std::bad_alloc&) {
    throw OutOfMemory(fmt::format(
        "{}: out of memory allocating {} bytes, even after handing {} cached bytes back to the "
        "backend and retrying: free buffers you no longer need or lower the batch size{}",
        describe(), size, dropped, free_failure));
  }
}

void LRUAllocator::free(Allocation allocation, std::size_t size, const BufferOptions& options) {
  const Settings& cfg = settings();
  if (!cfg.lru || options.nolru) {
    Allocator::free(allocation, size, options);
    return;
  }
  const std::uint64_t cap = cfg.lru_max_bytes ? *cfg.lru_max_bytes : default_max_bytes_;
  std::vector<Entry> evicted;  // empty unless the byte cap is hit: no allocation otherwise
  {
    std::lock_guard lock(mutex_);
    const detail::LiveAllocations::Record* record = check_free(allocation, size, options);
    Key key{size, options.bits()};
    // These may throw bad_alloc: nothing has changed yet.
    if (cap && stats_.bytes_cached + size > cap) evicted.reserve(stats_.entries_cached + 1);
    Bucket& bucket = bucket_for(key);
    Entry* e = new_entry();
    live_.erase(record);
    e->allocation = allocation;
    e->key = key;
    e->reuse_after = queued_work_mark();
    e->bucket = &bucket;
    e->key_newer = nullptr;
    e->key_older = bucket.newest;
    if (bucket.newest) bucket.newest->key_newer = e;
    bucket.newest = e;
    e->lru_newer = nullptr;
    e->lru_older = lru_newest_;
    if (lru_newest_) lru_newest_->lru_newer = e;
    else lru_oldest_ = e;
    lru_newest_ = e;
    stats_.bytes_cached += size;
    stats_.entries_cached += 1;
    if (cap && stats_.bytes_cached > cap) evict_over_cap(cap, evicted);
  }
  if (!evicted.empty()) release(evicted);
}

void LRUAllocator::free_cache() {
  std::vector<Entry> all;
  {
    std::lock_guard lock(mutex_);
    all.reserve(stats_.entries_cached);
    evict_over_cap(0, all);
    stats_.evictions -= all.size();  // a requested drop is not an eviction
  }
  release(all);
}

AllocatorStats Allocator::stats() const {
  std::lock_guard lock(mutex_);
  AllocatorStats out;
  out.live_allocations = live_.size();
  out.rejected_frees = rejected_frees_;
  return out;
}

AllocatorStats LRUAllocator::stats() const {
  const std::uint64_t bound = max_bytes();
  std::lock_guard lock(mutex_);
  AllocatorStats out = stats_;
  out.max_bytes = bound;
  out.live_allocations = live_.size();
  out.rejected_frees = rejected_frees_;
  return out;
}

// ---- host memory helpers ----------------------------------------------------------------------

Allocation detail::alloc_host_memory(std::size_t size, std::string_view who) {
  void* p = nullptr;
  // posix_memalign never zero-fills; large sizes come from fresh mmap pages, which the kernel
  // zeroes lazily on first touch, so a fresh 64 MiB buffer costs no memset here.
  const std::size_t alignment = size >= 4096 ? 4096 : 64;
  if (::posix_memalign(&p, alignment, size) != 0 || !p)
    throw OutOfMemory(fmt::format("{}: host allocation of {} bytes failed", who, size));
  return Allocation{reinterpret_cast<std::uintptr_t>(p), size, nullptr};
}

void detail::free_host_memory(const Allocation& allocation) noexcept { std::free(allocation.host_ptr()); }

// Note [Streaming copies]
// A large copy into memory nobody reads soon (a staging-ring chunk landing in device memory, a
// tensor read from a file) should not pull every destination line into the cache first: regular
// stores read each line before writing it (read-for-ownership), doubling the memory traffic.
// Non-temporal stores skip that. glibc's memcpy streams only above a threshold sized by the
// last-level cache (99 MiB on a VM reporting a 260 MiB L3), which such copies do not reach, and
// below it runs at about half the speed on them. So: 32-byte AVX2 streaming stores where the CPU
// has them (about 25% faster than SSE2's on a 1 GiB copy here), else 16-byte SSE2 ones (every
// x86-64), then one store fence, since streaming stores are weakly ordered and whoever is told
// the bytes landed must see them. Elsewhere, memcpy.
namespace {
#if defined(__x86_64__)
// Both copy the unaligned head with memcpy, stream what they can (AVX2: whole groups of four
// pages; SSE2: 64-byte blocks), and return how far they got; the caller copies the rest.
__attribute__((target("avx2"))) std::size_t stream_avx2(std::byte* dest, const std::byte* src, std::size_t size) {
  const std::size_t head = std::min(size, (32 - reinterpret_cast<std::uintptr_t>(dest) % 32) % 32);
  std::memcpy(dest, src, head);
  std::size_t i = head;
  // Four pages at a time, a line of each in turn (as glibc's large copy): four sequential streams
  // keep more DRAM pages open than one.
  constexpr std::size_t kPage = 4096;
  for (; i + 4 * kPage <= size; i += 4 * kPage) {
    for (std::size_t line = 0; line < kPage; line += 64) {
      const auto* s0 = reinterpret_cast<const __m256i*>(src + i + line);
      const auto* s1 = reinterpret_cast<const __m256i*>(src + i + kPage + line);
      const auto* s2 = reinterpret_cast<const __m256i*>(src + i + 2 * kPage + line);
      const auto* s3 = reinterpret_cast<const __m256i*>(src + i + 3 * kPage + line);
      const __m256i a0 = _mm256_loadu_si256(s0), a1 = _mm256_loadu_si256(s0 + 1);
      const __m256i b0 = _mm256_loadu_si256(s1), b1 = _mm256_loadu_si256(s1 + 1);
      const __m256i c0 = _mm256_loadu_si256(s2), c1 = _mm256_loadu_si256(s2 + 1);
      const __m256i e0 = _mm256_loadu_si256(s3), e1 = _mm256_loadu_si256(s3 + 1);
      auto* d0 = reinterpret_cast<__m256i*>(dest + i + line);
      auto* d1 = reinterpret_cast<__m256i*>(dest + i + kPage + line);
      auto* d2 = reinterpret_cast<__m256i*>(dest + i + 2 * kPage + line);
      auto* d3 = reinterpret_cast<__m256i*>(dest + i + 3 * kPage + line);
      _mm256_stream_si256(d0, a0);
      _mm256_stream_si256(d0 + 1, a1);
      _mm256_stream_si256(d1, b0);
      _mm256_stream_si256(d1 + 1, b1);
      _mm256_stream_si256(d2, c0);
      _mm256_stream_si256(d2 + 1, c1);
      _mm256_stream_si256(d3, e0);
      _mm256_stream_si256(d3 + 1, e1);
    }
  }
  return i;  // under four pages left: the caller's memcpy
}

std::size_t stream_sse2(std::byte* dest, const std::byte* src, std::size_t size) {
  const std::size_t head = std::min(size, (16 - reinterpret_cast<std::uintptr_t>(dest) % 16) % 16);
  std::memcpy(dest, src, head);
  std::size_t i = head;
  for (; i + 64 <= size; i += 64) {
    const auto* s = reinterpret_cast<const __m128i*>(src + i);
    auto* d = reinterpret_cast<__m128i*>(dest + i);
    const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1), c = _mm_loadu_si128(s + 2),
                  e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d, a);
    _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c);
    _mm_stream_si128(d + 3, e);
  }
  return i;
}

bool has_avx2() noexcept {
  static const bool has = [] {
    __builtin_cpu_init();  // callable before static constructors ran
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}
#endif
}  // namespace

void detail::streaming_copy(std::byte* dest, const std::byte* src, std::size_t size) noexcept {
#if defined(__x86_64__)
  const std::size_t streamed = has_avx2() ? stream_avx2(dest, src, size) : stream_sse2(dest, src, size);
  std::memcpy(dest + streamed, src + streamed, size - streamed);
  _mm_sfence();
#else
  std::memcpy(dest, src, size);
#endif
}

Allocation detail::sub_allocation(const Allocation& base, std::size_t size, std::size_t offset, std::string_view who) {
  if (offset > base.size || size > base.size - offset)
    throw InvalidArgument(fmt::format("{}: a view of {} bytes at offset {} does not fit in a {}-byte allocation",
                                      who, size, offset, base.size));
  return Allocation{base.va_addr + offset, size, base.backend};
}

void detail::check_fits(std::size_t bytes, const Allocation& allocation, std::string_view what, std::string_view who) {
  if (bytes > allocation.size)
    throw InvalidArgument(fmt::format("{}: {} of {} bytes with an allocation of {} bytes: too large", who, what, bytes,
                                      allocation.size));
}

// ---- MallocAllocator ---------------------------------------------------------------------------

MallocAllocator::~MallocAllocator() { free_cache(); }

Allocation MallocAllocator::alloc_impl(std::size_t size, const BufferOptions&) {
  return detail::alloc_host_memory(size, describe());
}

void MallocAllocator::free_impl(Allocation allocation, std::size_t, const BufferOptions&) {
  detail::free_host_memory(allocation);
}

void MallocAllocator::copyin(Allocation dest, std::span<const std::byte> src) {
  detail::check_fits(src.size(), dest, "copyin", describe());
  // memmove: copy() between overlapping views of one buffer passes a zero-copy window of the
  // source (the seed's ctypes.memmove).
  std::memmove(dest.host_ptr(), src.data(), src.size());
}

void MallocAllocator::copyout(std::span<std::byte> dest, Allocation src) {
  detail::check_fits(dest.size(), src, "copyout", describe());
  std::memmove(dest.data(), src.host_ptr(), dest.size());
}

Allocation MallocAllocator::offset(Allocation base, std::size_t size, std::size_t offset) {
  return detail::sub_allocation(base, size, offset, describe());
}

std::optional<std::span<std::byte>> MallocAllocator::as_buffer(Allocation allocation) {
  return std::span<std::byte>(allocation.host_ptr<std::byte>(), allocation.size);
}

std::shared_ptr<MallocAllocator> MallocAllocator::shared() {
  // Never destroyed: buffers in other static objects may still free into it at exit.
  static auto* instance = new std::shared_ptr<MallocAllocator>(std::make_shared<MallocAllocator>());
  return *instance;
}

}  // namespace tinydev
