#include "tinydev/profile.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>

#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/error.hpp"

namespace tinydev {

namespace {

std::string json_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) out += fmt::format("\\u{:04x}", c);
        else out += c;
    }
  }
  return out;
}

const std::uint64_t kEpochNs = Profiler::now_ns();  // trace time 0

}  // namespace

Profiler::Profiler() = default;

Profiler& Profiler::global() {
  static Profiler* p = new Profiler();  // never destroyed: the exit writer runs after statics die
  return *p;
}

std::uint64_t Profiler::now_ns() noexcept {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

bool Profiler::enabled() const {
  return overridden_.load(std::memory_order_acquire) || !settings().profile.empty();
}

void Profiler::enable(std::string path) {
  std::lock_guard lock(mutex_);
  path_override_ = std::move(path);
  overridden_.store(!path_override_.empty(), std::memory_order_release);
  if (!path_override_.empty()) register_exit_writer();
}

void Profiler::register_exit_writer() {
  // Caller holds mutex_.
  if (exit_writer_registered_) return;
  exit_writer_registered_ = true;
  std::atexit([] {
    try {
      // A write() that already put every event in this file (a tool checking the result itself)
      // needs no second one, and a failed one needs no second message. Pending device records
      // are flushed into events first, so work done after that write() is not lost.
      std::size_t n = Profiler::global().write_impl("", /*skip_if_unchanged=*/true);
      debug_log(1, "profile", "wrote {} profile events", n);
    } catch (const std::exception& e) {
      log_message(LogLevel::error, "profile", std::string("could not write the profile: ") + e.what());
    }
  });
}

void Profiler::add(ProfileEvent event) {
  std::lock_guard lock(mutex_);
  register_exit_writer();
  events_.push_back(std::move(event));
}

std::uint64_t Profiler::on_flush(std::function<void()> hook) {
  const bool profiling = overridden_.load() || !settings().profile.empty();  // may throw: before we register
  std::lock_guard lock(mutex_);
  hooks_.emplace_back(next_token_, std::move(hook));
  // With TINYDEV_PROFILE set, a device's pending records must reach the file at exit even if no
  // event was added yet.
  if (profiling) register_exit_writer();
  return next_token_++;
}

void Profiler::remove_flush(std::uint64_t token) {
  std::lock_guard lock(mutex_);
  std::erase_if(hooks_, [&](const auto& h) { return h.first == token; });
}

std::vector<ProfileEvent> Profiler::events() const {
  std::lock_guard lock(mutex_);
  return events_;
}

void Profiler::clear() {
  std::lock_guard lock(mutex_);
  events_.clear();
  last_write_events_ = SIZE_MAX;
}


std::size_t Profiler::write(std::string path) { return write_impl(std::move(path), false); }

std::size_t Profiler::write_impl(std::string path, bool skip_if_unchanged) {
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard lock(mutex_);
    if (path.empty()) path = !path_override_.empty() ? path_override_ : settings().profile;
    if (path.empty()) return 0;  // profiling is off: nothing to flush or write
    for (const auto& [token, hook] : hooks_) hooks.push_back(hook);
  }
  for (auto& hook : hooks) hook();  // outside the lock: hooks add events
  std::lock_guard lock(mutex_);
  if (skip_if_unchanged && path == last_write_path_ && events_.size() == last_write_events_) return 0;
  std::map<std::string, int> pids;
  for (const ProfileEvent& e : events_) pids.emplace(e.device, static_cast<int>(pids.size()) + 1);
  std::string out = "{\"traceEvents\":[\n";
  bool first = true;
  auto emit = [&](const std::string& line) {
    out += first ? "" : ",\n";
    out += line;
    first = false;
  };
  for (const auto& [device, pid] : pids) {
    emit(fmt::format(R"({{"name":"process_name","ph":"M","pid":{},"args":{{"name":"{}"}}}})", pid, json_escape(device)));
    emit(fmt::format(R"({{"name":"thread_name","ph":"M","pid":{},"tid":1,"args":{{"name":"COMPUTE"}}}})", pid));
    emit(fmt::format(R"({{"name":"thread_name","ph":"M","pid":{},"tid":2,"args":{{"name":"DMA"}}}})", pid));
  }
  for (const ProfileEvent& e : events_) {
    const double ts = (static_cast<double>(e.start_ns) - static_cast<double>(kEpochNs)) / 1e3;
    const double dur = e.end_ns > e.start_ns ? static_cast<double>(e.end_ns - e.start_ns) / 1e3 : 0.0;
    emit(fmt::format(R"({{"name":"{}","ph":"X","pid":{},"tid":{},"ts":{:.3f},"dur":{:.3f}}})", json_escape(e.name),
                     pids[e.device], e.lane == "DMA" ? 2 : 1, ts, dur));
  }
  out += "\n],\"displayTimeUnit\":\"ns\"}\n";
  last_write_path_ = path;
  last_write_events_ = events_.size();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << out;
  f.close();
  if (!f) throw Error(fmt::format("cannot write the profile to '{}': check the folder exists and is writable", path));
  return events_.size();
}

}  // namespace tinydev
