#include "support.hpp"
#include <algorithm>
#include <set>
#include <utility>

#include "tinydev/hcq_stream.hpp"

using namespace tinydev;
using namespace tinydev::testing;

TEST_CASE("allocator: alloc rejects size 0", "[allocator]") {
  FakeAllocator a;
  CHECK_THROWS_WITH(a.alloc(0), Catch::Contains("alloc size must be positive"));
  CHECK(a.backend_allocs == 0);
}

TEST_CASE("lru: the same handle comes back for the same size and options", "[allocator]") {
  FakeAllocator a;
  const std::size_t size = 1000 + fresh_seed() % 5000;
  Allocation first = a.alloc(size);
  a.free(first, size);
  Allocation again = a.alloc(size);  // freed below
  CHECK(again == first);
  CHECK(a.backend_allocs == 1);
  LRUStats s = a.stats();
  CHECK(s.hits == 1);
  CHECK(s.misses == 1);
  CHECK(s.bytes_cached == 0);
  a.free(again, size);
  CHECK(a.stats().bytes_cached == size);
}

TEST_CASE("lru: reuse is last-in first-out per key", "[allocator]") {
  FakeAllocator a;
  Allocation x = a.alloc(256), y = a.alloc(256);
  a.free(x, 256);
  a.free(y, 256);
  CHECK(a.alloc(256) == y);
  CHECK(a.alloc(256) == x);
  a.free(x, 256);
  a.free(y, 256);
}

// Note [Bucket cache]: 2,000 keys over 64 cache slots, so keys share slots and evict each other's
// cached bucket (keys that differ only in their options among them, about 16 pairs a run); every
// hit must still come from its own key's list, newest first.
TEST_CASE("lru: thousands of sizes and option sets each reuse their own memory last-in first-out", "[allocator]") {
  FakeAllocator a;
  std::mt19937_64 rng(fresh_seed());
  struct KeyState {
    std::size_t size;
    BufferOptions options;
    std::vector<Allocation> cached;  // the model: freed, newest last
    std::vector<Allocation> live;
  };
  std::vector<KeyState> keys;
  std::set<std::size_t> sizes;
  while (sizes.size() < 1000) sizes.insert(1 + rng() % 8192);
  for (const std::size_t size : sizes)  // each size with two option sets: keys that differ only there
    for (const bool host : {false, true}) keys.push_back(KeyState{size, BufferOptions{.host = host}, {}, {}});
  for (int step = 0; step < 40000; ++step) {
    KeyState& k = keys[rng() % keys.size()];
    if (k.live.empty() || rng() % 2) {
      const Allocation got = a.alloc(k.size, k.options);
      if (!k.cached.empty()) {
        INFO("size " << k.size << " host " << k.options.host << " step " << step);
        REQUIRE(got == k.cached.back());
        k.cached.pop_back();
      }
      k.live.push_back(got);
    } else {
      const std::size_t i = rng() % k.live.size();
      const Allocation freed = k.live[i];
      k.live.erase(k.live.begin() + static_cast<std::ptrdiff_t>(i));
      a.free(freed, k.size, k.options);
      k.cached.push_back(freed);
    }
  }
  std::size_t cached_bytes = 0;
  for (KeyState& k : keys) {
    for (const Allocation& x : k.live) a.free(x, k.size, k.options);
    cached_bytes += k.size * (k.cached.size() + k.live.size());
  }
  CHECK(a.stats().bytes_cached == cached_bytes);
  CHECK(a.stats().live_allocations == 0);
}

TEST_CASE("lru: different options or sizes get different memory", "[allocator]") {
  FakeAllocator a;
  Allocation plain = a.alloc(4096);
  a.free(plain, 4096);
  Allocation host = a.alloc(4096, BufferOptions{.host = true});
  CHECK(host != plain);
  Allocation bigger = a.alloc(8192);
  CHECK(bigger != plain);
  CHECK(a.backend_allocs == 3);
  CHECK(a.alloc(4096) == plain);
  a.free(host, 4096, BufferOptions{.host = true});
  CHECK(a.alloc(4096, BufferOptions{.host = true}) == host);
  a.free(plain, 4096);
  a.free(host, 4096, BufferOptions{.host = true});
  a.free(bigger, 8192);
}

TEST_CASE("lru: nolru and TINYDEV_LRU=0 free for real", "[allocator]") {
  FakeAllocator a;
  Allocation x = a.alloc(512, BufferOptions{.nolru = true});
  a.free(x, 512, BufferOptions{.nolru = true});
  CHECK(a.backend_frees == 1);
  CHECK(a.stats().entries_cached == 0);
  {
    ScopedOverride off("TINYDEV_LRU", "0");
    Allocation y = a.alloc(512);
    a.free(y, 512);
    CHECK(a.backend_frees == 2);
  }
  Allocation z = a.alloc(512);
  a.free(z, 512);
  CHECK(a.backend_frees == 2);
  CHECK(a.stats().entries_cached == 1);
}

TEST_CASE("lru: out of memory frees the cache and retries once", "[allocator]") {
  FakeAllocator a;
  a.limit_bytes = 10000;
  Allocation x = a.alloc(6000);
  a.free(x, 6000);  // cached: the backend still holds 6000 bytes
  Allocation y = a.alloc(5000);  // 6000 + 5000 > limit: drop the cache, retry, succeed
  CHECK(a.backend_frees == 1);
  CHECK(a.stats().oom_retries == 1);
  CHECK(a.stats().bytes_cached == 0);
  // Still too big after dropping everything: OutOfMemory, and the live allocation is untouched.
  CHECK_THROWS_AS(a.alloc(9000), OutOfMemory);
  CHECK_THROWS_WITH(a.alloc(9000), Catch::Contains("even after handing"));
  CHECK(a.live_bytes == 5000);
  a.free(y, 5000);
}

TEST_CASE("lru: TINYDEV_LRU_MAX_BYTES evicts the least recently freed", "[allocator]") {
  ScopedOverride cap("TINYDEV_LRU_MAX_BYTES", "3000");
  FakeAllocator a;
  Allocation p = a.alloc(1000), q = a.alloc(1000), r = a.alloc(1000), s = a.alloc(500);
  a.free(p, 1000);
  a.free(q, 1000);
  a.free(r, 1000);
  CHECK(a.stats().bytes_cached == 3000);
  a.free(s, 500);  // over the cap: p (freed first) goes
  CHECK(a.stats().bytes_cached == 2500);
  CHECK(a.stats().evictions == 1);
  CHECK(a.backend_frees == 1);
  CHECK(a.alloc(1000) == r);
  CHECK(a.alloc(1000) == q);
  const int backend_before = a.backend_allocs;
  Allocation fresh = a.alloc(1000);  // p was really freed: this one comes from the backend
  CHECK(a.backend_allocs == backend_before + 1);
  for (Allocation x : {q, r, fresh}) a.free(x, 1000);
}

TEST_CASE("lru: free_cache returns everything to the backend", "[allocator]") {
  FakeAllocator a;
  std::vector<Allocation> xs;
  for (int i = 0; i < 100; ++i) xs.push_back(a.alloc(64 + (i % 7) * 64));
  for (int i = 0; i < 100; ++i) a.free(xs[i], 64 + (i % 7) * 64);
  CHECK(a.stats().entries_cached == 100);
  a.free_cache();
  CHECK(a.stats().entries_cached == 0);
  CHECK(a.stats().bytes_cached == 0);
  CHECK(a.backend_frees == 100);
  CHECK(a.live_bytes == 0);
}

TEST_CASE("lru: a free that fails while the cache empties is thrown once every other entry was freed", "[allocator]") {
  FakeAllocator a;
  std::mt19937_64 rng(fresh_seed());
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 20; ++i) sizes.push_back(64 * (1 + i + 20 * (rng() % 50)));  // distinct
  std::vector<Allocation> xs;
  for (std::size_t size : sizes) xs.push_back(a.alloc(size));
  for (std::size_t i = 0; i < sizes.size(); ++i) a.free(xs[i], sizes[i]);
  a.failing_free_size = sizes[rng() % (sizes.size() / 2)];  // among the older half: entries are freed oldest first
  CHECK_THROWS_WITH(a.free_cache(), Catch::Contains("failed free of " + std::to_string(a.failing_free_size.load())));
  CHECK(a.stats().entries_cached == 0);
  CHECK(a.stats().bytes_cached == 0);
  CHECK(a.backend_frees == static_cast<int>(sizes.size()));
  CHECK(a.live_bytes == 0);
  a.failing_free_size = 0;
}

TEST_CASE("lru: out of memory retries after emptying the cache even when a free there fails", "[allocator]") {
  FakeAllocator a;
  const std::size_t unit = 4096 * (1 + fresh_seed() % 8);
  a.limit_bytes = 8 * unit;
  // Six units cached in three entries; the free of the 1-unit entry fails.
  const Allocation one = a.alloc(unit), two = a.alloc(2 * unit), three = a.alloc(3 * unit);
  a.free(one, unit);
  a.free(two, 2 * unit);
  a.free(three, 3 * unit);
  a.failing_free_size = unit;
  const Allocation big = a.alloc(7 * unit);  // fits only once the cache is empty
  CHECK(a.stats().oom_retries == 1);
  CHECK(a.stats().entries_cached == 0);
  CHECK(a.live_bytes == 7 * unit);
  // When the retry fails too, its OutOfMemory tells of the failed free.
  const Allocation again = a.alloc(unit);
  a.free(again, unit);
  CHECK_THROWS_WITH(a.alloc(5 * unit), Catch::Contains("even after handing") &&
                                           Catch::Contains("a free while emptying the cache failed") &&
                                           Catch::Contains("failed free of " + std::to_string(unit)));
  a.failing_free_size = 0;
  a.free(big, 7 * unit);
}

TEST_CASE("lru: concurrent alloc and free from 8 threads keep the books straight", "[allocator]") {
  FakeAllocator a;
  std::atomic<int> corrupted{0};  // Catch assertions are not thread-safe: count, check after join
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&a, &corrupted, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::vector<std::pair<Allocation, std::size_t>> held;
      for (int i = 0; i < 2000; ++i) {
        if (held.size() < 8 && (rng() % 2 || held.empty())) {
          std::size_t size = 64 * (1 + rng() % 4);
          Allocation x = a.alloc(size);
          std::memset(x.host_ptr(), t, size);  // we own it exclusively
          held.emplace_back(x, size);
        } else {
          auto [x, size] = held.back();
          for (std::size_t k = 0; k < size; ++k) corrupted += x.host_ptr<unsigned char>()[k] != t;
          held.pop_back();
          a.free(x, size);
        }
      }
      for (auto [x, size] : held) a.free(x, size);
    });
  for (auto& t : threads) t.join();
  CHECK(corrupted == 0);  // no allocation was handed to two threads at once
  LRUStats s = a.stats();
  CHECK(s.misses == static_cast<std::uint64_t>(a.backend_allocs.load()));  // one backend call per miss
  CHECK(s.hits > 0);
  a.free_cache();
  CHECK(a.live_bytes == 0);
}

// Note [LRU cache layout]: cache entries are recycled through a spare list and reused without
// being cleared, so a long run with a byte bound walks every link many times over. The model is the
// cache as the seed's LRUAllocator plus a bound defines it: per key newest first, evictions oldest
// freed first. Every step checks what alloc hands back and the cache's counters against it.
TEST_CASE("lru: a long random run under a byte bound evicts the least recently freed and reuses the newest",
          "[allocator]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  constexpr std::uint64_t kCap = 40 * 1024;
  ScopedOverride cap("TINYDEV_LRU_MAX_BYTES", std::to_string(kCap));
  FakeAllocator a;
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 24; ++i) sizes.push_back(64 * (1 + rng() % 64));  // 64 B .. 4 KiB, some repeated
  struct Cached {
    Allocation allocation;
    std::size_t size;
  };
  std::vector<Cached> cache;  // the model: oldest freed first
  std::vector<Cached> live;
  std::uint64_t evictions = 0;
  for (int step = 0; step < 30000; ++step) {
    INFO("step " << step);
    if (live.empty() || (live.size() < 40 && rng() % 2)) {
      const std::size_t size = sizes[rng() % sizes.size()];
      // The newest cached allocation of this size, if any, is what alloc must hand back.
      auto newest = std::find_if(cache.rbegin(), cache.rend(), [&](const Cached& c) { return c.size == size; });
      const int backend_before = a.backend_allocs;
      const Allocation got = a.alloc(size);
      if (newest != cache.rend()) {
        REQUIRE(got == newest->allocation);
        REQUIRE(a.backend_allocs == backend_before);
        cache.erase(std::next(newest).base());
      } else {
        REQUIRE(a.backend_allocs == backend_before + 1);
      }
      live.push_back(Cached{got, size});
    } else {
      const std::size_t i = rng() % live.size();
      const Cached freed = live[i];
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      a.free(freed.allocation, freed.size);
      cache.push_back(freed);
      std::uint64_t bytes = 0;
      for (const Cached& c : cache) bytes += c.size;
      while (bytes > kCap) {  // the least recently freed go first
        bytes -= cache.front().size;
        cache.erase(cache.begin());
        ++evictions;
      }
    }
    const LRUStats s = a.stats();
    std::uint64_t bytes = 0;
    for (const Cached& c : cache) bytes += c.size;
    REQUIRE(s.entries_cached == cache.size());
    REQUIRE(s.bytes_cached == bytes);
    REQUIRE(s.evictions == evictions);
    REQUIRE(s.live_allocations == live.size());
  }
  CHECK(evictions > 1000);  // the bound was at work all along, not only at the end
  for (const Cached& c : live) a.free(c.allocation, c.size);
  a.free_cache();
  CHECK(a.live_bytes == 0);
}

TEST_CASE("malloc allocator: aligned - host-visible - with views", "[allocator]") {
  MallocAllocator a;
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const std::size_t size = 1 + seed % 100000;
  Allocation x = a.alloc(size);
  CHECK(x.va_addr % 64 == 0);
  auto data = random_bytes(size, seed);
  a.copyin(x, data);
  std::vector<std::byte> back(size);
  a.copyout(back, x);
  CHECK(back == data);
  auto window = a.as_buffer(x);
  REQUIRE(window);
  CHECK(std::equal(window->begin(), window->end(), data.begin()));
  const std::size_t off = size / 3;
  Allocation v = a.offset(x, size - off, off);
  CHECK(v.va_addr == x.va_addr + off);
  CHECK(std::memcmp(v.host_ptr(), data.data() + off, size - off) == 0);
  CHECK_THROWS_AS(a.offset(x, size, 1), InvalidArgument);
  CHECK_THROWS_AS(a.copyin(x, random_bytes(size + 1, seed)), InvalidArgument);
  a.free(x, size);
}

TEST_CASE("memory: the streaming copy is byte-exact at every alignment and size around its block sizes", "[lru]") {
  const std::uint64_t seed = tinydev::testing::fresh_seed();
  INFO("seed " << seed);
  const auto src = tinydev::testing::random_bytes((1u << 20) + 200, seed);
  std::vector<std::byte> dest(src.size() + 200);
  for (std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t{63}, std::size_t{64}, std::size_t{127},
                           std::size_t{128}, std::size_t{4095}, std::size_t{16384}, std::size_t{16384 + 129},
                           std::size_t{(1u << 20) + 77}})
    for (std::size_t src_off : {0, 1, 31, 64})
      for (std::size_t dest_off : {0, 7, 32, 100}) {
        INFO("size " << size << " src+" << src_off << " dest+" << dest_off);
        std::fill(dest.begin(), dest.end(), std::byte{0xAB});
        tinydev::detail::streaming_copy(dest.data() + dest_off, src.data() + src_off, size);
        CHECK(std::equal(src.begin() + src_off, src.begin() + src_off + size, dest.begin() + dest_off));
        CHECK(std::all_of(dest.begin(), dest.begin() + dest_off, [](std::byte b) { return b == std::byte{0xAB}; }));
        CHECK(std::all_of(dest.begin() + dest_off + size, dest.end(), [](std::byte b) { return b == std::byte{0xAB}; }));
      }
}

// Note [Spare captures]: the policy CPU and CUDA streams share for reusing copyin captures.
namespace {
struct CountedBlock {
  std::size_t bytes = 0;
  int* alive = nullptr;  // counts blocks not yet freed
  CountedBlock(std::size_t b, int* a) : bytes(b), alive(a) { ++*alive; }
  CountedBlock(CountedBlock&& o) noexcept : bytes(std::exchange(o.bytes, 0)), alive(std::exchange(o.alive, nullptr)) {}
  CountedBlock& operator=(CountedBlock&& o) noexcept {
    if (this != &o) {
      if (alive) --*alive;
      bytes = std::exchange(o.bytes, 0);
      alive = std::exchange(o.alive, nullptr);
    }
    return *this;
  }
  ~CountedBlock() {
    if (alive) --*alive;
  }
  std::size_t size() const noexcept { return bytes; }
};
}  // namespace

TEST_CASE("spare captures: the smallest spare within twice the size and the budget is reused and the oldest are freed first",
          "[allocator]") {
  const std::size_t u = 4096 + fresh_seed() % 4096, budget = 64 * u;
  int alive = 0;
  detail::SpareCaptures<CountedBlock> spares;
  spares.keep(CountedBlock(8 * u, &alive), 0, budget);  // oldest
  spares.keep(CountedBlock(3 * u, &alive), 0, budget);
  spares.keep(CountedBlock(5 * u, &alive), 0, budget);
  CHECK(spares.bytes() == 16 * u);
  CHECK(alive == 3);
  // The smallest that fits: 5 units for 4 (8 fits too but is larger, 3 is too small).
  auto a = spares.take(4 * u, 0, budget);
  REQUIRE(a.has_value());
  CHECK(a->size() == 5 * u);
  auto b = spares.take(2 * u, 0, budget);
  REQUIRE(b.has_value());
  CHECK(b->size() == 3 * u);
  CHECK(spares.bytes() == 8 * u);
  // 8 units are more than twice 3: none is taken, and with room in the budget none is freed.
  CHECK_FALSE(spares.take(3 * u, 0, budget).has_value());
  CHECK(spares.bytes() == 8 * u);
  CHECK(alive == 3);
  // A spare that fits in size but not beside what is queued is not taken; spares are freed until
  // the queued bytes, the spares and a new block fit.
  CHECK_FALSE(spares.take(8 * u, 57 * u, budget).has_value());
  CHECK(spares.bytes() == 0);
  CHECK(alive == 2);
  // Kept only within the budget beside the queued bytes; otherwise freed at once.
  spares.keep(CountedBlock(10 * u, &alive), 60 * u, budget);
  CHECK(spares.bytes() == 0);
  CHECK(alive == 2);
  spares.keep(std::move(*a), 0, budget);
  spares.keep(std::move(*b), 0, budget);
  CHECK(spares.bytes() == 8 * u);
  // One block larger than the budget is allowed alone.
  CHECK_FALSE(spares.take(100 * u, 0, budget).has_value());
  CHECK(spares.bytes() == 0);  // the spares made room for it
  CHECK(alive == 0);
  spares.keep(CountedBlock(2 * u, &alive), 0, budget);
  spares.clear();
  CHECK(alive == 0);
  CHECK(spares.bytes() == 0);
}
