// The profiler for servers (tinydev/profile.hpp): enable("") disables, a bounded event buffer that
// counts and reports what it drops, user ranges with request ids, and two writers of one file.
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "support.hpp"
#include "tinydev/tinydev.hpp"

using namespace tinydev;
using namespace tinydev::testing;

namespace {

nlohmann::json read_trace(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f.good());
  return nlohmann::json::parse(f);
}

}  // namespace

TEST_CASE("profile: enable(\"\") turns profiling off even with TINYDEV_PROFILE set", "[profile]") {
  TempDir dir;
  ScopedOverride env("TINYDEV_PROFILE", dir.str() + "/env.json");
  Profiler& p = Profiler::global();
  p.use_environment();
  CHECK(p.enabled());
  p.enable("");
  CHECK_FALSE(p.enabled());
  CHECK(p.write() == 0);  // off: nothing written
  p.enable(dir.str() + "/mine.json");
  CHECK(p.enabled());
  p.use_environment();
  CHECK(p.enabled());
}

TEST_CASE("profile: the event buffer is bounded and the trace says how many events were dropped", "[profile]") {
  TempDir dir;
  const std::string path = dir.str() + "/bounded.json";
  const int bound = 3 + static_cast<int>(fresh_seed() % 5);
  ScopedOverride max("TINYDEV_PROFILE_MAX_EVENTS", std::to_string(bound));
  Profiler& p = Profiler::global();
  p.enable(path);
  p.clear();
  const std::uint64_t now = Profiler::now_ns();
  for (int i = 0; i < bound + 7; ++i) p.add(ProfileEvent{"k" + std::to_string(i), now + i, now + i + 10, "DEV", "COMPUTE"});
  CHECK(p.events().size() == static_cast<std::size_t>(bound));
  CHECK(p.dropped() == 7);
  std::string warned;
  set_log_sink([&](LogLevel level, std::string_view, std::string_view message) {
    if (level == LogLevel::warning) warned = std::string(message);
  });
  CHECK(p.write() == static_cast<std::size_t>(bound));
  set_log_sink(nullptr);
  CHECK_THAT(warned, Catch::Contains("7 events were dropped") && Catch::Contains("TINYDEV_PROFILE_MAX_EVENTS"));
  const auto trace = read_trace(path);
  CHECK(trace.at("otherData").at("dropped_events") == 7);
  bool reported = false;
  for (const auto& e : trace.at("traceEvents"))
    reported |= e.at("ph") == "i" && e.at("name").get<std::string>().find("7 events dropped") != std::string::npos;
  CHECK(reported);
  p.clear();
  CHECK(p.dropped() == 0);
  p.use_environment();
  for (const char* bad : {"0", "-1", "1e3", "99999999999999999999", "12abc", " 5"})
    CHECK_THROWS_WITH(ScopedOverride("TINYDEV_PROFILE_MAX_EVENTS", bad),
                      Catch::Contains("TINYDEV_PROFILE_MAX_EVENTS=") && Catch::Contains("is not valid"));
}

TEST_CASE("profile: ProfileRange puts user ranges on a lane per thread and tags work issued inside with the request", "[profile]") {
  TempDir dir;
  const std::string path = dir.str() + "/ranges.json";
  Profiler& p = Profiler::global();
  p.enable(path);
  p.clear();
  const std::uint64_t request = 1000 + fresh_seed() % 100000;
  {
    ProfileRange outer("request " + std::to_string(request), request);
    CHECK(Profiler::current_request() == request);
    const std::uint64_t now = Profiler::now_ns();
    p.add(ProfileEvent{"inside", now, now + 5, "DEV", "COMPUTE"});  // tagged on add
    {
      ProfileRange inner("parse");  // no id of its own: the request stays
      CHECK(Profiler::current_request() == request);
    }
  }
  CHECK(Profiler::current_request() == 0);
  std::thread([&] { ProfileRange other("other thread", request + 1); }).join();
  const std::uint64_t now = Profiler::now_ns();
  p.add(ProfileEvent{"outside", now, now + 5, "DEV", "COMPUTE"});
  p.write();
  p.use_environment();
  const auto trace = read_trace(path);
  std::map<std::string, nlohmann::json> by_name;
  std::map<std::pair<int, int>, std::string> thread_names;
  int host_pid = -1;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("name") == "process_name" && e.at("args").at("name") == "host") host_pid = e.at("pid");
    if (e.at("name") == "thread_name") thread_names[{e.at("pid"), e.at("tid")}] = e.at("args").at("name");
    if (e.at("ph") == "X") by_name[e.at("name")] = e;
  }
  REQUIRE(host_pid > 0);
  const auto& range = by_name.at("request " + std::to_string(request));
  CHECK(range.at("pid") == host_pid);
  CHECK(thread_names[{host_pid, range.at("tid")}].starts_with("USER "));
  CHECK(range.at("args").at("request") == request);
  CHECK(by_name.at("parse").at("tid") == range.at("tid"));  // same thread, same lane
  CHECK(by_name.at("other thread").at("tid") != range.at("tid"));
  CHECK(by_name.at("inside").at("args").at("request") == request);
  CHECK_FALSE(by_name.at("outside").contains("args"));
}

TEST_CASE("profile: a file another writer holds is left alone and this writer takes a numbered sibling", "[profile]") {
  TempDir dir;
  const std::string path = dir.str() + "/shared.json";
  // Another copy of tinydev (or another process) holding the file, as the profiler holds it.
  const int other = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);
  REQUIRE(other >= 0);
  REQUIRE(::flock(other, LOCK_EX | LOCK_NB) == 0);
  REQUIRE(::write(other, "theirs", 6) == 6);
  Profiler& p = Profiler::global();
  p.enable(path);
  p.clear();
  const std::uint64_t now = Profiler::now_ns();
  p.add(ProfileEvent{"mine", now, now + 5, "DEV", "COMPUTE"});
  std::string warned;
  set_log_sink([&](LogLevel, std::string_view, std::string_view message) { warned = std::string(message); });
  CHECK(p.write() == 1);
  set_log_sink(nullptr);
  p.use_environment();
  ::close(other);
  std::ifstream theirs(path);
  std::string content((std::istreambuf_iterator<char>(theirs)), std::istreambuf_iterator<char>());
  CHECK(content == "theirs");
  CHECK_THAT(warned, Catch::Contains("shared.2.json"));
  const auto trace = read_trace(dir.str() + "/shared.2.json");
  bool mine = false;
  for (const auto& e : trace.at("traceEvents")) mine |= e.at("name") == "mine";
  CHECK(mine);
}

TEST_CASE("profile: when the file and every numbered sibling are held write() is an Error and nothing is overwritten", "[profile]") {
  TempDir dir;
  std::vector<int> held;
  for (int n = 1; n <= 64; ++n) {
    const std::string path = dir.str() + (n == 1 ? "/busy.json" : "/busy." + std::to_string(n) + ".json");
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::flock(fd, LOCK_EX | LOCK_NB) == 0);
    REQUIRE(::write(fd, "theirs", 6) == 6);
    held.push_back(fd);
  }
  Profiler& p = Profiler::global();
  p.enable(dir.str() + "/busy.json");
  p.clear();
  const std::uint64_t now = Profiler::now_ns();
  p.add(ProfileEvent{"mine", now, now + 5, "DEV", "COMPUTE"});
  CHECK_THROWS_WITH(p.write(), Catch::Contains("cannot write the profile") &&
                                   Catch::Contains("63 numbered siblings are held by other writers"));
  p.use_environment();
  for (int fd : held) ::close(fd);
  std::ifstream first(dir.str() + "/busy.json");
  std::string content((std::istreambuf_iterator<char>(first)), std::istreambuf_iterator<char>());
  CHECK(content == "theirs");
}
