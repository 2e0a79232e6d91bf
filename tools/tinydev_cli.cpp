// The tinydev CLI: `tinydev devices` and `tinydev demo [DEVICE]`. Exit codes: 0 ok, 1 a failure
// (device unavailable, wrong result), 2 a usage error.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <system_error>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "demo_kernels.hpp"
#include "tinydev/tinydev.hpp"

namespace {

constexpr const char* kUsage =
    "usage: tinydev <command>\n"
    "  devices          list every backend of this build: usable, or why not, and its properties\n"
    "  demo [DEVICE]    compile an add kernel, run it on random data, check it against the CPU,\n"
    "                   print compile times (cold, cached), kernel time and GB/s\n"
    "                   (DEVICE defaults to the default device: TINYDEV_DEVICE, else CUDA, LLVM, CLANG)\n"
    "  --help           this text\n";

int usage_error(const std::string& why) {
  fmt::print(stderr, "tinydev: {}\n{}", why, kUsage);
  return 2;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int devices() {
  for (const std::string& type : tinydev::Device.backends()) {
    try {
      tinydev::Compiled& dev = tinydev::Device[type];
      fmt::print("{:<8} usable\n", type);
      for (const auto& [key, value] : dev.properties()) fmt::print("    {:<16} {}\n", key, value);
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
