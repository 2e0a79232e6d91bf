// Hostile input for layers 1-4: each case is a finding of the trust-boundaries issue, and each
// fails without its fix (docs/reliability.md maps them). The CPU backends' hostile cases (object
// blobs, the clang subprocess, planted kernels) are in tests/conformance/test_trust.cpp.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>

#include "support.hpp"

using namespace tinydev;
using namespace tinydev::testing;
namespace fs = std::filesystem;

namespace {

std::string random_name(std::mt19937_64& rng) {
  // Mostly name-like text (types, colons, digits, zeros), sometimes any byte at all.
  static const std::string alphabet = "llvmLLVMclangCLANGdiskDISKfakeFAKEgpu_x:::0000123456789/.-";
  std::string out;
  const std::size_t n = rng() % 24;
  for (std::size_t i = 0; i < n; ++i)
    out.push_back(rng() % 16 == 0 ? static_cast<char>(rng() & 0xff) : alphabet[rng() % alphabet.size()]);
  return out;
}

std::string random_source(std::uint64_t seed) {
  auto bytes = random_bytes(64 + seed % 256, seed);
  std::string s = "kernel " + std::to_string(seed) + "\n";
  for (std::byte b : bytes) s.push_back(static_cast<char>('a' + static_cast<int>(b) % 26));
  return s;
}

// An allocator that is not an LRU cache: frees go straight to the backend.
class PlainAllocator final : public Allocator {
 public:
  int frees = 0;
  void copyin(Allocation, std::span<const std::byte>) override {}
  void copyout(std::span<std::byte>, Allocation) override {}

 protected:
  Allocation alloc_impl(std::size_t size, const BufferOptions&) override {
    return Allocation{reinterpret_cast<std::uintptr_t>(std::malloc(size)), size, nullptr};
  }
  void free_impl(Allocation a, std::size_t, const BufferOptions&) override {
    ++frees;
    std::free(a.host_ptr());
  }
};

// A fake allocator whose default cache bound is small, to see the default rule at work.
class SmallDefaultBound final : public LRUAllocator {
 public:
  explicit SmallDefaultBound(std::uint64_t bound) { set_default_max_bytes(bound); }
  ~SmallDefaultBound() override { free_cache(); }
  void copyin(Allocation, std::span<const std::byte>) override {}
  void copyout(std::span<std::byte>, Allocation) override {}

 protected:
  Allocation alloc_impl(std::size_t size, const BufferOptions&) override {
    return Allocation{reinterpret_cast<std::uintptr_t>(std::malloc(size)), size, nullptr};
  }
  void free_impl(Allocation a, std::size_t, const BufferOptions&) override { std::free(a.host_ptr()); }
};

class NoopProgram final : public Program {
 public:
  NoopProgram() : Program("noop") {}
  std::optional<double> operator()(std::span<const Allocation>, std::span<const std::int32_t>,
                                   const LaunchParams&) override {
    return std::nullopt;
  }
};

}  // namespace

// ---- names ---------------------------------------------------------------------------------------

TEST_CASE("names: canonicalize is idempotent over random strings", "[hostile][registry]") {
  register_fakes();
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  int accepted = 0;
  for (int i = 0; i < 200000; ++i) {
    const std::string name = random_name(rng);
    std::string once;
    try {
      once = canonicalize(name);
    } catch (const InvalidArgument&) {
      continue;
    }
    ++accepted;
    INFO("name '" << quote_for_message(name) << "' -> '" << once << "'");
    REQUIRE(canonicalize(once) == once);
  }
  CHECK(accepted > 10000);  // the generator reaches valid names, not only errors
}

TEST_CASE("names: a Buffer and Device[] given the same name reach the same device", "[hostile][registry]") {
  register_fakes();
  static const bool path_type = [] {
    Device.register_backend("FAKEPATH", [](const std::string& name) {
      return std::make_unique<FakeDevice>(name, std::make_shared<FakeAllocator>());
    }, DeviceSuffix::path);
    return true;
  }();
  (void)path_type;
  for (std::string name : {"fake", "fake:0", "FAKE:7", "fakepath:/tmp/a:0:0", "FAKEPATH:x:0", "fakepath:/y"}) {
    INFO(name);
    Buffer b(name, 16, dtypes::float32);
    b.allocate();
    CHECK(b.device() == Device[name].name());
    CHECK(&Device[b.device()] == &Device[name]);
    CHECK(Device[name].allocator().live_info(b.allocation()).has_value());
  }
}

TEST_CASE("names: ordinal suffixes are plain decimal numbers within the limit", "[hostile][registry]") {
  CHECK(canonicalize("llvm:63") == "LLVM:63");
  CHECK(canonicalize("cuda:0") == "CUDA");
  CHECK(canonicalize("CLANG:42") == "CLANG:42");
  for (std::string bad : {"LLVM:-1", "LLVM:99999999999999999999", "clang:1:2", "LLVM:../../etc", "clang:0:0",
                          "LLVM:64", "LLVM:01", "CUDA:+1", "cuda:1 ", "NULL:x"}) {
    INFO(bad);
    CHECK_THROWS_AS(canonicalize(bad), InvalidArgument);
  }
  CHECK_THROWS_WITH(canonicalize("clang:0:0"), Catch::Contains("plain decimal ordinal from 0 to 63"));
  // Names this build does not know keep their suffix (the contract's "gpu:00").
  CHECK(canonicalize("gpu:00") == "GPU:00");
  CHECK(canonicalize("disk:000.txt") == "DISK:000.txt");
}

TEST_CASE("names: NUL and control characters are errors and messages stay short", "[hostile][registry]") {
  using namespace std::string_literals;
  CHECK_THROWS_WITH(canonicalize("LLVM:1\0evil"s), Catch::Contains("NUL or control character"));
  CHECK_THROWS_AS(canonicalize("disk:/tmp/a\nb"), InvalidArgument);
  CHECK_THROWS_AS(canonicalize("llvm\x7f"), InvalidArgument);
  CHECK_THROWS_AS(Buffer("LLVM:1\0evil"s, 4, dtypes::int8), InvalidArgument);
  const std::string huge = "LLVM:" + std::string(1 << 20, '7');
  try {
    canonicalize(huge);
    FAIL("a 1 MiB name was accepted");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()).size() < 400);  // not the name twice (2 MiB)
  }
  try {
    Device["nosuch:" + std::string(1 << 20, 'x')];
    FAIL("a 1 MiB name was accepted");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()).size() < 400);
  }
  CHECK(quote_for_message(std::string(500, 'a')).size() < 130);
  CHECK(quote_for_message("a\0b\n"s) == "a\\x00b\\n");
}

TEST_CASE("names: hostile names open no device", "[hostile][registry]") {
  register_fakes();
  const auto before = Device.opened().size();
  for (std::string bad : {"fake:-1", "fake:99999999999999999999", "fake:1:2", "fake:../../etc"}) {
    CHECK_THROWS_AS(Device[bad], InvalidArgument);
    CHECK_THROWS_AS(Buffer(bad, 1, dtypes::int8), InvalidArgument);
  }
  CHECK(Device.opened().size() == before);
}

// ---- settings ------------------------------------------------------------------------------------

TEST_CASE("settings: an unknown TINYDEV_ variable gets one warning naming the closest known one", "[hostile][config]") {
  CHECK(closest_known_variable("TINYDEV_DEBGU") == "TINYDEV_DEBUG");
  CHECK(closest_known_variable("TINYDEV_CACHEDIR") == "TINYDEV_CACHE_DIR");
  ::setenv("TINYDEV_DEBGU", "1", 1);
  const std::string first = capture_stderr([] { reload_environment(); });
  const std::string second = capture_stderr([] { reload_environment(); });
  ::unsetenv("TINYDEV_DEBGU");
  reload_environment();
  CHECK_THAT(first, Catch::Contains("TINYDEV_DEBGU is not a tinydev variable") &&
                        Catch::Contains("did you mean TINYDEV_DEBUG?"));
  std::size_t mentions = 0;
  for (std::size_t at = 0; (at = first.find("TINYDEV_DEBGU is not", at)) != std::string::npos; ++at) ++mentions;
  CHECK(mentions == 1);
  CHECK(second.find("TINYDEV_DEBGU") == std::string::npos);  // once per process
  CHECK_THROWS_WITH(ScopedOverride("TINYDEV_DEBGU", "1"), Catch::Contains("did you mean TINYDEV_DEBUG?"));
}

TEST_CASE("settings: NUL or control characters in a path setting are errors", "[hostile][config]") {
  using namespace std::string_literals;
  const std::string before = settings().cache_dir;
  CHECK_THROWS_WITH(ScopedOverride("TINYDEV_CACHE_DIR", "/tmp/a\0/etc"s),
                    Catch::Contains("TINYDEV_CACHE_DIR") && Catch::Contains("NUL or control character"));
  CHECK_THROWS_AS(ScopedOverride("TINYDEV_PROFILE", "/tmp/p\n.json"), InvalidArgument);
  CHECK(settings().cache_dir == before);
}

TEST_CASE("settings: TINYDEV_COMPILE_TIMEOUT", "[hostile][config]") {
  {
    ScopedOverride unset("TINYDEV_COMPILE_TIMEOUT", std::nullopt);
    CHECK(settings().compile_timeout_s == 300);
  }
  {
    ScopedOverride t("TINYDEV_COMPILE_TIMEOUT", "5");
    CHECK(settings().compile_timeout_s == 5);
  }
  CHECK_THROWS_WITH(ScopedOverride("TINYDEV_COMPILE_TIMEOUT", "0"), Catch::Contains("from 1 to 86400"));
  CHECK_THROWS_AS(ScopedOverride("TINYDEV_COMPILE_TIMEOUT", "1s"), InvalidArgument);
}

// ---- sizes ---------------------------------------------------------------------------------------

TEST_CASE("sizes: element counts whose byte size overflows are errors naming the numbers", "[hostile][buffer]") {
  fake_device();
  const std::size_t huge = (std::size_t{1} << 62) + 4;
  CHECK_THROWS_WITH(Buffer("fake", huge, dtypes::float32),
                    Catch::Contains("4611686018427387908 x float") && Catch::Contains("overflows 64 bits"));
  Buffer b("fake", 64, dtypes::float32);
  CHECK_THROWS_WITH(b.view(std::size_t{1} << 62, dtypes::float32, 0), Catch::Contains("overflows 64 bits"));
  CHECK_THROWS_AS(b.view(SIZE_MAX, dtypes::float64, 8), InvalidArgument);
  CHECK_THROWS_AS(b.view(1, dtypes::float32, SIZE_MAX), InvalidArgument);
  CHECK_FALSE(b.is_allocated());  // nothing was allocated by any of these
}

TEST_CASE("sizes: graph input and variable numbers are bounded", "[hostile][graph]") {
  FakeDevice& dev = fake_device();
  auto prg = std::make_shared<NoopProgram>();
  auto node = [&](GraphBuffer b, GraphValue v) {
    std::vector<GraphNode> nodes;
    nodes.push_back(GraphKernel{prg, {b}, {v}, {}});
    return nodes;
  };
  CHECK_THROWS_WITH(make_eager_graph(dev, node(GraphBuffer::in(SIZE_MAX), GraphValue::of(1))),
                    Catch::Contains("input number 18446744073709551615 is out of range"));
  CHECK_THROWS_WITH(make_eager_graph(dev, node(GraphBuffer::in(0), GraphValue::var(kMaxGraphIndex))),
                    Catch::Contains("variable number"));
  std::vector<GraphNode> wide;
  wide.push_back(GraphKernel{prg, std::vector<GraphBuffer>(kMaxGraphKernelArgs + 1, GraphBuffer::in(0)), {}, {}});
  CHECK_THROWS_WITH(make_eager_graph(dev, std::move(wide)), Catch::Contains("at most 4096"));
  auto ok = make_eager_graph(dev, node(GraphBuffer::in(2), GraphValue::var(1)));
  CHECK(ok->num_inputs() == 3);
  CHECK(ok->num_variables() == 2);
}

// ---- frees ---------------------------------------------------------------------------------------

TEST_CASE("frees: twice and with another size or options or of a foreign allocation are errors that change nothing", "[hostile][allocator]") {
  FakeAllocator a, other;
  const std::size_t size = 4096 + fresh_seed() % 4096;
  Allocation x = a.alloc(size);
  a.free(x, size);
  const LRUStats cached = a.stats();
  CHECK_THROWS_WITH(a.free(x, size), Catch::Contains("did not hand out or that was freed already"));
  CHECK(a.stats().bytes_cached == cached.bytes_cached);  // not cached twice
  // Two later allocations are different memory (the double free would have handed out x twice).
  Allocation y = a.alloc(size), z = a.alloc(size);
  CHECK(y != z);

  CHECK_THROWS_WITH(a.free(y, size + 1), Catch::Contains("it was allocated with " + std::to_string(size) + " bytes"));
  CHECK_THROWS_WITH(a.free(y, size, BufferOptions{.host = true}), Catch::Contains("options"));
  Allocation foreign = other.alloc(64);
  CHECK_THROWS_AS(a.free(foreign, 64), InvalidArgument);
  const Allocation view{y.va_addr + 16, 32, nullptr};
  CHECK_THROWS_AS(a.free(view, 32), InvalidArgument);
  const int frees_before = a.backend_frees;
  {
    ScopedOverride off("TINYDEV_LRU", "0");  // the real-free path checks too
    CHECK_THROWS_AS(a.free(foreign, 64), InvalidArgument);
  }
  CHECK(a.backend_frees == frees_before);
  CHECK(a.stats().rejected_frees == 6);
  CHECK(a.stats().live_allocations == 2);
  a.free(y, size);
  a.free(z, size);
  other.free(foreign, 64);
  CHECK(a.stats().live_allocations == 0);

  PlainAllocator plain;  // not an LRU cache: the base class checks as well
  Allocation p = plain.alloc(100);
  plain.free(p, 100);
  CHECK_THROWS_AS(plain.free(p, 100), InvalidArgument);
  CHECK(plain.frees == 1);
}

TEST_CASE("frees: many live allocations are tracked through churn", "[hostile][allocator]") {
  FakeAllocator a;
  ScopedOverride cap("TINYDEV_LRU_MAX_BYTES", "0");
  std::mt19937_64 rng(fresh_seed());
  std::vector<std::pair<Allocation, std::size_t>> live;
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 3) {
      const std::size_t size = 1 + rng() % 512;
      live.emplace_back(a.alloc(size), size);
    } else {
      const std::size_t k = rng() % live.size();
      a.free(live[k].first, live[k].second);
      live[k] = live.back();
      live.pop_back();
    }
  }
  CHECK(a.stats().live_allocations == live.size());
  for (auto& [alloc, size] : live) {
    REQUIRE(a.live_info(alloc).has_value());
    CHECK(a.live_info(alloc)->size == size);
    a.free(alloc, size);
  }
  CHECK(a.stats().live_allocations == 0);
}

TEST_CASE("frees: a Buffer adopts only live allocations of its device and frees them as allocated", "[hostile][buffer]") {
  FakeDevice& dev = fake_device();
  FakeAllocator elsewhere;
  Allocation foreign = elsewhere.alloc(400);
  CHECK_THROWS_WITH(Buffer("fake", 100, dtypes::int32, Buffer::Params{.adopt = foreign}),
                    Catch::Contains("did not hand out the allocation"));
  elsewhere.free(foreign, 400);
  {
    Allocation mine = dev.allocator().alloc(400);
    Buffer first("fake", 100, dtypes::int32, Buffer::Params{.adopt = mine});
    // The buffer owns it now: a second adopter or a plain free would free memory the buffer (or,
    // once the buffer went, whoever reuses it) still holds.
    CHECK_THROWS_WITH(Buffer("fake", 100, dtypes::int32, Buffer::Params{.adopt = mine}),
                      Catch::Contains("adopted by another buffer already"));
    CHECK_THROWS_WITH(dev.allocator().free(mine, 400), Catch::Contains("which a Buffer adopted"));
  }
  Allocation big = dev.allocator().alloc(1000);
  const auto rejected = dev.fake->stats().rejected_frees;
  { Buffer adopted("fake", 100, dtypes::int32, Buffer::Params{.adopt = big}); }
  CHECK(dev.fake->stats().rejected_frees == rejected);  // freed with the 1000 bytes it was allocated with
  CHECK_FALSE(dev.allocator().live_info(big).has_value());
}

// ---- the LRU bound -------------------------------------------------------------------------------

TEST_CASE("lru: the cache is bounded by default and overridable and stats show the bound", "[hostile][allocator]") {
  ScopedOverride unset("TINYDEV_LRU_MAX_BYTES", std::nullopt);
  const std::uint64_t host = default_host_cache_bound();
  CHECK(host > 0);
  CHECK(host <= 2ull << 30);
  FakeAllocator fake;
  CHECK(fake.stats().max_bytes == host);

  SmallDefaultBound a(64 << 10);
  CHECK(a.stats().max_bytes == 64 << 10);
  // A serving loop whose sizes vary: with no bound every size stays cached forever.
  std::mt19937_64 rng(fresh_seed());
  for (int i = 0; i < 2000; ++i) {
    const std::size_t size = 1024 + rng() % (16 << 10);
    Allocation x = a.alloc(size);
    a.free(x, size);
    REQUIRE(a.stats().bytes_cached <= 64 << 10);
  }
  CHECK(a.stats().evictions > 0);
  {
    ScopedOverride set("TINYDEV_LRU_MAX_BYTES", "1M");
    CHECK(a.stats().max_bytes == 1 << 20);
  }
  {
    ScopedOverride none("TINYDEV_LRU_MAX_BYTES", "0");  // the seed's unbounded cache, asked for
    CHECK(a.stats().max_bytes == 0);
  }
}

// ---- the compile cache's trust boundary ----------------------------------------------------------

TEST_CASE("cache trust: the folder is created 0700 (parents too) and entries 0600", "[hostile][cache]") {
  TempDir dir;
  const std::string folder = dir.str() + "/a/b/cache";
  ScopedOverride f("TINYDEV_CACHE_DIR", folder);
  FakeCompiler c;
  const std::string src = random_source(fresh_seed());
  c.compile_cached(src);
  struct stat st {};
  for (const std::string& p : {dir.str() + "/a", dir.str() + "/a/b", folder}) {
    REQUIRE(::stat(p.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0700);
  }
  REQUIRE(::stat(DiskCache::global().entry_path("compile_fake", c.identity(), src).c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
}

TEST_CASE("cache trust: a folder others can write is not used - compiles still work", "[hostile][cache]") {
  TempDir dir;
  REQUIRE(::chmod(dir.str().c_str(), 0777) == 0);
  ScopedOverride f("TINYDEV_CACHE_DIR", dir.str());
  const auto before = DiskCache::global().stats().rejected_folders;
  std::string log;
  {
    ScopedOverride debug("TINYDEV_DEBUG", "1");
    log = capture_stderr([] { (void)DiskCache::global().folder(); });
  }
  CHECK(DiskCache::global().folder().empty());
  CHECK(DiskCache::global().stats().rejected_folders == before + 1);
  CHECK_THAT(log, Catch::Contains("is writable by others") && Catch::Contains("not used"));
  FakeCompiler c;
  const std::string src = random_source(fresh_seed());
  CHECK(c.compile_cached(src) == FakeCompiler::expected(src));
  CHECK(c.compile_cached(src) == FakeCompiler::expected(src));
  CHECK(c.compiles == 1);  // the memory layer
  CHECK(fs::is_empty(dir.path));  // nothing written there
}

TEST_CASE("cache trust: a folder or entry owned by another user is not used", "[hostile][cache]") {
  if (::geteuid() != 0) {
    skip("changing a file's owner needs root, and this test runs as uid " + std::to_string(::geteuid()));
    return;
  }
  constexpr uid_t kStranger = 4242;
  const std::string src = random_source(fresh_seed());
  {
    TempDir dir;
    REQUIRE(::chown(dir.str().c_str(), kStranger, kStranger) == 0);
    ScopedOverride f("TINYDEV_CACHE_DIR", dir.str());
    const auto before = DiskCache::global().stats().rejected_folders;
    CHECK(DiskCache::global().folder().empty());
    CHECK(DiskCache::global().stats().rejected_folders == before + 1);
  }
  TempDir dir;
  ScopedOverride f("TINYDEV_CACHE_DIR", dir.str());
  FakeCompiler c;
  c.compile_cached(src);
  const std::string path = DiskCache::global().entry_path("compile_fake", c.identity(), src);
  // Another user's entry with a valid key and checksum (both are public knowledge).
  REQUIRE(::chown(path.c_str(), kStranger, kStranger) == 0);
  DiskCache::global().drop_memory_layer();
  const auto before = DiskCache::global().stats();
  CHECK(c.compile_cached(src) == FakeCompiler::expected(src));
  CHECK(c.compiles == 2);  // recompiled: the entry was not loaded
  CHECK(DiskCache::global().stats().rejected_entries == before.rejected_entries + 1);
  CHECK(DiskCache::global().stats().disk_hits == before.disk_hits);
}

TEST_CASE("cache trust: group-writable entries and FIFOs and directories and symlinks and huge sparse files are fast misses", "[hostile][cache]") {
  TempDir dir;
  ScopedOverride f("TINYDEV_CACHE_DIR", dir.str());
  FakeCompiler c;
  const std::uint64_t seed = fresh_seed();
  TempDir elsewhere;
  // A valid entry (right key and checksum) of the planted key, made in another folder: only the
  // trust checks can make these plants a miss, not verification.
  auto valid_entry_for = [&](const std::string& src) {
    ScopedOverride other("TINYDEV_CACHE_DIR", elsewhere.str());
    DiskCache::global().put("compile_fake", c.identity(), src, FakeCompiler::expected(src));
    return DiskCache::global().entry_path("compile_fake", c.identity(), src);
  };
  std::vector<std::pair<std::string, std::function<bool(const std::string&, const std::string&)>>> plants = {
      {"group-writable", [&](const std::string& p, const std::string& src) {
         fs::copy_file(valid_entry_for(src), p);
         return ::chmod(p.c_str(), 0620) == 0;
       }},
      {"FIFO", [](const std::string& p, const std::string&) { return ::mkfifo(p.c_str(), 0600) == 0; }},
      {"directory", [](const std::string& p, const std::string&) { return ::mkdir(p.c_str(), 0700) == 0; }},
      {"symlink", [&](const std::string& p, const std::string& src) {
         return ::symlink(valid_entry_for(src).c_str(), p.c_str()) == 0;
       }},
      {"1 TiB sparse file", [](const std::string& p, const std::string&) {
         const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT, 0600);
         const bool ok = fd >= 0 && ::ftruncate(fd, off_t{1} << 40) == 0;
         if (fd >= 0) ::close(fd);
         return ok;
       }},
  };
  int i = 0;
  for (auto& [what, plant] : plants) {
    INFO(what);
    const std::string src = random_source(seed + i++);
    const std::string path = DiskCache::global().entry_path("compile_fake", c.identity(), src);
    if (!plant(path, src)) {
      WARN("skipped " << what << ": this file system cannot make one (" << std::strerror(errno) << ")");
      continue;
    }
    DiskCache::global().drop_memory_layer();
    const auto before = DiskCache::global().stats();
    const auto start = std::chrono::steady_clock::now();
    const auto got = DiskCache::global().get("compile_fake", c.identity(), src);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    CHECK_FALSE(got.has_value());
    CHECK(DiskCache::global().stats().rejected_entries == before.rejected_entries + 1);
    CHECK(DiskCache::global().stats().corrupt == before.corrupt);
    // Under 10 ms on an idle machine (docs/reliability.md has the figures); the bound here only
    // needs to catch a hang (FIFO) or a whole read (4 GiB took 22 s), also under sanitizers.
    CHECK(ms < 250.0);
    // And the compile goes on: a real compile, no exception.
    const int compiles = c.compiles;
    CHECK(c.compile_cached(src) == FakeCompiler::expected(src));
    CHECK(c.compiles == compiles + 1);
  }
}

TEST_CASE("cache bound: eviction goes to a low-water mark and the folder is not rescanned on every write", "[hostile][cache]") {
  TempDir dir;
  ScopedOverride f("TINYDEV_CACHE_DIR", dir.str());
  ScopedOverride cap("TINYDEV_CACHE_MAX_BYTES", "64K");
  FakeCompiler c;
  const std::uint64_t seed = fresh_seed();
  const auto before = DiskCache::global().stats();
  for (int i = 0; i < 400; ++i) c.compile_cached(std::string(400, 'a' + i % 26) + random_source(seed + i));
  const auto after = DiskCache::global().stats();
  std::uint64_t total = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) total += e.file_size();
  CHECK(total <= 64 * 1024);
  // ~1 KB entries, 400 writes against a 64 KiB bound evicting down to 48 KiB: a rescan every ~16
  // writes after the first 64, about 20 in all (a rescan per write over the bound would be ~340).
  const auto scans = after.scans - before.scans;
  INFO(scans << " scans");
  CHECK(scans <= 40);
  CHECK(scans >= 5);
  CHECK(after.evictions - before.evictions > 300);
}

// ---- an invalid environment at startup ---------------------------------------------------------

// Run by the test below in a fresh process whose environment held TINYDEV_LRU=yes from the start.
TEST_CASE("settings: invalid TINYDEV_LRU probe", "[.][probe][invalid-lru-probe]") {
  // Opening a device reads the settings: a Buffer never gets memory.
  register_fakes();
  Buffer b("fake", 100, dtypes::int32);
  CHECK_THROWS_WITH(b.allocate(), Catch::Contains("TINYDEV_LRU='yes'"));
  CHECK_FALSE(b.is_allocated());
  // An allocator used directly says so at its first allocation, before memory is handed out (its
  // free reads the settings, and could not give the memory back), and its stats say so instead of
  // ending the process (a noexcept read of the settings did).
  MallocAllocator host;
  CHECK_THROWS_WITH(host.alloc(100), Catch::Contains("TINYDEV_LRU='yes'") && Catch::Contains("set it to 0 or 1"));
  CHECK_THROWS_WITH(host.stats(), Catch::Contains("TINYDEV_LRU"));
  CHECK_THROWS_WITH(host.max_bytes(), Catch::Contains("TINYDEV_LRU"));
}

TEST_CASE("settings: an invalid setting at startup is an error at the first allocation and not an abort", "[hostile][config]") {
  CHECK(run_probe("[invalid-lru-probe]", {{"TINYDEV_LRU", "yes"}}) == 0);
}
