#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <dirent.h>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "tinydev/compile.hpp"
#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"

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
//
// Note [Cache trust]
// An entry is machine code this process will run, so the cache trusts only what this user wrote,
// as ssh's StrictModes does for authorized_keys. The folder is created 0700 (each missing parent
// too) and entries 0600. The disk layer is used only when the folder, opened once and then used
// through that descriptor (openat/renameat/unlinkat, so a path swapped later changes nothing), is a
// directory owned by the effective uid and writable by nobody else; otherwise the process caches
// in memory only, says so once at TINYDEV_DEBUG>=1 and counts it in stats().rejected_folders.
// An entry is opened O_NOFOLLOW|O_NONBLOCK (a symlink fails, a FIFO does not block) and checked
// on that descriptor: a regular file, owned by the effective uid, not group/other-writable, at
// most kMaxEntryBytes long; it is read only up to the size fstat gave. Anything else is a plain,
// fast miss counted in stats().rejected_entries. The checksum protects against corruption only: it
// is not a secret, anyone can compute it. No std:: exception leaves the cache: a failure is a miss.

namespace {

constexpr char kMagic[8] = {'T', 'D', 'V', 'C', 'A', 'C', 'H', 'E'};
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kHeader = 8 + 4 + 4 + 8 + 8;
constexpr std::size_t kMemoryLayerBytes = 64u << 20;
// No real entry is this large (a kernel's source, key and object code): a bigger file is a miss
// without a byte read, and a bigger blob is kept in memory only.
constexpr std::uint64_t kMaxEntryBytes = 64ull << 20;
// Note [Cache low-water mark]: the bound evicts down to 3/4 of itself, so the next rescan of the
// folder comes only after a quarter of the bound has been written again (amortized, not per write).
constexpr std::uint64_t low_water(std::uint64_t bound) { return bound / 4 * 3; }

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

struct Fd {
  int fd = -1;
  explicit Fd(int f = -1) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

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

// Why the entry or folder behind `st` is not trusted, or "" when it is.
std::string distrust(const struct stat& st, bool want_directory) {
  if (want_directory ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode))
    return want_directory ? "is not a folder" : "is not a regular file";
  if (st.st_uid != ::geteuid())
    return fmt::format("is owned by uid {}, not by this user (uid {})", st.st_uid, ::geteuid());
  if (st.st_mode & (S_IWGRP | S_IWOTH))
    return fmt::format("is writable by {} (mode {:o})", (st.st_mode & S_IWOTH) ? "others" : "its group",
                       st.st_mode & 07777);
  return {};
}

}  // namespace

detail::CacheEntryCheck detail::check_cache_entry(std::span<const std::byte> file, std::string_view full,
                                                  std::span<const std::byte>& blob) {
  const auto* p = reinterpret_cast<const unsigned char*>(file.data());
  const std::size_t file_size = file.size();
  if (file_size < kHeader + 8) return CacheEntryCheck::corrupt;
  const auto key_len = get_le<std::uint64_t>(p + 16);
  const auto blob_len = get_le<std::uint64_t>(p + 24);
  if (std::memcmp(p, kMagic, 8) != 0 || get_le<std::uint32_t>(p + 8) != kVersion ||
      get_le<std::uint32_t>(p + 12) != 0 || key_len > file_size || blob_len > file_size ||
      kHeader + key_len + blob_len + 8 != file_size)
    return CacheEntryCheck::corrupt;
  if (XXH3_64bits(p, file_size - 8) != get_le<std::uint64_t>(p + file_size - 8)) return CacheEntryCheck::corrupt;
  if (key_len != full.size() || std::memcmp(p + kHeader, full.data(), key_len) != 0)
    return CacheEntryCheck::other_key;  // a hash collision: another key's entry, intact
  blob = file.subspan(kHeader + key_len, blob_len);
  return CacheEntryCheck::ok;
}

std::string detail::cache_full_key(std::string_view key, std::string_view identity, std::string_view source) {
  return full_key(key, identity, source);
}

struct DiskCache::Impl {
  std::mutex mutex;
  std::string folder;        // as configured
  // The folder, opened and checked once; entries are reached through it (openat), so a path
  // component swapped after the check cannot redirect reads or writes. Shared so that a reader
  // outside the lock keeps it open while another thread switches folders.
  std::shared_ptr<Fd> dir;
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
    debug_log(1, "cache", "compile cache {}; entries are kept in memory only where this fails", what);
  }

  // Creates `path` 0700, and each missing parent 0700 (these are tinydev's to protect). Returns
  // the first error, or 0.
  static int make_folder(const std::string& path) {
    if (::mkdir(path.c_str(), 0700) == 0 || errno == EEXIST) return 0;
    if (errno != ENOENT) return errno;
    const std::size_t slash = path.find_last_of('/');
    if (slash == std::string::npos || slash == 0) return ENOENT;
    if (int err = make_folder(path.substr(0, slash))) return err;
    return (::mkdir(path.c_str(), 0700) == 0 || errno == EEXIST) ? 0 : errno;
  }

  // Caller holds mutex. Re-checks when TINYDEV_CACHE_DIR changed (scoped overrides in tests).
  std::shared_ptr<Fd> ready_folder() {
    const std::string& want = settings().cache_dir;
    if (want == folder && folder_checked) return dir;
    folder = want;
    folder_checked = true;
    dir.reset();
    disk_bytes = -1;
    memory.clear();
    memory_bytes = 0;
    warned = false;
    if (folder.empty()) {
      warn_once("has no folder (TINYDEV_CACHE_DIR, XDG_CACHE_HOME and HOME are unset)");
      return nullptr;
    }
    if (int err = make_folder(folder)) {
      warn_once(fmt::format("folder '{}' cannot be created ({})", folder, std::strerror(err)));
      return nullptr;
    }
    auto fd = std::make_shared<Fd>(::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    struct stat st {};
    if (fd->fd < 0 || ::fstat(fd->fd, &st) != 0) {
      warn_once(fmt::format("path '{}' is not a folder that can be opened ({})", folder, std::strerror(errno)));
      return nullptr;
    }
    if (std::string why = distrust(st, true); !why.empty()) {
      stats.rejected_folders += 1;
      // Said once per configured folder, when TINYDEV_DEBUG>=1 at the time of the check; always
      // counted in stats().rejected_folders.
      warn_once(fmt::format("folder '{}' {}: it is not used, since any code in it would run as this "
                            "user (Note [Cache trust]); chmod go-w it or set TINYDEV_CACHE_DIR to a "
                            "folder of your own",
                            folder, why));
      return nullptr;
    }
    dir = std::move(fd);
    return dir;
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

  // Caller holds mutex; `folder_fd` is the ready folder. Keeps the folder under the byte bound:
  // rescans only when the running estimate is unknown or over the bound, then evicts oldest first
  // down to the low-water mark.
  void enforce_bound(const Fd& folder_fd, std::uint64_t max_bytes) {
    if (disk_bytes >= 0 && static_cast<std::uint64_t>(disk_bytes) <= max_bytes) return;
    struct File {
      std::string name;
      std::uint64_t size;
      std::int64_t mtime_ns;
    };
    std::vector<File> files;
    std::uint64_t total = 0;
    stats.scans += 1;
    const int scan_fd = ::dup(folder_fd.fd);
    std::unique_ptr<DIR, int (*)(DIR*)> dir_stream(scan_fd >= 0 ? ::fdopendir(scan_fd) : nullptr, &::closedir);
    if (!dir_stream) {
      if (scan_fd >= 0) ::close(scan_fd);
      return;
    }
    DIR* d = dir_stream.get();
    ::rewinddir(d);
    struct timespec now {};
    ::clock_gettime(CLOCK_REALTIME, &now);
    while (const dirent* de = ::readdir(d)) {
      std::string_view fname(de->d_name);
      const bool temp = fname.starts_with(".tmp-");
      if (!temp && !fname.ends_with(".tdc")) continue;
      struct stat st {};
      if (::fstatat(folder_fd.fd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      if (temp) {
        // A writer that died between create and rename leaves these; an hour is long enough.
        if (S_ISREG(st.st_mode) && now.tv_sec - st.st_mtim.tv_sec > 3600) ::unlinkat(folder_fd.fd, de->d_name, 0);
        continue;
      }
      const std::uint64_t size = S_ISREG(st.st_mode) ? static_cast<std::uint64_t>(st.st_size) : 0;
      files.push_back({std::string(fname), size, st.st_mtim.tv_sec * 1'000'000'000ll + st.st_mtim.tv_nsec});
      total += size;
    }
    dir_stream.reset();
    if (total > max_bytes) {
      std::sort(files.begin(), files.end(), [](const File& a, const File& b) { return a.mtime_ns < b.mtime_ns; });
      const std::uint64_t target = low_water(max_bytes);
      for (const File& f : files) {
        if (total <= target) break;
        if (::unlinkat(folder_fd.fd, f.name.c_str(), 0) == 0) {
          total -= f.size;
          stats.evictions += 1;
        }
      }
    }
    disk_bytes = static_cast<std::int64_t>(total);
  }

  std::optional<Blob> get(std::string_view key, std::string_view identity, std::string_view source);
  void put(std::string_view key, std::string_view identity, std::string_view source, std::span<const std::byte> blob);
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
  try {
    return impl_->get(key, identity, source);
  } catch (const std::exception&) {
    // Out of memory or a formatting failure: a miss, never an escape (Note [Cache trust]).
    std::lock_guard lock(impl_->mutex);
    impl_->stats.misses += 1;
    return std::nullopt;
  }
}

void DiskCache::put(std::string_view key, std::string_view identity, std::string_view source,
                    std::span<const std::byte> blob) {
  try {
    impl_->put(key, identity, source, blob);
  } catch (const std::exception&) {
    std::lock_guard lock(impl_->mutex);
    impl_->stats.write_failures += 1;
  }
}

std::optional<Blob> DiskCache::Impl::get(std::string_view key, std::string_view identity,
                                         std::string_view source) {
  std::string full = full_key(key, identity, source);
  std::string name = hex_name(full);
  std::shared_ptr<Fd> folder_fd;
  {
    std::lock_guard lock(mutex);
    folder_fd = ready_folder();
    if (auto it = memory.find(name); it != memory.end() && it->second.full == full) {
      stats.memory_hits += 1;
      return *it->second.blob;
    }
    if (!folder_fd) {
      stats.misses += 1;
      return std::nullopt;
    }
  }
  const std::string file = name + ".tdc";
  // File I/O happens outside the lock.
  enum class Outcome { absent, rejected, corrupt };
  auto miss = [&](Outcome outcome, std::string_view why = {}) -> std::optional<Blob> {
    std::lock_guard lock(mutex);
    stats.misses += 1;
    if (outcome == Outcome::corrupt) {
      stats.corrupt += 1;
      debug_log(1, "cache", "compile cache entry {}/{} failed verification; recompiling", folder, file);
    } else if (outcome == Outcome::rejected) {
      stats.rejected_entries += 1;
      debug_log(1, "cache", "compile cache entry {}/{} {}: not loaded (Note [Cache trust]); recompiling",
                folder, file, why);
    }
    return std::nullopt;
  };
  Fd fd(::openat(folder_fd->fd, file.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.fd < 0) {
    if (errno == ENOENT) return miss(Outcome::absent);
    return miss(Outcome::rejected, fmt::format("cannot be opened safely ({})", std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) return miss(Outcome::rejected, "cannot be examined");
  if (std::string why = distrust(st, false); !why.empty()) return miss(Outcome::rejected, why);
  if (st.st_size < 0 || static_cast<std::uint64_t>(st.st_size) > kMaxEntryBytes)
    return miss(Outcome::rejected, fmt::format("has {} bytes, more than any entry ({})", st.st_size, kMaxEntryBytes));
  const std::size_t file_size = static_cast<std::size_t>(st.st_size);
  std::vector<unsigned char> data(file_size);
  if (!read_all(fd.fd, data.data(), file_size)) return miss(Outcome::corrupt);
  std::span<const std::byte> stored;
  switch (detail::check_cache_entry(std::as_bytes(std::span(data)), full, stored)) {
    case detail::CacheEntryCheck::corrupt: return miss(Outcome::corrupt);
    case detail::CacheEntryCheck::other_key: return miss(Outcome::absent);
    case detail::CacheEntryCheck::ok: break;
  }
  ::futimens(fd.fd, nullptr);  // refresh recency for the size bound; best effort
  auto blob = std::make_shared<const Blob>(stored.begin(), stored.end());
  std::lock_guard lock(mutex);
  stats.disk_hits += 1;
  remember(name, std::move(full), blob);
  return *blob;
}

void DiskCache::Impl::put(std::string_view key, std::string_view identity, std::string_view source,
                          std::span<const std::byte> blob) {
  std::string full = full_key(key, identity, source);
  std::string name = hex_name(full);
  std::shared_ptr<Fd> folder_fd;
  {
    std::lock_guard lock(mutex);
    remember(name, full, std::make_shared<const Blob>(blob.begin(), blob.end()));
    folder_fd = ready_folder();
    if (!folder_fd) return;
  }
  const std::uint64_t entry_size = kHeader + full.size() + blob.size() + 8;
  if (entry_size > kMaxEntryBytes) {
    std::lock_guard lock(mutex);
    stats.write_failures += 1;
    warn_once(fmt::format("entry of {} bytes is over the {}-byte bound of an entry", entry_size, kMaxEntryBytes));
    return;
  }
  std::string entry;
  entry.reserve(entry_size);
  entry.append(kMagic, 8);
  put_le<std::uint32_t>(entry, kVersion);
  put_le<std::uint32_t>(entry, 0);
  put_le<std::uint64_t>(entry, full.size());
  put_le<std::uint64_t>(entry, blob.size());
  entry.append(full);
  entry.append(reinterpret_cast<const char*>(blob.data()), blob.size());
  put_le<std::uint64_t>(entry, XXH3_64bits(entry.data(), entry.size()));

  const std::string file = name + ".tdc";
  const std::string temp = fmt::format(".tmp-{}-{}-{:x}-{}", name, ::getpid(),
                                       std::hash<std::thread::id>()(std::this_thread::get_id()),
                                       temp_counter.fetch_add(1));
  int err = 0;
  auto step = [&err](bool ok) {
    if (!ok && err == 0) err = errno ? errno : EIO;  // the first failure's reason
    return ok;
  };
  errno = 0;
  int fd = ::openat(folder_fd->fd, temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  bool ok = step(fd >= 0) && step(write_all(fd, entry.data(), entry.size()));
  if (fd >= 0) ok = step(::close(fd) == 0) && ok;
  ok = ok && step(::renameat(folder_fd->fd, temp.c_str(), folder_fd->fd, file.c_str()) == 0);
  std::lock_guard lock(mutex);
  if (!ok) {
    if (fd >= 0) ::unlinkat(folder_fd->fd, temp.c_str(), 0);
    stats.write_failures += 1;
    warn_once(fmt::format("could not write '{}/{}' ({})", folder, file, std::strerror(err)));
    return;
  }
  stats.writes += 1;
  // The estimate belongs to the folder in use now; a switch while we wrote reset it (and the fd).
  if (folder_fd != dir) return;
  if (disk_bytes >= 0) disk_bytes += static_cast<std::int64_t>(entry.size());
  enforce_bound(*folder_fd, settings().cache_max_bytes);
}

}  // namespace tinydev
