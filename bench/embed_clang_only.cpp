// A trivial CLANG-only program for bench_embedding.cpp and scripts/test: links tinydev::core and
// tinydev::clang and nothing of LLVM; adds two small random vectors on CLANG and checks them.
// Exits 0 when right, 1 when wrong, 3 when libLLVM is mapped into the process (it must not be:
// Note [ORC only with the LLVM backend]), 4 when CLANG cannot open here.
#include <tinydev/tinydev.hpp>

#include <cstdio>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

int main() {
  using namespace tinydev;
  const char* source =
      "void add(float* restrict out, const float* restrict a, const float* restrict b, int n) {\n"
      "  for (int i = 0; i < n; i++) out[i] = a[i] + b[i];\n}\n";
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  const int n = 1024;
  std::vector<float> a(n), b(n), out(n);
  for (int i = 0; i < n; ++i) a[i] = dist(rng), b[i] = dist(rng);
  try {
    Compiled& dev = Device["CLANG"];
    auto add = dev.load_kernel("add", source);
    Buffer ba("CLANG", n, dtypes::float32), bb("CLANG", n, dtypes::float32), bo("CLANG", n, dtypes::float32);
    ba.allocate().copyin(std::span<const float>(a));
    bb.allocate().copyin(std::span<const float>(b));
    bo.allocate();
    const Allocation args[] = {bo.allocation(), ba.allocation(), bb.allocation()};
    const std::int32_t vals[] = {n};
    (*add)(args, vals, LaunchParams{.wait = true});
    bo.copyout(std::span<float>(out));
  } catch (const DeviceUnavailable& e) {
    std::fprintf(stderr, "embed_clang_only: %s\n", e.what());
    return 4;
  }
  for (int i = 0; i < n; ++i)
    if (out[i] != a[i] + b[i]) return 1;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (line.find("libLLVM") != std::string::npos) {
      std::fprintf(stderr, "embed_clang_only: libLLVM is mapped: %s\n", line.c_str());
      return 3;
    }
  // The peak resident set of this program's own memory map, for bench_embedding.cpp.
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.starts_with("VmHWM:")) std::printf("%s\n", line.c_str());
  return 0;
}
