#include "tinydev/profile.hpp"

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/error.hpp"
#include "tinydev/log.hpp"
#include "tinydev/version.hpp"

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

thread_local std::uint64_t tls_request = 0;  // the innermost ProfileRange's id on this thread
thread_local std::uint64_t tls_graph = 0;    // the graph this thread records (ProfileGraphScope)

// A small number per thread for the "USER <n>" lanes (thread ids would be long and unstable).
std::uint64_t thread_number() {
  static std::atomic<std::uint64_t> next{1};
  thread_local const std::uint64_t mine = next.fetch_add(1, std::memory_order_relaxed);
  return mine;
}

// Note [Two copies, one profile]
// Two copies of tinydev in one process (two plugins, Note [Copies in one process]), or two
// processes, may be told the same TINYDEV_PROFILE. Each would write its own events over the
// other's. So a writer claims its file with an exclusive flock on a descriptor it keeps open (flock
// locks belong to open files, so two copies in one process conflict like two processes do) and
// writes through that descriptor, in place. A writer that finds the file claimed takes the next
// free "<stem>.2<ext>", "<stem>.3<ext>", ... and logs where its events went.
}  // namespace

Profiler::Claim Profiler::claim(const std::string& path) {
  const std::filesystem::path asked(path);
  for (int n = 1; n <= 64; ++n) {
    std::string candidate = path;
    if (n > 1) {
      std::filesystem::path p = asked;
      p.replace_filename(asked.stem().string() + "." + std::to_string(n) + asked.extension().string());
      candidate = p.string();
    }
    const int fd = ::open(candidate.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
      throw Error(fmt::format("cannot write the profile to '{}': {}; check the folder exists and is writable",
                              candidate, std::strerror(errno)));
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
      if (n > 1)
        log_message(LogLevel::warning, "profile",
                    fmt::format("'{}' is being written by another copy of tinydev (another plugin or process); "
                                "this copy's events go to '{}'",
                                path, candidate));
      return {path, candidate, fd};
    }
    ::close(fd);
  }
  throw Error(fmt::format("cannot write the profile to '{}': it and 63 numbered siblings are held by other writers",
                          path));
}

namespace {

void write_all(int fd, const std::string& text, const std::string& path) {
  if (::ftruncate(fd, 0) != 0)
    throw Error(fmt::format("cannot write the profile to '{}': {}", path, std::strerror(errno)));
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::pwrite(fd, text.data() + done, text.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw Error(fmt::format("cannot write the profile to '{}': {}; check the disk has room", path,
                              n < 0 ? std::strerror(errno) : "nothing written"));
    done += static_cast<std::size_t>(n);
  }
}

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

std::uint64_t Profiler::current_request() noexcept { return tls_request; }
std::uint64_t Profiler::current_graph() noexcept { return tls_graph; }

ProfileGraphScope::ProfileGraphScope(std::uint64_t graph) noexcept : outer_(tls_graph) { tls_graph = graph; }
ProfileGraphScope::~ProfileGraphScope() { tls_graph = outer_; }

bool Profiler::enabled() const {
  switch (mode_.load(std::memory_order_acquire)) {
    case Mode::on: return true;
    case Mode::off: return false;
    case Mode::environment: break;
  }
  return !settings().profile.empty();
}

void Profiler::enable(std::string path) {
  std::lock_guard lock(mutex_);
  path_override_ = std::move(path);
  mode_.store(path_override_.empty() ? Mode::off : Mode::on, std::memory_order_release);
  if (!path_override_.empty()) register_exit_writer();
}

void Profiler::use_environment() {
  std::lock_guard lock(mutex_);
  path_override_.clear();
  mode_.store(Mode::environment, std::memory_order_release);
}

void Profiler::register_exit_writer() {
  // Caller holds mutex_.
  if (exit_writer_registered_) return;
  exit_writer_registered_ = true;
  std::atexit([] {
    try {
      // A write() that already put every event in this file (a tool checking the result itself)
      // needs no second one, and a failed one needs no second message. The devices finish their
      // work first (finish=true), so work done after that write() is not lost.
      std::size_t n = Profiler::global().write_impl("", /*skip_if_unchanged=*/true, /*finish=*/true);
      debug_log(1, "profile", "wrote {} profile events", n);
    } catch (const std::exception& e) {
      log_message(LogLevel::error, "profile", std::string("could not write the profile: ") + e.what());
    }
  });
}

void Profiler::add(ProfileEvent event) {
  if (event.request == 0) event.request = tls_request;
  const std::uint64_t bound = settings().profile_max_events;
  std::lock_guard lock(mutex_);
  register_exit_writer();
  if (events_.size() >= bound) {
    ++dropped_;
    return;
  }
  events_.push_back(std::move(event));
}

std::uint64_t Profiler::on_flush(std::function<void(bool finish)> hook) {
  const bool profiling = enabled();  // may throw: before we register
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

std::uint64_t Profiler::dropped() const {
  std::lock_guard lock(mutex_);
  return dropped_;
}

void Profiler::clear() {
  std::lock_guard lock(mutex_);
  events_.clear();
  dropped_ = 0;
  last_write_events_ = SIZE_MAX;
}

std::size_t Profiler::write(std::string path) { return write_impl(std::move(path), false, false); }

std::size_t Profiler::write_impl(std::string path, bool skip_if_unchanged, bool finish) {
  std::vector<std::function<void(bool)>> hooks;
  {
    std::lock_guard lock(mutex_);
    // enable() leaves path_override_ empty when it turned profiling off.
    if (path.empty()) path = mode_.load() == Mode::environment ? settings().profile : path_override_;
    if (path.empty()) return 0;  // profiling is off: nothing to flush or write
    for (const auto& [token, hook] : hooks_) hooks.push_back(hook);
  }
  for (auto& hook : hooks) hook(finish);  // outside the lock: hooks add events
  std::lock_guard lock(mutex_);
  if (skip_if_unchanged && path == last_write_path_ && events_.size() == last_write_events_) return 0;
  // Processes (devices) and their threads (lanes), numbered in order of first appearance.
  std::map<std::string, int> pids;
  std::map<std::pair<std::string, std::string>, int> tids;
  std::map<std::string, int> lanes_per_pid;
  for (const ProfileEvent& e : events_) {
    pids.emplace(e.device, static_cast<int>(pids.size()) + 1);
    if (!tids.contains({e.device, e.lane})) {
      // COMPUTE and DMA keep tids 1 and 2 so traces of a device always read the same.
      int tid = e.lane == "COMPUTE" ? 1 : e.lane == "DMA" ? 2 : 3 + lanes_per_pid[e.device]++;
      tids.emplace(std::make_pair(e.device, e.lane), tid);
    }
  }
  std::string out = "{\"traceEvents\":[\n";
  bool first = true;
  auto emit = [&](const std::string& line) {
    out += first ? "" : ",\n";
    out += line;
    first = false;
  };
  for (const auto& [device, pid] : pids)
    emit(fmt::format(R"({{"name":"process_name","ph":"M","pid":{},"args":{{"name":"{}"}}}})", pid, json_escape(device)));
  for (const auto& [key, tid] : tids)
    emit(fmt::format(R"({{"name":"thread_name","ph":"M","pid":{},"tid":{},"args":{{"name":"{}"}}}})", pids[key.first],
                     tid, json_escape(key.second)));
  double last_ts = 0;
  for (const ProfileEvent& e : events_) {
    const double ts = (static_cast<double>(e.start_ns) - static_cast<double>(kEpochNs)) / 1e3;
    const double dur = e.end_ns > e.start_ns ? static_cast<double>(e.end_ns - e.start_ns) / 1e3 : 0.0;
    last_ts = std::max(last_ts, ts + dur);
    std::string args;
    if (e.request && e.graph) args = fmt::format(R"(,"args":{{"request":{},"graph":{}}})", e.request, e.graph);
    else if (e.request) args = fmt::format(R"(,"args":{{"request":{}}})", e.request);
    else if (e.graph) args = fmt::format(R"(,"args":{{"graph":{}}})", e.graph);
    emit(fmt::format(R"({{"name":"{}","ph":"X","pid":{},"tid":{},"ts":{:.3f},"dur":{:.3f}{}}})", json_escape(e.name),
                     pids[e.device], tids[{e.device, e.lane}], ts, dur, args));
  }
  if (dropped_ > 0)
    emit(fmt::format(R"j({{"name":"tinydev: {} events dropped (TINYDEV_PROFILE_MAX_EVENTS={})","ph":"i","s":"g","pid":0,"tid":0,"ts":{:.3f}}})j",
                     dropped_, settings().profile_max_events, last_ts));
  out += fmt::format("\n],\"displayTimeUnit\":\"ns\",\"otherData\":{{\"tinydev_version\":\"{}\",\"dropped_events\":{}}}}}\n",
                     kVersionString, dropped_);
  last_write_path_ = path;
  last_write_events_ = events_.size();
  if (claimed_.fd < 0 || claimed_.path != path) {  // Note [Two copies, one profile]
    Claim file = claim(path);
    if (claimed_.fd >= 0) ::close(claimed_.fd);
    claimed_ = std::move(file);
  }
  write_all(claimed_.fd, out, claimed_.used);
  if (dropped_ > 0)
    log_message(LogLevel::warning, "profile",
                fmt::format("{} events were dropped: TINYDEV_PROFILE_MAX_EVENTS={} were kept already", dropped_,
                            settings().profile_max_events));
  return events_.size();
}

ProfileRange::ProfileRange(std::string name, std::uint64_t request)
    : name_(std::move(name)), request_(request), outer_request_(tls_request), enabled_(Profiler::global().enabled()) {
  if (request_ != 0) tls_request = request_;
  if (enabled_) start_ns_ = Profiler::now_ns();
}

ProfileRange::~ProfileRange() {
  tls_request = outer_request_;
  if (!enabled_) return;
  try {
    // A range without an id of its own gets the outer one from add(): tls_request is that again.
    Profiler::global().add(ProfileEvent{std::move(name_), start_ns_, Profiler::now_ns(), "host",
                                        fmt::format("USER {}", thread_number()), request_});
  } catch (...) {
    // A range that cannot be recorded (out of memory) is not worth an exception in a destructor.
  }
}

}  // namespace tinydev
