// bench/bench_serving.cpp: the serving rows (docs/serving.md): streams against the idle device,
// one client, a bare queue and direct calls, measured in the same run.
#include <fmt/format.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "bench_support.hpp"
#include "cpu_hcq.hpp"
#include "demo_kernels.hpp"
#include "tinydev/tinydev.hpp"

namespace tinydev::bench {

namespace {

using Clock = std::chrono::steady_clock;

double us_since(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// busy(out, iters): a dependent chain of `iters` float operations through memory the compiler
// must keep (volatile): compute-bound work of a length we choose, on one core.
std::string busy_kernel_ir() {
  return "define void @busy(ptr %out, i32 %n) {\n"
         "entry:\n  %empty = icmp sle i32 %n, 0\n  br i1 %empty, label %exit, label %loop\n"
         "loop:\n  %i = phi i32 [ 0, %entry ], [ %next, %loop ]\n"
         "  %v = load volatile float, ptr %out\n  %m = fmul float %v, 0x3FEFFFFFE0000000\n"
         "  %a = fadd float %m, 1.000000e+00\n  store volatile float %a, ptr %out\n"
         "  %next = add nuw nsw i32 %i, 1\n  %done = icmp eq i32 %next, %n\n"
         "  br i1 %done, label %exit, label %loop\nexit:\n  ret void\n}\n";
}

struct ServingSetup {
  cpu::CpuHCQDevice& dev = dynamic_cast<cpu::CpuHCQDevice&>(Device["LLVM"]);
  std::shared_ptr<Program> busy = dev.load_kernel("busy", busy_kernel_ir());
  std::shared_ptr<Program> add = dev.load_kernel("add", kernels::add_f32(SourceLanguage::LLVMIR));
  // Iterations of busy() per millisecond, measured by a direct call.
  std::int32_t iters_per_ms = 0;

  ServingSetup() {
    Buffer scratch(dev.name(), 1, dtypes::float32);
    scratch.allocate();
    const Allocation args[] = {scratch.allocation()};
    const std::int32_t n[] = {200000};
    (*busy)(args, n);  // warm
    const auto start = Clock::now();
    (*busy)(args, n);
    iters_per_ms = static_cast<std::int32_t>(200000 / (us_since(start) / 1000.0));
  }
};

}  // namespace

void bench_serving(const RowFn& row) {
  ServingSetup s;
  auto& dev = s.dev;
  const int samples = g_quick ? 60 : 300;

  // 1. A 4-byte copyout on stream B while stream A runs a 50 ms graph (5 nodes of 10 ms), against
  // the same copyout on an idle device.
  {
    auto stream_a = dev.create_stream(), stream_b = dev.create_stream();
    Buffer scratch_a(dev.name(), 1, dtypes::float32), small(dev.name(), 1, dtypes::float32);
    scratch_a.allocate();
    small.allocate();
    std::vector<GraphNode> nodes;
    for (int i = 0; i < 5; ++i)
      nodes.push_back(GraphKernel{s.busy, {GraphBuffer::in(0)}, {GraphValue::of(10 * s.iters_per_ms)}});
    auto graph = stream_a->create_graph(nodes);
    float out = 0;
    auto copyout = [&] {
      const auto start = Clock::now();
      stream_b->copyout(std::as_writable_bytes(std::span(&out, 1)), small).wait();
      return us_since(start);
    };
    std::vector<double> idle, busy_samples;
    // Both sample sets are taken 200 us apart (a thread waking from a sleep, as a server's does).
    for (int i = 0; i < samples; ++i) {
      idle.push_back(copyout());
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    const Buffer inputs[] = {scratch_a};
    Event a_done = stream_a->replay(*graph, inputs);
    const auto graph_start = Clock::now();
    double graph_ms = 0;
    int graphs = 1;
    while (static_cast<int>(busy_samples.size()) < samples) {
      if (a_done.query()) {
        graph_ms = std::chrono::duration<double, std::milli>(Clock::now() - graph_start).count() / graphs;
        a_done = stream_a->replay(*graph, inputs);
        graphs += 1;
      }
      busy_samples.push_back(copyout());
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // spread the samples over the graph
    }
    stream_a->synchronize();
    const Percentiles b = percentiles(busy_samples), i = percentiles(idle);
    row(fmt::format("4-byte copyout on stream B during a 50 ms graph on A (graph {:.0f} ms), p50 (p99)",
                    graph_ms > 0 ? graph_ms : 50.0),
        fmt::format("{:.1f} ({:.1f}) us", b.p50, b.p99), fmt::format("{:.1f} ({:.1f}) us", i.p50, i.p99),
        fmt::format("{:.2f}x ({:.2f}x)", b.p50 / i.p50, b.p99 / i.p99), "p50 <= 2x the idle device", b.p50 <= 2 * i.p50);
  }

  // 2. Two clients, compute-bound requests (a 2 ms kernel), each on its own stream, against one.
  {
    const int requests = g_quick ? 20 : 60;
    auto client = [&](Stream& stream, Buffer& scratch) {
      const Buffer args[] = {scratch};
      const std::vector<std::int32_t> n = {2 * s.iters_per_ms};
      float in = 1.0f, out = 0;
      for (int r = 0; r < requests; ++r) {
        stream.copyin(scratch, std::as_bytes(std::span(&in, 1)));
        stream.launch(s.busy, args, n);
        stream.copyout(std::as_writable_bytes(std::span(&out, 1)), scratch).wait();
      }
    };
    auto throughput = [&](int clients) {
      std::vector<std::shared_ptr<Stream>> streams;
      std::vector<Buffer> scratch;
      for (int c = 0; c < clients; ++c) {
        streams.push_back(dev.create_stream());
        scratch.emplace_back(dev.name(), 1, dtypes::float32).allocate();
      }
      const auto start = Clock::now();
      std::vector<std::thread> threads;
      for (int c = 0; c < clients; ++c) threads.emplace_back([&, c] { client(*streams[c], scratch[c]); });
      for (std::thread& t : threads) t.join();
      return clients * requests / (us_since(start) / 1e6);
    };
    throughput(1);  // warm
    const double one = throughput(1), two = throughput(2);
    row("2 clients x 2 ms requests on 2 streams vs 1 client (throughput)", fmt::format("{:.0f} req/s", two),
        fmt::format("{:.0f} req/s", one), fmt::format("{:.2f}x", two / one), ">= 1.7x", two / one >= 1.7);
  }

  // 3. Event record + wait on an idle stream, against submit + wait of an empty queue.
  {
    auto stream = dev.create_stream();
    const double lib = ns_per_op([&] { stream->record().wait(); }, 20000);
    const double base = ns_per_op([&] {
      std::uint64_t v;
      {
        auto r = dev.reserve_timeline_value();
        v = r.value();
        dev.compute_queue().wait(dev.timeline_signal(), v - 1).signal(dev.timeline_signal(), v).submit(dev);
        r.submitted();
      }
      dev.wait_timeline(v);
    }, 2000);
    row("event record + wait on an idle stream vs empty queue submit+wait", fmt_ns(lib), fmt_ns(base),
        fmt::format("{:.2f}x", lib / base), "<= 1.2x", lib <= 1.2 * base);
  }

  // 3b. Copyins into a stream held behind an event nobody has completed yet (a request queued
  // behind another's output), p50 and p99 of the call, against a memcpy of the same bytes: the
  // call returns once the bytes are read (Note [CPU stream copyin captures]); before, the fifth
  // waited for the event. The first round takes fresh memory for its captures (cold: page faults);
  // later rounds on the same stream reuse it (warm).
  {
    const std::size_t bytes = std::size_t{1} << 20;
    const int copies = g_quick ? 16 : 48;  // 48 MiB queued: within a stream's 64 MiB of captures
    std::vector<std::byte> src(bytes, std::byte{7}), dst(bytes);
    std::vector<Buffer> dests;
    for (int i = 0; i < copies; ++i) dests.emplace_back(dev.name(), bytes, dtypes::uint8), dests.back().allocate();
    std::vector<double> cold_us, warm_us, base_us;
    auto stream = dev.create_stream();
    for (int round = 0; round < 4; ++round) {
      Signal gate = dev.alloc_signal(0);
      stream->wait(Event(gate, 1, nullptr));
      for (int i = 0; i < copies; ++i) {
        const auto start = Clock::now();
        stream->copyin(dests[i], src);
        (round == 0 ? cold_us : warm_us).push_back(us_since(start));
        const auto base_start = Clock::now();
        std::memcpy(dst.data(), src.data(), bytes);
        base_us.push_back(us_since(base_start));
      }
      gate.set(1);
      stream->synchronize();
      dev.free_signal(gate);
    }
    const Percentiles cold = percentiles(cold_us), warm = percentiles(warm_us), base = percentiles(base_us);
    row(fmt::format("1 MiB copyin into a stream behind an incomplete event (x{}), warm, p50 (p99)", copies),
        fmt::format("{:.0f} ({:.0f}) us", warm.p50, warm.p99), fmt::format("memcpy {:.0f} ({:.0f}) us", base.p50, base.p99),
        fmt::format("{:.2f}x ({:.2f}x)", warm.p50 / base.p50, warm.p99 / base.p99), "returns: p99 < 50 ms",
        warm.p99 < 50'000);
    row("  the same, cold (the stream's first round: fresh memory)", fmt::format("{:.0f} ({:.0f}) us", cold.p50, cold.p99),
        fmt::format("memcpy {:.0f} ({:.0f}) us", base.p50, base.p99),
        fmt::format("{:.2f}x ({:.2f}x)", cold.p50 / base.p50, cold.p99 / base.p99), "returns: p99 < 50 ms",
        cold.p99 < 50'000);
  }

  // 3c. Graph replays with new inputs into a stream held behind an event nobody has completed yet
  // (requests queued behind another's output, each with buffers of its own), p50 and p99 of the
  // call, against replays of the same graph with unchanged inputs behind the same event. Each
  // replay with new inputs takes a copy of the graph's queues and kernel arguments of its own
  // (Note [HCQ graph replay]); before, the third waited for the first. The first round records
  // the copies (cold); later rounds rewrite their kernel arguments (warm).
  {
    constexpr std::int32_t n = 64;
    constexpr int kReplays = 16;  // what a graph keeps kernel arguments for
    constexpr int kNodes = 8;
    auto buffer = [&] {
      Buffer b(dev.name(), n, dtypes::float32);
      b.allocate();
      return b;
    };
    Buffer t = buffer();
    std::vector<GraphNode> nodes;
    for (int i = 0; i < kNodes; ++i)  // t = x + y, then out = t + y, t = out + y, ...
      nodes.push_back(i == 0 ? GraphKernel{s.add, {GraphBuffer::of(t.allocation()), GraphBuffer::in(0), GraphBuffer::in(1)}, {GraphValue::of(n)}}
                             : GraphKernel{s.add, {GraphBuffer::in(2), GraphBuffer::of(t.allocation()), GraphBuffer::in(1)}, {GraphValue::of(n)}});
    std::vector<std::array<Buffer, 3>> inputs;
    // Two sets of kReplays inputs, in turn per round: a round's inputs are in none of the copies.
    for (int i = 0; i < 2 * kReplays; ++i) inputs.push_back({buffer(), buffer(), buffer()});
    std::vector<double> cold_us, warm_us, base_us;
    auto stream = dev.create_stream();
    auto graph = stream->create_graph(nodes);
    for (int round = 0; round < 8; ++round) {
      for (const bool changed : {true, false}) {
        Signal gate = dev.alloc_signal(0);
        stream->wait(Event(gate, 1, nullptr));
        for (int i = 0; i < kReplays; ++i) {
          const auto start = Clock::now();
          stream->replay(*graph, inputs[changed ? (round % 2) * kReplays + i : 0]);
          (changed ? (round == 0 ? cold_us : warm_us) : base_us).push_back(us_since(start));
        }
        gate.set(1);
        stream->synchronize();
        dev.free_signal(gate);
      }
    }
    const Percentiles cold = percentiles(cold_us), warm = percentiles(warm_us), base = percentiles(base_us);
    row(fmt::format("graph replay ({} nodes) with new inputs into a stream behind an incomplete event (x{}), warm, "
                    "p50 (p99)", kNodes, kReplays),
        fmt::format("{:.2f} ({:.2f}) us", warm.p50, warm.p99),
        fmt::format("unchanged inputs {:.2f} ({:.2f}) us", base.p50, base.p99),
        fmt::format("{:.2f}x ({:.2f}x)", warm.p50 / base.p50, warm.p99 / base.p99), "returns: p50 <= 2x", warm.p50 <= 2 * base.p50);
    row("  the same, cold (the graph's first round: copies recorded)", fmt::format("{:.2f} ({:.2f}) us", cold.p50, cold.p99),
        fmt::format("unchanged inputs {:.2f} ({:.2f}) us", base.p50, base.p99),
        fmt::format("{:.2f}x ({:.2f}x)", cold.p50 / base.p50, cold.p99 / base.p99), "returns: p99 < 1 ms", cold.p99 < 1000);
  }

  // 4. A request through a stream (copy in, 2 kernels, copy out), 64-wide, against the same calls
  // made directly and synchronously; the stream both inline on idle (the default) and through its
  // workers (run_inline_when_idle = false).
  {
    constexpr std::size_t n = 64;
    Buffer a(dev.name(), n, dtypes::float32), b(dev.name(), n, dtypes::float32), t(dev.name(), n, dtypes::float32),
        out(dev.name(), n, dtypes::float32);
    a.allocate();
    b.allocate();
    t.allocate();
    out.allocate();
    std::vector<float> va(n, 1.5f), vb(n, 2.5f), back(n);
    const Allocation first[] = {t.allocation(), a.allocation(), b.allocation()},
                     second[] = {out.allocation(), t.allocation(), b.allocation()};
    const Buffer first_b[] = {t, a, b}, second_b[] = {out, t, b};
    const std::int32_t values[] = {static_cast<std::int32_t>(n)};
    const double direct = ns_per_op([&] {
      a.copyin(std::as_bytes(std::span(va)));
      (*s.add)(first, values);
      (*s.add)(second, values);
      out.copyout(std::as_writable_bytes(std::span(back)));
    }, 20000);
    for (bool inline_when_idle : {true, false}) {
      auto stream = dev.create_stream(StreamOptions{.run_inline_when_idle = inline_when_idle});
      const double lib = ns_per_op([&] {
        stream->copyin(a, std::as_bytes(std::span(va)));
        stream->launch(s.add, first_b, values);
        stream->launch(s.add, second_b, values);
        stream->copyout(std::as_writable_bytes(std::span(back)), out).wait();
      }, inline_when_idle ? 20000 : 5000);
      // Through the workers costs thread hand-offs, which the direct calls never pay: shown, with no target.
      if (inline_when_idle)
        row("request through a stream (in, 2 kernels, out), 64-wide", fmt_ns(lib), fmt_ns(direct),
            fmt::format("{:.2f}x", lib / direct), "<= 1.3x", lib <= 1.3 * direct);
      else
        row("  the same request with run_inline_when_idle = false", fmt_ns(lib), fmt_ns(direct),
            fmt::format("{:.2f}x", lib / direct), "none: 4 hand-offs to workers", true);
    }
  }
}

}  // namespace tinydev::bench
