// The seed's HCQ behaviour on every HCQ device: signals, queues and their patching, the timeline,
// the staging ring, transfers, bad input.
#include <atomic>
#include <exception>
#include <thread>

#include "cpu_hcq.hpp"
#include "hcq_support.hpp"

using namespace tinydev;
using namespace tinydev::testing;
using namespace std::chrono_literals;

TEST_CASE("hcq: a wait on a value set late times out first then succeeds", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    Signal s = dev.alloc_signal(0);
    const std::uint64_t want = 1 + fresh_seed() % 1000;
    CHECK_THROWS_AS(s.wait(want, 20ms), Timeout);
    CHECK_THROWS_WITH(s.wait(want, 20ms), Catch::Contains(s.describe()) && Catch::Contains("to reach " + std::to_string(want)) &&
                                              Catch::Contains("it is at 0"));
    std::thread setter([&] {
      std::this_thread::sleep_for(30ms);
      s.set(want);
    });
    CHECK_NOTHROW(s.wait(want, 5000ms));
    setter.join();
    // A queue sets it too, and a host waiter sleeping on it wakes.
    std::thread waiter([&] { s.wait(want + 5, 5000ms); });
    std::this_thread::sleep_for(10ms);
    dev.compute_queue().signal(s, want + 5).submit(dev);
    waiter.join();
    CHECK(s.value() == want + 5);
    dev.free_signal(s);
  }, Needs{});
}

TEST_CASE("hcq: queued waits hold later commands until the signal arrives", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    Signal gate = dev.alloc_signal(0), done = dev.alloc_signal(0);
    dev.compute_queue().wait(gate, 7).signal(done, 1).submit(dev);
    std::this_thread::sleep_for(20ms);
    CHECK(done.value() == 0);
    gate.set(7);
    done.wait(1, 5000ms);
    CHECK(done.value() == 1);
  }, Needs{});
}

TEST_CASE("hcq: update_signal and update_wait patch a recorded queue - which resubmits", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    Signal a = dev.alloc_signal(0), b = dev.alloc_signal(0), gate = dev.alloc_signal(0);
    typename std::remove_cvref_t<decltype(dev)>::compute_queue_type q;
    q.wait(gate, 1).signal(a, 10);
    REQUIRE(q.size() == 2);
    q.submit(dev);
    gate.set(1);
    a.wait(10, 5000ms);
    q.update_wait(0, std::nullopt, 2).update_signal(1, b, 20);
    q.submit(dev);
    std::this_thread::sleep_for(10ms);
    CHECK(b.value() == 0);  // still waiting for gate >= 2
    gate.set(2);
    b.wait(20, 5000ms);
    CHECK(a.value() == 10);
    for (int i = 0; i < 5; ++i) {
      q.update_signal(1, std::nullopt, 21 + i).submit(dev);
      b.wait(21 + i, 5000ms);
    }
  }, Needs{});
}

TEST_CASE("hcq: a recorded queue whose signal was freed is not submitted again into the signal that took its slot", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    const std::uint64_t seed = fresh_seed();
    const std::uint64_t value = 1000 + seed % 1000;
    Signal done = dev.alloc_signal(0), gate = dev.alloc_signal(0);
    typename std::remove_cvref_t<decltype(dev)>::compute_queue_type q;
    q.wait(gate, 1).signal(done, value);
    gate.set(1);
    q.submit(dev);
    done.wait(value, 5000ms);
    dev.synchronize();
    dev.free_signal(done);
    dev.synchronize();  // the slot is reusable once the timeline passed its uses
    // The next signal takes the freed slot (newest first); it must not see the old queue's write.
    Signal reused = dev.alloc_signal(7);
    CHECK(reused.index() == done.index());
    CHECK_THROWS_WITH(q.submit(dev), Catch::Contains("command 1 (a signal) uses a signal freed since it was "
                                                     "recorded") &&
                                         Catch::Contains("update_signal"));
    dev.synchronize();
    CHECK(reused.value() == 7);
    // Patched with a live signal, the queue submits again.
    Signal fresh = dev.alloc_signal(0);
    q.update_signal(1, fresh, value + 1).submit(dev);
    fresh.wait(value + 1, 5000ms);
    CHECK(reused.value() == 7);
    // A freed wait signal likewise names update_wait.
    dev.synchronize();
    dev.free_signal(gate);
    CHECK_THROWS_WITH(q.submit(dev), Catch::Contains("command 0 (a wait)") && Catch::Contains("update_wait"));
    dev.synchronize();
    dev.free_signal(fresh);
    dev.free_signal(reused);
  }, Needs{});
}

// Note [Queue resubmission]: patching a queue never changes a snapshot still queued.
TEST_CASE("hcq: resubmitting while earlier submissions are still queued leaves them as submitted", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    Signal gate = dev.alloc_signal(0);
    std::vector<Signal> out;
    for (int i = 0; i < 12; ++i) out.push_back(dev.alloc_signal(0));
    const std::uint64_t base = 1 + fresh_seed() % 1000;
    typename std::remove_cvref_t<decltype(dev)>::compute_queue_type q;
    q.wait(gate, 1).signal(out[0], 0).memory_barrier().signal(out[0], 0);
    for (int round = 0; round < 2; ++round) {
      // All 12 wait behind the gate (more than the queue keeps spare copies of).
      for (int i = 0; i < 12; ++i)
        q.update_wait(0, std::nullopt, round * 100 + 1)
            .update_signal(1, out[i], base + round * 1000 + i)
            .update_signal(3, out[i], base + round * 1000 + i + 1)
            .submit(dev);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      for (const Signal& s : out) CHECK(s.value() == (round == 0 ? 0 : base + 1000 * (round - 1) + (&s - &out[0]) + 1));
      gate.set(round * 100 + 1);
      for (int i = 0; i < 12; ++i) {
        out[i].wait(base + round * 1000 + i + 1, std::chrono::milliseconds(5000));
        CHECK(out[i].value() == base + round * 1000 + i + 1);
      }
    }
    dev.free_signal(gate);
    for (const Signal& s : out) dev.free_signal(s);
  }, Needs{});
}

// Note [Submission ring] in src/cpu/cpu_hcq.cpp: a CPU worker takes submissions from a ring of 128
// slots and an overflow list behind it. Here, in three phases, one submitting thread queues:
// (A) a few hundred behind a closed gate: the ring fills and the rest overflow;
// (B) 300 more while the worker is held mid-ring (submission kHeld also waits for `halfway`), so
//     they must go on to the overflow although the ring has room again;
// (C) 200 more while the worker is held inside the overflow list (submission kHeld2 waits for
//     `third`): the ring is empty then, so these reuse its slots, freeing the words left in them,
//     and overflow once more.
// Each submission waits for its predecessor's value before setting its own, so one run out of
// order waits for ever: the final wait is a Timeout instead of a pass. A submit must never block
// (the submitter sets the gates itself). CPU devices only: a GPU driver's own queue may block a
// submit past its depth (Note [CUDA queue depth]).
TEST_CASE("hcq: hundreds of submissions behind one gate never block the submitter and run in order", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    Signal gate = dev.alloc_signal(0), halfway = dev.alloc_signal(0), third = dev.alloc_signal(0),
           seq = dev.alloc_signal(0);
    constexpr int kHeld = 64, kHeld2 = 160;
    const int gated = 200 + static_cast<int>(fresh_seed() % 100), phase_c = gated + 300, n = phase_c + 200;
    typename std::remove_cvref_t<decltype(dev)>::compute_queue_type recorded;
    recorded.wait(gate, 1).wait(seq, 0).signal(seq, 0);
    std::atomic<int> phase_reached{0};  // 1: A submitted, 2: B submitted, 3: C submitted
    std::uint64_t before_gate = ~std::uint64_t{0};
    std::exception_ptr failure;
    std::thread submitter([&] {
      try {
        for (int i = 0; i < n; ++i) {
          if (i == gated) {
            phase_reached = 1;
            before_gate = seq.value();
            gate.set(1);
            seq.wait(kHeld, 10000ms);  // the worker now waits at submission kHeld, mid-ring
          } else if (i == phase_c) {
            phase_reached = 2;
            halfway.set(1);
            seq.wait(kHeld2, 10000ms);  // ... and now at kHeld2, in the overflow list it took
          }
          const auto v = static_cast<std::uint64_t>(i);
          if (i == kHeld || i == kHeld2)
            dev.compute_queue().wait(i == kHeld ? halfway : third, 1).wait(seq, v).signal(seq, v + 1).submit(dev);
          else if (i % 3 == 2)  // a recorded queue patched and resubmitted, among eager ones
            recorded.update_wait(1, std::nullopt, v).update_signal(2, std::nullopt, v + 1).submit(dev);
          else
            dev.compute_queue().wait(gate, 1).wait(seq, v).signal(seq, v + 1).submit(dev);
        }
        phase_reached = 3;
      } catch (...) {
        failure = std::current_exception();
      }
      third.set(1);
    });
    // A submit that blocks would hang the submitter before it opens the gates: open them from here
    // after 10 s, so the failure is reported instead of hanging the run.
    for (int i = 0; i < 1000 && phase_reached < 3 && !failure; ++i) std::this_thread::sleep_for(10ms);
    const int reached = phase_reached;
    for (const Signal* s : {&gate, &halfway, &third}) s->set(1);
    submitter.join();
    // On any failure the worker may be stuck on a wait for `seq` for an hour: poison it so the
    // device drains and the tests after this one run.
    struct PoisonOnFailure {
      const Signal& seq;
      bool armed = true;
      ~PoisonOnFailure() {
        if (armed) seq.poison("the test waiting for it failed");
      }
    } poison_on_failure{seq};
    if (failure) std::rethrow_exception(failure);
    CHECK(reached == 3);  // no submit blocked
    CHECK(before_gate == 0);  // nothing passed the gate
    seq.wait(static_cast<std::uint64_t>(n), 10000ms);
    CHECK(seq.value() == static_cast<std::uint64_t>(n));
    poison_on_failure.armed = false;
    dev.synchronize();
    for (const Signal& s : {gate, halfway, third, seq}) dev.free_signal(s);
  }, Needs{.host_objects = true});
}

TEST_CASE("hcq: a timeline timeout names the wait its queue is blocked on", "[hcq]") {
  for_each_backend(Needs{.host_objects = true, .hcq = true}, [](Compiled& compiled) {
    auto& dev = dynamic_cast<cpu::CpuHCQDevice&>(compiled);
    Signal gate = dev.alloc_signal(0);
    const std::uint64_t want = 2 + fresh_seed() % 50;
    std::uint64_t v;
    {
      std::lock_guard lock(dev.submit_mutex());
      v = dev.next_timeline_value();
      dev.compute_queue().wait(dev.timeline_signal(), v - 1).wait(gate, want).signal(dev.timeline_signal(), v).submit(dev);
    }
    CHECK_THROWS_WITH(dev.wait_timeline(v, 100ms), Catch::Contains("waiting for timeline value " + std::to_string(v)) &&
                                                       Catch::Contains("COMPUTE queue is blocked on command 1") &&
                                                       Catch::Contains("to reach " + std::to_string(want)) &&
                                                       Catch::Contains("it is at 0"));
    gate.set(want);
    dev.wait_timeline(v);
    dev.synchronize();
    dev.free_signal(gate);
  });
}

TEST_CASE("hcq: one exec and two kernels ping-ponged 100 times giving 200", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    auto ping = load_program(dev, "ping", inc_kernel("ping"));
    auto pong = load_program(dev, "pong", inc_kernel("pong"));
    Buffer a = int_counter(dev), b = int_counter(dev);
    Kernargs ab = dev.alloc_kernargs(2, 0), ba = dev.alloc_kernargs(2, 0);
    const Allocation to_b[] = {b.allocation(), a.allocation()}, to_a[] = {a.allocation(), b.allocation()};
    fill_kernargs(*ping, ab, to_b, {});
    fill_kernargs(*pong, ba, to_a, {});
    std::lock_guard lock(dev.submit_mutex());
    // One exec.
    std::uint64_t v = dev.next_timeline_value();
    dev.compute_queue().wait(dev.timeline_signal(), v - 1).exec(*ping, ab, {1, 1, 1}, {1, 1, 1})
        .signal(dev.timeline_signal(), v).submit(dev);
    dev.synchronize();
    CHECK(read_int(b) == 1);
    // 100 ping-pongs in one queue: a = 2*i, b = 2*i - 1.
    auto q = dev.compute_queue();
    q.wait(dev.timeline_signal(), dev.timeline_value() - 1);
    for (int i = 0; i < 100; ++i) q.exec(*pong, ba, {1, 1, 1}, {1, 1, 1}).exec(*ping, ab, {1, 1, 1}, {1, 1, 1});
    v = dev.next_timeline_value();
    q.signal(dev.timeline_signal(), v).submit(dev);
    dev.synchronize();
    CHECK(read_int(a) == 200);
    CHECK(read_int(b) == 201);
  }, Needs{.kernels = true, .cuda_too = true});
}

TEST_CASE("hcq: exec with a grid appends the index and update_exec changes the sizes", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    auto fill = load_program(dev, "fill", kFill);
    REQUIRE(fill->signature() == KernelSignature{1, 2});  // the grid index is the last value
    const std::int32_t k = static_cast<std::int32_t>(fresh_seed() % 100000);
    Buffer out(dev.name(), 64, dtypes::int32);
    std::vector<std::int32_t> init(64, -1);
    out.allocate().copyin(std::span<const std::int32_t>(init));
    Kernargs args = dev.alloc_kernargs(1, 1);
    const Allocation bufs[] = {out.allocation()};
    const std::int32_t vals[] = {k};
    fill_kernargs(*fill, args, bufs, vals);
    std::lock_guard lock(dev.submit_mutex());
    auto q = dev.compute_queue();
    std::uint64_t v = dev.next_timeline_value();
    q.wait(dev.timeline_signal(), v - 1).exec(*fill, args, {4, 2, 1}, {1, 1, 1}).signal(dev.timeline_signal(), v).submit(dev);
    dev.synchronize();
    std::vector<std::int32_t> got(64);
    out.copyout(std::span<std::int32_t>(got));
    for (int i = 0; i < 64; ++i) CHECK(got[i] == (i < 8 ? k + i : -1));
    v = dev.next_timeline_value();
    q.update_exec(1, {8, 2, 2}, {2, 1, 1}).update_wait(0, std::nullopt, v - 1).update_signal(2, std::nullopt, v).submit(dev);
    dev.synchronize();
    out.copyout(std::span<std::int32_t>(got));
    for (int i = 0; i < 64; ++i) CHECK(got[i] == (i < 32 ? k + i : -1));
    // The direct call path runs grids the same way.
    (*fill)(bufs, vals, LaunchParams{.global = {64, 1, 1}});
    out.copyout(std::span<std::int32_t>(got));
    for (int i = 0; i < 64; ++i) CHECK(got[i] == k + i);
  });
}

TEST_CASE("hcq: copies of 8 bytes and 64 MiB and with updated addresses", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    for (std::size_t size : {std::size_t{8}, std::size_t{64} << 20}) {
      auto data = random_bytes(size, seed + size);
      Buffer src(dev.name(), size, dtypes::uint8), dst(dev.name(), size, dtypes::uint8), dst2(dev.name(), size, dtypes::uint8);
      src.allocate().copyin(data);
      dst.allocate();
      dst2.allocate();
      std::lock_guard lock(dev.submit_mutex());
      auto q = dev.copy_queue();
      std::uint64_t v = dev.next_timeline_value();
      q.wait(dev.timeline_signal(), v - 1).copy(dst.allocation(), src.allocation(), size).signal(dev.timeline_signal(), v).submit(dev);
      dev.synchronize();
      CHECK(std::equal(data.begin(), data.end(), dst.as_buffer(true).bytes().begin()));
      v = dev.next_timeline_value();
      q.update_copy(1, dst2.allocation(), std::nullopt).update_wait(0, std::nullopt, v - 1).update_signal(2, std::nullopt, v).submit(dev);
      dev.synchronize();
      CHECK(std::equal(data.begin(), data.end(), dst2.as_buffer(true).bytes().begin()));
    }
  }, Needs{});
}

TEST_CASE("hcq: a signal waited on by another device", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    auto* other = second_device(dev);
    if (!other) return;
    Signal from_first = dev.alloc_signal(0), done = other->alloc_signal(0);
    REQUIRE(other->can_reach(*from_first.pool()));
    other->compute_queue().wait(from_first, 3).signal(done, 1).submit(*other);
    std::this_thread::sleep_for(10ms);
    CHECK(done.value() == 0);
    dev.compute_queue().signal(from_first, 3).submit(dev);
    done.wait(1, 5000ms);
    CHECK(done.value() == 1);
  }, Needs{});
}

TEST_CASE("hcq: timestamps are positive and ordered", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    Signal t0 = dev.alloc_signal(), t1 = dev.alloc_signal(), t2 = dev.alloc_signal(), done = dev.alloc_signal();
    auto fill = load_program(dev, "fill", kFill);
    Buffer out(dev.name(), 1 << 16, dtypes::int32);
    out.allocate();
    Kernargs args = dev.alloc_kernargs(1, 1);
    const Allocation bufs[] = {out.allocation()};
    const std::int32_t vals[] = {1};
    fill_kernargs(*fill, args, bufs, vals);
    dev.compute_queue().timestamp(t0).exec(*fill, args, {1 << 16, 1, 1}, {1, 1, 1}).timestamp(t1).timestamp(t2)
        .signal(done, 1).submit(dev);
    done.wait(1, 5000ms);
    CHECK(t0.timestamp() > 0);
    CHECK(t1.timestamp() > t0.timestamp());
    CHECK(t2.timestamp() >= t1.timestamp());
  }, Needs{.kernels = true, .cuda_too = true});
}

TEST_CASE("hcq: the timeline started at 2^32-20 rolls over with all work still correct", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    auto ping = load_program(dev, "ping", inc_kernel("ping"));
    Buffer a = int_counter(dev), b = int_counter(dev);
    dev.synchronize();
    // An Event of the default queue recorded while work is held (Note [Recorded events]): it
    // must stay complete across two wraps, after which the timeline's old slot is reset. The
    // timeline is first taken past 150, so an Event on it (the mistake this guards against)
    // would wait for a value the reset slot does not reach after the second wrap (< 100).
    for (int i = 0; i < 150; ++i) submit_ordered(dev, [](auto&) {});
    dev.synchronize();
    REQUIRE(dev.timeline_value() > 150);
    Signal gate = dev.alloc_signal(0);
    submit_ordered(dev, [&](auto& q) { q.wait(gate, 1); });
    const Event recorded = dev.record();
    CHECK_FALSE(recorded.query());
    gate.set(1);
    recorded.wait(std::chrono::seconds(5));
    dev.synchronize();
    dev.free_signal(gate);
    dev.set_timeline_for_testing((1ull << 32) - 20);
    const Signal old_timeline = dev.timeline_signal();
    Kernargs args = dev.alloc_kernargs(2, 0);
    const Allocation ab[] = {a.allocation(), a.allocation()};
    fill_kernargs(*ping, args, ab, {});
    for (int i = 0; i < 40; ++i) {
      submit_ordered(dev, [&](auto& q) { q.exec(*ping, args, {1, 1, 1}, {1, 1, 1}); });
      if (i % 10 == 9) dev.synchronize();  // the wrap happens at a synchronize past 2^31
    }
    dev.synchronize();
    CHECK(dev.timeline_value() < 100);  // wrapped
    CHECK_FALSE(dev.timeline_signal() == old_timeline);
    CHECK(read_int(a) == 40);
    // Staging copies after the wrap still work.
    auto data = random_bytes((2u << 20) + 3, fresh_seed());
    Buffer big(dev.name(), data.size(), dtypes::uint8);
    hcq_allocator(dev).set_force_staging(true);
    big.allocate().copyin(data);
    std::vector<std::byte> back(data.size());
    big.copyout(back);
    hcq_allocator(dev).set_force_staging(false);
    CHECK(back == data);
    // A second wrap: the first timeline's slot is now reset, the recorded Event's signal is not.
    dev.set_timeline_for_testing((1ull << 32) - 20);
    for (int i = 0; i < 3; ++i) submit_ordered(dev, [&](auto& q) { q.exec(*ping, args, {1, 1, 1}, {1, 1, 1}); });
    dev.synchronize();
    CHECK(dev.timeline_value() < 100);
    CHECK(dev.timeline_signal() == old_timeline);  // the first slot again, reset to 0
    CHECK(recorded.query());
    CHECK(read_int(a) == 43);
  }, Needs{.kernels = true, .cuda_too = true});
}

TEST_CASE("hcq: staging-ring copyin of 1 B - 2 MiB-1 - 2 MiB+1 and 64 MiB+3", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    hcq_allocator(dev).set_force_staging(true);
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    for (std::size_t size : {std::size_t{1}, (std::size_t{2} << 20) - 1, (std::size_t{2} << 20) + 1, (std::size_t{64} << 20) + 3}) {
      INFO("size " << size);
      std::vector<std::byte> data = random_bytes(size, seed + size);
      Buffer b(dev.name(), size, dtypes::uint8);
      b.allocate().copyin(data);
      std::fill(data.begin(), data.end(), std::byte{0});  // copyin returned: our memory is free to reuse
      std::vector<std::byte> back(size);
      b.copyout(back);
      CHECK(back == random_bytes(size, seed + size));
    }
    hcq_allocator(dev).set_force_staging(false);
  }, Needs{});
}

TEST_CASE("hcq: transfer between two devices is ordered on both timelines", "[hcq]") {
  for_each_hcq_device([](auto& src_dev) {
    auto* dst_dev = second_device(src_dev);
    if (!dst_dev) return;
    using Allocator = std::remove_reference_t<decltype(hcq_allocator(src_dev))>;
    const std::uint64_t seed = fresh_seed();
    auto data = random_bytes(3u << 20, seed);
    Buffer src(src_dev.name(), data.size(), dtypes::uint8), dst(dst_dev->name(), data.size(), dtypes::uint8);
    src.allocate().copyin(data);
    dst.allocate();
    Allocator::transfer(dst.allocation(), src.allocation(), data.size(), src_dev, *dst_dev);
    std::vector<std::byte> back(data.size());
    dst.copyout(back);  // synchronizes the second device, whose timeline waited on the first's copy
    CHECK(back == data);
    CHECK_THROWS_AS(Allocator::transfer(dst.allocation(), src.allocation(), data.size() + 1, src_dev, *dst_dev),
                    InvalidArgument);
  }, Needs{});
}

TEST_CASE("hcq: bad input is an error before anything is queued", "[hcq]") {
  register_fakes();
  for_each_hcq_device([](auto& dev) {
    auto ping = load_program(dev, "ping", inc_kernel("ping"));
    Buffer a(dev.name(), 4, dtypes::int32), b(dev.name(), 8, dtypes::int32);
    a.allocate();
    b.allocate();
    // Freed and foreign signals.
    Signal freed = dev.alloc_signal();
    dev.free_signal(freed);
    CHECK_THROWS_WITH(freed.wait(1, 10ms), Catch::Contains("was freed"));
    auto q = dev.compute_queue();
    CHECK_THROWS_WITH(q.wait(freed, 1), Catch::Contains("was freed"));
    CHECK(q.size() == 0);
    SignalPool foreign("elsewhere");
    Signal alien = foreign.alloc(0);
    q.signal(alien, 1);
    CHECK_THROWS_WITH(q.submit(dev), Catch::Contains("pool 'elsewhere'") && Catch::Contains("cannot reach"));
    CHECK(alien.value() == 0);
    // Wrong numbers of buffers or values.
    Kernargs three = dev.alloc_kernargs(3, 0);
    const Allocation bufs3[] = {a.allocation(), a.allocation(), a.allocation()};
    CHECK_THROWS_WITH(fill_kernargs(*ping, three, bufs3, {}), Catch::Contains("takes 2 buffers and 0 values, got 3 and 0"));
    auto q2 = dev.compute_queue();
    CHECK_THROWS_WITH(q2.exec(*ping, three, {1, 1, 1}, {1, 1, 1}), Catch::Contains("takes 2 buffers"));
    CHECK(q2.size() == 0);
    // Patches out of range or of the wrong kind.
    Signal s = dev.alloc_signal();
    q2.signal(s, 1);
    CHECK_THROWS_WITH(q2.update_signal(5, std::nullopt, 2), Catch::Contains("out of range"));
    CHECK_THROWS_WITH(q2.update_wait(0, std::nullopt, 2), Catch::Contains("called update_wait not on a wait command"));
    CHECK_THROWS_WITH(q2.update_exec(0, {1, 1, 1}, {1, 1, 1}), Catch::Contains("not on a exec command"));
    q2.wait(s, 0);
    CHECK_THROWS_WITH(q2.update_signal(1, std::nullopt, 2),
                      Catch::Contains("called update_signal not on a signal command: command 1 is a wait"));
    // A copy past a buffer's end.
    auto c = dev.copy_queue();
    CHECK_THROWS_WITH(c.copy(a.allocation(), b.allocation(), b.nbytes()),
                      Catch::Contains("past the end of the destination") &&
                          Catch::Contains("copy at most " + std::to_string(a.nbytes()) + " bytes"));
    CHECK(c.size() == 0);
    c.copy(b.allocation(), a.allocation(), a.nbytes());
    CHECK_THROWS_AS(c.update_copy(0, std::nullopt, Allocation{a.allocation().va_addr, 4, nullptr}), InvalidArgument);
    c.signal(s, 1);
    CHECK_THROWS_WITH(c.update_copy(1, b.allocation(), std::nullopt),
                      Catch::Contains("called update_copy not on a copy command: command 1 is a signal"));
    // Submitting to a device of another kind.
    CHECK_THROWS_WITH(q2.submit(Device["FAKE"]), Catch::Contains("cannot submit"));
    CHECK(s.value() == 0);  // nothing half-submitted
    dev.free_signal(s);
  });
}

TEST_CASE("hcq: a failure poisons the signals its queue would set", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    Signal upstream = dev.alloc_signal(0), downstream = dev.alloc_signal(0);
    dev.compute_queue().wait(upstream, 1).signal(downstream, 1).submit(dev);
    upstream.poison("the copy engine faulted");
    CHECK_THROWS_WITH(downstream.wait(1, 5000ms), Catch::Contains("poisoned") && Catch::Contains("copy engine faulted"));
    CHECK_THROWS_WITH(upstream.wait(1, 100ms), Catch::Contains("poisoned"));
    // The device keeps working for everything else.
    dev.synchronize();
    Signal fine = dev.alloc_signal(0);
    dev.compute_queue().signal(fine, 2).submit(dev);
    fine.wait(2, 5000ms);
  }, Needs{});
}

TEST_CASE("hcq: direct program calls run after queued work", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    auto ping = load_program(dev, "ping", inc_kernel("ping"));
    Buffer a = int_counter(dev);
    Signal gate = dev.alloc_signal(0);
    Kernargs args = dev.alloc_kernargs(2, 0);
    const Allocation aa[] = {a.allocation(), a.allocation()};
    fill_kernargs(*ping, args, aa, {});
    submit_ordered(dev, [&](auto& q) { q.wait(gate, 1).exec(*ping, args, {1, 1, 1}, {1, 1, 1}); });
    {
      const GateOpener opener(gate, 20ms);
      (*ping)(aa, {});  // waits for the queued increment first: 0 -> 1 -> 2
    }
    CHECK(read_int(a) == 2);
  }, Needs{.kernels = true, .cuda_too = true});
}

TEST_CASE("hcq: kernargs allocation never blocks - even holding an unsubmitted timeline value", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    auto ping = load_program(dev, "ping", inc_kernel("ping"));
    Buffer a = int_counter(dev);
    const Allocation aa[] = {a.allocation(), a.allocation()};
    std::lock_guard lock(dev.submit_mutex());
    const std::uint64_t v = dev.next_timeline_value();  // reserved, not yet submitted
    auto q = dev.compute_queue();
    q.wait(dev.timeline_signal(), v - 1);
    const auto t0 = std::chrono::steady_clock::now();
    Kernargs first = dev.alloc_kernargs(2, 0);
    fill_kernargs(*ping, first, aa, {});
    q.exec(*ping, first, {1, 1, 1}, {1, 1, 1});
    for (int i = 0; i < 200000; ++i) dev.alloc_kernargs(2, 0);  // ~3 MiB: several pages
    CHECK(std::chrono::steady_clock::now() - t0 < 5s);
    CHECK(first.buffer(0) == a.allocation().va_addr);  // still intact: its page is not reused yet
    q.signal(dev.timeline_signal(), v).submit(dev);
    dev.synchronize();
    CHECK(read_int(a) == 1);
  }, Needs{.kernels = true, .cuda_too = true});
}

TEST_CASE("hcq: memory freed while a staged copy is in flight is only freed after it", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    ScopedOverride no_cache("TINYDEV_LRU", "0");  // frees are real
    Signal gate = dev.alloc_signal(0);
    submit_ordered(dev, [&](auto& q) { q.wait(gate, 1); });  // holds the timeline until the gate opens
    const auto data = random_bytes((5u << 20) + 7, fresh_seed());
    {
      const GateOpener opener(gate, 30ms);
      Buffer tmp(dev.name(), data.size(), dtypes::uint8);
      tmp.allocate().copyin(data);  // the device is busy: staged, queued behind the gate
    }  // freed here: must wait for the queued copy, or the worker writes freed memory (ASan)
    dev.synchronize();
    Buffer check(dev.name(), data.size(), dtypes::uint8);
    check.allocate().copyin(data);
    std::vector<std::byte> back(data.size());
    check.copyout(back);
    CHECK(back == data);
  }, Needs{});
}

TEST_CASE("hcq: kernargs allocated before the timeline value is taken stay intact", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    auto ping = load_program(dev, "ping", inc_kernel("ping"));
    Buffer a = int_counter(dev);
    const Allocation aa[] = {a.allocation(), a.allocation()};
    dev.synchronize();  // idle: the case where a just-retired page could look free
    std::lock_guard lock(dev.submit_mutex());
    Kernargs first = dev.alloc_kernargs(2, 0);
    fill_kernargs(*ping, first, aa, {});
    for (int i = 0; i < 200000; ++i) dev.alloc_kernargs(2, 0);
    CHECK(first.buffer(0) == a.allocation().va_addr);
    const std::uint64_t v = dev.next_timeline_value();
    dev.compute_queue().wait(dev.timeline_signal(), v - 1).exec(*ping, first, {1, 1, 1}, {1, 1, 1})
        .signal(dev.timeline_signal(), v).submit(dev);
    dev.synchronize();
    CHECK(read_int(a) == 1);
  }, Needs{.kernels = true, .cuda_too = true});
}

TEST_CASE("hcq: a signal freed while work is in flight is dead at once - freeing twice is an error", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    Signal gate = dev.alloc_signal(0), s = dev.alloc_signal(5);
    submit_ordered(dev, [&](auto& q) { q.wait(gate, 1); });  // holds the timeline until the gate opens
    dev.free_signal(s);
    CHECK_THROWS_WITH(s.value(), Catch::Contains("was freed"));
    CHECK_THROWS_WITH(dev.free_signal(s), Catch::Contains("freed twice"));
    gate.set(1);
    dev.synchronize();
    Signal fresh = dev.alloc_signal(9);  // the device keeps working
    CHECK(fresh.value() == 9);
    fresh.wait(9, std::chrono::milliseconds::max());  // "forever" does not overflow
    dev.free_signal(fresh);
    dev.free_signal(gate);
  }, Needs{});
}

TEST_CASE("hcq: more bad input: foreign programs in graphs - missing or oversized kernargs", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    auto* other = second_device(dev);
    if (!other) return;
    auto foreign = other->load_kernel("ping", inc_kernel("ping").for_device(*other));
    CHECK_THROWS_WITH(dev.create_graph({GraphKernel{foreign, {GraphBuffer::in(0), GraphBuffer::in(1)}, {}}}),
                      Catch::Contains("was loaded by " + other->name() + ", not by " + dev.name() + "'s runtime"));
    auto ping = load_program(dev, "ping", inc_kernel("ping"));
    auto q = dev.compute_queue();
    CHECK_THROWS_WITH(q.exec(*ping, Kernargs{nullptr, 2, 0}, {1, 1, 1}, {1, 1, 1}), Catch::Contains("have no memory"));
    CHECK(q.size() == 0);
    CHECK_THROWS_WITH(dev.alloc_kernargs(200000, 0), Catch::Contains("do not fit"));
    CHECK_THROWS_WITH(q.exec(*ping, dev.alloc_kernargs(2, 0), {0, 1, 1}, {1, 1, 1}), Catch::Contains("zero dimension"));
  }, Needs{.kernels = true, .cuda_too = true});
}

TEST_CASE("hcq: transfer within one device and a custom staging ring shape", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    const auto data = random_bytes((3u << 20) + 5, fresh_seed());
    Buffer a(dev.name(), data.size(), dtypes::uint8), b(dev.name(), data.size(), dtypes::uint8);
    a.allocate().copyin(data);
    b.allocate();
    auto& allocator = hcq_allocator(dev);
    allocator.transfer(b.allocation(), a.allocation(), data.size(), dev, dev);  // must not wait on itself
    std::vector<std::byte> back(data.size());
    b.copyout(back);
    CHECK(back == data);
    hcq_allocator(dev).set_staging_shape(1u << 20, 3);
    hcq_allocator(dev).set_force_staging(true);
    Buffer c(dev.name(), data.size(), dtypes::uint8);
    c.allocate().copyin(data);
    std::vector<std::byte> back2(data.size());
    c.copyout(back2);
    hcq_allocator(dev).set_force_staging(false);
    CHECK(back2 == data);
    CHECK(hcq_allocator(dev).staging_batch_count() == 3);
    allocator.set_staging_shape(allocator.kDefaultBatchSize, 4);
    CHECK_THROWS_AS(hcq_allocator(dev).set_staging_shape(0, 4), InvalidArgument);
  }, Needs{});
}

TEST_CASE("hcq: a signal freed on one device is not reused while another device's queue uses it", "[hcq]") {
  for_each_hcq_device([](auto& first) {
    auto* second = second_device(first);
    if (!second) return;
    auto& other = *second;
    Signal gate = other.alloc_signal(0);
    Signal shared = first.alloc_signal(0);
    {
      std::lock_guard lock(other.submit_mutex());
      const std::uint64_t v = other.next_timeline_value();
      other.compute_queue().wait(other.timeline_signal(), v - 1).wait(gate, 1).signal(shared, 2)
          .signal(other.timeline_signal(), v).submit(other);
    }
    const std::uint32_t index = shared.index();
    first.free_signal(shared);  // the second device's queued command will still write it
    std::vector<Signal> fresh;
    for (int i = 0; i < 600; ++i) fresh.push_back(first.alloc_signal(0));
    for (const Signal& s : fresh) CHECK(s.index() != index);
    gate.set(1);
    other.synchronize();
    for (const Signal& s : fresh) {
      CHECK(s.value() == 0);  // nobody's write landed in a reused slot
      first.free_signal(s);
    }
  }, Needs{});
}

TEST_CASE("hcq: a queued exec with the wrong number of values is rejected", "[hcq]") {
  for_each_hcq_device([](auto& dev) {
    auto fill = load_program(dev, "fill", kFill);  // 1 buffer, 1 value (+ the grid index)
    auto q = dev.compute_queue();
    CHECK_THROWS_WITH(q.exec(*fill, dev.alloc_kernargs(1, 3), {4, 1, 1}, {1, 1, 1}),
                      Catch::Contains("takes 1 buffers and 2 values, got 1 and 3"));
    CHECK_THROWS_WITH(q.exec(*fill, dev.alloc_kernargs(1, 1), {1, 1, 1}, {1, 1, 1}), Catch::Contains("got 1 and 1"));
    CHECK(q.size() == 0);
  });
}
