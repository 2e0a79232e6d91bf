// libFuzzer target: compile cache entries. The input is an entry file; it is checked directly
// against two keys (a fixed one, and the key the file claims), then planted in a private cache
// folder and read back through DiskCache::get. Nothing crashes, a damaged file is a miss, and a
// hit returns exactly the stored blob of a file whose checksum and key are right.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tinydev/compile.hpp"
#include "tinydev/config.hpp"

namespace {
const std::string& folder() {
  static const std::string dir = [] {
    char templ[] = "/tmp/tinydev-fuzz-cache-XXXXXX";
    if (!::mkdtemp(templ)) std::abort();
    return std::string(templ);
  }();
  return dir;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto file = std::as_bytes(std::span(data, size));
  const std::string fixed = tinydev::detail::cache_full_key("compile_fuzz", "fuzz 1", "kernel source");
  std::span<const std::byte> blob;
  const auto verdict = tinydev::detail::check_cache_entry(file, fixed, blob);
  if (verdict == tinydev::detail::CacheEntryCheck::ok &&
      (blob.data() < file.data() || blob.data() + blob.size() > file.data() + file.size()))
    std::abort();
  // The key the file claims (if its header is readable) checks as ok or corrupt, never out of bounds.
  if (size >= 32) {
    std::uint64_t key_len = 0;
    std::memcpy(&key_len, data + 16, 8);
    if (key_len <= size - 32) {
      std::string_view claimed(reinterpret_cast<const char*>(data + 32), key_len);
      (void)tinydev::detail::check_cache_entry(file, claimed, blob);
    }
  }
  // Through the real reader: plant the bytes where the fixed key's entry lives.
  static tinydev::ScopedOverride dir("TINYDEV_CACHE_DIR", folder());
  tinydev::DiskCache& cache = tinydev::DiskCache::global();
  const std::string path = cache.entry_path("compile_fuzz", "fuzz 1", "kernel source");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) std::abort();
  if (size && ::write(fd, data, size) != static_cast<ssize_t>(size)) std::abort();
  ::close(fd);
  cache.drop_memory_layer();
  const auto got = cache.get("compile_fuzz", "fuzz 1", "kernel source");
  if (got && (verdict != tinydev::detail::CacheEntryCheck::ok || got->size() != blob.size() ||
              !std::equal(got->begin(), got->end(), blob.begin())))
    std::abort();
  return 0;
}
