// The baseline of bench_embedding.cpp: the same work as embed_clang_only.cpp in plain C++.
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

int main() {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  const int n = 1024;
  std::vector<float> a(n), b(n), out(n);
  for (int i = 0; i < n; ++i) a[i] = dist(rng), b[i] = dist(rng);
  for (int i = 0; i < n; ++i) out[i] = a[i] + b[i];
  volatile float sink = out[n / 2];
  (void)sink;
  // The peak resident set of this program's own memory map, for bench_embedding.cpp.
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.starts_with("VmHWM:")) std::printf("%s\n", line.c_str());
  return 0;
}
