// bench/bench_cpu_speed.cpp: what a user of the CPU devices feels (issue "CPU speed users feel"):
// generator-style kernels against clang -O2 of the same source called directly, the hand-off of
// one command (latency p50/p99, idle and with every thread on one core) against a futex
// ping-pong, graph replays with changed inputs against unchanged ones, a small request through a
// graph against the same calls made eagerly, pipelined resubmission against submit + wait, and
// opening the CLANG device in a new process against opening LLVM. Each row says what it measures.
#include <dlfcn.h>
#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "bench_support.hpp"
#include "corpus.hpp"
#include "cpu_hcq.hpp"
#include "cpu_program.hpp"
#include "demo_kernels.hpp"
#include "tinydev/hcq.hpp"
#include "tinydev/tinydev.hpp"

namespace tinydev::bench {

namespace {

using Clock = std::chrono::steady_clock;

double since_ns(Clock::time_point start) {
  return std::chrono::duration<double, std::nano>(Clock::now() - start).count();
}

// ---- kernels against clang -O2 of the same source -------------------------------------------------

// A shared object clang-19 made of `source`, dlopen'ed: the baseline "called directly".
class ClangSharedObject {
 public:
  ClangSharedObject(const std::string& source, bool ir) {
    dir_ = std::filesystem::temp_directory_path() / fmt::format("tinydev-bench-{}-{}", ::getpid(), counter_++);
    std::filesystem::create_directories(dir_);
    const auto src = dir_ / (ir ? "k.ll" : "k.c");
    std::ofstream(src) << source;
    const auto so = dir_ / "k.so";
    const std::string cmd = fmt::format("clang-19 -O2 -march=native -fPIC -shared {} -x {} '{}' -o '{}' 2>&1",
                                        ir ? "" : "-ffreestanding -fno-math-errno", ir ? "ir" : "c", src.string(),
                                        so.string());
    if (std::system(cmd.c_str()) != 0) throw Error(fmt::format("bench: `{}` failed", cmd));
    handle_ = ::dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle_) throw Error(fmt::format("bench: dlopen {}: {}", so.string(), ::dlerror()));
  }
  ~ClangSharedObject() {
    if (handle_) ::dlclose(handle_);
    std::filesystem::remove_all(dir_);
  }
  void* symbol(const std::string& name) const {
    void* f = ::dlsym(handle_, name.c_str());
    if (!f) throw Error(fmt::format("bench: no symbol {} in clang's object", name));
    return f;
  }

 private:
  static inline int counter_ = 0;
  std::filesystem::path dir_;
  void* handle_ = nullptr;
};

// Calls a kernel with the kernel ABI (Note [CPU grid ABI]): every argument as a 64-bit word.
void call_words(void* fn, const std::vector<std::uint64_t>& a) {
  using W = std::uint64_t;
  switch (a.size()) {
    case 1: reinterpret_cast<void (*)(W)>(fn)(a[0]); break;
    case 2: reinterpret_cast<void (*)(W, W)>(fn)(a[0], a[1]); break;
    case 3: reinterpret_cast<void (*)(W, W, W)>(fn)(a[0], a[1], a[2]); break;
    case 4: reinterpret_cast<void (*)(W, W, W, W)>(fn)(a[0], a[1], a[2], a[3]); break;
    case 5: reinterpret_cast<void (*)(W, W, W, W, W)>(fn)(a[0], a[1], a[2], a[3], a[4]); break;
    case 6: reinterpret_cast<void (*)(W, W, W, W, W, W)>(fn)(a[0], a[1], a[2], a[3], a[4], a[5]); break;
    case 7: reinterpret_cast<void (*)(W, W, W, W, W, W, W)>(fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6]); break;
    case 8: reinterpret_cast<void (*)(W, W, W, W, W, W, W, W)>(fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]); break;
    default: throw Error(fmt::format("bench: {} kernel arguments", a.size()));
  }
}

void bench_corpus_kernel(const RowFn& row, const corpus::Kernel& k, const char* device, bool ir) {
  Compiled& dev = Device[device];
  std::mt19937_64 rng(0xbe4c4);
  auto host = corpus::random_buffers(k, rng);
  std::vector<Buffer> bufs;
  std::vector<Allocation> allocs;
  for (std::size_t i = 0; i < k.buffers.size(); ++i) {
    auto& b = bufs.emplace_back(device, host[i].size(), dtypes::uint8);
    b.allocate().copyin(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(host[i].data()), host[i].size()));
    allocs.push_back(b.allocation());
  }
  auto prg = dev.load_kernel(k.name, ir ? k.ir_source : k.c_source);
  const LaunchParams launch{.global = {k.grid, 1, 1}};
  ClangSharedObject so(ir ? k.ir_source : k.c_source, ir);
  void* fn = so.symbol(k.name);
  std::vector<std::uint64_t> words;
  for (const Allocation& a : allocs) words.push_back(a.va_addr);
  for (std::int32_t v : k.values) words.push_back(static_cast<std::uint32_t>(v));
  if (k.grid > 1) words.push_back(0);
  // The device runs a grid on the thread pool; the direct baseline calls every index in turn on
  // one thread, so grid kernels would flatter the device: the rows use grid-1 kernels only.
  auto device_call = [&] { (*prg)(allocs, k.values, launch); };
  auto direct_call = [&] {
    for (std::uint32_t i = 0; i < k.grid; ++i) {
      if (k.grid > 1) words.back() = i;
      call_words(fn, words);
    }
  };
  // Batches of about 2 ms, the two interleaved, so drift in the machine's speed (another VM, the
  // clock) lands on both; the medians are compared.
  device_call();
  direct_call();
  auto start = Clock::now();
  direct_call();
  const double once = std::max(1.0, since_ns(start));
  const int reps = std::max(1, static_cast<int>(2e6 / once));
  std::vector<double> lib_samples, base_samples;
  for (int round = 0; round < (g_quick ? 7 : 31); ++round) {
    start = Clock::now();
    for (int r = 0; r < reps; ++r) device_call();
    lib_samples.push_back(since_ns(start) / reps);
    start = Clock::now();
    for (int r = 0; r < reps; ++r) direct_call();
    base_samples.push_back(since_ns(start) / reps);
  }
  const double lib = percentiles(lib_samples).p50, base = percentiles(base_samples).p50;
  row(fmt::format("{} ({}, {}) vs clang-19 -O2 -march=native", k.name, device, ir ? "IR" : "C"), fmt_ns(lib),
      fmt_ns(base), fmt::format("{:.2f}x", base / lib), ">= 0.95x (speed)", base / lib >= 0.95);
}

void bench_kernels(const RowFn& row) {
  for (const char* name : {"matmul_64", "matmul_256", "matmul_512", "conv2d"}) {
    const auto& all = corpus::kernels();
    auto it = std::find_if(all.begin(), all.end(), [&](const corpus::Kernel& k) { return k.name == name; });
    if (it == all.end()) throw Error(fmt::format("bench: the corpus has no kernel {}", name));
    if (g_quick && std::string_view(name) == "matmul_512") continue;
    bench_corpus_kernel(row, *it, "LLVM", true);
    bench_corpus_kernel(row, *it, "CLANG", false);
  }
}

// ---- hand-off of one command ----------------------------------------------------------------------

// Round trip of an atomic store + futex wake answered the same way by another thread, which
// sleeps in the futex (never spins): the cheapest honest hand-off between two threads.
Percentiles futex_ping_pong(int rounds) {
  std::atomic<std::uint32_t> ping{0}, pong{0};
  std::thread other([&] {
    for (std::uint32_t i = 1; i <= static_cast<std::uint32_t>(rounds); ++i) {
      while (ping.load(std::memory_order_acquire) < i) futex_wait(ping, i - 1);
      pong.store(i, std::memory_order_release);
      futex_wake(pong);
    }
  });
  std::vector<double> samples;
  for (std::uint32_t i = 1; i <= static_cast<std::uint32_t>(rounds); ++i) {
    const auto start = Clock::now();
    ping.store(i, std::memory_order_release);
    futex_wake(ping);
    while (pong.load(std::memory_order_acquire) < i) futex_wait(pong, i - 1);
    samples.push_back(since_ns(start));
  }
  other.join();
  return percentiles(samples);
}

// Submit + wait of one small exec on an LLVM device: record (wait, exec, signal), submit, wait
// for the timeline. Submit to completion, as a caller sees it.
Percentiles submit_and_wait(int rounds) {
  auto& dev = dynamic_cast<cpu::CpuHCQDevice&>(Device["LLVM"]);
  auto prg = dev.load_kernel("add", kernels::add_f32(SourceLanguage::LLVMIR));
  constexpr std::int32_t n = 16;
  Buffer a("LLVM", n, dtypes::float32), b("LLVM", n, dtypes::float32), o("LLVM", n, dtypes::float32);
  std::vector<float> init(n, 1.25f);
  a.allocate().copyin(std::span<const float>(init));
  b.allocate().copyin(std::span<const float>(init));
  o.allocate();
  const Allocation bufs[] = {o.allocation(), a.allocation(), b.allocation()};
  const std::int32_t vals[] = {n};
  const auto& program = dynamic_cast<const cpu::CpuProgram&>(*prg);
  std::vector<double> samples;
  for (int i = 0; i < rounds + 100; ++i) {
    const auto start = Clock::now();
    std::uint64_t v;
    {
      std::lock_guard lock(dev.submit_mutex());
      Kernargs args = dev.alloc_kernargs(3, 1);
      fill_kernargs(*prg, args, bufs, vals);
      v = dev.next_timeline_value();
      dev.compute_queue().wait(dev.timeline_signal(), v - 1).exec(program, args, {1, 1, 1}, {1, 1, 1})
          .signal(dev.timeline_signal(), v).submit(dev);
    }
    dev.wait_timeline(v);
    if (i >= 100) samples.push_back(since_ns(start));  // the first 100 warm up
  }
  return percentiles(samples);
}

}  // namespace

// The child process of the hand-off rows: pins itself to CPU 0 first when asked (every thread it
// starts inherits that), then prints "lib_p50 lib_p99 base_p50 base_p99" in ns.
int child_handoff(const std::string& mode) {
  if (mode == "pinned") {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(0, &one);
    if (::sched_setaffinity(0, sizeof one, &one) != 0) return 3;
  }
  const int rounds = g_quick ? 2000 : 20000;
  const Percentiles base = futex_ping_pong(rounds);
  const Percentiles lib = submit_and_wait(rounds);
  std::printf("%.1f %.1f %.1f %.1f\n", lib.p50, lib.p99, base.p50, base.p99);
  return 0;
}

// The child process of the device-open row: prints the ns Device[name] took in a fresh process.
int child_open(const std::string& name) {
  const auto start = Clock::now();
  Compiled& dev = Device[name];
  const double ns = since_ns(start);
  (void)dev;
  std::printf("%.1f\n", ns);
  return 0;
}

namespace {

void bench_handoff(const RowFn& row, const std::string& exe) {
  for (const char* mode : {"pinned", "idle"}) {
    const auto f = run_child(exe, fmt::format("--child-handoff {}", mode));
    if (f.size() != 4) throw Error("bench: the hand-off child printed something else");
    const bool pinned = std::string_view(mode) == "pinned";
    const double ratio = f[0] / f[2];
    row(fmt::format("submit+wait of 1 exec, {}, p50 (p99)", pinned ? "all threads on 1 core" : "idle machine"),
        fmt::format("{} ({})", fmt_ns(f[0]), fmt_ns(f[1])), fmt::format("{} ({})", fmt_ns(f[2]), fmt_ns(f[3])),
        fmt::format("{:.2f}x", ratio), pinned ? "p50 <= 2x and <= 5 us (latency)" : "p50 <= 1.5x (latency)",
        pinned ? ratio <= 2 && f[0] <= 5000 : ratio <= 1.5);
  }
}

// ---- graphs ----------------------------------------------------------------------------------------

void bench_graph_inputs(const RowFn& row) {
  auto& dev = dynamic_cast<cpu::CpuHCQDevice&>(Device["LLVM"]);
  auto prg = dev.load_kernel("add", kernels::add_f32(SourceLanguage::LLVMIR));
  constexpr std::int32_t n = 16;
  std::vector<Buffer> bufs;
  for (int i = 0; i < 5; ++i) bufs.emplace_back("LLVM", n, dtypes::float32).allocate();
  for (std::size_t nodes : {std::size_t{100}, std::size_t{1000}}) {
    std::vector<GraphNode> graph_nodes;
    for (std::size_t i = 0; i < nodes; ++i)
      graph_nodes.push_back(GraphKernel{prg, {GraphBuffer::in(0), GraphBuffer::in(1), GraphBuffer::in(2)}, {GraphValue::of(n)}});
    auto graph = dev.create_graph(graph_nodes);
    const Allocation same[] = {bufs[0].allocation(), bufs[1].allocation(), bufs[2].allocation()};
    const Allocation other[] = {bufs[3].allocation(), bufs[1].allocation(), bufs[4].allocation()};
    const int reps = (g_quick ? 20000 : 100000) / static_cast<int>(nodes);
    const double unchanged = ns_per_op([&] {
      for (int r = 0; r < reps; ++r) graph->replay(same);
      dev.synchronize();
    }, 1, 9) / (reps * nodes);
    const double changed = ns_per_op([&] {
      for (int r = 0; r < reps; ++r) graph->replay(r % 2 ? other : same);
      dev.synchronize();
    }, 1, 9) / (reps * nodes);
    row(fmt::format("graph replay, {} nodes, inputs changed every replay, per node", nodes), fmt_ns(changed),
        fmt_ns(unchanged), fmt::format("{:.2f}x", changed / unchanged), "<= 1.5x (throughput)", changed <= 1.5 * unchanged);
  }
}

// y = W2 relu(W1 x): two matrix-vector kernels, reductions vectorizable (reassoc).
std::string matvec_ir(const char* name, bool relu) {
  return fmt::format(R"(define void @{0}(ptr noalias %y, ptr noalias %w, ptr noalias %x, i32 %n) {{
entry:
  %any = icmp sgt i32 %n, 0
  br i1 %any, label %outer, label %done
outer:
  %i = phi i32 [ 0, %entry ], [ %i.next, %row.end ]
  %row = mul i32 %i, %n
  br label %inner
inner:
  %j = phi i32 [ 0, %outer ], [ %j.next, %inner ]
  %acc = phi float [ 0.0, %outer ], [ %acc.next, %inner ]
  %wi = add i32 %row, %j
  %wi64 = sext i32 %wi to i64
  %wp = getelementptr inbounds float, ptr %w, i64 %wi64
  %wv = load float, ptr %wp, align 4
  %j64 = sext i32 %j to i64
  %xp = getelementptr inbounds float, ptr %x, i64 %j64
  %xv = load float, ptr %xp, align 4
  %m = fmul reassoc nsz contract float %wv, %xv
  %acc.next = fadd reassoc nsz contract float %acc, %m
  %j.next = add nsw i32 %j, 1
  %j.done = icmp eq i32 %j.next, %n
  br i1 %j.done, label %row.end, label %inner
row.end:
  %r = {1}
  %i64 = sext i32 %i to i64
  %yp = getelementptr inbounds float, ptr %y, i64 %i64
  store float %r, ptr %yp, align 4
  %i.next = add nsw i32 %i, 1
  %i.done = icmp eq i32 %i.next, %n
  br i1 %i.done, label %done, label %outer
done:
  ret void
}}
declare float @llvm.maxnum.f32(float, float)
)",
                     name, relu ? "call float @llvm.maxnum.f32(float %acc.next, float 0.0)" : "fadd float %acc.next, 0.0");
}

void bench_request(const RowFn& row) {
  auto& dev = dynamic_cast<cpu::CpuHCQDevice&>(Device["LLVM"]);
  auto layer1 = dev.load_kernel("layer1", matvec_ir("layer1", true));
  auto layer2 = dev.load_kernel("layer2", matvec_ir("layer2", false));
  for (std::int32_t width : {64, 1024}) {
    const std::size_t n = static_cast<std::size_t>(width), bytes = n * 4;
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> dist(-1, 1);
    std::vector<float> w(n * n), x(n);
    Buffer w1("LLVM", n * n, dtypes::float32), w2("LLVM", n * n, dtypes::float32);
    Buffer xd("LLVM", n, dtypes::float32), hd("LLVM", n, dtypes::float32), yd("LLVM", n, dtypes::float32);
    Buffer request("LLVM", n, dtypes::float32), answer("LLVM", n, dtypes::float32);
    for (Buffer* b : {&w1, &w2}) {
      for (float& v : w) v = dist(rng);
      b->allocate().copyin(std::span<const float>(w));
    }
    for (float& v : x) v = dist(rng);
    for (Buffer* b : {&xd, &hd, &yd, &answer}) b->allocate();
    request.allocate().copyin(std::span<const float>(x));
    // Graph: copy the request in, two kernels, copy the answer out.
    std::vector<GraphNode> nodes{
        GraphCopy{GraphBuffer::of(xd.allocation()), GraphBuffer::in(0), bytes},
        GraphKernel{layer1, {GraphBuffer::of(hd.allocation()), GraphBuffer::of(w1.allocation()), GraphBuffer::of(xd.allocation())}, {GraphValue::of(width)}},
        GraphKernel{layer2, {GraphBuffer::of(yd.allocation()), GraphBuffer::of(w2.allocation()), GraphBuffer::of(hd.allocation())}, {GraphValue::of(width)}},
        GraphCopy{GraphBuffer::in(1), GraphBuffer::of(yd.allocation()), bytes}};
    auto graph = dev.create_graph(nodes);
    const Allocation inputs[] = {request.allocation(), answer.allocation()};
    // Eager: the same four steps as calls.
    const Allocation args1[] = {hd.allocation(), w1.allocation(), xd.allocation()};
    const Allocation args2[] = {yd.allocation(), w2.allocation(), hd.allocation()};
    const std::int32_t vals[] = {width};
    float* request_host = request.allocation().host_ptr<float>();
    float* answer_host = answer.allocation().host_ptr<float>();
    auto eager = [&] {
      xd.copyin(std::span<const float>(request_host, n));
      (*layer1)(args1, vals);
      (*layer2)(args2, vals);
      yd.copyout(std::span<float>(answer_host, n));
    };
    const int rounds = width == 64 ? (g_quick ? 2000 : 20000) : (g_quick ? 200 : 1000);
    std::vector<double> g, e;
    for (int i = 0; i < rounds + 20; ++i) {
      auto start = Clock::now();
      graph->replay(inputs, {}, true);
      if (i >= 20) g.push_back(since_ns(start));
      start = Clock::now();
      eager();
      if (i >= 20) e.push_back(since_ns(start));
    }
    const Percentiles pg = percentiles(g), pe = percentiles(e);
    row(fmt::format("request (copy in, 2 matvec kernels, copy out), {}-wide: graph vs eager, p50 (p99)", width),
        fmt::format("{} ({})", fmt_ns(pg.p50), fmt_ns(pg.p99)), fmt::format("{} ({})", fmt_ns(pe.p50), fmt_ns(pe.p99)),
        fmt::format("{:.2f}x", pg.p50 / pe.p50), "<= 1.1x (latency)", pg.p50 <= 1.1 * pe.p50);
  }
}

void bench_resubmission(const RowFn& row) {
  auto& dev = dynamic_cast<cpu::CpuHCQDevice&>(Device["LLVM"]);
  auto prg = dev.load_kernel("add", kernels::add_f32(SourceLanguage::LLVMIR));
  constexpr std::int32_t n = 16;
  Buffer a("LLVM", n, dtypes::float32), o("LLVM", n, dtypes::float32);
  a.allocate();
  o.allocate();
  const Allocation bufs[] = {o.allocation(), a.allocation(), a.allocation()};
  const std::int32_t vals[] = {n};
  auto block = dev.allocate_kernargs_block(Kernargs::bytes_for(3, 1));  // reused by every submission
  const Kernargs args{block.get(), 3, 1};
  fill_kernargs(*prg, args, bufs, vals);
  const auto& program = dynamic_cast<const cpu::CpuProgram&>(*prg);
  constexpr std::size_t kCommands = 1000;
  auto q = dev.compute_queue();
  q.wait(dev.timeline_signal(), 0);
  for (std::size_t i = 0; i < kCommands; ++i) q.exec(program, args, {1, 1, 1}, {1, 1, 1});
  q.signal(dev.timeline_signal(), 0);
  auto submit = [&] {
    std::lock_guard lock(dev.submit_mutex());
    const std::uint64_t v = dev.next_timeline_value();
    q.update_wait(0, dev.timeline_signal(), v - 1).update_signal(kCommands + 1, dev.timeline_signal(), v).submit(dev);
    return v;
  };
  const int reps = g_quick ? 50 : 300;
  const double pipelined = ns_per_op([&] {
    for (int r = 0; r < reps; ++r) submit();
    dev.synchronize();
  }, 1, 9) / (reps * kCommands);
  const double waited = ns_per_op([&] {
    for (int r = 0; r < reps; ++r) dev.wait_timeline(submit());
  }, 1, 9) / (reps * kCommands);
  row("pipelined resubmission of a 1,000-command queue, per command", fmt_ns(pipelined), fmt_ns(waited),
      fmt::format("{:.2f}x", pipelined / waited), "<= 1x (throughput)", pipelined <= waited);
}

void bench_device_open(const RowFn& row, const std::string& exe) {
  // The first CLANG open learns clang's version (Note [clang's identity, cached]); the row is the
  // steady state of a new process, the figure a server restart sees.
  run_child(exe, "--child-open CLANG");
  std::vector<double> clang, llvm;
  for (int i = 0; i < (g_quick ? 3 : 9); ++i) {
    clang.push_back(run_child(exe, "--child-open CLANG").at(0));
    llvm.push_back(run_child(exe, "--child-open LLVM").at(0));
  }
  const double c = percentiles(clang).p50, l = percentiles(llvm).p50;
  row("CLANG device open, new process (vs LLVM open)", fmt_ns(c), fmt_ns(l), fmt::format("{:.2f}x", c / l),
      "<= 2x (latency)", c <= 2 * l);
}

}  // namespace

void bench_cpu_speed(const RowFn& row, const std::string& exe) {
  bench_kernels(row);
  bench_handoff(row, exe);
  bench_graph_inputs(row);
  bench_request(row);
  bench_resubmission(row);
  bench_device_open(row, exe);
}

}  // namespace tinydev::bench
