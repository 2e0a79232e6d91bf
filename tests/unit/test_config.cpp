#include <cstdlib>

#include "support.hpp"
#include "tinydev/stream.hpp"  // StreamOptions

using namespace tinydev;

TEST_CASE("config: overrides take effect and restore in reverse order", "[config]") {
  const Settings before = settings();
  {
    ScopedOverride lru("TINYDEV_LRU", "0");
    CHECK_FALSE(settings().lru);
    {
      ScopedOverride again("TINYDEV_LRU", "1");
      CHECK(settings().lru);
    }
    CHECK_FALSE(settings().lru);
    ScopedOverride debug("TINYDEV_DEBUG", "3");
    CHECK(settings().debug == 3);
    ScopedOverride dev("TINYDEV_DEVICE", "cuda:0");
    CHECK(settings().device == "CUDA");  // canonicalized
    ScopedOverride cap("TINYDEV_LRU_MAX_BYTES", "64M");
    CHECK(settings().lru_max_bytes == 64ull << 20);
  }
  CHECK(settings().lru == before.lru);
  CHECK(settings().debug == before.debug);
  CHECK(settings().device == before.device);
}

TEST_CASE("config: invalid values are errors naming the variable and change nothing", "[config]") {
  const int debug_before = settings().debug;
  CHECK_THROWS_WITH(ScopedOverride("TINYDEV_DEBUG", "9"), Catch::Contains("TINYDEV_DEBUG='9'"));
  CHECK_THROWS_WITH(ScopedOverride("TINYDEV_DEBUG", "two"), Catch::Contains("TINYDEV_DEBUG"));
  CHECK_THROWS_WITH(ScopedOverride("TINYDEV_LRU", "yes"), Catch::Contains("TINYDEV_LRU='yes'"));
  CHECK_THROWS_WITH(ScopedOverride("TINYDEV_CACHE_MAX_BYTES", "12X"),
                    Catch::Contains("TINYDEV_CACHE_MAX_BYTES='12X'"));
  CHECK_THROWS_WITH(ScopedOverride("TINYDEV_DEVICE", "cu da"), Catch::Contains("TINYDEV_DEVICE"));
  CHECK_THROWS_AS(ScopedOverride("TINYDEV_ASSERT_COMPILE", "2"), InvalidArgument);
  CHECK_THROWS_WITH(ScopedOverride("TINYDEV_NOPE", "1"), Catch::Contains("not a tinydev variable"));
  CHECK(settings().debug == debug_before);
}

TEST_CASE("config: the environment is read once and reload rejects bad values", "[config]") {
  const int before = settings().debug;
  REQUIRE(before != 2);
  ::setenv("TINYDEV_DEBUG", "2", 1);
  CHECK(settings().debug == before);  // setenv alone is not seen: the environment is read once
  reload_environment();
  CHECK(settings().debug == 2);
  ::setenv("TINYDEV_DEBUG", "eight", 1);
  CHECK_THROWS_WITH(reload_environment(), Catch::Contains("TINYDEV_DEBUG='eight'"));
  CHECK(settings().debug == 2);  // the last good snapshot stays
  ::unsetenv("TINYDEV_DEBUG");
  reload_environment();
  CHECK(settings().debug == 0);
}

TEST_CASE("config: TINYDEV_WAIT_TIMEOUT_MS is the default timeout of waits - read at each wait", "[config]") {
  using std::chrono::milliseconds;
  {
    ScopedOverride unset("TINYDEV_WAIT_TIMEOUT_MS", std::nullopt);
    CHECK(default_wait_timeout() == milliseconds(30'000));  // tinygrad's HCQDEV_WAIT_TIMEOUT_MS default
    CHECK(StreamOptions{}.drop_timeout == milliseconds(30'000));
  }
  const int ms = 1 + static_cast<int>(testing::fresh_seed() % 86'400'000);
  {
    ScopedOverride set("TINYDEV_WAIT_TIMEOUT_MS", std::to_string(ms));
    CHECK(settings().wait_timeout_ms == ms);
    CHECK(default_wait_timeout() == milliseconds(ms));
    CHECK(StreamOptions{}.drop_timeout == milliseconds(ms));
  }
  for (const char* bad : {"0", "86400001", "30s", "-5", "1e3"})
    CHECK_THROWS_WITH(ScopedOverride("TINYDEV_WAIT_TIMEOUT_MS", bad),
                      Catch::Contains(std::string("TINYDEV_WAIT_TIMEOUT_MS='") + bad) &&
                          Catch::Contains("from 1 to 86400000"));
}

TEST_CASE("config: an override of nullopt acts as unset", "[config]") {
  ::setenv("TINYDEV_LRU", "0", 1);
  reload_environment();
  CHECK_FALSE(settings().lru);
  {
    ScopedOverride unset("TINYDEV_LRU", std::nullopt);
    CHECK(settings().lru);
  }
  CHECK_FALSE(settings().lru);
  ::unsetenv("TINYDEV_LRU");
  reload_environment();
  CHECK(settings().lru);
}

TEST_CASE("config: the cache folder follows XDG_CACHE_HOME then HOME", "[config]") {
  ScopedOverride no_dir("TINYDEV_CACHE_DIR", std::nullopt);
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  std::string saved_xdg = xdg ? xdg : "";
  ::setenv("XDG_CACHE_HOME", "/tmp/xdg-test", 1);
  reload_environment();
  CHECK(settings().cache_dir == "/tmp/xdg-test/tinydev");
  ::unsetenv("XDG_CACHE_HOME");
  reload_environment();
  CHECK(settings().cache_dir == std::string(std::getenv("HOME")) + "/.cache/tinydev");
  if (xdg) ::setenv("XDG_CACHE_HOME", saved_xdg.c_str(), 1);
  reload_environment();
}

TEST_CASE("config: byte counts", "[config]") {
  CHECK(parse_byte_count("0", "X") == 0);
  CHECK(parse_byte_count("4096", "X") == 4096);
  CHECK(parse_byte_count("4K", "X") == 4096);
  CHECK(parse_byte_count("3M", "X") == 3ull << 20);
  CHECK(parse_byte_count("2GiB", "X") == 2ull << 30);
  CHECK_THROWS_AS(parse_byte_count("", "X"), InvalidArgument);
  CHECK_THROWS_AS(parse_byte_count("-1", "X"), InvalidArgument);
  CHECK_THROWS_AS(parse_byte_count("1T", "X"), InvalidArgument);
  CHECK_THROWS_AS(parse_byte_count("99999999999999999999", "X"), InvalidArgument);
  CHECK_THROWS_WITH(parse_byte_count("1 G", "VAR"), Catch::Contains("VAR='1 G'"));
}
