#include <nlohmann/json.hpp>

#include <atomic>
#include <fstream>
#include <new>
#include <thread>

#include "support.hpp"

using namespace tinydev;
using namespace tinydev::testing;
using namespace std::chrono_literals;

TEST_CASE("signal: values - freeing and stale handles", "[signal]") {
  SignalPool pool("TEST");
  const std::uint64_t start = fresh_seed() % 1000;
  Signal s = pool.alloc(start);
  CHECK(s.value() == start);
  s.set(start + 5);
  CHECK(s.value() == start + 5);
  CHECK(s.describe() == "TEST signal #" + std::to_string(s.index()));
  pool.free(s);
  CHECK_THROWS_WITH(s.value(), Catch::Contains("was freed"));
  CHECK_THROWS_WITH(pool.free(s), Catch::Contains("freed twice"));
  Signal again = pool.alloc(1);  // reuses the slot with a new generation
  CHECK(again.index() == s.index());
  CHECK_FALSE(again == s);
  CHECK(again.value() == 1);
  SignalPool other("OTHER");
  CHECK_THROWS_WITH(other.free(again), Catch::Contains("belongs elsewhere"));
  CHECK_THROWS_WITH(Signal().value(), Catch::Contains("empty Signal"));
  CHECK(pool.live() == 1);
}

TEST_CASE("signal: many signals grow the pool without moving slots", "[signal]") {
  SignalPool pool("GROW");
  std::vector<Signal> signals;
  std::vector<SignalSlot*> slots;
  for (int i = 0; i < 1000; ++i) {
    signals.push_back(pool.alloc(static_cast<std::uint64_t>(i)));
    slots.push_back(&signals.back().slot());
  }
  for (int i = 0; i < 1000; ++i) {
    CHECK(&signals[i].slot() == slots[i]);
    CHECK(signals[i].value() == static_cast<std::uint64_t>(i));
  }
}

TEST_CASE("signal: a sleeping waiter wakes on set and times out naming what it saw", "[signal]") {
  SignalPool pool("WAKE");
  Signal s = pool.alloc(0);
  const std::uint64_t want = 1 + fresh_seed() % 100;
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);  // long past the spin phase: the waiter is in the futex
    s.set(want);
  });
  const auto t0 = std::chrono::steady_clock::now();
  s.wait(want, 5s);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  setter.join();
  s.set(3);
  CHECK_THROWS_WITH(s.wait(4, 30ms), Catch::Contains("WAKE signal") && Catch::Contains("to reach 4") &&
                                         Catch::Contains("it is at 3"));
}

// Note [Signal waits]: a store wakes sleepers only at the value they wait for.
TEST_CASE("signal: a store wakes only sleepers whose value it reaches", "[signal]") {
  SignalPool pool("TARGET");
  Signal s = pool.alloc(0);
  SignalSlot& slot = s.slot();
  const std::uint64_t near = 5 + fresh_seed() % 20, far = near + 10 + fresh_seed() % 50;
  std::atomic<int> done{0};
  std::thread far_waiter([&] {
    s.wait(far, 20s);
    done += 10;
  });
  std::thread near_waiter([&] {
    s.wait(near, 20s);
    done += 1;
  });
  // Past the spin phase (at most 40 us) both sleep in the futex.
  for (int i = 0; i < 2000 && slot.waiters.load() != 2; ++i) std::this_thread::sleep_for(1ms);
  REQUIRE(slot.waiters.load() == 2);
  const std::uint32_t seq = slot.wake_seq.load();
  for (std::uint64_t v = 1; v < near; ++v) s.set(v);
  CHECK(slot.wake_seq.load() == seq);  // no store below either value woke anyone
  s.set(near);
  near_waiter.join();
  CHECK(done.load() == 1);
  CHECK(slot.wake_seq.load() == seq + 1);
  for (int i = 0; i < 2000 && slot.waiters.load() != 1; ++i) std::this_thread::sleep_for(1ms);
  const std::uint32_t seq2 = slot.wake_seq.load();
  for (std::uint64_t v = near + 1; v < far; ++v) s.set(v);
  CHECK(slot.wake_seq.load() == seq2);
  CHECK(done.load() == 1);
  s.set(far);
  far_waiter.join();
  CHECK(done.load() == 11);
}

TEST_CASE("signal: poisoning wakes sleepers with the reason", "[signal]") {
  SignalPool pool("POISON");
  Signal s = pool.alloc(0);
  std::string seen;
  std::thread waiter([&] {
    try {
      s.wait(1, 5s);
    } catch (const Error& e) {
      seen = e.what();
    }
  });
  std::this_thread::sleep_for(30ms);
  s.poison("the device fell off the bus");
  waiter.join();
  CHECK_THAT(seen, Catch::Contains("poisoned") && Catch::Contains("fell off the bus"));
  Signal fresh = pool.alloc(0);  // a freed-and-reused slot starts clean
  pool.free(s);
  Signal reused = pool.alloc(2);
  CHECK_NOTHROW(reused.wait(2, 10ms));
  (void)fresh;
}

TEST_CASE("signal: a wait past the value a signal held when poisoned fails even once the value is written - one it held returns", "[signal]") {
  // Both kinds of slot: futex-woken (host memory) and polled (memory a device writes).
  for (const bool polled : {false, true}) {
    INFO("polled " << polled);
    SignalPool pool(polled ? "POLLED" : "HOST",
                    SignalMemory{.allocate = [](std::size_t bytes) -> void* {
                                   return ::operator new(bytes, std::align_val_t{alignof(SignalSlot)});
                                 },
                                 .release = [](void* memory, std::size_t) {
                                   ::operator delete(memory, std::align_val_t{alignof(SignalSlot)});
                                 },
                                 .device_writes_without_wake = polled});
    const std::uint64_t held = 5 + fresh_seed() % 100;
    Signal s = pool.alloc(held);
    s.poison("the producer failed");
    s.set(held + 3);  // a queue let go past the failure writes its value later
    CHECK_NOTHROW(s.wait(held, 10ms));
    CHECK_THROWS_WITH(s.wait(held + 1, 10ms), Catch::Contains("poisoned") && Catch::Contains("the producer failed"));
    CHECK_THROWS_WITH(s.wait(held + 3, 10ms), Catch::Contains("the producer failed"));
    CHECK(poison_failed(s.slot(), held + 1));
    CHECK_FALSE(poison_failed(s.slot(), held));
    // A waiter sleeping when the poison and then the value come fails too.
    Signal t = pool.alloc(0);
    std::thread poisoner([&] {
      std::this_thread::sleep_for(20ms);
      t.poison("its queue failed");
      t.set(1);
    });
    CHECK_THROWS_WITH(t.wait(1, 5s), Catch::Contains("its queue failed"));
    poisoner.join();
  }
}

namespace {
std::atomic<int> g_hook_calls{0};
SignalSlot* g_hook_slot = nullptr;
void count_poison(SignalSlot& slot) noexcept {
  g_hook_calls += 1;
  g_hook_slot = &slot;
}
}  // namespace

TEST_CASE("signal: a pool's on_poison hook runs once per poison after the flag - and reuses counts each time a slot is handed out", "[signal]") {
  g_hook_calls = 0;
  SignalPool pool("HOOKED", SignalMemory{.allocate = [](std::size_t bytes) -> void* {
                                           return ::operator new(bytes, std::align_val_t{alignof(SignalSlot)});
                                         },
                                         .release = [](void* memory, std::size_t) {
                                           ::operator delete(memory, std::align_val_t{alignof(SignalSlot)});
                                         },
                                         .on_poison = &count_poison});
  Signal s = pool.alloc(0);
  SignalSlot& slot = s.slot();
  const std::uint32_t first = slot.reuses.load();
  s.poison("first");
  s.poison("second: the first reason stays, and the hook ran already");
  CHECK(g_hook_calls.load() == 1);
  CHECK(g_hook_slot == &slot);
  CHECK(slot.poisoned.load() == 1);
  CHECK(slot.poison_text() == "first");
  // The slot handed out again: a new signal, counted; its poison calls the hook again.
  pool.free(s);
  Signal again = pool.alloc(0);
  REQUIRE(&again.slot() == &slot);  // the pool reuses the last freed slot first
  CHECK(slot.reuses.load() == first + 1);
  CHECK(slot.poisoned.load() == 0);
  again.poison("third");
  CHECK(g_hook_calls.load() == 2);
  // Under hold_reuse nothing is handed out: an alloc from another thread waits for it.
  std::atomic<bool> allocated{false};
  std::thread allocator;
  {
    const auto hold = pool.hold_reuse();
    allocator = std::thread([&] {
      Signal other = pool.alloc(0);
      allocated = true;
      (void)other;
    });
    std::this_thread::sleep_for(30ms);
    CHECK_FALSE(allocated.load());
  }
  allocator.join();
  CHECK(allocated.load());
}

TEST_CASE("signal: an Event past the value its timeline held when poisoned stays failed when the value comes later",
          "[signal]") {
  SignalPool pool("EVENTS");
  const std::uint64_t reached = 10 + fresh_seed() % 100;
  Signal timeline = pool.alloc(reached);
  const Event done(timeline, reached, nullptr), pending(timeline, reached + 2, nullptr);
  CHECK(done.query());
  CHECK_FALSE(pending.query());
  timeline.poison("a later submission failed");
  // Work queued before the failure runs on and writes the timeline past both values.
  timeline.set(reached + 5);
  CHECK(done.query());
  CHECK_NOTHROW(done.wait(10ms));
  CHECK_THROWS_AS(pending.query(), DeviceFault);
  CHECK_THROWS_WITH(pending.wait(10ms), Catch::Contains("a later submission failed"));
  // A waiter poisoned while it waits: failed too, even though the value comes right after.
  Signal other = pool.alloc(0);
  const Event waited(other, 1, nullptr);
  std::thread poisoner([&] {
    std::this_thread::sleep_for(20ms);
    other.poison("its queue failed");
    other.set(1);
  });
  CHECK_THROWS_AS(waited.wait(5s), DeviceFault);
  poisoner.join();
  CHECK_THROWS_AS(waited.query(), DeviceFault);
}

TEST_CASE("profile: the writer escapes names and groups events by device", "[profile]") {
  TempDir dir;
  const std::string path = dir.str() + "/t.json";
  Profiler& p = Profiler::global();
  p.clear();
  const std::uint64_t now = Profiler::now_ns();
  p.add(ProfileEvent{"kernel \"q\"\\n", now, now + 1500, "DEV:1", "COMPUTE"});
  p.add(ProfileEvent{"CPU -> DEV:1", now + 2000, now + 2500, "DEV:1", "DMA"});
  p.add(ProfileEvent{"other", now, now + 10, "DEV:2", "COMPUTE"});
  CHECK(p.write(path) == 3);
  std::ifstream f(path);
  auto trace = nlohmann::json::parse(f);
  int processes = 0, events = 0;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("name") == "process_name") ++processes;
    if (e.at("ph") != "X") continue;
    ++events;
    if (e.at("name") == "kernel \"q\"\\n") CHECK(e.at("dur").get<double>() == Approx(1.5));
  }
  CHECK(processes == 2);
  CHECK(events == 3);
  p.clear();
  CHECK_THROWS_WITH(p.write(dir.str() + "/missing/t.json"), Catch::Contains("cannot write the profile"));
}

TEST_CASE("config: TINYDEV_CPU_THREADS and TINYDEV_PROFILE", "[config]") {
  {
    ScopedOverride threads("TINYDEV_CPU_THREADS", "3");
    CHECK(settings().cpu_threads == 3);
  }
  CHECK_THROWS_WITH(ScopedOverride("TINYDEV_CPU_THREADS", "0"), Catch::Contains("TINYDEV_CPU_THREADS='0'"));
  ScopedOverride prof("TINYDEV_PROFILE", "/tmp/x.json");
  CHECK(settings().profile == "/tmp/x.json");
  CHECK(Profiler::global().enabled());
}

TEST_CASE("signal: a pool on backend memory - device writes without wake are polled - bad memory is refused", "[signal]") {
  // Memory the "backend" hands out, counted; a device writing a slot's value directly (no wake).
  std::size_t chunks = 0, released = 0;
  SignalMemory memory{.allocate =
                          [&](std::size_t bytes) -> void* {
                            chunks += 1;
                            return ::operator new(bytes, std::align_val_t{64});
                          },
                      .release =
                          [&](void* p, std::size_t) {
                            released += 1;
                            ::operator delete(p, std::align_val_t{64});
                          },
                      .device_writes_without_wake = true};
  {
    SignalPool pool("DEVICE", memory);
    Signal s = pool.alloc(0);
    CHECK(chunks == 1);
    CHECK(s.slot().polled == 1);
    const std::uint64_t want = 1 + fresh_seed() % 100;
    std::thread device([&] {
      std::this_thread::sleep_for(30ms);  // past the spin budget: the waiter is polling
      s.slot().value.store(want, std::memory_order_release);  // as a GPU writes: no futex wake
    });
    const auto t0 = std::chrono::steady_clock::now();
    s.wait(want, 5s);
    CHECK(std::chrono::steady_clock::now() - t0 < 2s);
    device.join();
    CHECK_THROWS_WITH(s.wait(want + 1, 20ms), Catch::Contains("DEVICE signal") && Catch::Contains("timed out"));
    s.poison("the device faulted");
    CHECK_THROWS_WITH(s.wait(want + 1, 5s), Catch::Contains("the device faulted"));
  }
  CHECK(released == 1);  // the pool gave its chunk back when it died
  SignalMemory half = memory;
  half.release = nullptr;
  CHECK_THROWS_WITH(SignalPool("HALF", half), Catch::Contains("needs both allocate and release"));
  // Memory that is not 64-byte aligned is given back and refused; the pool stays empty.
  alignas(64) static std::byte arena[128];
  std::size_t misaligned_releases = 0;
  SignalPool crooked("CROOKED", SignalMemory{.allocate = [&](std::size_t) -> void* { return arena + 8; },
                                             .release = [&](void*, std::size_t) { misaligned_releases += 1; }});
  CHECK_THROWS_WITH(crooked.alloc(0), Catch::Contains("not 64-byte aligned"));
  CHECK(misaligned_releases == 1);
  CHECK(crooked.live() == 0);
}

// detail::SmallVector keeps a queue's signal uses and pools: a few in place, the rest on the heap.
// Random inserts and removals of the last against std::vector, through the spill and across
// copies and moves.
TEST_CASE("signal: a queue's small vector of signal uses keeps order through its spill - copies and moves",
          "[signal]") {
  std::mt19937_64 rng(fresh_seed());
  for (int round = 0; round < 200; ++round) {
    tinydev::detail::SmallVector<std::uint64_t, 4> small;
    std::vector<std::uint64_t> reference;
    const int n = static_cast<int>(rng() % 16);
    for (int i = 0; i < n; ++i) {
      if (!reference.empty() && rng() % 4 == 0) {  // a command whose recording threw drops its use
        small.pop_back();
        reference.pop_back();
        REQUIRE(std::vector<std::uint64_t>(small.begin(), small.end()) == reference);
        continue;
      }
      const std::uint64_t value = rng();
      const std::size_t at = reference.empty() ? 0 : rng() % (reference.size() + 1);
      small.insert(small.begin() + at, value);
      reference.insert(reference.begin() + static_cast<std::ptrdiff_t>(at), value);
      REQUIRE(std::vector<std::uint64_t>(small.begin(), small.end()) == reference);
    }
    const auto copy = small;
    CHECK(std::vector<std::uint64_t>(copy.begin(), copy.end()) == reference);
    tinydev::detail::SmallVector<std::uint64_t, 4> moved(std::move(small));
    CHECK(std::vector<std::uint64_t>(moved.begin(), moved.end()) == reference);
    CHECK(small.empty());
    small = copy;  // a moved-from one takes values again, in place or spilled
    small.push_back(42);
    reference.push_back(42);
    CHECK(std::vector<std::uint64_t>(small.begin(), small.end()) == reference);
    CHECK(small.size() == reference.size());
    if (!reference.empty()) CHECK(small[reference.size() - 1] == 42);
    // Onto a spilled one from one in place and back, onto itself, and inserting its own value.
    tinydev::detail::SmallVector<std::uint64_t, 4> spilled;
    for (int i = 0; i < 6; ++i) spilled.push_back(rng());
    tinydev::detail::SmallVector<std::uint64_t, 4> in_place;
    in_place.push_back(rng());
    const std::vector<std::uint64_t> in_place_values(in_place.begin(), in_place.end());
    spilled = in_place;
    CHECK(std::vector<std::uint64_t>(spilled.begin(), spilled.end()) == in_place_values);
    const auto& self = spilled;
    spilled = self;
    CHECK(std::vector<std::uint64_t>(spilled.begin(), spilled.end()) == in_place_values);
    spilled.insert(spilled.begin(), spilled[0]);
    CHECK(spilled.size() == 2);
    CHECK(spilled[0] == in_place_values[0]);
    CHECK(spilled[1] == in_place_values[0]);
  }
}
