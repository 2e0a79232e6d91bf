// CUDA benchmarks: each row puts tinydev's figure beside the raw driver call doing the same in
// the same run, and their ratio (issue 8's table). On the fake driver (TINYDEV_CUDA_DRIVER pointing
// at tests/cuda/fake_driver) the rows measure tinydev's host-side cost only and say so. Run:
//   build/default/bench/tinydev_bench_cuda [--quick]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "cuda_api.hpp"
#include "demo_kernels.hpp"
#include "tinydev/tinydev.hpp"

using namespace tinydev;
using Clock = std::chrono::steady_clock;

namespace tinydev {
std::unique_ptr<Compiled> open_cuda_device(const std::string& canonical_name);
}

namespace {

using bench::fmt_ns;
using bench::ns_per_op;

int g_missed = 0;

void row(const std::string& what, double lib, double base, const std::string& target, bool met) {
  fmt::print("  {:<58} {:>12} {:>12} {:>8.2f}x  {} {}\n", what, fmt_ns(lib), fmt_ns(base), lib / base, target,
             met ? "(met)" : "(MISSED)");
  g_missed += !met;
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  bench::g_quick = argc > 1 && std::string(argv[1]) == "--quick";
  Device.register_backend("CUDA", &open_cuda_device);
  Compiled* dev = nullptr;
  try {
    dev = &Device["CUDA"];
  } catch (const DeviceUnavailable& e) {
    fmt::print("tinydev_bench_cuda: no CUDA device opens here, nothing to measure: {}\n", e.what());
    return 0;
  }
  const auto props = dev->properties();
  const bool fake = props.at("gpu").find("tinydev fake GPU") != std::string::npos;
  fmt::print("tinydev CUDA benchmarks on {} ({}){}\n", props.at("gpu"), props.at("driver"),
             fake ? ": FAKE DRIVER, host-side costs only" : "");
  const std::string label = fake ? " [fake driver]" : "";
  const cuda::Driver& api = cuda::driver();

  // Eager launches: Program::operator() against cuLaunchKernel of the same function and arguments.
  const std::size_t n = 1024;
  Buffer a(dev->name(), n, dtypes::float32), o(dev->name(), n, dtypes::float32);
  a.allocate();
  o.allocate();
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const Allocation bufs[] = {o.allocation(), a.allocation(), a.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  const LaunchParams grid{.global = {4, 1, 1}, .local = {256, 1, 1}};
  const Blob blob = dev->compiler().compile_cached(kernels::add_f32(SourceLanguage::CUDA));
  Blob image = blob;
  image.push_back(std::byte{0});
  CUmodule module = nullptr;
  CUfunction function = nullptr;
  cuda::check(api.cuModuleLoadData(&module, image.data()), "cuModuleLoadData", "bench");
  cuda::check(api.cuModuleGetFunction(&function, module, "add"), "cuModuleGetFunction", "bench");
  struct {
    std::uint64_t out, x, y;
    std::int32_t count;
  } packed{o.allocation().va_addr, a.allocation().va_addr, a.allocation().va_addr, static_cast<std::int32_t>(n)};
  std::size_t size = 28;
  void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &packed, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
  const auto sync = [&] { cuda::check(api.cuCtxSynchronize(), "cuCtxSynchronize", "bench"); };
  const std::size_t launches = 500;  // under the stream's queue depth
  const double raw = ns_per_op([&] { api.cuLaunchKernel(function, 4, 1, 1, 256, 1, 1, 0, nullptr, nullptr, extra); },
                               launches, 15, sync);
  const double lib = ns_per_op([&] { (*add)(bufs, vals, grid); }, launches, 15, [&] { dev->synchronize(); });
  // Pipelined throughput: batches of 500 launches then one synchronize, median batch per launch.
  row("eager launch, host time per kernel (pipelined, p50 batch)" + label, lib, raw, "<= 1.1x", lib <= 1.1 * raw);

  // A compile-cache hit from disk plus the module load, against a cold NVRTC compile.
  // A source no earlier run cached (a unique comment), with the kernel every driver here knows.
  const std::string source = kernels::add_f32(SourceLanguage::CUDA) +
                             fmt::format("// bench {}\n", Clock::now().time_since_epoch().count());
  const auto t0 = Clock::now();
  const Blob cold = dev->compiler().compile(source);
  const double cold_ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
  dev->compiler().compile_cached(source);
  std::vector<double> hits;
  for (int i = 0; i < (bench::g_quick ? 3 : 9); ++i) {
    DiskCache::global().drop_memory_layer();
    const auto start = Clock::now();
    const Blob hit = dev->compiler().compile_cached(source);
    auto program = dev->runtime().load("add", hit);
    hits.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count());
  }
  std::sort(hits.begin(), hits.end());
  const double hit_ns = hits[hits.size() / 2];
  fmt::print("  {:<58} {:>12} {:>12} {:>8.2f}%  {} {}\n", "NVRTC cache hit from disk + module load (latency, p50)" + label,
             fmt_ns(hit_ns), fmt_ns(cold_ns), 100 * hit_ns / cold_ns, "<= 2% (same process)",
             hit_ns <= 0.02 * cold_ns ? "(met)" : "(MISSED)");
  g_missed += hit_ns > 0.02 * cold_ns;
  api.cuModuleUnload(module);
  fmt::print("{} target{} missed\n", g_missed, g_missed == 1 ? "" : "s");
  return 0;
}
