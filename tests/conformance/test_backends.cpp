// Device-level behaviour every backend must show: one instance per name, errors from the compiler
// and the loader, the compile cache with the real compiler, timing and counters.
#include <thread>

#include "conformance.hpp"
#include "cpu_blob.hpp"
#include "tinydev/config.hpp"
#include "demo_kernels.hpp"

using namespace tinydev;
using namespace tinydev::testing;

namespace {
const KernelSource kBroken{"define void @add(ptr %o {\n  ret void\n}\n",
                           "void add(float* o) { this is not C; }\n"};
const KernelSource kUnresolved{
    "declare void @tinydev_no_such_function()\n"
    "define void @calls_missing() {\n  call void @tinydev_no_such_function()\n  ret void\n}\n",
    "void tinydev_no_such_function(void);\nvoid calls_missing(void) { tinydev_no_such_function(); }\n"};
}  // namespace

TEST_CASE("backends: every backend of this build is registered in order and the default device is one of them", "[backends][host]") {
  const auto types = Device.backends();
  REQUIRE(types.size() >= build_backends().size());
  for (std::size_t i = 0; i < build_backends().size(); ++i) CHECK(types[i] == build_backends()[i].type);
  ScopedOverride unset("TINYDEV_DEVICE", std::nullopt);
  const std::string def = Device.default_device();
  CHECK((def == "LLVM" || def == "CLANG" || def == "CUDA"));
  CHECK(std::find(types.begin(), types.end(), def) != types.end());
  // It is the first of CUDA, LLVM and CLANG in this build that opens: a build with CUDA on a
  // machine without a GPU moves on to LLVM.
  std::string first_that_opens;
  for (const char* candidate : {"CUDA", "LLVM", "CLANG"}) {
    if (std::find(types.begin(), types.end(), candidate) == types.end()) continue;
    try {
      Device[candidate];
      first_that_opens = candidate;
      break;
    } catch (const DeviceUnavailable& e) {
      UNSCOPED_INFO(candidate << " does not open: " << e.what());
    }
  }
  CHECK(def == first_that_opens);
}

TEST_CASE("backends: one instance per canonical name even from 16 threads", "[backends]") {
  for_each_backend([](Compiled& dev) {
    std::string lower = dev.name();
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    CHECK(&Device[lower] == &dev);
    CHECK(&Device[lower + ":0"] == &dev);
    CHECK_FALSE(dev.properties().empty());
    // The second device of the type ("LLVM:1", "CUDA:1"), opened by 16 threads at once. A GPU
    // machine with one GPU has none: each thread then sees the same DeviceUnavailable.
    std::vector<Compiled*> seen(16, nullptr);
    std::vector<std::string> errors(16);
    std::vector<std::thread> threads;
    const std::string second = dev.name() + ":1";
    for (int i = 0; i < 16; ++i)
      threads.emplace_back([&, i] {
        try {
          seen[i] = &Device[second];
        } catch (const DeviceUnavailable& e) {
          errors[i] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    if (!errors[0].empty()) {
      for (const std::string& e : errors) CHECK(e == errors[0]);
      return skip("no second " + dev.name() + " device here: " + errors[0]);
    }
    for (Compiled* p : seen) CHECK(p == seen[0]);
    CHECK(seen[0] != &dev);
    CHECK(seen[0]->name() == second);
  });
}

TEST_CASE("backends: invalid source is a CompileError carrying the compiler's log", "[backends]") {
  for_each_backend(Needs{.kernels = true, .rejects_invalid_source = true}, [](Compiled& dev) {
    try {
      dev.compiler().compile(kBroken.for_device(dev));
      FAIL("expected a CompileError");
    } catch (const CompileError& e) {
      INFO(e.what());
      CHECK_FALSE(e.log().empty());
      CHECK(e.log().find("error") != std::string::npos);
      CHECK(e.code() == ErrorCode::compile);
    }
    // Through load_kernel the error also says where: the device and the kernel, in what() (one
    // line) and as fields, with the compiler's whole log kept in log().
    const std::string kernel = "broken_" + std::to_string(fresh_seed() % 100000);
    try {
      dev.load_kernel(kernel, kBroken.for_device(dev));
      FAIL("expected a CompileError");
    } catch (const CompileError& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(e.device() == dev.name());
      CHECK(e.kernel() == kernel);
      CHECK(what.find("'" + kernel + "'") != std::string::npos);
      CHECK(what.starts_with(dev.name()));
      CHECK(what.find('\n') == std::string::npos);
      CHECK(e.log().find("error") != std::string::npos);
    }
  });
}

TEST_CASE("backends: a missing kernel name and an unresolved symbol are clear errors", "[backends]") {
  for_each_backend(Needs{.kernels = true, .host_objects = true}, [](Compiled& dev) {
    Blob blob = dev.compiler().compile_cached(kernels::add_f32(dev.source_language()));
    CHECK_THROWS_WITH(dev.runtime().load("nope", blob),
                      Catch::Contains("'nope' is not in the compiled object") && Catch::Contains("add"));
    CHECK_THROWS_WITH(dev.runtime().load("add", Blob(100, std::byte{7})),
                      Catch::Contains("is not a loadable object: it is not an ELF file"));
    Blob missing = dev.compiler().compile(kUnresolved.for_device(dev));
    CHECK_THROWS_WITH(dev.runtime().load("calls_missing", missing),
                      Catch::Contains("tinydev_no_such_function"));
    // The device still works after the failures.
    auto prg = dev.runtime().load("add", blob);
    CHECK(prg->name() == "add");
  });
}

TEST_CASE("backends: launches with the wrong counts or an empty grid or too many arguments are rejected", "[backends]") {
  for_each_backend(Needs{.kernels = true, .checks_signatures = true, .host_objects = true}, [](Compiled& dev) {
    auto prg = dev.load_kernel("add", kernels::add_f32(dev.source_language()));
    REQUIRE(prg->signature().has_value());
    CHECK(*prg->signature() == KernelSignature{3, 1});
    Buffer o(dev.name(), 4, dtypes::float32);
    o.allocate();
    const Allocation bufs[] = {o.allocation(), o.allocation(), o.allocation()};
    const std::int32_t vals[] = {4};
    CHECK_THROWS_WITH((*prg)(std::span(bufs, 2), vals), Catch::Contains("takes 3 buffers and 1 values, got 2 and 1"));
    CHECK_THROWS_WITH((*prg)(bufs, {}), Catch::Contains("got 3 and 0"));
    CHECK_THROWS_WITH((*prg)(bufs, vals, LaunchParams{.global = {2, 0, 1}}), Catch::Contains("zero dimension"));
    const Blob wrapped = dev.compiler().compile_cached(kernels::add_f32(dev.source_language()));
    auto unchecked = dev.runtime().load("add", cpu::unwrap_object(wrapped).object);
    CHECK_FALSE(unchecked->signature().has_value());  // a bare object: counts are the caller's business
    std::vector<Allocation> many(70, o.allocation());
    CHECK_THROWS_WITH((*unchecked)(many, vals), Catch::Contains("more than the 64 arguments"));
  });
}

TEST_CASE("backends: wait returns the kernel's time and the counters move", "[backends]") {
  for_each_backend(Needs{.add_kernel = true}, [](Compiled& dev) {
    auto prg = dev.load_kernel("add", kernels::add_f32(dev.source_language()));
    const std::size_t n = 1 << 16;
    auto a = random_floats(n, fresh_seed());
    Buffer ba(dev.name(), n, dtypes::float32), bo(dev.name(), n, dtypes::float32);
    ba.allocate().copyin(std::span<const float>(a));
    bo.allocate();
    const Allocation bufs[] = {bo.allocation(), ba.allocation(), ba.allocation()};
    const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
    const auto kernels_before = GlobalCounters::kernel_count.load();
    const double time_before = GlobalCounters::time_sum.load();
    CHECK_FALSE((*prg)(bufs, vals).has_value());
    std::optional<double> t = (*prg)(bufs, vals, LaunchParams{.wait = true});
    REQUIRE(t.has_value());
    CHECK(*t > 0.0);
    CHECK(*t < 10.0);
    CHECK(GlobalCounters::kernel_count == kernels_before + 2);
    CHECK(GlobalCounters::time_sum.load() >= time_before + *t * 0.999);
    std::vector<float> out(n);
    bo.copyout(std::span<float>(out));
    for (std::size_t i = 0; i < n; ++i) REQUIRE(out[i] == a[i] + a[i]);
  });
}

TEST_CASE("backends: compile_cached with the real compiler: cache on and disabled and asserted", "[backends]") {
  for_each_backend(Needs{.add_kernel = true, .caches_compiles = true}, [](Compiled& dev) {
    TempDir dir;
    ScopedOverride folder("TINYDEV_CACHE_DIR", dir.str());
    const std::string src = kernels::add_f32(dev.source_language(), "add_" + std::to_string(fresh_seed() % 1000000));
    const auto before = DiskCache::global().stats();
    Blob cold = dev.compiler().compile_cached(src);
    CHECK_FALSE(cold.empty());
    CHECK(DiskCache::global().stats().writes == before.writes + 1);
    DiskCache::global().drop_memory_layer();
    {
      ScopedOverride strict("TINYDEV_ASSERT_COMPILE", "1");
      CHECK(dev.compiler().compile_cached(src) == cold);
    }
    CHECK(DiskCache::global().stats().disk_hits == before.disk_hits + 1);
    {
      ScopedOverride off("TINYDEV_DISABLE_COMPILER_CACHE", "1");
      ScopedOverride strict("TINYDEV_ASSERT_COMPILE", "1");
      CHECK_THROWS_AS(dev.compiler().compile_cached(src), CompileError);  // bypassed: a real compile
    }
    const std::string other = kernels::add_f32(dev.source_language(), "other_" + std::to_string(fresh_seed() % 1000000));
    ScopedOverride strict("TINYDEV_ASSERT_COMPILE", "1");
    CHECK_THROWS_WITH(dev.compiler().compile_cached(other), Catch::Contains("other_"));
  });
}

TEST_CASE("backends: the allocator caches by size and options and mem_used follows buffers", "[backends]") {
  for_each_backend([](Compiled& dev) {
    const std::size_t size = 4096 * (1 + fresh_seed() % 16);
    Allocation a = dev.allocator().alloc(size);
    dev.allocator().free(a, size);
    CHECK(dev.allocator().alloc(size) == a);
    dev.allocator().free(a, size);
    const auto used = GlobalCounters::mem_used.load();
    {
      Buffer b(dev.name(), size / 4, dtypes::float32);
      b.allocate();
      CHECK(b.allocation() == a);  // handed back from the cache
      CHECK(GlobalCounters::mem_used == used + static_cast<std::int64_t>(size));
    }
    CHECK(GlobalCounters::mem_used == used);
  });
}

TEST_CASE("backends: allocator statistics are read through Allocator without a cast", "[backends]") {
  for_each_backend([](Compiled& dev) {
    const std::size_t size = 4096 * (1 + fresh_seed() % 16);
    const AllocatorStats before = dev.allocator().stats();
    Allocation a = dev.allocator().alloc(size);
    CHECK(dev.allocator().stats().live_allocations == before.live_allocations + 1);
    CHECK_THROWS_AS(dev.allocator().free(a, size + 1), InvalidArgument);  // wrong size: refused, counted
    CHECK(dev.allocator().stats().rejected_frees == before.rejected_frees + 1);
    dev.allocator().free(a, size);
    CHECK(dev.allocator().stats().live_allocations == before.live_allocations);
  });
}

TEST_CASE("backends: buffers round-trip random bytes and views read their base at the offset", "[backends]") {
  for_each_backend([](Compiled& dev) {
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const std::size_t n = (1u << 20) + 13;
    const auto data = random_bytes(n, seed);
    Buffer b(dev.name(), n, dtypes::uint8);
    b.allocate().copyin(data);
    std::vector<std::byte> back(n);
    b.copyout(back);
    CHECK(back == data);
    // A view at an odd offset, through the allocator's offset() (the seed's _offset).
    if (!dev.allocator().supports_offset()) return skip(dev.name() + "'s allocator has no views (supports_offset)");
    const std::size_t offset = 4099, size = 1000;
    Buffer v = b.view(size, dtypes::uint8, offset);
    v.allocate();
    std::vector<std::byte> part(size);
    v.copyout(part);
    CHECK(std::equal(part.begin(), part.end(), data.begin() + offset));
    // Writing the view writes the base.
    const auto patch = random_bytes(size, seed + 1);
    v.copyin(patch);
    b.copyout(back);
    CHECK(std::equal(patch.begin(), patch.end(), back.begin() + offset));
    CHECK(std::equal(data.begin(), data.begin() + offset, back.begin()));
  });
}

TEST_CASE("backends: CLANG without a clang on PATH is DeviceUnavailable saying so", "[backends]") {
  if (!in_this_run("CLANG")) return;
  const char* old_path = std::getenv("PATH");
  const std::string saved = old_path ? old_path : "";
  TempDir empty;
  ::setenv("PATH", empty.str().c_str(), 1);
  try {
    Device["CLANG:42"];  // a fresh instance looks for clang now
    ::setenv("PATH", saved.c_str(), 1);
    FAIL("expected DeviceUnavailable");
  } catch (const DeviceUnavailable& e) {
    ::setenv("PATH", saved.c_str(), 1);
    CHECK_THAT(std::string(e.what()), Catch::Contains("no clang compiler on PATH") && Catch::Contains("apt-get install clang-19"));
  }
  CHECK(Device["CLANG:42"].name() == "CLANG:42");  // with clang back on PATH the open is retried and works
}
