// Graphs: native HCQ replay must equal eager execution, node for node.
#include <nlohmann/json.hpp>

#include <fstream>

#include <unistd.h>

#include "demo_kernels.hpp"
#include "hcq_support.hpp"

using namespace tinydev;
using namespace tinydev::testing;

namespace {

// A set of float buffers on one device with the same random contents in two copies: one for the
// graph, one for the eager reference.
struct Twin {
  std::vector<Buffer> graph, eager;
  Twin(Compiled& dev, std::size_t count, std::size_t n, std::uint64_t seed) {
    for (std::size_t i = 0; i < count; ++i) {
      auto data = random_floats(n, seed + i);
      for (auto* set : {&graph, &eager}) {
        set->emplace_back(dev.name(), n, dtypes::float32);
        set->back().allocate().copyin(std::span<const float>(data));
      }
    }
  }
  std::vector<Allocation> allocations(bool for_graph) const {
    std::vector<Allocation> out;
    for (const Buffer& b : for_graph ? graph : eager) out.push_back(b.allocation());
    return out;
  }
  void check_equal() const {
    for (std::size_t i = 0; i < graph.size(); ++i) {
      HostBytes g = graph[i].as_buffer(true), e = eager[i].as_buffer(true);
      INFO("buffer " << i);
      REQUIRE(std::equal(g.bytes().begin(), g.bytes().end(), e.bytes().begin()));
    }
  }
};

// Replays `nodes` natively and eagerly on fresh random inputs `replays` times with fresh variables.
void replay_matches_eager(Compiled& dev, const std::vector<GraphNode>& nodes, std::size_t inputs, std::size_t n,
                          std::size_t variables, int replays = 3) {
  auto native = dev.create_graph(nodes);
  auto eager = make_eager_graph(dev, nodes);
  REQUIRE(native->num_inputs() == inputs);
  REQUIRE(native->num_variables() == variables);
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937 rng(static_cast<unsigned>(seed));
  for (int r = 0; r < replays; ++r) {
    Twin twin(dev, inputs, n, seed + 100 * r);
    std::vector<std::int32_t> vars(variables);
    for (auto& v : vars) v = static_cast<std::int32_t>(rng() % 7) - 3;
    native->replay(twin.allocations(true), vars, /*wait=*/true);
    eager->replay(twin.allocations(false), vars, true);
    twin.check_equal();
  }
}

GraphBuffer in(std::size_t i) { return GraphBuffer::in(i); }

}  // namespace

TEST_CASE("graph: write-after-write - read-then-write and write-then-read replay as eager", "[graph]") {
  for_each_backend(Needs{.kernels = true, .cuda_too = true, .native_graphs = true}, [](Compiled& dev) {
    const std::size_t n = 1000;
    auto add = dev.load_kernel("add", kernels::add_f32(dev.source_language()));
    auto scale = dev.load_kernel("scale", kScale.for_device(dev));
    const GraphValue count = GraphValue::of(static_cast<std::int32_t>(n));
    // write-after-write: x = a + b, then x = a * k: x ends as a * k.
    replay_matches_eager(dev,
                         {GraphKernel{add, {in(0), in(1), in(2)}, {count}},
                          GraphKernel{scale, {in(0), in(1)}, {GraphValue::var(0), count}}},
                         3, n, 1);
    // read-then-write: y = x * 2 reads x before x = a + b overwrites it.
    replay_matches_eager(dev,
                         {GraphKernel{scale, {in(1), in(0)}, {GraphValue::of(2), count}},
                          GraphKernel{add, {in(0), in(2), in(3)}, {count}}},
                         4, n, 0);
    // write-then-read: x = a + b, then y = x * k sees the new x.
    replay_matches_eager(dev,
                         {GraphKernel{add, {in(0), in(1), in(2)}, {count}},
                          GraphKernel{scale, {in(3), in(0)}, {GraphValue::var(0), count}}},
                         4, n, 1, 4);
  });
}

TEST_CASE("graph: copies - offsets - fixed buffers and two graphs", "[graph]") {
  for_each_backend(Needs{.kernels = true, .cuda_too = true, .native_graphs = true}, [](Compiled& dev) {
    const std::size_t n = 512;
    auto add = dev.load_kernel("add", kernels::add_f32(dev.source_language()));
    const GraphValue count = GraphValue::of(static_cast<std::int32_t>(n));
    // A copy feeding a kernel feeding a copy.
    replay_matches_eager(dev,
                         {GraphCopy{in(0), in(1), n * 4}, GraphKernel{add, {in(2), in(0), in(1)}, {count}},
                          GraphCopy{in(3), in(2), n * 4}},
                         4, n, 0);
    // Offsets: inputs are views into one base buffer, at different offsets each replay.
    auto data = random_floats(4 * n, fresh_seed());
    Buffer base_g(dev.name(), 4 * n, dtypes::float32), base_e(dev.name(), 4 * n, dtypes::float32);
    base_g.allocate().copyin(std::span<const float>(data));
    base_e.allocate().copyin(std::span<const float>(data));
    std::vector<GraphNode> nodes{GraphKernel{add, {in(0), in(1), in(2)}, {count}}};
    auto native = dev.create_graph(nodes);
    auto eager = make_eager_graph(dev, nodes);
    for (std::size_t shift : {std::size_t{0}, std::size_t{16}, std::size_t{48}}) {
      auto views = [&](Buffer& base) {
        std::vector<Buffer> v{base.view(n, dtypes::float32, (2 * n + shift) * 4), base.view(n, dtypes::float32, shift * 4),
                              base.view(n, dtypes::float32, (n + shift) * 4)};
        std::vector<Allocation> a;
        for (Buffer& b : v) a.push_back(b.ensure_allocated().allocation());
        return a;
      };
      native->replay(views(base_g), {}, true);
      eager->replay(views(base_e), {}, true);
      HostBytes g = base_g.as_buffer(true), e = base_e.as_buffer(true);
      REQUIRE(std::equal(g.bytes().begin(), g.bytes().end(), e.bytes().begin()));
    }
    // Two graphs over the same buffers, replayed alternately, with a fixed buffer in one.
    Buffer fixed(dev.name(), n, dtypes::float32);
    auto fixed_data = random_floats(n, fresh_seed());
    fixed.allocate().copyin(std::span<const float>(fixed_data));
    auto g1 = dev.create_graph({GraphKernel{add, {in(0), in(1), GraphBuffer::of(fixed.allocation())}, {count}}});
    auto g2 = dev.create_graph({GraphKernel{add, {in(1), in(0), in(0)}, {count}}});
    Twin twin(dev, 2, n, fresh_seed());
    auto e1 = make_eager_graph(dev, g1->nodes()), e2 = make_eager_graph(dev, g2->nodes());
    for (int r = 0; r < 3; ++r) {
      g1->replay(twin.allocations(true));
      g2->replay(twin.allocations(true));
      e1->replay(twin.allocations(false));
      e2->replay(twin.allocations(false));
    }
    dev.synchronize();
    twin.check_equal();
  });
}

// Note [HCQ graph replay]: double-buffered kernel arguments.
TEST_CASE("graph: back-to-back replays with new inputs and variables each compute their own", "[graph]") {
  for_each_backend(Needs{.kernels = true, .cuda_too = true, .native_graphs = true}, [](Compiled& dev) {
    const std::size_t n = 1000;
    auto add = dev.load_kernel("add", kernels::add_f32(dev.source_language()));
    std::vector<GraphNode> nodes{GraphKernel{add, {in(0), in(1), in(2)}, {GraphValue::var(0)}},
                                 GraphKernel{add, {in(3), in(0), in(2)}, {GraphValue::var(1)}}};
    auto native = dev.create_graph(nodes);
    auto eager = make_eager_graph(dev, nodes);
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    std::vector<Twin> twins;
    for (int r = 0; r < 7; ++r) twins.emplace_back(dev, 4, n, seed + 10 * r);
    for (int r = 0; r < 7; ++r) {
      // Counts differ per replay, so a replay that read another's arguments shows.
      const std::vector<std::int32_t> vars{static_cast<std::int32_t>(n - 37 * r), static_cast<std::int32_t>(n - 11 * r)};
      native->replay(twins[r].allocations(true), vars, /*wait=*/false);
      eager->replay(twins[r].allocations(false), vars, false);
    }
    dev.synchronize();
    for (const Twin& t : twins) t.check_equal();
  });
}

// Note [HCQ graph replay]: graph-signal commands only where the nodes change queues. Each node
// reads what the one before it wrote, so a node run early, on either queue, reads stale bytes;
// runs of copies and of kernels, a copy first and last, and no nodes at all, replayed five times
// without waiting (the CPU device's two workers, not the caller) with new inputs each time.
TEST_CASE("graph: chains of copies and kernels that switch queues replay as eager without waiting", "[graph]") {
  for_each_backend(Needs{.kernels = true, .cuda_too = true, .native_graphs = true}, [](Compiled& dev) {
    const std::size_t n = 4096 + fresh_seed() % 4096;
    auto add = dev.load_kernel("add", kernels::add_f32(dev.source_language()));
    const GraphValue count = GraphValue::of(static_cast<std::int32_t>(n));
    constexpr std::size_t kWork = 5;  // in(2) to in(6), written in turn
    for (const std::string_view pattern : {"CCKKKCKCC", "KCCK", "C", "KKKK", "CKCKCK", "KKCCCK", ""}) {
      INFO("nodes " << pattern << " (C: a copy, K: a kernel)");
      std::vector<GraphNode> nodes;
      for (std::size_t i = 0; i < pattern.size(); ++i) {
        const GraphBuffer src = i == 0 ? in(0) : in(2 + (i - 1) % kWork), dest = in(2 + i % kWork);
        if (pattern[i] == 'C') nodes.push_back(GraphCopy{dest, src, n * 4});
        else nodes.push_back(GraphKernel{add, {dest, src, in(1)}, {count}});
      }
      auto native = dev.create_graph(nodes);
      auto eager = make_eager_graph(dev, nodes);
      const std::uint64_t seed = fresh_seed();
      INFO("seed " << seed);
      std::vector<Twin> twins;
      for (int r = 0; r < 5; ++r) twins.emplace_back(dev, native->num_inputs(), n, seed + 10 * r);
      // Every native replay first, so several are in flight at once on both queues (an eager
      // replay's direct calls wait for the device's queued work).
      for (int r = 0; r < 5; ++r) native->replay(twins[r].allocations(true), {}, /*wait=*/false);
      for (int r = 0; r < 5; ++r) eager->replay(twins[r].allocations(false), {}, false);
      dev.synchronize();
      for (const Twin& t : twins) t.check_equal();
    }
  });
}

// Note [Inline replay]: a waited replay on an idle CPU device runs on the caller's thread.
TEST_CASE("graph: a waited replay on an idle CPU device runs on the calling thread and others on the worker", "[graph]") {
  for_each_backend(Needs{.kernels = true, .host_objects = true, .native_graphs = true}, [](Compiled& dev) {
    const KernelSource thread_id{"declare i32 @gettid()\ndefine void @tid(ptr %o) {\n  %t = call i32 @gettid()\n"
                                 "  store i32 %t, ptr %o\n  ret void\n}\n",
                                 "int gettid(void);\nvoid tid(int* o) { o[0] = gettid(); }\n"};
    auto tid = dev.load_kernel("tid", thread_id.for_device(dev));
    Buffer out(dev.name(), 1, dtypes::int32);
    out.allocate();
    auto graph = dev.create_graph({GraphKernel{tid, {in(0)}, {}}});
    const Allocation inputs[] = {out.allocation()};
    auto ran_on = [&] {
      std::int32_t t = 0;
      out.copyout(std::span<std::int32_t>(&t, 1));
      return t;
    };
    const std::int32_t me = static_cast<std::int32_t>(::gettid());
    dev.synchronize();
    graph->replay(inputs, {}, /*wait=*/true);
    CHECK(ran_on() == me);
    graph->replay(inputs, {}, /*wait=*/false);
    dev.synchronize();
    CHECK(ran_on() != me);
    CHECK(ran_on() > 0);
  });
}

TEST_CASE("graph: bad graphs and replays are errors", "[graph]") {
  for_each_backend(Needs{.kernels = true, .cuda_too = true, .checks_signatures = true}, [](Compiled& dev) {
    auto add = dev.load_kernel("add", kernels::add_f32(dev.source_language()));
    CHECK_THROWS_WITH(dev.create_graph({GraphKernel{add, {in(0), in(1)}, {GraphValue::of(1)}}}),
                      Catch::Contains("takes 3 buffers and 1 values, the node gives 2 and 1"));
    auto g = dev.create_graph({GraphKernel{add, {in(0), in(1), in(2)}, {GraphValue::var(0)}}});
    Buffer b(dev.name(), 4, dtypes::float32);
    b.allocate();
    const Allocation two[] = {b.allocation(), b.allocation()};
    CHECK_THROWS_WITH(g->replay(two, std::vector<std::int32_t>{4}), Catch::Contains("takes 3 and 1"));
    auto c = dev.create_graph({GraphCopy{in(0), in(1), 64}});
    const Allocation small[] = {b.allocation(), b.allocation()};
    CHECK_THROWS_WITH(c->replay(small), Catch::Contains("node 0 copies 64"));
  });
}

TEST_CASE("graph: devices without native graphs replay eagerly", "[graph][host]") {
  FakeDevice& fake = fake_device();
  CHECK_FALSE(fake.supports_graph());
  Buffer a("fake", 16, dtypes::int32), b("fake", 16, dtypes::int32);
  auto data = random_bytes(64, fresh_seed());
  a.allocate().copyin(data);
  b.allocate();
  auto g = fake.create_graph({GraphCopy{in(1), in(0), 64}});
  g->replay(std::vector<Allocation>{a.allocation(), b.allocation()}, {}, true);
  HostBytes got = b.as_buffer();
  CHECK(std::equal(got.bytes().begin(), got.bytes().end(), data.begin()));
}

TEST_CASE("profile: the trace is JSON with one process per device - COMPUTE and DMA lanes - named events", "[profile]") {
  for_each_hcq_device([](auto& dev) {
    TempDir dir;
    const std::string path = dir.str() + "/trace.json";
    Profiler::global().enable(path);
    Profiler::global().clear();
    auto add = dev.load_kernel("add", kernels::add_f32(dev.source_language()));
    const std::size_t n = 4096;
    auto data = random_floats(n, fresh_seed());
    Buffer a(dev.name(), n, dtypes::float32), o(dev.name(), n, dtypes::float32);
    hcq_allocator(dev).set_force_staging(true);
    a.allocate().copyin(std::span<const float>(data));  // through the ring: timestamps from the copy queue
    hcq_allocator(dev).set_force_staging(false);
    o.allocate();
    auto g = dev.create_graph({GraphKernel{add, {in(0), in(1), in(1)}, {GraphValue::of(static_cast<std::int32_t>(n))}}});
    g->replay(std::vector<Allocation>{o.allocation(), a.allocation()}, {}, true);
    std::vector<float> out(n);
    o.copyout(std::span<float>(out));
    CHECK(out[7] == data[7] + data[7]);
    dev.synchronize();  // write() waits for no device: work still in flight would come in a later write
    const std::size_t written = Profiler::global().write();
    Profiler::global().enable("");
    CHECK(written >= 3);
    std::ifstream f(path);
    nlohmann::json trace = nlohmann::json::parse(f);  // throws if it is not JSON
    std::map<std::string, int> names;
    bool device_process = false, compute = false, dma = false;
    double last_ts = 0;
    for (const auto& e : trace.at("traceEvents")) {
      // The CPU queues run the graph's recorded execs: their events name the graph.
      if constexpr (std::is_same_v<std::decay_t<decltype(dev)>, cpu::CpuHCQDevice>)
        if (e.at("ph") == "X" && e.at("name") == "add") CHECK(e.at("args").at("graph") == g->id());
      if (e.at("ph") == "M") {
        const std::string arg = e.at("args").at("name");
        device_process |= e.at("name") == "process_name" && arg == dev.name();
        compute |= arg == "COMPUTE";
        dma |= arg == "DMA";
        continue;
      }
      CHECK(e.at("ph") == "X");
      CHECK(e.at("dur").get<double>() >= 0);
      last_ts = std::max(last_ts, e.at("ts").get<double>());
      names[e.at("name").get<std::string>()] += 1;
    }
    CHECK(device_process);
    CHECK(compute);
    CHECK(dma);
    CHECK(last_ts > 0);
    CHECK(names["CPU -> " + dev.name()] >= 1);
    CHECK(names[dev.name() + " -> CPU"] >= 1);
    CHECK(names["add"] >= 1);
  }, Needs{.kernels = true, .cuda_too = true});
}

TEST_CASE("profile: write() waits for no device and queued work carries the request it was issued under", "[profile]") {
  for_each_hcq_device([](auto& dev) {
    TempDir dir;
    const std::string path = dir.str() + "/live.json";
    Profiler::global().enable(path);
    Profiler::global().clear();
    auto inc = load_program(dev, "ping", inc_kernel("ping"));  // a name the fake CUDA driver knows
    Buffer a = int_counter(dev), b = int_counter(dev);
    Kernargs args = dev.alloc_kernargs(2, 0);
    const Allocation to_b[] = {b.allocation(), a.allocation()};
    fill_kernargs(*inc, args, to_b, {});
    Signal gate = dev.alloc_signal(0);
    const std::uint64_t request = 1 + fresh_seed() % 1000000;
    {
      // A queue held up behind a gate nobody has opened yet, issued inside a request's range.
      ProfileRange range("request", request);
      std::lock_guard lock(dev.submit_mutex());
      const std::uint64_t v = dev.next_timeline_value();
      dev.compute_queue().wait(dev.timeline_signal(), v - 1).wait(gate, 1).exec(*inc, args, {1, 1, 1}, {1, 1, 1})
          .signal(dev.timeline_signal(), v).submit(dev);
    }
    // The old writer synchronized every device first and would hang here until the gate opened.
    const auto start = std::chrono::steady_clock::now();
    Profiler::global().write();
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
    gate.set(1);
    dev.synchronize();
    Profiler::global().write();
    Profiler::global().use_environment();
    dev.free_signal(gate);
    CHECK(read_int(b) == 1);
    std::ifstream f(path);
    const nlohmann::json trace = nlohmann::json::parse(f);
    bool found = false;
    for (const auto& e : trace.at("traceEvents"))
      if (e.at("ph") == "X" && e.at("name") == "ping") {
        found = true;
        CHECK(e.at("args").at("request") == request);
      }
    CHECK(found);
  }, Needs{.kernels = true, .cuda_too = true});
}

TEST_CASE("profile: eager direct calls are traced without waiting for their time", "[profile]") {
  for_each_backend(Needs{.kernels = true, .cuda_too = true, .add_kernel = true}, [](Compiled& dev) {
    TempDir dir;
    Profiler::global().enable(dir.str() + "/eager.json");
    Profiler::global().clear();
    const std::string name = "add";  // a name the fake CUDA driver knows; clear() above leaves only these calls
    auto add = dev.load_kernel(name, kernels::add_f32(dev.source_language(), name));
    const std::size_t n = 1024;
    Buffer a(dev.name(), n, dtypes::float32), o(dev.name(), n, dtypes::float32);
    const auto data = random_floats(n, fresh_seed());
    a.allocate().copyin(std::span<const float>(data));
    o.allocate();
    const Allocation args[] = {o.allocation(), a.allocation(), a.allocation()};
    const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
    const int calls = 3 + static_cast<int>(fresh_seed() % 5);
    for (int i = 0; i < calls; ++i) CHECK_FALSE((*add)(args, vals, LaunchParams{.wait = false}).has_value());
    dev.synchronize();
    int traced = 0;
    for (const ProfileEvent& e : Profiler::global().events()) traced += e.name == name && e.device == dev.name();
    Profiler::global().use_environment();
    std::vector<float> out(n);
    o.copyout(std::span<float>(out));
    CHECK(out[n / 2] == data[n / 2] + data[n / 2]);
    CHECK(traced == calls);
  });
}
