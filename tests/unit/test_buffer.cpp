#include "support.hpp"

using namespace tinydev;
using namespace tinydev::testing;

TEST_CASE("buffer: allocation is lazy and allocating twice is an error", "[buffer]") {
  FakeDevice& dev = fake_device();
  const int before = dev.fake->backend_allocs;
  Buffer b("fake", 1000, dtypes::float32);
  CHECK_FALSE(b.is_allocated());
  CHECK(b.nbytes() == 4000);
  CHECK(dev.fake->backend_allocs == before);
  b.allocate();
  CHECK(b.is_allocated());
  CHECK_THROWS_WITH(b.allocate(), Catch::Contains("already allocated"));
  Allocation a = b.allocation();
  b.ensure_allocated();
  CHECK(b.allocation() == a);
  CHECK(b.device() == "FAKE");
}

TEST_CASE("buffer: copyin and copyout round-trip random data", "[buffer]") {
  fake_device();
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const std::size_t n = 1 + seed % 4096;
  auto data = random_floats(n, seed);
  Buffer b("fake", n, dtypes::float32);
  b.allocate().copyin(std::span<const float>(data));
  std::vector<float> back(n);
  b.copyout(std::span<float>(back));
  CHECK(back == data);
  HostBytes copy = b.as_buffer();
  CHECK_FALSE(copy.is_zero_copy());
  CHECK(std::equal(copy.as<float>().begin(), copy.as<float>().end(), data.begin()));
}

TEST_CASE("buffer: size mismatches and unallocated buffers are errors", "[buffer]") {
  fake_device();
  Buffer b("fake", 16, dtypes::int32);
  std::vector<std::int32_t> right(16), wrong(15);
  CHECK_THROWS_WITH(b.copyin(std::span<const std::int32_t>(right)), Catch::Contains("unallocated"));
  CHECK_THROWS_WITH(b.copyout(std::span<std::int32_t>(right)), Catch::Contains("unallocated"));
  CHECK_THROWS_AS(b.allocation(), InvalidArgument);
  b.allocate();
  CHECK_THROWS_WITH(b.copyin(std::span<const std::int32_t>(wrong)), Catch::Contains("size mismatch"));
  CHECK_THROWS_WITH(b.copyout(std::span<std::int32_t>(wrong)), Catch::Contains("size mismatch"));
}

TEST_CASE("buffer: views see their base at an offset - a view of a view is rooted at the base", "[buffer]") {
  fake_device();
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  auto data = random_floats(64, seed);
  Buffer base("fake", 64, dtypes::float32);
  base.allocate().copyin(std::span<const float>(data));
  Buffer v = base.view(32, dtypes::float32, 16 * 4);  // elements 16..47
  CHECK(v.is_view());
  CHECK(v.offset() == 64);
  Buffer vv = v.view(8, dtypes::float32, 4 * 4);  // elements 20..27 of the base
  CHECK(vv.offset() == 80);
  CHECK(vv.base().offset() == 0);
  CHECK_FALSE(vv.base().is_view());
  std::vector<float> got(8);
  vv.ensure_allocated().copyout(std::span<float>(got));
  CHECK(std::equal(got.begin(), got.end(), data.begin() + 20));
  // Writing through a view changes the base.
  auto fresh = random_floats(8, seed + 1);
  vv.copyin(std::span<const float>(fresh));
  std::vector<float> all(64);
  base.copyout(std::span<float>(all));
  CHECK(std::equal(fresh.begin(), fresh.end(), all.begin() + 20));
  CHECK(all[19] == data[19]);
  CHECK(all[28] == data[28]);
  // A view with another dtype reinterprets the bytes.
  Buffer bytes = base.view(4, dtypes::uint8, 0);
  std::vector<std::uint8_t> raw(4);
  bytes.ensure_allocated().copyout(std::span<std::uint8_t>(raw));
  CHECK(std::memcmp(raw.data(), all.data(), 4) == 0);
}

TEST_CASE("buffer: out-of-range views are errors", "[buffer]") {
  fake_device();
  Buffer base("fake", 16, dtypes::float32);  // 64 bytes
  CHECK_THROWS_WITH(base.view(1, dtypes::float32, 64), Catch::Contains("offset must be less than nbytes"));
  CHECK_THROWS_WITH(base.view(2, dtypes::float32, 60), Catch::Contains("runs past the end"));
  Buffer v = base.view(4, dtypes::float32, 32);  // 16 bytes
  CHECK_THROWS_AS(v.view(5, dtypes::float32, 0), InvalidArgument);
  CHECK_NOTHROW(v.view(4, dtypes::float32, 0));
}

TEST_CASE("buffer: a view keeps its base alive", "[buffer]") {
  FakeDevice& dev = fake_device();
  const std::uint64_t seed = fresh_seed();
  auto data = random_floats(32, seed);
  std::optional<Buffer> view;
  const std::uint64_t live_before = dev.fake->live_bytes;
  {
    Buffer base("fake", 32, dtypes::float32, BufferOptions{.nolru = true});
    base.allocate().copyin(std::span<const float>(data));
    view = base.view(16, dtypes::float32, 64);
    view->ensure_allocated();
  }
  CHECK(dev.fake->live_bytes == live_before + 128);  // the base is still held
  std::vector<float> got(16);
  view->copyout(std::span<float>(got));
  CHECK(std::equal(got.begin(), got.end(), data.begin() + 16));
  view.reset();
  CHECK(dev.fake->live_bytes == live_before);  // nolru: freed for real with the last handle
}

TEST_CASE("buffer: mem_used counts allocated bases - not views", "[buffer]") {
  fake_device();
  const std::int64_t before = GlobalCounters::mem_used;
  {
    Buffer b("fake", 250, dtypes::float64);
    CHECK(GlobalCounters::mem_used == before);
    b.allocate();
    CHECK(GlobalCounters::mem_used == before + 2000);
    Buffer v = b.view(10, dtypes::float64, 0);
    v.ensure_allocated();
    CHECK(GlobalCounters::mem_used == before + 2000);
  }
  CHECK(GlobalCounters::mem_used == before);
}

TEST_CASE("buffer: initial value - preallocate and adoption", "[buffer]") {
  FakeDevice& dev = fake_device();
  const std::uint64_t seed = fresh_seed();
  auto bytes = random_bytes(300, seed);
  Buffer init("fake", 150, dtypes::float16, Buffer::Params{.initial_value = bytes});
  CHECK(init.is_allocated());
  HostBytes got = init.as_buffer();
  CHECK(std::equal(got.bytes().begin(), got.bytes().end(), bytes.begin()));
  CHECK_THROWS_WITH(Buffer("fake", 100, dtypes::float16, Buffer::Params{.initial_value = bytes}),
                    Catch::Contains("initial value has 300 bytes"));

  Buffer pre("fake", 10, dtypes::int8, Buffer::Params{.preallocate = true});
  CHECK(pre.is_allocated());

  Allocation theirs = dev.allocator().alloc(400);
  dev.allocator().copyin(theirs, bytes);
  {
    Buffer adopted("fake", 100, dtypes::int32, Buffer::Params{.adopt = theirs});
    CHECK(adopted.is_allocated());
    CHECK(adopted.allocation() == theirs);
    std::vector<std::byte> out(400);
    adopted.copyout(out);
    CHECK(std::equal(out.begin(), out.begin() + 300, bytes.begin()));
  }
  // The adopted memory went back to the allocator's cache with the buffer.
  Allocation again = dev.allocator().alloc(400);
  CHECK(again == theirs);
  dev.allocator().free(again, 400);
}

TEST_CASE("buffer: as_buffer zero copy where the memory is host-visible", "[buffer]") {
  fake_device();
  fake_device("FAKEDEV");
  const std::uint64_t seed = fresh_seed();
  auto data = random_floats(100, seed);
  Buffer host("fake", 100, dtypes::float32);
  host.allocate().copyin(std::span<const float>(data));
  HostBytes zc = host.as_buffer(/*allow_zero_copy=*/true);
  CHECK(zc.is_zero_copy());
  CHECK(zc.data() == host.allocation().host_ptr<std::byte>());
  CHECK(zc.as<float>()[42] == data[42]);

  Buffer dev("fakedev", 100, dtypes::float32);
  dev.allocate().copyin(std::span<const float>(data));
  HostBytes copy = dev.as_buffer(true);
  CHECK_FALSE(copy.is_zero_copy());
  CHECK(copy.as<float>()[7] == data[7]);
  CHECK_THROWS_WITH(dev.as_buffer(false, /*force_zero_copy=*/true),
                    Catch::Contains("force zero copy was passed, but copy is required"));
}

TEST_CASE("buffer: views need an allocator with offsets", "[buffer]") {
  fake_device("FAKEDEV");
  Buffer base("fakedev", 16, dtypes::float32);
  Buffer v = base.view(4, dtypes::float32, 0);
  CHECK_THROWS_WITH(v.allocate(), Catch::Contains("cannot make views"));
  CHECK(base.is_allocated());  // the base allocation itself is fine and stays
}

TEST_CASE("buffer: bad device names fail at construction", "[buffer]") {
  CHECK_THROWS_AS(Buffer("", 4, dtypes::float32), InvalidArgument);
  Buffer unknown("nosuch", 4, dtypes::float32);  // parsing never opens a device
  CHECK_THROWS_WITH(unknown.allocate(), Catch::Contains("unknown device"));
  CHECK_FALSE(unknown.is_allocated());
}

TEST_CASE("buffer: lb_refcount lives on the base", "[buffer]") {
  fake_device();
  Buffer base("fake", 8, dtypes::float32);
  Buffer v = base.view(2, dtypes::float32, 8);
  v.ref(3);
  CHECK(base.lb_refcount() == 3);
  base.ref(-1);
  CHECK(v.lb_refcount() == 2);
  CHECK(v.repr().find("offset:8") != std::string::npos);
}

TEST_CASE("buffer: repr lists the options set and nothing for the default ones", "[buffer]") {
  fake_device();
  const Buffer plain("fake", 8, dtypes::float32);
  CHECK(plain.repr() == "<buf real:false device:FAKE size:8 dtype:float>");
  const Buffer pinned("fake", 8, dtypes::float32, BufferOptions{.host = true, .nolru = true});
  CHECK(pinned.repr() == "<buf real:false device:FAKE size:8 dtype:float options:host,nolru>");
  const Buffer uncached("fake", 8, dtypes::float32, BufferOptions{.uncached = true, .cpu_access = true});
  CHECK(uncached.repr().find(" options:uncached,cpu_access>") != std::string::npos);
  CHECK(pinned.view(1, dtypes::float32, 4).repr() == "<buf real:false device:FAKE size:1 dtype:float offset:4>");
}

TEST_CASE("dtype: sizes and names", "[buffer]") {
  CHECK(dtypes::all().size() == 13);
  CHECK(dtype_from_name("float32") == dtypes::float32);
  CHECK(dtype_from_name("half") == dtypes::float16);
  CHECK(dtype_from_name("bfloat16").itemsize == 2);
  CHECK(dtypes::uint64.itemsize == 8);
  CHECK_THROWS_WITH(dtype_from_name("float128"), Catch::Contains("unknown dtype 'float128'"));
}

TEST_CASE("buffer: adopting an allocation smaller than the buffer is an error", "[buffer]") {
  FakeDevice& dev = fake_device();
  Allocation small = dev.allocator().alloc(100);
  CHECK_THROWS_WITH(Buffer("fake", 100, dtypes::int32, Buffer::Params{.adopt = small}),
                    Catch::Contains("cannot adopt an allocation of 100 bytes for a buffer of 400 bytes"));
  dev.allocator().free(small, 100);
}

TEST_CASE("device: a device without a runtime says so when asked for a kernel", "[buffer]") {
  FakeDevice& dev = fake_device();
  CHECK_THROWS_WITH(dev.load_kernel("k", "source"), Catch::Contains("runs no kernels"));
  Compiler none;  // the base compiler (the seed's Compiler()): compiles nothing
  CHECK_THROWS_WITH(none.compile_cached("x"), Catch::Contains("has no compiler"));
}

// ---- ownership and concurrent allocation (Note [Buffer allocation]) ----------------------------

TEST_CASE("buffer: memory a Buffer allocated is its own: no other Buffer adopts it and no plain free takes it", "[buffer]") {
  FakeDevice& dev = fake_device();
  const auto bytes = random_bytes(400, fresh_seed());
  const auto rejected = dev.fake->stats().rejected_frees;
  {
    Buffer owner("fake", 100, dtypes::int32);
    owner.allocate().copyin(bytes);
    // Either would hand the memory back to the cache while `owner` still uses it, and the next
    // buffer of that size would share it.
    CHECK_THROWS_WITH(Buffer("fake", 100, dtypes::int32, Buffer::Params{.adopt = owner.allocation()}),
                      Catch::Contains("adopted by another buffer already"));
    CHECK_THROWS_WITH(dev.allocator().free(owner.allocation(), 400), Catch::Contains("which a Buffer adopted"));
    Buffer next("fake", 100, dtypes::int32);
    next.allocate();
    CHECK(next.allocation().va_addr != owner.allocation().va_addr);
    std::vector<std::byte> out(400);
    owner.copyout(out);
    CHECK(out == bytes);
  }
  // The refused free counted; the buffers' own frees went through.
  CHECK(dev.fake->stats().rejected_frees == rejected + 1);
}

TEST_CASE("buffer: a wrong initial value leaves the allocation offered for adoption with its owner", "[buffer]") {
  FakeDevice& dev = fake_device();
  Allocation mine = dev.allocator().alloc(400);
  const auto wrong = random_bytes(300, fresh_seed());
  CHECK_THROWS_WITH(Buffer("fake", 100, dtypes::int32, Buffer::Params{.adopt = mine, .initial_value = wrong}),
                    Catch::Contains("initial value has 300 bytes"));
  REQUIRE(dev.allocator().live_info(mine).has_value());  // not freed into the cache by the failed buffer
  CHECK_NOTHROW(dev.allocator().free(mine, 400));       // and still the caller's, not marked adopted
}

TEST_CASE("buffer: an adopted allocation larger than the buffer shows the buffer's bytes and its real size", "[buffer]") {
  FakeDevice& dev = fake_device();
  fake_device("FAKEDEV");
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const auto big_bytes = random_bytes(1000, seed);
  for (const std::uint64_t claimed : {std::uint64_t{1000}, std::uint64_t{0}}) {
    INFO("adopted with size " << claimed);
    Allocation big = dev.allocator().alloc(1000);
    dev.allocator().copyin(big, big_bytes);
    Buffer src("fake", 100, dtypes::int32, Buffer::Params{.adopt = Allocation{big.va_addr, claimed, big.backend}});
    CHECK(src.allocation().size == 1000);  // what the allocator handed out, whatever the caller said
    CHECK(src.as_buffer(true).size() == 400);
    CHECK(src.as_buffer(false).size() == 400);
    // Through the host into device-like memory: the buffer's 400 bytes, not the allocation's 1000.
    Buffer dst("FAKEDEV", 100, dtypes::int32);
    CHECK(copy(dst, src) == CopyPath::copyin);
    std::vector<std::byte> out(400);
    dst.copyout(out);
    CHECK(std::equal(out.begin(), out.end(), big_bytes.begin()));
    const auto fresh = random_bytes(400, seed + 1);
    CHECK_NOTHROW(src.copyin(fresh));
    src.copyout(out);
    CHECK(out == fresh);
  }
}

TEST_CASE("buffer: views of one base allocated from two threads at once allocate the base once", "[buffer][threads]") {
  FakeDevice& dev = fake_device();
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const auto first = random_bytes(256, seed), second = random_bytes(256, seed + 1);
  for (int round = 0; round < 200; ++round) {
    const auto live_before = dev.fake->stats().live_allocations;
    const auto used_before = GlobalCounters::mem_used.load();
    {
      Buffer base("fake", 512, dtypes::uint8);
      Buffer a = base.view(256, dtypes::uint8, 0), b = base.view(256, dtypes::uint8, 256);
      std::atomic<int> ready{0};
      auto fill = [&](Buffer& v, const std::vector<std::byte>& bytes) {
        ready.fetch_add(1);
        while (ready.load() < 2) std::this_thread::yield();
        v.ensure_allocated().copyin(bytes);
      };
      std::thread t([&] { fill(b, second); });
      fill(a, first);
      t.join();
      REQUIRE(dev.fake->stats().live_allocations == live_before + 1);
      REQUIRE(GlobalCounters::mem_used.load() == used_before + 512);
      // Both views landed in the one base.
      std::vector<std::byte> out(512);
      base.copyout(out);
      REQUIRE(std::equal(first.begin(), first.end(), out.begin()));
      REQUIRE(std::equal(second.begin(), second.end(), out.begin() + 256));
    }
    REQUIRE(dev.fake->stats().live_allocations == live_before);
  }
}

TEST_CASE("buffer: copies from one unallocated view of an allocated base into two buffers at once", "[buffer][threads]") {
  fake_device();
  fake_device("FAKEDEV");
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const auto bytes = random_bytes(1024, seed);
  Buffer base("fake", 1024, dtypes::uint8);
  base.allocate().copyin(bytes);
  for (int round = 0; round < 200; ++round) {
    Buffer slice = base.view(512, dtypes::uint8, 256);  // shared by both copies, allocated by them
    Buffer d1("FAKEDEV", 512, dtypes::uint8), d2("FAKEDEV", 512, dtypes::uint8);
    std::atomic<int> ready{0};
    std::atomic<int> failures{0};
    auto run = [&](const Buffer& dest) {
      ready.fetch_add(1);
      while (ready.load() < 2) std::this_thread::yield();
      try {
        copy(dest, slice);
      } catch (const std::exception&) {
        failures.fetch_add(1);
      }
    };
    std::thread t([&] { run(d2); });
    run(d1);
    t.join();
    REQUIRE(failures.load() == 0);
    for (const Buffer* d : {&d1, &d2}) {
      std::vector<std::byte> out(512);
      d->copyout(out);
      REQUIRE(std::equal(out.begin(), out.end(), bytes.begin() + 256));
    }
  }
}

TEST_CASE("host memory: copies between overlapping ranges of one allocation move the bytes as memmove does", "[buffer]") {
  MallocAllocator host;
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const std::size_t n = std::size_t{4} << 20, shift = 4096 + 64;
  const auto bytes = random_bytes(n, seed);
  Allocation a = host.alloc(n);
  for (const bool forward : {true, false}) {
    INFO((forward ? "to a later" : "to an earlier") << " range");
    host.copyin(a, bytes);
    const std::size_t from = forward ? 0 : shift, to = forward ? shift : 0;
    // copy() of two overlapping views passes the source's zero-copy window to the copyin.
    const auto window = *host.as_buffer(host.offset(a, n - shift, from));
    host.copyin(host.offset(a, n - shift, to), window);
    std::vector<std::byte> out(n);
    host.copyout(out, a);
    CHECK(std::equal(out.begin() + static_cast<std::ptrdiff_t>(to), out.begin() + static_cast<std::ptrdiff_t>(to + n - shift),
                     bytes.begin() + static_cast<std::ptrdiff_t>(from)));
  }
  host.free(a, n);
}
