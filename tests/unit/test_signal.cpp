#include <nlohmann/json.hpp>

#include <fstream>
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
