// tests/corpus/check_standalone.cpp: standalone check of the corpus (not built by the project).
// For every kernel: writes the C and the IR source to a temp folder, compiles each with clang-19
//   C : clang-19 -O2 -march=native -ffreestanding -fno-math-errno -fPIC -shared -Wall
//   IR: clang-19 -O2 -march=native -fPIC -shared -Wno-override-module -x ir
// dlopens both, runs each on the same random inputs (32-byte aligned copies; grid kernels once per
// core_id) and compares the outputs against Kernel::reference with compare_output, for a few seeds.
// Build and run (from this folder):
//   g++ -std=c++20 -O2 -Wall -Wextra check_standalone.cpp corpus*.cpp -ldl -o /tmp/corpus_check
//   /tmp/corpus_check [name-substring [seeds, default 3]]
#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "corpus.hpp"

namespace {

template <std::size_t> using Ptr = void*;
template <std::size_t> using Int = int;

template <std::size_t... P, std::size_t... I>
void call_exact(void* fn, void* const* ptrs, const int* ints, std::index_sequence<P...>, std::index_sequence<I...>) {
  using Fn = void (*)(Ptr<P>..., Int<I>...);
  reinterpret_cast<Fn>(fn)(ptrs[P]..., ints[I]...);
}

template <std::size_t NB>
bool call_nb(void* fn, void* const* ptrs, const int* ints, std::size_t ni) {
  switch (ni) {
    case 0: call_exact(fn, ptrs, ints, std::make_index_sequence<NB>{}, std::make_index_sequence<0>{}); return true;
    case 1: call_exact(fn, ptrs, ints, std::make_index_sequence<NB>{}, std::make_index_sequence<1>{}); return true;
    case 2: call_exact(fn, ptrs, ints, std::make_index_sequence<NB>{}, std::make_index_sequence<2>{}); return true;
    case 3: call_exact(fn, ptrs, ints, std::make_index_sequence<NB>{}, std::make_index_sequence<3>{}); return true;
    case 4: call_exact(fn, ptrs, ints, std::make_index_sequence<NB>{}, std::make_index_sequence<4>{}); return true;
  }
  return false;
}

template <std::size_t... NB>
bool call_any(void* fn, void* const* ptrs, const int* ints, std::size_t nb, std::size_t ni, std::index_sequence<NB...>) {
  bool ok = false;
  ((nb == NB + 1 ? (ok = call_nb<NB + 1>(fn, ptrs, ints, ni), 0) : 0), ...);
  return ok;
}

// calls fn(ptrs..., ints...) with the exact prototype void(void*..., int...)
bool call(void* fn, const std::vector<void*>& ptrs, const std::vector<int>& ints) {
  return call_any(fn, ptrs.data(), ints.data(), ptrs.size(), ints.size(), std::make_index_sequence<12>{});
}

std::string tmpdir;

void* build(const corpus::Kernel& k, bool ir, std::string& err) {
  const std::string base = tmpdir + "/" + k.name + (ir ? "_ir" : "_c");
  const std::string src = base + (ir ? ".ll" : ".c"), so = base + ".so", log = base + ".log";
  std::ofstream(src) << (ir ? k.ir_source : k.c_source);
  const std::string cmd = ir ? "clang-19 -O2 -march=native -fPIC -shared -Wno-override-module -x ir " + src + " -o " + so + " 2>" + log
                             : "clang-19 -O2 -march=native -ffreestanding -fno-math-errno -fPIC -shared -Wall " + src +
                                   " -o " + so + " 2>" + log;
  const int rc = std::system(cmd.c_str());
  std::ifstream lf(log);
  std::string logtext((std::istreambuf_iterator<char>(lf)), std::istreambuf_iterator<char>());
  if (rc != 0) {
    err = "compile failed: " + logtext;
    return nullptr;
  }
  if (!logtext.empty()) std::printf("  [%s %s warnings]\n%s", k.name.c_str(), ir ? "IR" : "C", logtext.c_str());
  void* h = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    err = std::string("dlopen: ") + dlerror();
    return nullptr;
  }
  void* fn = dlsym(h, k.name.c_str());
  if (!fn) err = "symbol " + k.name + " not found";
  return fn;
}

// largest |got - want| / max(1, |want|) over the float outputs (reported to size tolerances)
double max_error(const corpus::Kernel& k, std::size_t b, const std::vector<std::byte>& got, const std::vector<std::byte>& want) {
  const corpus::Buffer& buf = k.buffers[b];
  double worst = 0;
  for (std::size_t i = 0; i < buf.count; ++i) {
    double g, w;
    if (buf.elem == corpus::Elem::f32) {
      float x, y;
      std::memcpy(&x, got.data() + 4 * i, 4), std::memcpy(&y, want.data() + 4 * i, 4);
      g = x, w = y;
    } else if (buf.elem == corpus::Elem::f64) {
      std::memcpy(&g, got.data() + 8 * i, 8), std::memcpy(&w, want.data() + 8 * i, 8);
    } else {
      return 0;
    }
    if (g != w) worst = std::max(worst, std::fabs(g - w) / std::max(1.0, std::fabs(w)));
  }
  return worst;
}

struct Aligned {
  std::byte* p = nullptr;
  explicit Aligned(std::size_t n) : p(static_cast<std::byte*>(std::aligned_alloc(64, (n + 63) / 64 * 64 + 64))) {}
  ~Aligned() { std::free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
};

// runs fn on copies of bufs; returns the buffers afterwards and the time of one launch (all cores)
std::vector<std::vector<std::byte>> run(const corpus::Kernel& k, void* fn, const std::vector<std::vector<std::byte>>& bufs,
                                        double& ms) {
  std::vector<std::unique_ptr<Aligned>> mem;
  std::vector<void*> ptrs;
  for (const auto& b : bufs) {
    mem.push_back(std::make_unique<Aligned>(b.size()));
    std::memcpy(mem.back()->p, b.data(), b.size());
    ptrs.push_back(mem.back()->p);
  }
  std::vector<int> ints(k.values.begin(), k.values.end());
  const auto t0 = std::chrono::steady_clock::now();
  if (k.grid > 1) {
    ints.push_back(0);
    for (std::uint32_t c = 0; c < k.grid; ++c) {
      ints.back() = static_cast<int>(c);
      if (!call(fn, ptrs, ints)) std::abort();
    }
  } else if (!call(fn, ptrs, ints)) {
    std::abort();
  }
  ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::vector<std::vector<std::byte>> out;
  for (std::size_t i = 0; i < bufs.size(); ++i) out.emplace_back(mem[i]->p, mem[i]->p + bufs[i].size());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  char tmpl[] = "/tmp/corpus_check_XXXXXX";
  if (!mkdtemp(tmpl)) return 2;
  tmpdir = tmpl;
  const std::string filter = argc > 1 ? argv[1] : "";
  const std::uint64_t seeds = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 3;
  int failed = 0, passed = 0;
  std::vector<std::string> names;
  for (const corpus::Kernel& k : corpus::kernels()) {
    for (const auto& n : names)
      if (n == k.name) std::printf("DUPLICATE NAME %s\n", k.name.c_str()), ++failed;
    names.push_back(k.name);
    if (!filter.empty() && k.name.find(filter) == std::string::npos) continue;
    std::string err;
    void* fc = build(k, false, err);
    void* fi = fc ? build(k, true, err) : nullptr;
    double worst_ms = 0, worst_err = 0;
    for (std::uint64_t seed = 1; err.empty() && seed <= seeds; ++seed) {
      std::mt19937_64 rng(seed * 7919);
      auto bufs = corpus::random_buffers(k, rng);
      double ms_c = 0, ms_i = 0;
      auto got_c = run(k, fc, bufs, ms_c);
      auto got_i = run(k, fi, bufs, ms_i);
      worst_ms = std::max({worst_ms, ms_c, ms_i});
      auto want = bufs;
      k.reference(want, k.values);
      for (std::size_t b = 0; b < k.buffers.size() && err.empty(); ++b) {
        if (!k.buffers[b].output) {
          if (got_c[b] != bufs[b] || got_i[b] != bufs[b]) err = "input buffer " + std::to_string(b) + " was modified";
          continue;
        }
        worst_err = std::max({worst_err, max_error(k, b, got_c[b], want[b]), max_error(k, b, got_i[b], want[b])});
        if (std::string m = corpus::compare_output(k, b, got_c[b], want[b]); !m.empty()) err = "C: " + m;
        else if (std::string m2 = corpus::compare_output(k, b, got_i[b], want[b]); !m2.empty()) err = "IR: " + m2;
      }
      if (!err.empty()) err = "seed " + std::to_string(seed) + ": " + err;
    }
    if (err.empty()) {
      ++passed;
      std::printf("PASS %-24s %8.3f ms  err %.1e (tol %.0e)  %s\n", k.name.c_str(), worst_ms, worst_err, k.tolerance,
                  k.what.c_str());
    } else {
      ++failed;
      std::printf("FAIL %-28s %s\n", k.name.c_str(), err.c_str());
    }
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed, %zu kernels in the corpus\n", passed, failed, corpus::kernels().size());
  std::string rm = "rm -rf " + tmpdir;
  if (std::system(rm.c_str()) != 0) std::printf("could not remove %s\n", tmpdir.c_str());
  return failed ? 1 : 0;
}
