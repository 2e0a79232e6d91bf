// The tinydev CLI: `tinydev devices`, `tinydev demo [DEVICE]` and `tinydev load FILE [DEVICE]`.
// Exit codes: 0 ok, 1 a failure (device unavailable, wrong result, a bad or unreadable file), 2 a
// usage error.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <system_error>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "demo_kernels.hpp"
#include "tinydev/tinydev.hpp"

namespace {

constexpr const char* kUsage =
    "usage: tinydev <command>\n"
    "  devices          list every backend of this build: usable, or why not, and its properties\n"
    "  demo [DEVICE]    compile an add kernel, run it on random data, check it against the CPU,\n"
    "                   print compile times (cold, cached), kernel time and GB/s\n"
    "                   (DEVICE defaults to the default device: TINYDEV_DEVICE, else CUDA, LLVM, CLANG)\n"
    "  load FILE [DEVICE] [--verify]\n"
    "                   load a safetensors file onto DEVICE (default: the default device) through a\n"
    "                   DISK device, with a progress bar on a terminal (plain lines otherwise); print\n"
    "                   tensors, bytes, seconds and GB/s; --verify reads every tensor back and\n"
    "                   compares it with the file\n"
    "  --help           this text\n";

int usage_error(const std::string& why) {
  fmt::print(stderr, "tinydev: {}\n{}", why, kUsage);
  return 2;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int devices() {
  // Device.available() decides what is usable (and opens the first device of each backend that
  // cannot count its devices); each backend that lists nothing says why.
  const std::vector<std::string> usable = tinydev::Device.available();
  for (const std::string& type : tinydev::Device.backends()) {
    if (tinydev::Device.suffix_kind(type) == tinydev::DeviceSuffix::path) {
      fmt::print("{:<8} usable: each device is a file, {}:/path/to/file or {}:shm:name\n", type, type, type);
      continue;
    }
    bool listed = false;
    for (const std::string& name : usable) {
      if (name != type && !name.starts_with(type + ":")) continue;
      listed = true;
      try {
        tinydev::Compiled& dev = tinydev::Device[name];
        fmt::print("{:<8} usable\n", name);
        for (const auto& [key, value] : dev.properties()) fmt::print("    {:<16} {}\n", key, value);
      } catch (const tinydev::Error& e) {
        fmt::print("{:<8} unavailable: {}\n", name, e.what());
      }
    }
    if (listed) continue;
    try {
      (void)tinydev::Device[type];  // listed nothing: opening it says why
      fmt::print("{:<8} usable\n", type);
    } catch (const tinydev::Error& e) {
      fmt::print("{:<8} unavailable: {}\n", type, e.what());
    }
  }
  return 0;
}

int demo(const std::string& device_name) {
  using namespace tinydev;
  Compiled& dev = Device[device_name];
  if (!dev.capabilities().runs_kernels)
    throw InvalidArgument(fmt::format("{}'s programs compute nothing (its capabilities say so), so there is no "
                                      "result to check: run the demo on a device that runs kernels, such as one "
                                      "of `tinydev devices` with queues",
                                      dev.name()));
  const std::string src = kernels::add_f32(dev.source_language(), "add");
  // 16M floats: the three arrays (192 MiB) leave every cache, so the bandwidth is memory's.
  constexpr std::size_t n = 1u << 24;

  auto t0 = std::chrono::steady_clock::now();
  Blob cold = dev.compiler().compile(src);
  const double cold_s = seconds_since(t0);
  dev.compiler().compile_cached(src);  // make sure the entry is on disk
  DiskCache::global().drop_memory_layer();
  const DiskCache::Stats before = DiskCache::global().stats();
  t0 = std::chrono::steady_clock::now();
  Blob cached = dev.compiler().compile_cached(src);
  const double cached_s = seconds_since(t0);
  const DiskCache::Stats after = DiskCache::global().stats();
  // Say where the second compile came from, as it happened (a disabled or memory-only cache
  // compiles again, and the time shows that).
  std::string cached_from;
  if (settings().disable_compiler_cache)
    cached_from = "not cached: TINYDEV_DISABLE_COMPILER_CACHE=1, so this was another real compile";
  else if (!dev.compiler().cache_key())
    cached_from = "not cached: this device's compiler has no cache key";
  else if (after.disk_hits > before.disk_hits)
    cached_from = fmt::format("from the disk cache in {}", DiskCache::global().folder());
  else if (after.memory_hits > before.memory_hits)
    cached_from = "from the in-process cache: the disk layer is not in use (TINYDEV_DEBUG=1 says why)";
  else
    cached_from = "not cached: the cache missed, so this was another real compile (TINYDEV_DEBUG=1 says why)";
  std::shared_ptr<Program> add = dev.runtime().load("add", cached);

  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  std::vector<float> a(n), b(n), out(n);
  for (std::size_t i = 0; i < n; ++i) {
    a[i] = dist(rng);
    b[i] = dist(rng);
  }
  Buffer ba(dev.name(), n, dtypes::float32), bb(dev.name(), n, dtypes::float32),
      bo(dev.name(), n, dtypes::float32);
  ba.allocate().copyin(std::span<const float>(a));
  bb.allocate().copyin(std::span<const float>(b));
  bo.allocate();
  const Allocation bufs[] = {bo.allocation(), ba.allocation(), bb.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  // A CPU add loops over n itself (a CPU grid would call it once per index); on a GPU the add is
  // a grid-stride loop, launched over blocks of 256 threads.
  LaunchParams launch{.wait = true};
  if (dev.source_language() == SourceLanguage::CUDA) {
    launch.global = {static_cast<std::uint32_t>((n + 255) / 256), 1, 1};
    launch.local = {256, 1, 1};
  }
  std::vector<double> times;
  for (int rep = 0; rep < 10; ++rep) times.push_back(*(*add)(bufs, vals, launch));
  std::sort(times.begin(), times.end());
  const double best = times.front(), median = (times[4] + times[5]) / 2;
  bo.copyout(std::span<float>(out));
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += out[i] != a[i] + b[i];

  fmt::print("device          {} ({} kernels)\n", dev.name(), to_string(dev.source_language()));
  fmt::print("compile cold    {:.3f} ms\n", cold_s * 1e3);
  fmt::print("compile cached  {:.3f} ms ({})\n", cached_s * 1e3, cached_from);
  fmt::print("kernel          {:.3f} ms median, {:.3f} ms best, of 10 runs over {} floats\n", median * 1e3,
             best * 1e3, n);
  fmt::print("bandwidth       {:.2f} GB/s median, {:.2f} GB/s best (3 x {} MiB moved)\n", 3.0 * n * 4 / median / 1e9,
             3.0 * n * 4 / best / 1e9, n * 4 >> 20);
  if (wrong != 0) {
    fmt::print(stderr, "tinydev demo: FAILED: {} of {} results differ from the CPU reference\n", wrong, n);
    return 1;
  }
  fmt::print("check           all {} results match the CPU reference\n", n);
  return 0;
}

// The progress of a load: a bar redrawn in place on a terminal, else a line every tenth.
class ProgressPrinter {
 public:
  explicit ProgressPrinter(bool terminal) : terminal_(terminal), start_(std::chrono::steady_clock::now()) {}
  void operator()(const tinydev::LoadProgress& p) {
    const double s = seconds_since(start_);
    const double frac = p.bytes_total ? static_cast<double>(p.bytes_done) / static_cast<double>(p.bytes_total) : 1.0;
    const double gbps = s > 0 ? static_cast<double>(p.bytes_done) / s / 1e9 : 0.0;
    const double eta = frac > 0 && frac < 1 ? s / frac - s : 0.0;
    if (terminal_) {
      constexpr int kWidth = 30;
      const int filled = static_cast<int>(frac * kWidth);
      fmt::print("\r[{}{}] {:5.1f}% {:.2f}/{:.2f} GB {:.2f} GB/s ETA {:.1f} s  ", std::string(filled, '#'),
                 std::string(kWidth - filled, '.'), frac * 100, p.bytes_done / 1e9, p.bytes_total / 1e9, gbps, eta);
      std::fflush(stdout);
      drawn_ = true;
    } else if (const int tenth = static_cast<int>(frac * 10); tenth > last_tenth_ || p.tensors_done == p.tensors_total) {
      if (tenth == last_tenth_) return;
      last_tenth_ = tenth;
      fmt::print("progress {:3d}% {} of {} bytes, {} of {} tensors, {:.2f} GB/s\n", tenth * 10, p.bytes_done,
                 p.bytes_total, p.tensors_done, p.tensors_total, gbps);
    }
  }
  void finish() {
    if (drawn_) fmt::print("\n");
  }

 private:
  bool terminal_, drawn_ = false;
  int last_tenth_ = -1;
  std::chrono::steady_clock::time_point start_;
};

// Compares each loaded tensor with the file's bytes (read with pread, not through DISK).
std::size_t verify_against_file(const std::string& path, const std::vector<tinydev::LoadedTensor>& tensors) {
  const tinydev::SafetensorsHeader header = tinydev::read_safetensors_header(path);  // the offsets, in file order
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw tinydev::IoError(fmt::format("--verify: cannot open {}: {}", path, std::strerror(errno)));
  // A file changed since the load names other tensors: those without a counterpart differ.
  const std::size_t common = std::min(tensors.size(), header.tensors.size());
  std::size_t wrong = std::max(tensors.size(), header.tensors.size()) - common;
  std::vector<std::byte> expect, got;
  for (std::size_t i = 0; i < common; ++i) {
    const tinydev::SafetensorsTensor& t = header.tensors[i];
    expect.resize(t.nbytes());
    got.resize(t.nbytes());
    std::size_t done = 0;
    while (done < expect.size()) {
      const ssize_t n = ::pread(fd, expect.data() + done, expect.size() - done,
                                static_cast<off_t>(header.data_offset + t.begin + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        ::close(fd);
        throw tinydev::IoError(fmt::format("--verify: reading {} failed", path));
      }
      done += static_cast<std::size_t>(n);
    }
    if (t.nbytes() > 0) tensors[i].buffer.copyout(std::span<std::byte>(got));
    if (got != expect) {
      ++wrong;
      fmt::print(stderr, "tinydev load: tensor {} differs from the file\n", tinydev::quote_for_message(t.name));
    }
  }
  ::close(fd);
  return wrong;
}

int load(const std::string& path, const std::string& device, bool verify) {
  using namespace tinydev;
  try {
    ProgressPrinter printer(::isatty(STDOUT_FILENO) == 1);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<LoadedTensor> tensors = load_safetensors(path, device, std::ref(printer));
    const double s = seconds_since(t0);
    printer.finish();
    std::uint64_t bytes = 0;
    for (const LoadedTensor& t : tensors) bytes += t.buffer.nbytes();
    fmt::print("loaded {} tensors, {} bytes onto {} in {:.3f} s ({:.2f} GB/s)\n", tensors.size(), bytes,
               Device[device].name(), s, s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0.0);
    if (verify) {
      if (const std::size_t wrong = verify_against_file(path, tensors)) {
        fmt::print(stderr, "tinydev load: FAILED: {} of {} tensors differ from the file\n", wrong, tensors.size());
        return 1;
      }
      fmt::print("verified: all {} tensors match the file\n", tensors.size());
    }
    return 0;
  } catch (const Error& e) {
    // A bad file or device state is the command's failure, not a usage error.
    fmt::print(stderr, "tinydev load: {}\n", e.what());
    return 1;
  }
}

}  // namespace

// Everything a command printed must have reached stdout, and a requested profile its file: a
// failure there is the command's failure (exit 1), not a silent success.
static int finish(int rc) {
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    fmt::print(stderr, "tinydev: cannot write to standard output: {}\n", std::strerror(errno));
    return 1;
  }
  if (tinydev::Profiler::global().enabled()) {
    try {
      tinydev::Profiler::global().write();
    } catch (const tinydev::Error& e) {
      fmt::print(stderr, "tinydev: {}\n", e.what());
      return 1;
    }
  }
  return rc;
}

static int run(const std::vector<std::string>& args);

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  const int rc = run(args);
  return rc == 2 ? rc : finish(rc);
}

static int run(const std::vector<std::string>& args) {
  if (args.empty()) return usage_error("missing command");
  try {
    tinydev::settings();  // an invalid TINYDEV_* variable is a usage error, before anything opens
  } catch (const tinydev::InvalidArgument& e) {
    return usage_error(e.what());
  }
  try {
    if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
      fmt::print("{}", kUsage);
      return 0;
    }
    if (args[0] == "devices") {
      if (args.size() != 1) return usage_error("'devices' takes no arguments");
      return devices();
    }
    if (args[0] == "demo") {
      if (args.size() > 2) return usage_error("'demo' takes at most one device name");
      std::string device;
      if (args.size() == 2) {
        try {
          device = tinydev::canonicalize(args[1]);
        } catch (const tinydev::InvalidArgument& e) {
          return usage_error(e.what());
        }
      } else {
        device = tinydev::Device.default_device();
      }
      return demo(device);
    }
    if (args[0] == "load") {
      std::vector<std::string> positional;
      bool verify = false;
      for (std::size_t i = 1; i < args.size(); ++i) {
        if (args[i] == "--verify") verify = true;
        else if (args[i].starts_with("--")) return usage_error(fmt::format("'load' has no option {}", args[i]));
        else positional.push_back(args[i]);
      }
      if (positional.empty() || positional.size() > 2)
        return usage_error("'load' takes a safetensors file and at most one device name");
      std::string device;
      try {
        device = positional.size() == 2 ? tinydev::canonicalize(positional[1]) : tinydev::Device.default_device();
        (void)tinydev::Device[device];  // an unknown or unusable device is said before the file is read
      } catch (const tinydev::InvalidArgument& e) {
        return usage_error(e.what());
      }
      return load(positional[0], device, verify);
    }
    return usage_error(fmt::format("unknown command '{}'", args[0]));
  } catch (const tinydev::InvalidArgument& e) {
    return usage_error(e.what());  // a bad argument, e.g. a device this build does not have
  } catch (const std::system_error& e) {  // fmt could not write (stdout closed or full)
    fmt::print(stderr, "tinydev: cannot write to standard output: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "tinydev: {}\n", e.what());
    return 1;
  }
}
