// The log sink (tinydev/log.hpp): every message reaches it with its level and subsystem, the default
// writes one prefixed line to stderr, and a misbehaving sink cannot hurt the caller.
#include <catch2/catch.hpp>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"
#include "tinydev/tinydev.hpp"

using namespace tinydev;
using namespace tinydev::testing;

namespace {

struct Captured {
  LogLevel level;
  std::string subsystem, message;
};

// Installs a sink collecting messages for its lifetime, and restores the default after.
struct CollectingSink {
  std::mutex mutex;
  std::vector<Captured> seen;
  CollectingSink() {
    set_log_sink([this](LogLevel level, std::string_view subsystem, std::string_view message) {
      std::lock_guard lock(mutex);
      seen.push_back({level, std::string(subsystem), std::string(message)});
    });
  }
  ~CollectingSink() { set_log_sink(nullptr); }
  std::vector<Captured> take() {
    std::lock_guard lock(mutex);
    return std::move(seen);
  }
};

}  // namespace

TEST_CASE("log: the library's messages reach the sink with level and subsystem and never stderr", "[log]") {
  register_fakes();
  const std::string var = "TINYDEV_LOGTEST" + std::to_string(fresh_seed() % 100000);
  std::vector<Captured> seen;
  const std::string err = capture_stderr([&] {
    CollectingSink sink;
    ScopedOverride debug("TINYDEV_DEBUG", "2");
    // An unknown variable: a warning from "config".
    ::setenv(var.c_str(), "1", 1);
    reload_environment();
    ::unsetenv(var.c_str());
    // A device opened: an info line from the device itself.
    const std::string name = "FAKE:" + std::to_string(1 + fresh_seed() % 60);
    (void)Device[name];
    // A caller's own trace.
    debug_log(2, "mine", "value {}", 42);
    debug_log(3, "mine", "not sent at TINYDEV_DEBUG=2");
    seen = sink.take();
  });
  reload_environment();
  CHECK(err.find("tinydev") == std::string::npos);  // nothing went around the sink
  auto find = [&](std::string_view text) -> const Captured* {
    for (const Captured& c : seen)
      if (c.message.find(text) != std::string::npos) return &c;
    return nullptr;
  };
  const Captured* warning = find(var + " is not a tinydev variable");
  REQUIRE(warning);
  CHECK(warning->level == LogLevel::warning);
  CHECK(warning->subsystem == "config");
  const Captured* opened = find("opened device FAKE:");
  REQUIRE(opened);
  CHECK(opened->level == LogLevel::info);
  CHECK(opened->subsystem.starts_with("FAKE:"));
  const Captured* mine = find("value 42");
  REQUIRE(mine);
  CHECK(mine->level == LogLevel::debug);
  CHECK(mine->subsystem == "mine");
  CHECK_FALSE(find("not sent"));
  for (const Captured& c : seen) CHECK(c.message.find('\n') == std::string::npos);
}

TEST_CASE("log: the default sink writes one line 'tinydev: <level>: <subsystem>: <message>'", "[log]") {
  set_log_sink(nullptr);
  const std::string text = "line " + std::to_string(fresh_seed());
  const std::string err = capture_stderr([&] { log_message(LogLevel::warning, "mine", text); });
  CHECK(err == "tinydev: warning: mine: " + text + "\n");
  CHECK(to_string(LogLevel::error) == "error");
}

TEST_CASE("log: a throwing or re-entrant sink cannot hurt the caller", "[log]") {
  std::atomic<int> calls{0};
  set_log_sink([&](LogLevel, std::string_view, std::string_view message) {
    ++calls;
    // Logging from inside the sink goes to stderr, not back here (no recursion).
    log_message(LogLevel::info, "sink", std::string("inside: ") + std::string(message));
    throw std::runtime_error("a broken sink");
  });
  std::string err;
  CHECK_NOTHROW(err = capture_stderr([] { log_message(LogLevel::error, "mine", "outer"); }));
  set_log_sink(nullptr);
  CHECK(calls == 1);
  CHECK(err == "tinydev: info: sink: inside: outer\n");
}

TEST_CASE("log: sinks swapped while threads log lose no message and call no freed sink", "[log]") {
  // Every message goes to one of the two sinks, whichever was installed when it was sent; a sink
  // being replaced is kept alive by the calls still running it (ASan checks the "no freed" part).
  std::atomic<long> first{0}, second{0}, sent{0};
  std::atomic<bool> stop{false};
  set_log_sink([&](LogLevel, std::string_view, std::string_view) { ++first; });
  std::vector<std::thread> loggers;
  for (int t = 0; t < 4; ++t)
    loggers.emplace_back([&] {
      while (!stop) {
        log_message(LogLevel::debug, "mine", "tick");
        ++sent;
      }
    });
  for (int i = 0; i < 2000 || first == 0 || second == 0; ++i) {
    set_log_sink([&](LogLevel, std::string_view, std::string_view) { ++second; });
    set_log_sink([&](LogLevel, std::string_view, std::string_view) { ++first; });
  }
  stop = true;
  for (auto& t : loggers) t.join();
  set_log_sink(nullptr);
  CHECK(first > 0);
  CHECK(second > 0);
  CHECK(first + second == sent);
}
