#include <sys/wait.h>

#include <fstream>
#include <thread>

#include "support.hpp"

using namespace tinydev;
using namespace tinydev::testing;
namespace fs = std::filesystem;

namespace {

std::string random_source(std::uint64_t seed) {
  auto bytes = random_bytes(64 + seed % 512, seed);
  std::string s = "kernel " + std::to_string(seed) + "\n";
  for (std::byte b : bytes) s.push_back(static_cast<char>('a' + static_cast<int>(b) % 26));
  return s;
}

std::size_t entries_in(const TempDir& dir) {
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) n += e.path().extension() == ".tdc";
  return n;
}

}  // namespace

TEST_CASE("compile_cached: a second compile is a cache hit with the same bytes", "[cache]") {
  TempDir dir;
  ScopedOverride folder("TINYDEV_CACHE_DIR", dir.str());
  FakeCompiler c;
  const std::string src = random_source(fresh_seed());
  Blob first = c.compile_cached(src);
  CHECK(first == FakeCompiler::expected(src));
  CHECK(c.compiles == 1);
  CHECK(entries_in(dir) == 1);
  CHECK(c.compile_cached(src) == first);  // in-process layer
  DiskCache::global().drop_memory_layer();
  CHECK(c.compile_cached(src) == first);  // from disk
  CHECK(c.compiles == 1);
  FakeCompiler other_version("compile_fake", "fake 2.0");  // identity is part of the key
  CHECK(other_version.compile_cached(src) == first);
  CHECK(other_version.compiles == 1);
  CHECK(entries_in(dir) == 2);
}

TEST_CASE("compile_cached: TINYDEV_DISABLE_COMPILER_CACHE=1 and no cache key compile every time", "[cache]") {
  TempDir dir;
  ScopedOverride folder("TINYDEV_CACHE_DIR", dir.str());
  const std::string src = random_source(fresh_seed());
  {
    ScopedOverride off("TINYDEV_DISABLE_COMPILER_CACHE", "1");
    FakeCompiler c;
    c.compile_cached(src);
    c.compile_cached(src);
    CHECK(c.compiles == 2);
    CHECK(entries_in(dir) == 0);
  }
  FakeCompiler keyless(std::nullopt);
  keyless.compile_cached(src);
  keyless.compile_cached(src);
  CHECK(keyless.compiles == 2);
  CHECK(entries_in(dir) == 0);
}

TEST_CASE("compile_cached: TINYDEV_ASSERT_COMPILE=1 makes a real compile an error naming the source", "[cache]") {
  TempDir dir;
  ScopedOverride folder("TINYDEV_CACHE_DIR", dir.str());
  FakeCompiler c;
  const std::string warm = random_source(fresh_seed());
  const std::string cold = random_source(fresh_seed());
  c.compile_cached(warm);
  ScopedOverride strict("TINYDEV_ASSERT_COMPILE", "1");
  CHECK(c.compile_cached(warm) == FakeCompiler::expected(warm));
  CHECK_THROWS_AS(c.compile_cached(cold), CompileError);
  try {
    c.compile_cached(cold);
  } catch (const CompileError& e) {
    CHECK_THAT(e.what(), Catch::Contains("TINYDEV_ASSERT_COMPILE") && Catch::Contains(cold.substr(0, cold.find('\n'))));
    CHECK(e.log() == cold);
  }
  CHECK(c.compiles == 1);
}

TEST_CASE("compile: a CompileError carries the compiler's log and nothing is cached", "[cache]") {
  TempDir dir;
  ScopedOverride folder("TINYDEV_CACHE_DIR", dir.str());
  FakeCompiler c;
  try {
    c.compile_cached("#error bad kernel");
    FAIL("expected a CompileError");
  } catch (const CompileError& e) {
    CHECK(e.log() == "kernel.fake:1: error: #error found");
    CHECK(std::string(e.what()).find("#error found") != std::string::npos);
  }
  CHECK(entries_in(dir) == 0);
}

TEST_CASE("disk cache: corrupt - truncated and foreign entries are misses that get replaced", "[cache]") {
  TempDir dir;
  ScopedOverride folder("TINYDEV_CACHE_DIR", dir.str());
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  FakeCompiler c;
  const std::string src = random_source(seed);
  const Blob good = c.compile_cached(src);
  const std::string path = DiskCache::global().entry_path("compile_fake", c.identity(), src);
  REQUIRE(fs::exists(path));
  const auto size = fs::file_size(path);

  auto damage = [&](auto&& how) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    how(f);
    f.close();
    DiskCache::global().drop_memory_layer();
  };
  const auto corrupt_before = DiskCache::global().stats().corrupt;
  // 1. One flipped byte somewhere in the blob.
  damage([&](std::fstream& f) {
    f.seekp(static_cast<std::streamoff>(size - 9 - seed % 8));
    f.put('\x7f');
  });
  CHECK(c.compile_cached(src) == good);
  CHECK(c.compiles == 2);
  CHECK(DiskCache::global().stats().corrupt == corrupt_before + 1);
  DiskCache::global().drop_memory_layer();
  CHECK(c.compile_cached(src) == good);  // the replaced entry is good again
  CHECK(c.compiles == 2);
  // 2. Truncated.
  fs::resize_file(path, size / 2);
  DiskCache::global().drop_memory_layer();
  CHECK(c.compile_cached(src) == good);
  CHECK(c.compiles == 3);
  // 3. A valid entry of another key at this path (as a hash collision would leave): a miss.
  const std::string other = random_source(seed + 1);
  c.compile_cached(other);
  fs::copy_file(DiskCache::global().entry_path("compile_fake", c.identity(), other), path,
                fs::copy_options::overwrite_existing);
  DiskCache::global().drop_memory_layer();
  CHECK(c.compile_cached(src) == good);
  CHECK(c.compiles == 5);
}

TEST_CASE("disk cache: an unusable folder keeps working uncached", "[cache]") {
  TempDir dir;
  const std::string not_a_dir = dir.str() + "/file";
  std::ofstream(not_a_dir) << "x";
  ScopedOverride folder("TINYDEV_CACHE_DIR", not_a_dir + "/cache");
  FakeCompiler c;
  const std::string src = random_source(fresh_seed());
  CHECK(c.compile_cached(src) == FakeCompiler::expected(src));
  CHECK(DiskCache::global().folder().empty());
  CHECK(c.compile_cached(src) == FakeCompiler::expected(src));  // the in-process layer still works
  CHECK(c.compiles == 1);
}

TEST_CASE("disk cache: TINYDEV_CACHE_MAX_BYTES evicts the least recently used entries", "[cache]") {
  TempDir dir;
  ScopedOverride folder("TINYDEV_CACHE_DIR", dir.str());
  ScopedOverride cap("TINYDEV_CACHE_MAX_BYTES", "6K");
  FakeCompiler c;
  std::vector<std::string> sources;
  const std::uint64_t seed = fresh_seed();
  for (int i = 0; i < 6; ++i) sources.push_back(std::string(900, 'a' + i) + random_source(seed + i));
  // Each entry is ~2.2 KB (key + blob); six of them cannot all stay under 6 KiB.
  for (int i = 0; i < 6; ++i) {
    c.compile_cached(sources[i]);
    // Make recency unambiguous at filesystem timestamp resolution.
    fs::last_write_time(DiskCache::global().entry_path("compile_fake", c.identity(), sources[i]),
                        fs::file_time_type::clock::now() - std::chrono::minutes(60 - i));
  }
  std::uint64_t total = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) total += e.file_size();
  CHECK(total <= 6 * 1024);
  CHECK(DiskCache::global().stats().evictions > 0);
  // The newest entry survived, the oldest did not.
  CHECK(fs::exists(DiskCache::global().entry_path("compile_fake", c.identity(), sources[5])));
  CHECK_FALSE(fs::exists(DiskCache::global().entry_path("compile_fake", c.identity(), sources[0])));
}

TEST_CASE("disk cache: 8 processes hammering one folder never see a torn or wrong entry", "[cache]") {
  TempDir dir;
  ScopedOverride folder("TINYDEV_CACHE_DIR", dir.str());
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::vector<std::string> shared;
  for (int i = 0; i < 16; ++i) shared.push_back(random_source(seed + i));
  std::vector<pid_t> children;
  for (int p = 0; p < 8; ++p) {
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int bad = 0;
      try {
        std::mt19937_64 rng(seed * 31 + p);
        FakeCompiler c;
        for (int i = 0; i < 300; ++i) {
          if (i % 7 == 0) DiskCache::global().drop_memory_layer();  // force disk reads
          // Shared keys race with other processes; distinct keys are this process's own.
          const std::string src = rng() % 2 ? shared[rng() % shared.size()]
                                            : random_source(seed + 1000 * (p + 1) + i);
          if (c.compile_cached(src) != FakeCompiler::expected(src)) ++bad;
        }
      } catch (...) {
        bad = 100;
      }
      ::_exit(bad > 100 ? 100 : bad);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
  // Every entry left on disk verifies and holds the right binary; no temporary files remain.
  DiskCache::global().drop_memory_layer();
  const auto corrupt_before = DiskCache::global().stats().corrupt;
  FakeCompiler check;
  {
    ScopedOverride strict("TINYDEV_ASSERT_COMPILE", "1");  // all shared keys must be hits
    for (const std::string& src : shared) CHECK(check.compile_cached(src) == FakeCompiler::expected(src));
  }
  CHECK(DiskCache::global().stats().corrupt == corrupt_before);
  for (const auto& e : fs::directory_iterator(dir.path))
    CHECK(e.path().filename().string().rfind(".tmp-", 0) != 0);
}

TEST_CASE("disk cache: threads sharing keys in one process", "[cache]") {
  TempDir dir;
  ScopedOverride folder("TINYDEV_CACHE_DIR", dir.str());
  const std::uint64_t seed = fresh_seed();
  std::vector<std::string> sources;
  for (int i = 0; i < 8; ++i) sources.push_back(random_source(seed + i));
  FakeCompiler c;
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const std::string& src = sources[(t + i) % sources.size()];
        if (c.compile_cached(src) != FakeCompiler::expected(src)) bad++;
      }
    });
  for (auto& t : threads) t.join();
  CHECK(bad == 0);
  CHECK(c.compiles >= 8);
  CHECK(entries_in(dir) == 8);
}
