// tinydev_bench: the foundation's benchmarks. Every row is tinydev's figure beside a baseline
// measured in this same process (or a child of it), and their ratio; targets from the issue.
// Usage: tinydev_bench [--quick]
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <sys/utsname.h>

#include <algorithm>
#include <climits>
#include <unordered_map>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>
#include <random>
#include <string>
#include <vector>

#include "cpu_hcq.hpp"
#include "bench_support.hpp"
#include "demo_kernels.hpp"
#include "tinydev/hcq.hpp"
#include "tinydev/tinydev.hpp"

using namespace tinydev;
using Clock = std::chrono::steady_clock;

namespace {

using bench::fmt_ns;
using bench::g_quick;
using bench::ns_per_op;

template <class T>
void keep(T&& value) {
  asm volatile("" : : "g"(&value) : "memory");
}

struct Row {
  std::string what, lib, base, ratio, target;
  bool met;
};
std::vector<Row> g_rows;

void row(std::string what, std::string lib, std::string base, std::string ratio, std::string target, bool met) {
  fmt::print("  {:<50} {:>12} {:>12} {:>14}  {} {}\n", what, lib, base, ratio, target, met ? "(met)" : "(MISSED)");
  std::fflush(stdout);
  g_rows.push_back({std::move(what), std::move(lib), std::move(base), std::move(ratio), std::move(target), met});
}

void bench_lru() {
  MallocAllocator alloc;
  for (std::size_t size : {std::size_t{4096}, std::size_t{64} << 20}) {
    const double lib = ns_per_op([&] {
      Allocation a = alloc.alloc(size);
      keep(a);
      alloc.free(a, size);
    }, 20000);
    const double base = ns_per_op([&] {
      void* p = std::malloc(size);
      keep(p);
      std::free(p);
    }, size > 65536 ? 2000 : 20000);
    row(fmt::format("LRU alloc+free, cache hit, {}", size == 4096 ? "4 KiB" : "64 MiB"), fmt_ns(lib),
        fmt_ns(base), fmt::format("{:.2f}x", lib / base), "<= 2x and < 100 ns",
        lib <= 2 * base + 1e-9 && lib < 100);
    if (size > 65536) {
      // glibc serves 64 MiB with mmap + munmap, so the row above compares a cache hit with a
      // syscall pair; a hand-written size-keyed free list is the honest cache-hit baseline.
      std::unordered_map<std::size_t, std::vector<void*>> free_list;
      free_list[size].push_back(std::malloc(size));
      const double hit = ns_per_op([&] {
        auto& slot = free_list[size];
        void* p = slot.back();
        slot.pop_back();
        keep(p);
        free_list[size].push_back(p);
      }, 20000);
      for (void* p : free_list[size]) std::free(p);
      row("  same, vs a hash-map free-list hit", fmt_ns(lib), fmt_ns(hit), fmt::format("{:.2f}x", lib / hit),
          "<= 2x and < 100 ns", lib <= 2 * hit && lib < 100);
    }
  }
  // What a server pays per request buffer: a Buffer made by device name, allocated (an LRU hit
  // after the first) and dropped, beside a ref-counted handle to malloc'd memory of the same size.
  Device["LLVM"];
  const double buffer = ns_per_op([&] {
    Buffer b("LLVM", 1024, dtypes::float32);
    b.allocate();
    keep(b);
  }, 20000);
  struct Handle {
    void* memory;
    explicit Handle(std::size_t bytes) : memory(std::malloc(bytes)) {}
    Handle(const Handle&) = delete;
    Handle& operator=(const Handle&) = delete;
    ~Handle() { std::free(memory); }
  };
  const double handle = ns_per_op([&] {
    auto h = std::make_shared<Handle>(4096);
    keep(h);
  }, 20000);
  row("Buffer made by name + allocated + dropped, 4 KiB, LLVM", fmt_ns(buffer), fmt_ns(handle),
      fmt::format("{:.2f}x", buffer / handle), "none (shown)", true);
}

// 256 MiB, past every cache: copyin and copyout beside memcpy and beside the non-temporal floor
// (whichever of the two baselines is faster is the floor; the row says which).
void bench_copies_large() {
  const std::size_t bytes = 256u << 20;
  std::vector<std::byte> host(bytes, std::byte{5}), back(bytes, std::byte{1}), dst(bytes, std::byte{2});
  Buffer buf("LLVM", bytes, dtypes::uint8);
  buf.allocate().copyin(host);
  const double mem = ns_per_op([&] { std::memcpy(dst.data(), host.data(), bytes); keep(dst); }, 1, 5);
  // The copy queue's own non-temporal copy (cpu::streaming_copy): the floor a large copy can
  // reach without reading the destination first.
  const double nt = ns_per_op([&] { cpu::streaming_copy(dst.data(), host.data(), bytes); keep(dst); }, 1, 5);
  const double in = ns_per_op([&] { buf.copyin(host); }, 1, 5);
  const double out = ns_per_op([&] { buf.copyout(std::span<std::byte>(back)); keep(back); }, 1, 5);
  const bool nt_floor = nt < mem;
  const double floor = std::min(nt, mem);
  auto gbs = [&](double ns) { return fmt::format("{:.1f} GiB/s", 0.25 / (ns / 1e9)); };
  const std::string base = fmt::format("{} ({})", gbs(floor), nt_floor ? "NT stores" : "memcpy");
  row(fmt::format("Buffer copyin 256 MiB (floor: the faster of memcpy {} and NT stores {})", gbs(mem), gbs(nt)),
      gbs(in), base, fmt::format("{:.2f}x", floor / in), ">= 0.9x", floor / in >= 0.9);
  row("Buffer copyout 256 MiB (same floor)", gbs(out), base, fmt::format("{:.2f}x", floor / out), ">= 0.9x",
      floor / out >= 0.9);
}

void bench_copies() {
  const std::size_t n = (64u << 20) / 4;
  std::vector<float> host(n), back(n);
  std::mt19937 rng(1);
  for (auto& x : host) x = static_cast<float>(rng());
  Buffer buf("LLVM", n, dtypes::float32);
  buf.allocate().copyin(std::span<const float>(host));  // touch every page once
  std::vector<float> dst(n);
  std::memcpy(dst.data(), host.data(), n * 4);
  const double gib = 64.0 / 1024;
  const double base = ns_per_op([&] { std::memcpy(dst.data(), host.data(), n * 4); keep(dst); }, 1, 11);
  const double in = ns_per_op([&] { buf.copyin(std::span<const float>(host)); }, 1, 11);
  const double out = ns_per_op([&] { buf.copyout(std::span<float>(back)); keep(back); }, 1, 11);
  auto gbs = [&](double ns) { return fmt::format("{:.1f} GiB/s", gib / (ns / 1e9)); };
  row("Buffer copyin 64 MiB", gbs(in), gbs(base), fmt::format("{:.2f}x", base / in), ">= 0.9x", base / in >= 0.9);
  row("Buffer copyout 64 MiB", gbs(out), gbs(base), fmt::format("{:.2f}x", base / out), ">= 0.9x", base / out >= 0.9);
  bench_copies_large();
}

void bench_compile(const std::string& exe) {
  for (const char* name : {"LLVM", "CLANG"}) {
    Compiled& dev = Device[name];
    const std::string src = kernels::add_f32(dev.source_language(), "add");
    dev.compiler().compile_cached(src);  // make sure the disk entry exists
    const double cold = ns_per_op([&] { keep(dev.compiler().compile(src)); }, 1, 7);
    std::vector<double> hits, with_open;
    for (int i = 0; i < (g_quick ? 3 : 7); ++i) {
      const std::vector<double> f = bench::run_child(exe, fmt::format("--child-cache-hit {}", name));
      if (f.size() != 2) throw Error("the cache-hit child printed something else");
      hits.push_back(f[0]);
      with_open.push_back(f[0] + f[1]);
    }
    const double hit = bench::percentiles(hits).p50, opened = bench::percentiles(with_open).p50;
    row(fmt::format("compile_cached hit, new process, +load ({})", name), fmt_ns(hit), fmt_ns(cold),
        fmt::format("{:.2f}%", 100 * hit / cold), "<= 2% and < 1 ms", hit <= 0.02 * cold && hit < 1e6);
    // What a new process pays before its first kernel runs: the device open too (the bare figure
    // above leaves it out).
    row(fmt::format("  same, device open included ({})", name), fmt_ns(opened), fmt_ns(cold),
        fmt::format("{:.2f}%", 100 * opened / cold), "< cold compile", opened < cold);
  }
  Compiled& llvm = Device["LLVM"];
  Compiled& clang = Device["CLANG"];
  const std::string ir = kernels::add_f32(SourceLanguage::LLVMIR), c = kernels::add_f32(SourceLanguage::C);
  const double lib = ns_per_op([&] { keep(llvm.compiler().compile(ir)); }, 1, 7);
  const double base = ns_per_op([&] { keep(clang.compiler().compile(c)); }, 1, 7);
  row("LLVM compile of a small kernel (vs clang -c)", fmt_ns(lib), fmt_ns(base),
      fmt::format("{:.2f}x", lib / base), "<= 0.5x", lib <= 0.5 * base);
}

void bench_calls() {
  Compiled& dev = Device["LLVM"];
  auto prg = dev.load_kernel("add", kernels::add_f32(SourceLanguage::LLVMIR));
  const std::size_t n = 16;
  Buffer a("LLVM", n, dtypes::float32), b("LLVM", n, dtypes::float32), o("LLVM", n, dtypes::float32);
  a.allocate();
  b.allocate();
  o.allocate();
  std::vector<float> init(n, 1.5f);
  a.copyin(std::span<const float>(init));
  b.copyin(std::span<const float>(init));
  const Allocation bufs[] = {o.allocation(), a.allocation(), b.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  using Fn = void (*)(float*, float*, float*, std::int32_t);
  Fn volatile direct = reinterpret_cast<Fn>(static_cast<const cpu::CpuProgram&>(*prg).host_function());
  float* po = o.allocation().host_ptr<float>();
  float* pa = a.allocation().host_ptr<float>();
  float* pb = b.allocation().host_ptr<float>();
  const double base = ns_per_op([&] { direct(po, pa, pb, static_cast<std::int32_t>(n)); }, 200000);
  const double lib = ns_per_op([&] { (*prg)(bufs, vals); }, 200000);
  row("Program call, 3 buffers, CPU (vs direct call)", fmt_ns(lib), fmt_ns(base),
      fmt::format("+{:.1f} ns", lib - base), "< 50 ns over it", lib - base < 50);
  // NULL's programs do nothing: its call is the library's fixed cost of a launch through Compiled,
  // against the same direct call of the real kernel (which does the work NULL skips).
  auto null_prg = Device["NULL"].load_kernel("add", "any source");
  const double fixed = ns_per_op([&] { (*null_prg)(bufs, vals); }, 200000);
  row("Program call on NULL: fixed launch cost (vs direct call)", fmt_ns(fixed), fmt_ns(base),
      fmt::format("{:+.1f} ns", fixed - base), "< 50 ns over it", fixed - base < 50);
}

void bench_add_kernel() {
  Compiled& dev = Device["LLVM"];
  auto prg = dev.load_kernel("add", kernels::add_f32(SourceLanguage::LLVMIR));
  const std::size_t n = 16u << 20;
  std::vector<float> init(n);
  std::mt19937 rng(2);
  for (auto& x : init) x = static_cast<float>(rng() % 1000);
  Buffer a("LLVM", n, dtypes::float32), b("LLVM", n, dtypes::float32), o("LLVM", n, dtypes::float32);
  a.allocate().copyin(std::span<const float>(init));
  b.allocate().copyin(std::span<const float>(init));
  o.allocate().copyin(std::span<const float>(init));
  const Allocation bufs[] = {o.allocation(), a.allocation(), b.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  const double kernel = ns_per_op([&] { (*prg)(bufs, vals); }, 1, 11);
  std::vector<float> dst(n);
  std::memcpy(dst.data(), init.data(), n * 4);
  const double copy = ns_per_op([&] { std::memcpy(dst.data(), init.data(), n * 4); keep(dst); }, 1, 11);
  const double kernel_rate = 3.0 * n * 4 / kernel;  // bytes per ns = GB/s
  const double copy_rate = 2.0 * n * 4 / copy;
  row("16M-float add kernel (bytes moved/s vs memcpy)", fmt::format("{:.1f} GB/s", kernel_rate),
      fmt::format("{:.1f} GB/s", copy_rate), fmt::format("{:.2f}x", kernel_rate / copy_rate), ">= 0.8x",
      kernel_rate / copy_rate >= 0.8);
}

// ---- HCQ ----------------------------------------------------------------------------------------

struct SmallKernel {
  cpu::CpuHCQDevice& dev;
  std::shared_ptr<cpu::CpuProgram> prg;
  Buffer a, b, o;
  Kernargs args;
  using Fn = void (*)(float*, float*, float*, std::int32_t);
  Fn fn;
  static constexpr std::int32_t n = 16;
  SmallKernel()
      : dev(dynamic_cast<cpu::CpuHCQDevice&>(Device["LLVM"])),
        prg(std::dynamic_pointer_cast<cpu::CpuProgram>(dev.load_kernel("add", kernels::add_f32(SourceLanguage::LLVMIR)))),
        a("LLVM", n, dtypes::float32), b("LLVM", n, dtypes::float32), o("LLVM", n, dtypes::float32) {
    std::vector<float> init(n, 1.5f);
    a.allocate().copyin(std::span<const float>(init));
    b.allocate().copyin(std::span<const float>(init));
    o.allocate();
    args = dev.alloc_kernargs(3, 1);
    const Allocation bufs[] = {o.allocation(), a.allocation(), b.allocation()};
    const std::int32_t vals[] = {n};
    fill_kernargs(*prg, args, bufs, vals);
    fn = reinterpret_cast<Fn>(static_cast<const cpu::CpuProgram&>(*prg).host_function());
  }
  void call_direct() {
    Fn volatile f = fn;
    f(o.allocation().host_ptr<float>(), a.allocation().host_ptr<float>(), b.allocation().host_ptr<float>(), n);
  }
  double direct_ns(std::size_t calls) {
    Fn volatile f = fn;
    float *po = o.allocation().host_ptr<float>(), *pa = a.allocation().host_ptr<float>(), *pb = b.allocation().host_ptr<float>();
    return ns_per_op([&] { f(po, pa, pb, n); }, calls);
  }
};

void bench_hcq() {
  SmallKernel k;
  const double direct = k.direct_ns(100000);
  auto& dev = k.dev;
  // A recorded 100-kernel queue, resubmitted: patch its two timeline values, submit, and in the
  // steady state the worker runs the commands back to back.
  constexpr int kKernels = 100;
  auto q = dev.compute_queue();
  q.wait(dev.timeline_signal(), 0);
  for (int i = 0; i < kKernels; ++i) q.exec(*k.prg, k.args, {1, 1, 1}, {1, 1, 1});
  q.signal(dev.timeline_signal(), 0);
  const int reps = g_quick ? 200 : 2000;
  auto replay_batch = [&] {
    std::lock_guard lock(dev.submit_mutex());
    for (int r = 0; r < reps; ++r) {
      const std::uint64_t v = dev.next_timeline_value();
      q.update_wait(0, dev.timeline_signal(), v - 1).update_signal(kKernels + 1, dev.timeline_signal(), v).submit(dev);
    }
    dev.synchronize();
  };
  const double per_cmd = ns_per_op(replay_batch, 1, 7) / (reps * kKernels);
  row("replay of a recorded 100-kernel queue, per command (pipelined throughput)", fmt_ns(per_cmd), fmt_ns(direct),
      fmt::format("+{:.1f} ns", per_cmd - direct), "< 150 ns over it", per_cmd - direct < 150);
  // The same queue submitted and waited for, one at a time: submit to completion as a caller
  // sees it, against 100 direct calls.
  {
    std::vector<double> samples, direct_samples;
    for (int r = 0; r < (g_quick ? 200 : 2000); ++r) {
      auto start = Clock::now();
      std::uint64_t v;
      {
        std::lock_guard lock(dev.submit_mutex());
        v = dev.next_timeline_value();
        q.update_wait(0, dev.timeline_signal(), v - 1).update_signal(kKernels + 1, dev.timeline_signal(), v).submit(dev);
      }
      dev.wait_timeline(v);
      samples.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count());
      start = Clock::now();
      for (int i = 0; i < kKernels; ++i) k.call_direct();
      direct_samples.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count());
    }
    const bench::Percentiles queue = bench::percentiles(samples);
    const double d50 = bench::percentiles(direct_samples).p50;
    row("  same queue, submit to completion, p50 (p99)", fmt::format("{} ({})", fmt_ns(queue.p50), fmt_ns(queue.p99)),
        fmt::format("{} (100 calls)", fmt_ns(d50)), fmt::format("+{}", fmt_ns(queue.p50 - d50)),
        "< 150 ns/command + 5 us", queue.p50 - d50 < 150 * kKernels + 5000);
  }

  // The same through a graph: 100 kernel nodes, replayed.
  std::vector<GraphNode> nodes;
  for (int i = 0; i < kKernels; ++i)
    nodes.push_back(GraphKernel{k.prg, {GraphBuffer::of(k.o.allocation()), GraphBuffer::in(0), GraphBuffer::in(1)},
                                {GraphValue::of(SmallKernel::n)}});
  auto graph = dev.create_graph(nodes);
  const Allocation inputs[] = {k.a.allocation(), k.b.allocation()};
  const int greps = g_quick ? 100 : 1000;
  const double per_node = ns_per_op([&] {
    for (int r = 0; r < greps; ++r) graph->replay(inputs);
    dev.synchronize();
  }, 1, 7) / (greps * kKernels);
  row("graph replay of 100 kernel nodes, per node", fmt_ns(per_node), fmt_ns(direct),
      fmt::format("+{:.1f} ns", per_node - direct), "< 150 ns over it", per_node - direct < 150);

  // Eager: one small queue per kernel (wait, exec, signal), as a framework without graphs does.
  const int eager = g_quick ? 2000 : 20000;
  const double per_kernel = ns_per_op([&] {
    std::lock_guard lock(dev.submit_mutex());
    for (int i = 0; i < eager; ++i) {
      const std::uint64_t v = dev.next_timeline_value();
      dev.compute_queue().wait(dev.timeline_signal(), v - 1).exec(*k.prg, k.args, {1, 1, 1}, {1, 1, 1})
          .signal(dev.timeline_signal(), v).submit(dev);
    }
    dev.synchronize();
  }, 1, 7) / eager;
  row("eager exec through a queue, per kernel (pipelined throughput)", fmt_ns(per_kernel), fmt_ns(direct),
      fmt::format("+{:.1f} ns", per_kernel - direct), "< 1 us over it", per_kernel - direct < 1000);
  // Its latency (one exec submitted and waited for) is the "submit+wait of 1 exec" rows below.
}

// Round trips between two threads: one sets, the other waits and answers. p50 of one-way latency.
template <class Set, class Wait>
double ping_pong_p50_ns(Set&& set, Wait&& wait, int rounds) {
  std::vector<double> samples;
  samples.reserve(rounds);
  std::thread other([&] {
    for (int i = 1; i <= rounds; ++i) {
      wait(0, static_cast<std::uint64_t>(i));
      set(1, static_cast<std::uint64_t>(i));
    }
  });
  for (int i = 1; i <= rounds; ++i) {
    const auto start = Clock::now();
    set(0, static_cast<std::uint64_t>(i));
    wait(1, static_cast<std::uint64_t>(i));
    samples.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count() / 2);
  }
  other.join();
  std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
  return samples[samples.size() / 2];
}

void bench_signals() {
  const int rounds = g_quick ? 20000 : 200000;
  auto& dev = dynamic_cast<cpu::CpuHCQDevice&>(Device["LLVM"]);
  Signal s[2] = {dev.alloc_signal(0), dev.alloc_signal(0)};
  const double lib = ping_pong_p50_ns([&](int w, std::uint64_t v) { s[w].set(v); },
                                      [&](int w, std::uint64_t v) { s[w].wait(v); }, rounds);
  std::atomic<std::uint64_t> raw[2] = {0, 0};
  const double base = ping_pong_p50_ns([&](int w, std::uint64_t v) { raw[w].store(v, std::memory_order_release); },
                                       [&](int w, std::uint64_t v) {
                                         while (raw[w].load(std::memory_order_acquire) < v) detail::cpu_relax();
                                       },
                                       rounds);
  row("cross-thread signal -> wake latency, p50 (vs a waiter that only spins)", fmt_ns(lib), fmt_ns(base),
      fmt::format("{:.2f}x", lib / base), "<= 1.5x", lib <= 1.5 * base);
  // The raw spinner above never sleeps (it burns its core for as long as it waits); a waiter that
  // sleeps in a futex at once is the other honest baseline: it costs nothing while it waits.
  std::atomic<std::uint32_t> word[2] = {0, 0};
  const double sleeper = ping_pong_p50_ns(
      [&](int w, std::uint64_t v) {
        word[w].store(static_cast<std::uint32_t>(v), std::memory_order_release);
        bench::futex_wake(word[w]);
      },
      [&](int w, std::uint64_t v) {
        for (std::uint32_t seen; (seen = word[w].load(std::memory_order_acquire)) < v;) bench::futex_wait(word[w], seen);
      },
      rounds);
  row("  same, vs a waiter that sleeps in a futex at once", fmt_ns(lib), fmt_ns(sleeper),
      fmt::format("{:.2f}x", lib / sleeper), "<= 1x", lib <= sleeper);
  dev.free_signal(s[0]);
  dev.free_signal(s[1]);
}

void bench_staging() {
  auto& dev = dynamic_cast<cpu::CpuHCQDevice&>(Device["LLVM"]);
  const std::size_t bytes = 64u << 20;
  std::vector<std::byte> host(bytes, std::byte{3}), dst(bytes, std::byte{1});
  Buffer buf("LLVM", bytes, dtypes::uint8);
  buf.allocate().copyin(host);
  const double base = ns_per_op([&] { std::memcpy(dst.data(), host.data(), bytes); keep(dst); }, 1, 9);
  dev.cpu_allocator().set_force_staging(true);
  const double ring = ns_per_op([&] { buf.copyin(host); dev.synchronize(); }, 1, 9);
  dev.cpu_allocator().set_force_staging(false);
  const double direct = ns_per_op([&] { buf.copyin(host); }, 1, 9);
  // The ring uses two threads (the caller fills it, the copy worker drains it): the fair baseline
  // is memcpy on two threads too, each copying half.
  const double two_threads = ns_per_op([&] {
    std::thread other([&] { std::memcpy(dst.data() + bytes / 2, host.data() + bytes / 2, bytes / 2); });
    std::memcpy(dst.data(), host.data(), bytes / 2);
    other.join();
    keep(dst);
  }, 1, 9);
  const double gib = 64.0 / 1024;
  auto gbs = [&](double ns) { return fmt::format("{:.1f} GiB/s", gib / (ns / 1e9)); };
  row("staging-ring copyin 64 MiB (through the ring, to completion)", gbs(ring), gbs(base),
      fmt::format("{:.2f}x", base / ring), ">= 0.8x", base / ring >= 0.8);
  row("  same, vs memcpy split over two threads (the ring's two)", gbs(ring), gbs(two_threads),
      fmt::format("{:.2f}x", two_threads / ring), ">= 0.8x", two_threads / ring >= 0.8);
  row("copyin 64 MiB on an idle CPU device (direct)", gbs(direct), gbs(base), fmt::format("{:.2f}x", base / direct),
      ">= 0.9x", base / direct >= 0.9);
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown cpu";
}

// Prints "<hit + load ns> <device open ns>": the bare cache hit, and what opening the device
// before it cost (a new process pays both).
int child_cache_hit(const std::string& device) {
  const auto opened = Clock::now();
  Compiled& dev = Device[device];
  const double open_ns = std::chrono::duration<double, std::nano>(Clock::now() - opened).count();
  const std::uint64_t hits_before = DiskCache::global().stats().disk_hits;  // CLANG's open may hit too
  const std::string src = kernels::add_f32(dev.source_language(), "add");
  const auto start = Clock::now();
  Blob blob = dev.compiler().compile_cached(src);
  auto prg = dev.runtime().load("add", blob);
  const double ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
  if (DiskCache::global().stats().disk_hits != hits_before + 1) return 3;  // it must have come from the disk
  std::printf("%.0f %.0f\n", ns, open_ns);
  return 0;
}

}  // namespace

// Percentile of samples (nanoseconds).
double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

// The compile cache's size bound with 100,000 entries in the folder: the mean cost of a write once
// the folder is over its bound (a rescan and its evictions amortized over one eviction cycle,
// entries/4 writes) against a write under the bound, in the same folder and process. This VM's
// disk latency drifts by 10x over seconds, so the two regimes alternate in rounds and the totals
// are compared. p99 and the worst write are printed too: a rescan is a spike.
void bench_cache_bound() {
  const std::size_t entries = g_quick ? 20000 : 100000;
  const int rounds = g_quick ? 1 : 3;
  char templ[] = "/tmp/tinydev-bench-cache-XXXXXX";
  if (!::mkdtemp(templ)) throw Error("cannot make a temporary folder");
  const std::string dir = templ;
  ScopedOverride folder("TINYDEV_CACHE_DIR", dir);
  DiskCache& cache = DiskCache::global();
  const Blob blob(160, std::byte{0x5a});
  std::uint64_t next = 0;
  auto write = [&] { cache.put("bench", "bench 1", fmt::format("source {}", next++), blob); };
  std::optional<ScopedOverride> bound;
  bound.emplace("TINYDEV_CACHE_MAX_BYTES", "64G");
  for (std::size_t i = 0; i < entries; ++i) write();
  auto folder_bytes = [&] {
    std::uint64_t bytes = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) bytes += e.file_size();
    return bytes;
  };
  const std::size_t cycle = entries / 4;  // writes between two rescans past the bound
  std::vector<double> under, over;
  auto timed = [&](std::vector<double>& out) {
    for (std::size_t i = 0; i < cycle; ++i) {
      const auto t = Clock::now();
      write();
      out.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t).count());
    }
  };
  write();  // this process's first write scans the folder once, in either regime
  const auto scans_before = cache.stats().scans;
  for (int r = 0; r < rounds; ++r) {
    bound.emplace("TINYDEV_CACHE_MAX_BYTES", "64G");
    timed(under);
    // Bound the folder at its size now (about `entries` files): the next write rescans and evicts.
    bound.emplace("TINYDEV_CACHE_MAX_BYTES", std::to_string(folder_bytes()));
    timed(over);
  }
  const auto scans = cache.stats().scans - scans_before;
  auto sum = [](const std::vector<double>& v) { double s = 0; for (double x : v) s += x; return s; };
  const double lib = sum(over) / over.size(), base = sum(under) / under.size();
  row(fmt::format("cache write over its bound, {}k entries (mean)", entries / 1000), fmt_ns(lib), fmt_ns(base),
      fmt::format("{:.2f}x", lib / base), "<= 2x a write under it", lib <= 2 * base);
  fmt::print("    ({} writes each, {} rescans; p50 {} vs {}, p99 {} vs {}, worst {} vs {})\n", over.size(), scans,
             fmt_ns(percentile(over, 0.5)), fmt_ns(percentile(under, 0.5)), fmt_ns(percentile(over, 0.99)),
             fmt_ns(percentile(under, 0.99)), fmt_ns(percentile(over, 1.0)), fmt_ns(percentile(under, 1.0)));
  bound.reset();
  std::filesystem::remove_all(dir);
}

// A hostile file at an entry's path (FIFO, folder, symlink, 1 TiB sparse file, another user's
// entry) must be a miss as fast as no file at all.
void bench_hostile_entries() {
  char templ[] = "/tmp/tinydev-bench-hostile-XXXXXX";
  if (!::mkdtemp(templ)) throw Error("cannot make a temporary folder");
  const std::string dir = templ;
  ScopedOverride folder("TINYDEV_CACHE_DIR", dir);
  DiskCache& cache = DiskCache::global();
  auto miss_ns = [&](const std::string& source) {
    std::vector<double> samples;
    for (int i = 0; i < 200; ++i) {
      const auto t = Clock::now();
      auto got = cache.get("bench", "bench 1", source);
      samples.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t).count());
      if (got) throw Error("a hostile entry was a hit");
    }
    return percentile(samples, 0.5);
  };
  const double base = miss_ns("absent");
  auto path = [&](const std::string& source) { return cache.entry_path("bench", "bench 1", source); };
  ::mkfifo(path("fifo").c_str(), 0600);
  ::mkdir(path("folder").c_str(), 0700);
  std::ofstream(dir + "/target") << "x";
  ::symlink((dir + "/target").c_str(), path("symlink").c_str());
  const int fd = ::open(path("sparse").c_str(), O_WRONLY | O_CREAT, 0600);
  const bool sparse = fd >= 0 && ::ftruncate(fd, off_t{1} << 40) == 0;
  if (fd >= 0) ::close(fd);
  std::ofstream(path("other-user")) << "x";
  const bool chowned = ::geteuid() == 0 && ::chown(path("other-user").c_str(), 4242, 4242) == 0;
  std::vector<std::pair<std::string, std::string>> kinds = {{"a FIFO", "fifo"}, {"a folder", "folder"}, {"a symlink", "symlink"}};
  if (sparse) kinds.emplace_back("a 1 TiB sparse file", "sparse");
  if (chowned) kinds.emplace_back("another user's file", "other-user");
  for (const auto& [what, source] : kinds) {
    const double lib = miss_ns(source);
    row(fmt::format("cache miss, entry is {}, p50", what), fmt_ns(lib), fmt_ns(base), fmt::format("{:.2f}x", lib / base),
        "< 10 ms (no file: baseline)", lib < 10e6);
  }
  std::filesystem::remove_all(dir);
}

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() >= 2 && args.back() == "--quick") {
      g_quick = true;
      args.pop_back();
    }
    // The child processes some rows run (bench::run_child).
    if (args.size() == 2 && args[0] == "--child-cache-hit") return child_cache_hit(args[1]);
    if (args.size() == 2 && args[0] == "--child-handoff") return bench::child_handoff(args[1]);
    if (args.size() == 2 && args[0] == "--child-open") return bench::child_open(args[1]);
    std::string only;
    if (args.size() >= 2 && args[args.size() - 2] == "--only") {
      only = args.back();
      args.resize(args.size() - 2);
    }
    if (!args.empty() && args[0] == "--quick") g_quick = true;
    else if (!args.empty()) {
      std::fprintf(stderr, "usage: tinydev_bench [--quick] [--only SECTION[,SECTION...]]\n");
      return 2;
    }
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
    struct utsname u {};
    ::uname(&u);
    fmt::print("tinydev {} benchmarks on {} ({} cores), {} {}\n", kVersionString, cpu_model(),
               std::thread::hardware_concurrency(), u.sysname, u.release);
    fmt::print("  {:<50} {:>12} {:>12} {:>14}  target\n", "what", "tinydev", "baseline", "ratio");
    // --only NAME[,NAME...] runs those sections (for working on one row); the table is all of them.
    const std::vector<std::pair<std::string, std::function<void()>>> sections{
        {"lru", bench_lru},
        {"copies", bench_copies},
        {"calls", bench_calls},
        {"compile", [&] { bench_compile(exe); }},
        {"add", bench_add_kernel},
        {"hcq", bench_hcq},
        {"signals", bench_signals},
        {"staging", bench_staging},
        {"cache_bound", bench_cache_bound},
        {"hostile", bench_hostile_entries},
        {"cpu_speed", [&] { bench::bench_cpu_speed(row, exe); }},
        {"serving", [&] { bench::bench_serving(row); }},
        {"disk", [&] { bench::bench_disk(row); }},
        {"embedding", [&] { bench::bench_embedding(row); }}};
    for (const auto& [name, run] : sections)
      if (only.empty() || ("," + only + ",").find("," + name + ",") != std::string::npos) run();
    int missed = 0;
    for (const Row& r : g_rows) missed += !r.met;
    fmt::print("{} of {} targets met\n", g_rows.size() - missed, g_rows.size());
    return 0;  // speed is reported, never asserted
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tinydev_bench: %s\n", e.what());
    return 1;
  }
}
