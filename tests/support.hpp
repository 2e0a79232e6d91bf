// tests/support.hpp: fresh random data, temporary folders and fake backends for the unit tests.
#pragma once

#include <catch2/catch.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <string>
#include <vector>

#include "tinydev/tinydev.hpp"

namespace tinydev::testing {

// Note [Skips reach ctest] in test_main.cpp: the exit code of a run whose tests all skipped.
inline constexpr int kSkipExitCode = 4;
// Skips the rest of the current test (or the current backend's run of it) with `reason`, which is
// printed; the test's own code must return after calling it.
void skip(const std::string& reason);
// A check for code that may run off the test's thread: Catch2 v2's macros are not thread-safe (two
// threads asserting at once race on its RunContext, which a CI run showed as a spurious failure,
// and ThreadSanitizer flags), so fakes the library may call from several threads, and bodies of
// threads a test starts, check with this. A failure names the check and aborts: nothing between
// the fake and the test (a library error path, a worker's catch) can swallow it.
#define TINYDEV_TEST_ASSERT(condition)                                                              \
  do {                                                                                             \
    if (!(condition)) {                                                                            \
      std::fprintf(stderr, "%s:%d: TINYDEV_TEST_ASSERT(%s) failed\n", __FILE__, __LINE__, #condition); \
      std::abort();                                                                                \
    }                                                                                              \
  } while (false)

// Errors caught on threads a test starts, handed to the test's thread: a thread body records
// what it caught with add(); once every thread joined, the test calls check_none(), which reports
// each error as a message and fails a CHECK if there was any (Catch's macros are not thread-safe,
// see TINYDEV_TEST_ASSERT). add() is thread-safe; check_none() runs on the test's thread only.
class ThreadErrors {
 public:
  void add(std::string error) {
    std::lock_guard lock(mutex_);
    errors_.push_back(std::move(error));
  }
  void check_none() {
    std::lock_guard lock(mutex_);
    for (const std::string& error : errors_) UNSCOPED_INFO(error);
    CHECK(errors_.empty());
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> errors_;
};

// Marks that the current test did real work (the conformance suite calls it per backend run).
void note_ran();
// How many times skip() was called in this run.
int skip_count();
// The name of the test case running now.
const std::string& current_test_name();
// The backend given with --backend, or "".
const std::string& selected_backend();

// A fresh seed per call, reported by Catch on failure so a failing run can be replayed: run the
// failing test again with TEST_SEED=<the seed it printed> and every call returns that seed.
inline std::uint64_t fresh_seed() {
  if (const char* replay = std::getenv("TEST_SEED")) return std::strtoull(replay, nullptr, 10);
  static std::random_device rd;
  static std::mutex rd_mutex;  // tests' threads draw seeds too, and random_device is not thread-safe
  std::lock_guard lock(rd_mutex);
  return (static_cast<std::uint64_t>(rd()) << 32) | rd();
}

inline std::vector<float> random_floats(std::size_t n, std::uint64_t seed, float lo = -100.f, float hi = 100.f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

// Sets an environment variable that is not a TINYDEV_* setting (ScopedOverride takes only those):
// a fake driver's, or the driver's, for a scope, then restores what it was.
struct ScopedEnvironmentVariable {
  std::string name;
  std::optional<std::string> was;
  ScopedEnvironmentVariable(std::string variable, const std::string& value) : name(std::move(variable)) {
    if (const char* old = std::getenv(name.c_str())) was = old;
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  ~ScopedEnvironmentVariable() {
    if (was) ::setenv(name.c_str(), was->c_str(), 1);
    else ::unsetenv(name.c_str());
  }
  ScopedEnvironmentVariable(const ScopedEnvironmentVariable&) = delete;
  ScopedEnvironmentVariable& operator=(const ScopedEnvironmentVariable&) = delete;
};

// Opens `gate` (sets it to 1) when it goes out of scope: a test that fails before it opens the
// gate leaves no queued work waiting for it for good (nor a graph's destructor for
// TINYDEV_WAIT_TIMEOUT_MS).
struct OpenGateAtExit {
  const Signal& gate;
  ~OpenGateAtExit() {
    try {
      gate.set(1);
    } catch (...) {  // freed by the test already
    }
  }
};

// Sets `gate` to 1 from a thread of its own `delay` after construction, for the work this thread
// does meanwhile to wait on. The destructor joins that thread, also when a check in the scope
// throws (a joinable std::thread would end the test run).
class GateOpener {
 public:
  GateOpener(const Signal& gate, std::chrono::milliseconds delay)
      : thread_([&gate, delay] {
          std::this_thread::sleep_for(delay);
          gate.set(1);
        }) {}
  ~GateOpener() { thread_.join(); }
  GateOpener(const GateOpener&) = delete;
  GateOpener& operator=(const GateOpener&) = delete;

 private:
  std::thread thread_;
};

inline std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (std::byte& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

// Captures what the code in `body` writes to stderr (fd 2); stderr is restored if it throws.
template <class Body>
std::string capture_stderr(Body&& body) {
  std::fflush(stderr);
  char path[] = "/tmp/tinydev-stderr-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  const int saved = ::dup(2);
  ::dup2(fd, 2);
  auto restore = [&] {
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
    ::close(fd);
  };
  try {
    body();
  } catch (...) {
    restore();
    ::unlink(path);
    throw;
  }
  restore();
  std::ifstream in(path);
  std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ::unlink(path);
  return out;
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string templ = (std::filesystem::temp_directory_path() / "tinydev-test-XXXXXX").string();
    REQUIRE(::mkdtemp(templ.data()) != nullptr);
    path = templ;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
};

// Runs this binary's hidden test case tagged `tag` in a fresh process (what is loaded once per
// process starts again there) with `env` set. Its exit status, or minus the signal that killed it.
inline int run_probe(const char* tag, std::initializer_list<std::pair<const char*, std::string>> env) {
  // The child's environment is made here: between fork and exec only async-signal-safe calls
  // (setenv takes a lock another thread may have held at the fork).
  std::vector<std::string> entries;
  for (char** e = environ; *e; ++e) {
    const std::string_view entry(*e);
    bool replaced = false;
    for (const auto& [name, value] : env) replaced |= entry.substr(0, entry.find('=')) == name;
    if (!replaced) entries.emplace_back(entry);
  }
  for (const auto& [name, value] : env) entries.push_back(std::string(name) + "=" + value);
  std::vector<char*> envp;
  for (std::string& entry : entries) envp.push_back(entry.data());
  envp.push_back(nullptr);
  char self[] = "/proc/self/exe", warn[] = "--warn", no_tests[] = "NoTests";
  std::string filter = tag;
  char* argv[] = {self, warn, no_tests, filter.data(), nullptr};
  const pid_t child = ::fork();
  if (child < 0) return 126;
  if (child == 0) {
    ::execve(self, argv, envp.data());
    ::_exit(127);
  }
  int status = 0;
  pid_t waited;
  do waited = ::waitpid(child, &status, 0);
  while (waited < 0 && errno == EINTR);
  if (waited != child) return 126;
  return WIFSIGNALED(status) ? -WTERMSIG(status) : WEXITSTATUS(status);
}

// Host memory behind an LRU cache, counting backend calls, with a byte limit to provoke
// out-of-memory on demand. `host_visible=false` makes it behave like device memory (no
// zero-copy, no views).
class FakeAllocator final : public LRUAllocator {
 public:
  explicit FakeAllocator(bool host_visible = true) : host_visible_(host_visible) {}
  ~FakeAllocator() override { free_cache(); }

  std::atomic<int> backend_allocs{0}, backend_frees{0};
  std::atomic<std::uint64_t> live_bytes{0};
  std::atomic<std::uint64_t> limit_bytes{UINT64_MAX};
  // A free of this many bytes gives the memory back, then throws (a backend that reports a failure).
  std::atomic<std::uint64_t> failing_free_size{0};

  void copyin(Allocation dest, std::span<const std::byte> src) override {
    TINYDEV_TEST_ASSERT(src.size() <= dest.size);  // called from the tests' threads too
    std::memcpy(dest.host_ptr(), src.data(), src.size());
  }
  void copyout(std::span<std::byte> dest, Allocation src) override {
    TINYDEV_TEST_ASSERT(dest.size() <= src.size);
    std::memcpy(dest.data(), src.host_ptr(), dest.size());
  }
  bool supports_offset() const noexcept override { return host_visible_; }
  Allocation offset(Allocation base, std::size_t size, std::size_t off) override {
    if (!host_visible_) return Allocator::offset(base, size, off);
    return Allocation{base.va_addr + off, size, base.backend};
  }
  std::optional<std::span<std::byte>> as_buffer(Allocation a) override {
    if (!host_visible_) return std::nullopt;
    return std::span<std::byte>(a.host_ptr<std::byte>(), a.size);
  }
  std::string describe() const override { return "fake allocator"; }

 protected:
  Allocation alloc_impl(std::size_t size, const BufferOptions&) override {
    if (live_bytes + size > limit_bytes)
      throw OutOfMemory("fake allocator: over its limit of " + std::to_string(limit_bytes.load()));
    backend_allocs++;
    live_bytes += size;
    return Allocation{reinterpret_cast<std::uintptr_t>(std::malloc(size)), size, nullptr};
  }
  void free_impl(Allocation a, std::size_t size, const BufferOptions&) override {
    backend_frees++;
    live_bytes -= size;
    std::free(a.host_ptr());
    if (size == failing_free_size) throw Error("fake allocator: the backend reported a failed free of " + std::to_string(size));
  }

 private:
  bool host_visible_;
};

// A Compiler whose "binary" is a deterministic transform of the source, counting real compiles.
class FakeCompiler final : public Compiler {
 public:
  explicit FakeCompiler(std::optional<std::string> key = "compile_fake", std::string identity = "fake 1.0")
      : Compiler(std::move(key)), identity_(std::move(identity)) {}
  std::atomic<int> compiles{0};
  std::string identity() const override { return identity_; }
  Blob compile(std::string_view source) override {
    compiles++;
    if (source.find("#error") != std::string_view::npos)
      throw CompileError("fake compiler rejected the source", "kernel.fake:1: error: #error found");
    return expected(source);
  }
  static Blob expected(std::string_view source) {
    Blob out;
    for (auto it = source.rbegin(); it != source.rend(); ++it) out.push_back(static_cast<std::byte>(*it ^ 0x5a));
    return out;
  }

 private:
  std::string identity_;
};

class FakeDevice final : public Compiled {
 public:
  FakeDevice(const std::string& name, std::shared_ptr<FakeAllocator> allocator)
      : Compiled(name, allocator, std::make_unique<FakeCompiler>(), nullptr, SourceLanguage::None),
        fake(std::move(allocator)) {}
  std::shared_ptr<FakeAllocator> fake;
};

// FAKE: host-visible memory. FAKEDEV: device-like memory (no zero copy, no views). Registered
// once per process; every FAKE:n is a separate device with its own allocator.
inline void register_fakes() {
  static const bool once = [] {
    Device.register_backend("FAKE", [](const std::string& name) {
      return std::make_unique<FakeDevice>(name, std::make_shared<FakeAllocator>(true));
    });
    Device.register_backend("FAKEDEV", [](const std::string& name) {
      return std::make_unique<FakeDevice>(name, std::make_shared<FakeAllocator>(false));
    });
    return true;
  }();
  (void)once;
}

inline FakeDevice& fake_device(const std::string& name = "FAKE") {
  register_fakes();
  return static_cast<FakeDevice&>(Device[name]);
}

// Records `body` into a compute queue of HCQ device `dev` ordered on its timeline (wait for the
// last value, signal the next) and submits it; returns the timeline value that ends it.
template <class Dev, class Body>
std::uint64_t submit_ordered(Dev& dev, Body&& body) {
  auto reservation = dev.reserve_timeline_value();
  const std::uint64_t v = reservation.value();
  auto q = dev.compute_queue();
  q.wait(dev.timeline_signal(), v - 1);
  body(q);
  q.signal(dev.timeline_signal(), v).submit(dev);
  reservation.submitted();
  return v;
}

}  // namespace tinydev::testing
