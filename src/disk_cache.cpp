#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "tinydev/compile.hpp"
#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"

namespace fs = std::filesystem;

namespace tinydev {

// Note [Cache entry format]
// One file per entry, `<folder>/<XXH3-128 of the full key, hex>.tdc`. The full key is
// "tinydev-cache-v1" NUL key NUL identity NUL source: everything that can change the output.
// The file is
//     magic "TDVCACHE" | u32 format version | u32 zero | u64 key length | u64 blob length |
//     full key | blob | u64 XXH3-64 of every byte before it
// A read checks the length, magic, version, the full key (so a hash collision is a miss, not a
// wrong binary) and the checksum (so a corrupt or truncated file is a miss). Writers build the
// entry in a unique temporary file in the same folder and rename(2) it into place, which is atomic:
// readers in any process see the old entry, no entry, or the new one, never a torn one.
// Recency is the file's mtime, refreshed on every hit; the size bound evicts the oldest first.

namespace {

constexpr char kMagic[8] = {'T', 'D', 'V', 'C', 'A', 'C', 'H', 'E'};
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kHeader = 8 + 4 + 4 + 8 + 8;
constexpr std::size_t kMemoryLayerBytes = 64u << 20;

std::string full_key(std::string_view key, std::string_view identity, std::string_view source) {
  std::string out;
  out.reserve(17 + key.size() + identity.size() + source.size() + 3);
  out.append("tinydev-cache-v1");
  out.push_back('\0');
  out.append(key);
  out.push_back('\0');
  out.append(identity);
  out.push_back('\0');
  out.append(source);
  return out;
}

std::string hex_name(std::string_view full) {
  XXH128_hash_t h = XXH3_128bits(full.data(), full.size());
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

template <class T>
void put_le(std::string& out, T v) {
  for (std::size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
template <class T>
T get_le(const unsigned char* p) {
  T v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(p[i]) << (8 * i);
  return v;
}

bool write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, unsigned char* p, std::size_t n) {
  while (n > 0) {
    ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

}  // namespace

struct DiskCache::Impl {
  std::mutex mutex;
  std::string folder;        // as configured
  bool folder_ready = false; // exists and we created or found it
  bool folder_checked = false;
  bool warned = false;
  std::int64_t disk_bytes = -1;  // estimate of the folder's size; -1 = not scanned yet
  struct MemoryEntry {
    std::string full;
    std::shared_ptr<const Blob> blob;
  };
  std::unordered_map<std::string, MemoryEntry> memory;
  std::size_t memory_bytes = 0;
  Stats stats;
  std::atomic<std::uint64_t> temp_counter{0};

  // Says once (per folder) why the disk layer is not working; only counts as said when it printed.
  void warn_once(const std::string& what) {
    if (warned || settings().debug < 1) return;
    warned = true;
    debug_log(1, "tinydev: compile cache {}; entries are kept in memory only where this fails", what);
  }

  // Caller holds mutex. Re-checks when TINYDEV_CACHE_DIR changed (scoped overrides in tests).
  bool ready_folder() {
    const std::string& want = settings().cache_dir;
    if (want != folder || !folder_checked) {
      folder = want;
      folder_checked = true;
      folder_ready = false;
      disk_bytes = -1;
      memory.clear();
      memory_bytes = 0;
      warned = false;
      if (folder.empty()) {
        warn_once("has no folder (TINYDEV_CACHE_DIR, XDG_CACHE_HOME and HOME are unset)");
        return false;
      }
      // One mkdir(2) in the common case (the folder exists); the full walk only when a parent is
      // missing. Writability shows at each put: a failed write leaves that entry in memory only.
      if (::mkdir(folder.c_str(), 0755) != 0 && errno != EEXIST) {
        std::error_code ec;
        fs::create_directories(folder, ec);
        if (ec) {
          warn_once(fmt::format("folder '{}' cannot be created ({})", folder, ec.message()));
          return false;
        }
      }
      struct stat st {};
      if (::stat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        warn_once(fmt::format("path '{}' is not a folder", folder));
        return false;
      }
      folder_ready = true;
    }
    return folder_ready;
  }

  void remember(const std::string& name, std::string full, std::shared_ptr<const Blob> blob) {
    if (auto it = memory.find(name); it != memory.end()) {
      memory_bytes -= it->second.blob->size();
      memory.erase(it);
    }
    if (memory_bytes + blob->size() > kMemoryLayerBytes) {
      memory.clear();
      memory_bytes = 0;
    }
    memory_bytes += blob->size();
    memory[name] = MemoryEntry{std::move(full), std::move(blob)};
  }

  // Caller holds mutex; folder is ready. Keeps the folder under the byte bound.
  void enforce_bound(std::uint64_t max_bytes) {
    if (disk_bytes >= 0 && static_cast<std::uint64_t>(disk_bytes) <= max_bytes) return;
    struct File {
      fs::path path;
      std::uint64_t size;
      fs::file_time_type mtime;
    };
    std::vector<File> files;
    std::uint64_t total = 0;
    std::error_code ec;
    const auto now = fs::file_time_type::clock::now();
    for (const auto& de : fs::directory_iterator(folder, ec)) {
      std::error_code e2;
      if (!de.is_regular_file(e2)) continue;
      std::string fname = de.path().filename().string();
      auto mtime = de.last_write_time(e2);
      if (e2) continue;
      if (fname.starts_with(".tmp-")) {
        // A writer that died between create and rename leaves these; an hour is long enough.
        if (now - mtime > std::chrono::hours(1)) fs::remove(de.path(), e2);
        continue;
      }
      if (!fname.ends_with(".tdc")) continue;
      std::uint64_t size = de.file_size(e2);
      if (e2) continue;
      files.push_back({de.path(), size, mtime});
      total += size;
    }
    if (total > max_bytes) {
      std::sort(files.begin(), files.end(),
                [](const File& a, const File& b) { return a.mtime < b.mtime; });
      for (const File& f : files) {
        if (total <= max_bytes) break;
        std::error_code e2;
        if (fs::remove(f.path, e2)) {
          total -= f.size;
          stats.evictions += 1;
        }
      }
    }
    disk_bytes = static_cast<std::int64_t>(total);
  }
};

DiskCache::DiskCache() : impl_(new Impl) {}
DiskCache::~DiskCache() { delete impl_; }

DiskCache& DiskCache::global() {
  static DiskCache* cache = new DiskCache();  // never destroyed: used from static destructors too
  return *cache;
}

std::string DiskCache::folder() {
  std::lock_guard lock(impl_->mutex);
  return impl_->ready_folder() ? impl_->folder : std::string();
}

void DiskCache::drop_memory_layer() {
  std::lock_guard lock(impl_->mutex);
  impl_->memory.clear();
  impl_->memory_bytes = 0;
}

DiskCache::Stats DiskCache::stats() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->stats;
}

std::string DiskCache::entry_path(std::string_view key, std::string_view identity,
                                  std::string_view source) {
  return fmt::format("{}/{}.tdc", settings().cache_dir, hex_name(full_key(key, identity, source)));
}

std::optional<Blob> DiskCache::get(std::string_view key, std::string_view identity,
                                   std::string_view source) {
  std::string full = full_key(key, identity, source);
  std::string name = hex_name(full);
  std::string path;
  {
    std::lock_guard lock(impl_->mutex);
    bool disk = impl_->ready_folder();
    if (auto it = impl_->memory.find(name); it != impl_->memory.end() && it->second.full == full) {
      impl_->stats.memory_hits += 1;
      return *it->second.blob;
    }
    if (!disk) {
      impl_->stats.misses += 1;
      return std::nullopt;
    }
    path = fmt::format("{}/{}.tdc", impl_->folder, name);
  }
  // File I/O happens outside the lock.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  auto miss = [&](bool corrupt) -> std::optional<Blob> {
    if (fd >= 0) ::close(fd);
    std::lock_guard lock(impl_->mutex);
    impl_->stats.misses += 1;
    if (corrupt) {
      impl_->stats.corrupt += 1;
      debug_log(1, "tinydev: compile cache entry {} failed verification; recompiling", path);
    }
    return std::nullopt;
  };
  if (fd < 0) return miss(false);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return miss(false);
  const std::size_t file_size = static_cast<std::size_t>(st.st_size);
  if (file_size < kHeader + 8) return miss(true);
  std::vector<unsigned char> data(file_size);
  if (!read_all(fd, data.data(), file_size)) return miss(true);
  const unsigned char* p = data.data();
  const auto key_len = get_le<std::uint64_t>(p + 16);
  const auto blob_len = get_le<std::uint64_t>(p + 24);
  if (std::memcmp(p, kMagic, 8) != 0 || get_le<std::uint32_t>(p + 8) != kVersion ||
      key_len > file_size || blob_len > file_size || kHeader + key_len + blob_len + 8 != file_size)
    return miss(true);
  if (XXH3_64bits(p, file_size - 8) != get_le<std::uint64_t>(p + file_size - 8)) return miss(true);
  if (key_len != full.size() || std::memcmp(p + kHeader, full.data(), key_len) != 0)
    return miss(false);  // a hash collision: another key's entry, intact
  ::futimens(fd, nullptr);  // refresh recency for the size bound; best effort
  ::close(fd);
  const auto* blob_begin = reinterpret_cast<const std::byte*>(p + kHeader + key_len);
  auto blob = std::make_shared<const Blob>(blob_begin, blob_begin + blob_len);
  std::lock_guard lock(impl_->mutex);
  impl_->stats.disk_hits += 1;
  impl_->remember(name, std::move(full), blob);
  return *blob;
}

void DiskCache::put(std::string_view key, std::string_view identity, std::string_view source,
                    std::span<const std::byte> blob) {
  std::string full = full_key(key, identity, source);
  std::string name = hex_name(full);
  std::string folder;
  {
    std::lock_guard lock(impl_->mutex);
    impl_->remember(name, full, std::make_shared<const Blob>(blob.begin(), blob.end()));
    if (!impl_->ready_folder()) return;
    folder = impl_->folder;
  }
  std::string entry;
  entry.reserve(kHeader + full.size() + blob.size() + 8);
  entry.append(kMagic, 8);
  put_le<std::uint32_t>(entry, kVersion);
  put_le<std::uint32_t>(entry, 0);
  put_le<std::uint64_t>(entry, full.size());
  put_le<std::uint64_t>(entry, blob.size());
  entry.append(full);
  entry.append(reinterpret_cast<const char*>(blob.data()), blob.size());
  put_le<std::uint64_t>(entry, XXH3_64bits(entry.data(), entry.size()));

  const std::string path = fmt::format("{}/{}.tdc", folder, name);
  const std::string temp = fmt::format(
      "{}/.tmp-{}-{}-{:x}-{}", folder, name, ::getpid(),
      std::hash<std::thread::id>()(std::this_thread::get_id()), impl_->temp_counter.fetch_add(1));
  int err = 0;
  auto step = [&err](bool ok) {
    if (!ok && err == 0) err = errno ? errno : EIO;  // the first failure's reason
    return ok;
  };
  errno = 0;
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  bool ok = step(fd >= 0) && step(write_all(fd, entry.data(), entry.size()));
  if (fd >= 0) ok = step(::close(fd) == 0) && ok;
  ok = ok && step(::rename(temp.c_str(), path.c_str()) == 0);
  std::lock_guard lock(impl_->mutex);
  if (!ok) {
    ::unlink(temp.c_str());
    impl_->stats.write_failures += 1;
    impl_->warn_once(fmt::format("could not write '{}' ({})", path, std::strerror(err)));
    return;
  }
  impl_->stats.writes += 1;
  if (impl_->disk_bytes >= 0) impl_->disk_bytes += static_cast<std::int64_t>(entry.size());
  impl_->enforce_bound(settings().cache_max_bytes);
}

}  // namespace tinydev
