// A plugin that links tinydev statically, built twice (tinydev_plugin_a and tinydev_plugin_b) for
// the plugin test (plugin_host.cpp, plugin_test.cmake): each copy runs kernels on its own devices.
// Built with -fvisibility=hidden like a careful plugin; its entry points are its only exports.
#include <tinydev/tinydev.hpp>

#include "demo_kernels.hpp"  // tools/: the add kernel in each language

#include <cstdio>
#include <exception>
#include <random>
#include <span>
#include <string>
#include <vector>

#define PLUGIN_ENTRY extern "C" __attribute__((visibility("default")))

namespace {

// Adds two random vectors on `device` with `source`; returns the number of wrong results.
int add_on(const std::string& device, const std::string& source, std::mt19937& rng) {
  using namespace tinydev;
  const int n = 4096 + static_cast<int>(rng() % 4096);
  std::vector<float> a(n), b(n), out(n);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (int i = 0; i < n; ++i) a[i] = dist(rng), b[i] = dist(rng);
  Compiled& dev = Device[device];
  auto add = dev.load_kernel("add", source);
  Buffer ba(device, n, dtypes::float32), bb(device, n, dtypes::float32), bo(device, n, dtypes::float32);
  ba.allocate().copyin(std::span<const float>(a));
  bb.allocate().copyin(std::span<const float>(b));
  bo.allocate();
  const Allocation args[] = {bo.allocation(), ba.allocation(), bb.allocation()};
  const std::int32_t vals[] = {n};
  (*add)(args, vals, LaunchParams{.wait = false});
  dev.synchronize();
  bo.copyout(std::span<float>(out));
  int wrong = 0;
  for (int i = 0; i < n; ++i) wrong += out[i] != a[i] + b[i];
  return wrong;
}

}  // namespace

// Runs the add kernel on every CPU backend this copy has, `rounds` times; writes what it did (or
// the error) to `report`. Returns the number of wrong results, or -1 on an exception.
static int run_kernels(int rounds, char* report, std::size_t capacity) {
  std::string what = PLUGIN_NAME ":";
  int wrong = 0;
  try {
    std::mt19937 rng(std::random_device{}());
    for (const std::string& type : tinydev::Device.backends()) {
      if (type != "LLVM" && type != "CLANG") continue;  // the CPU backends: kernels that run here
      const std::string source = tinydev::kernels::add_f32(tinydev::Device[type].source_language());
      for (int r = 0; r < rounds; ++r) wrong += add_on(type, source, rng);
      what += " " + type;
    }
  } catch (const std::exception& e) {
    std::snprintf(report, capacity, "%s %s", PLUGIN_NAME, e.what());
    return -1;
  }
  std::snprintf(report, capacity, "%s", what.c_str());
  return wrong;
}

// The address of this copy's device registry: two copies in one process must not share one.
static const void* registry() { return &tinydev::Device; }

// The entry points, under a name both plugins share (for dlopen and dlsym) and under names of this
// plugin's own (for a program linked to both plugins, which reaches only one of two equal names).
// Each calls the static functions above: a call to an exported name would be interposed.
PLUGIN_ENTRY int tinydev_plugin_run(int rounds, char* report, std::size_t capacity) {
  return run_kernels(rounds, report, capacity);
}
PLUGIN_ENTRY const void* tinydev_plugin_registry() { return registry(); }
#define PLUGIN_CONCAT2(a, b) a##b
#define PLUGIN_CONCAT(a, b) PLUGIN_CONCAT2(a, b)
PLUGIN_ENTRY int PLUGIN_CONCAT(PLUGIN_ID, _run)(int rounds, char* report, std::size_t capacity) {
  return run_kernels(rounds, report, capacity);
}
PLUGIN_ENTRY const void* PLUGIN_CONCAT(PLUGIN_ID, _registry)() { return registry(); }
