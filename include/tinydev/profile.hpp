// tinydev/profile.hpp: the trace writer (the seed's ProfileLogger / PROFILE).
//
// With TINYDEV_PROFILE=path, devices add one complete event per kernel and copy (queued or direct,
// waited on or not); at process exit (or on request, write()) the events go to `path` as Chrome
// trace JSON, which Perfetto and chrome://tracing open: one process per device, threads COMPUTE,
// DMA and each stream's, a "host" process with one lane per thread for ProfileRanges, microseconds
// on the host's steady clock since the profiler started. At most TINYDEV_PROFILE_MAX_EVENTS events
// are kept (a server profiled for hours stays bounded); the rest are counted, and the trace says
// how many. docs/profiling.md shows how to read it.
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

struct ProfileEvent {
  std::string name;        // "CPU -> LLVM", "LLVM -> CPU", a kernel's name, a ProfileRange's name
  std::uint64_t start_ns;  // host steady-clock nanoseconds
  std::uint64_t end_ns;
  std::string device;      // the trace's process: a device name, or "host" for ProfileRanges
  std::string lane;        // the trace's thread: "COMPUTE", "DMA", a stream's, or "USER <n>"
  // The request the work belongs to: the id of the innermost ProfileRange open on the thread that
  // issued it (0: none). Shown as args.request in the trace.
  std::uint64_t request = 0;
  // The graph whose replay ran it (Graph::id()), 0 for work outside graphs. args.graph.
  std::uint64_t graph = 0;
};

class Profiler {
 public:
  static Profiler& global();

  // Whether events are being collected: TINYDEV_PROFILE names a file, unless enable() decided.
  bool enabled() const;
  // Turns profiling on for this process, writing to `path` at exit (for code and tests);
  // enable("") turns it off, TINYDEV_PROFILE or not.
  void enable(std::string path);
  // Forgets enable(): TINYDEV_PROFILE decides again.
  void use_environment();
  void add(ProfileEvent event);
  // Hooks run before writing, so devices can turn their timestamps into events: with
  // finish=false (write()) only for work already done, without waiting for any device; with
  // finish=true (the exit writer) after finishing their work. Returns a token for remove_flush,
  // which whoever registered a hook must call before it dies.
  std::uint64_t on_flush(std::function<void(bool finish)> hook);
  void remove_flush(std::uint64_t token);
  // Writes every event so far to `path` (TINYDEV_PROFILE's when empty), without synchronizing any
  // device: work still running appears in a later write. Throws Error when the file cannot be
  // written. Returns the number of events written. The exit writer skips its write when, after
  // flushing the devices, the path and the events are those of the last write() (successful or
  // not), so a tool that wrote and checked the file gets no second write or message.
  std::size_t write(std::string path = "");
  std::vector<ProfileEvent> events() const;
  // Events not kept because TINYDEV_PROFILE_MAX_EVENTS were held already (the trace says so too).
  std::uint64_t dropped() const;
  void clear();
  // Host steady-clock nanoseconds (the clock of start_ns/end_ns).
  static std::uint64_t now_ns() noexcept;
  // The id of the innermost ProfileRange open on this thread with one; 0 when none.
  static std::uint64_t current_request() noexcept;
  // The graph whose queues this thread is recording (ProfileGraphScope); 0 when none.
  static std::uint64_t current_graph() noexcept;

 private:
  friend class ProfileRange;
  Profiler();
  void register_exit_writer();
  std::size_t write_impl(std::string path, bool skip_if_unchanged, bool finish);
  enum class Mode : std::uint8_t { environment, on, off };
  mutable std::mutex mutex_;
  std::atomic<Mode> mode_{Mode::environment};  // enabled() is on hot paths: no lock
  std::string path_override_;
  bool exit_writer_registered_ = false;
  std::vector<ProfileEvent> events_;
  std::uint64_t dropped_ = 0;
  std::vector<std::pair<std::uint64_t, std::function<void(bool)>>> hooks_;
  std::uint64_t next_token_ = 1;
  std::string last_write_path_;
  std::size_t last_write_events_ = SIZE_MAX;
  // The file this copy writes (Note [Two copies, one profile] in src/profile.cpp).
  struct Claim {
    std::string path;  // what was asked
    std::string used;  // where this copy writes: `path` or a numbered sibling
    int fd = -1;       // holds the flock; kept open
  } claimed_;
  static Claim claim(const std::string& path);
};

// Marks the commands this thread records while it lives as a graph's (HCQGraph opens one around
// recording its queues), so their events carry args.graph. For backends; users need not.
class ProfileGraphScope {
 public:
  explicit ProfileGraphScope(std::uint64_t graph) noexcept;
  ~ProfileGraphScope();
  ProfileGraphScope(const ProfileGraphScope&) = delete;
  ProfileGraphScope& operator=(const ProfileGraphScope&) = delete;

 private:
  std::uint64_t outer_;
};

// A user range: a span on this thread's own lane ("USER <n>") of the trace's "host" process, from
// construction to destruction, when profiling. With a nonzero `request` the range also tags what
// this thread issues inside it (kernels, copies, queue submissions) with that id, so one request's
// device work can be found in a busy trace. Nest them freely; the innermost id wins.
//
//   { ProfileRange r(fmt::format("request {}", id), id); ...serve it... }
//
// Not copyable or movable: it belongs to the thread and scope that opened it.
class ProfileRange {
 public:
  explicit ProfileRange(std::string name, std::uint64_t request = 0);
  ~ProfileRange();
  ProfileRange(const ProfileRange&) = delete;
  ProfileRange& operator=(const ProfileRange&) = delete;

 private:
  std::string name_;
  std::uint64_t start_ns_ = 0;
  std::uint64_t request_ = 0, outer_request_ = 0;
  bool enabled_ = false;
};

}  // namespace tinydev

TINYDEV_API_END
