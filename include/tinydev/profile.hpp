// tinydev/profile.hpp: the trace writer (the seed's ProfileLogger / PROFILE).
//
// With TINYDEV_PROFILE=path, devices add one complete event per kernel and copy; at process exit
// (or on request, write()) the events go to `path` as Chrome trace JSON, which Perfetto and
// chrome://tracing open: one process per device, threads COMPUTE and DMA, microseconds on the
// host's steady clock since the profiler started. docs/profiling.md shows how to read it.
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
  std::string name;        // "CPU -> LLVM", "LLVM -> CPU", a kernel's name
  std::uint64_t start_ns;  // host steady-clock nanoseconds
  std::uint64_t end_ns;
  std::string device;      // the trace's process
  std::string lane;        // the trace's thread: "COMPUTE" or "DMA"
};

class Profiler {
 public:
  static Profiler& global();

  // Whether TINYDEV_PROFILE names a file (or enable() was called).
  bool enabled() const;
  // Turns profiling on for this process, writing to `path` at exit (for code and tests).
  void enable(std::string path);
  void add(ProfileEvent event);
  // Hooks run before writing, so devices can turn their pending timestamps into events. Returns a
  // token for remove_flush, which whoever registered a hook must call before it dies.
  std::uint64_t on_flush(std::function<void()> hook);
  void remove_flush(std::uint64_t token);
  // Writes every event so far to `path` (TINYDEV_PROFILE's when empty). Throws Error when the
  // file cannot be written. Returns the number of events written. The exit writer skips its write
  // when, after flushing the devices, the path and the events are those of the last write()
  // (successful or not), so a tool that wrote and checked the file gets no second write or message.
  std::size_t write(std::string path = "");
  std::vector<ProfileEvent> events() const;
  void clear();
  // Host steady-clock nanoseconds (the clock of start_ns/end_ns).
  static std::uint64_t now_ns() noexcept;

 private:
  Profiler();
  void register_exit_writer();
  std::size_t write_impl(std::string path, bool skip_if_unchanged);
  mutable std::mutex mutex_;
  std::atomic<bool> overridden_{false};  // enabled() is on hot paths: no lock
  std::string path_override_;
  bool exit_writer_registered_ = false;
  std::vector<ProfileEvent> events_;
  std::vector<std::pair<std::uint64_t, std::function<void()>>> hooks_;
  std::uint64_t next_token_ = 1;
  std::string last_write_path_;
  std::size_t last_write_events_ = SIZE_MAX;
};

}  // namespace tinydev

TINYDEV_API_END
