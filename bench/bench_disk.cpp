// The DISK rows (docs/disk.md): a 1 GiB file into an LLVM buffer, warm and cold, against the
// baselines a user would reach for (memcpy from an mmap of the file, dd iflag=direct bs=8M), and
// load_safetensors (what `tinydev load` runs) against the same bytes through one copy().
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "bench_support.hpp"
#include "cpu_hcq.hpp"
#include "tinydev/tinydev.hpp"

namespace tinydev::bench {

namespace {

using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Fills `path` with `bytes` random bytes (written once, then reused by every row).
void make_file(const std::string& path, std::size_t bytes, std::size_t data_offset = 0,
               std::span<const std::byte> head = {}) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error("bench: cannot create " + path);
  std::vector<std::uint64_t> chunk((8u << 20) / 8);
  std::mt19937_64 rng(std::random_device{}());
  if (!head.empty() && ::write(fd, head.data(), head.size()) != static_cast<ssize_t>(head.size()))
    throw Error("bench: write failed");
  for (std::size_t done = 0; done < bytes - data_offset;) {
    for (auto& w : chunk) w = rng();
    const std::size_t n = std::min(chunk.size() * 8, bytes - data_offset - done);
    if (::write(fd, chunk.data(), n) != static_cast<ssize_t>(n)) throw Error("bench: write failed");
    done += n;
  }
  ::fsync(fd);
  ::close(fd);
}

// Drops the file's pages from the page cache (no privilege needed for clean pages of a file we
// can open); returns the fraction still resident afterwards (0 when it worked).
double drop_from_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  struct stat st{};
  ::fstat(fd, &st);
  const std::size_t size = static_cast<std::size_t>(st.st_size);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  std::vector<unsigned char> vec((size + 4095) / 4096);
  ::mincore(map, size, vec.data());
  std::size_t resident = 0;
  for (unsigned char v : vec) resident += v & 1;
  ::munmap(map, size);
  ::close(fd);
  return static_cast<double>(resident) / static_cast<double>(vec.size());
}

// What a user does by hand: mmap the file and memcpy it into the destination.
double mmap_memcpy(const std::string& path, std::byte* dest, std::size_t size) {
  const auto start = Clock::now();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  std::memcpy(dest, map, size);
  ::munmap(map, size);
  ::close(fd);
  return seconds(start);
}

// dd iflag=direct bs=8M of=/dev/null, in this process: sequential 8 MiB O_DIRECT reads, into one
// 8 MiB buffer, or with `into` set into consecutive 8 MiB of `into` (the same reads landing where
// a loader needs them).
double dd_direct(const std::string& path, std::size_t size, std::byte* into = nullptr) {
  constexpr std::size_t kBlock = 8u << 20;
  void* buffer = nullptr;
  if (::posix_memalign(&buffer, 4096, kBlock) != 0) throw Error("bench: no memory");
  std::memset(buffer, 0, kBlock);
  const auto start = Clock::now();
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) {
    std::free(buffer);
    throw Error("bench: O_DIRECT is not available for " + path);
  }
  for (std::size_t off = 0; off < size;) {
    const ssize_t n = ::pread(fd, into ? static_cast<void*>(into + off) : buffer, kBlock, static_cast<off_t>(off));
    if (n <= 0) break;
    off += static_cast<std::size_t>(n);
  }
  ::close(fd);
  const double s = seconds(start);
  std::free(buffer);
  return s;
}

std::string gbps(std::size_t bytes, double s) { return fmt::format("{:.2f} GB/s", static_cast<double>(bytes) / s / 1e9); }

}  // namespace

void bench_disk(const RowFn& row) {
  const std::size_t size = g_quick ? (256u << 20) : (1u << 30);
  const std::string label = g_quick ? "256 MiB" : "1 GiB";
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("tinydev-bench-disk-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  struct Cleanup {
    std::filesystem::path dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir};
  const std::string path = (dir / "weights.bin").string();
  make_file(path, size);
  const int runs = g_quick ? 3 : 5;

  Compiled& llvm = Device["LLVM"];
  Buffer dst(llvm.name(), size, dtypes::uint8);
  dst.allocate();
  std::byte* dest = dst.allocation().host_ptr<std::byte>();
  std::memset(dest, 1, size);  // faulted in: both sides write memory that is there already
  auto* staging = dynamic_cast<HCQAllocator<cpu::CpuHCQDevice>*>(&llvm.allocator());

  // ---- warm ----
  {
    Buffer file("DISK:" + path, size, dtypes::uint8);
    file.allocate();
    std::vector<double> lib, base, staged;
    mmap_memcpy(path, dest, size);  // the file in the page cache
    for (int i = 0; i < runs; ++i) {
      base.push_back(mmap_memcpy(path, dest, size));
      auto t = Clock::now();
      copy(dst, file);
      llvm.synchronize();
      lib.push_back(seconds(t));
      if (staging) {
        staging->set_force_staging(true);
        t = Clock::now();
        copy(dst, file);
        llvm.synchronize();
        staged.push_back(seconds(t));
        staging->set_force_staging(false);
      }
    }
    const double l = median(lib), b = median(base);
    row(label + " file -> LLVM buffer, page cache warm (vs memcpy from a fresh mmap)", gbps(size, l), gbps(size, b),
        fmt::format("{:.2f}x", b / l), ">= 0.8x", b / l >= 0.8);
    if (!staged.empty()) {
      const double s = median(staged);
      row("  the same through the staging ring and the copy queue", gbps(size, s), gbps(size, b),
          fmt::format("{:.2f}x", b / s), "(reference)", true);
    }
  }

  // ---- cold ----
  {
    std::vector<double> lib, base, base_into;
    double left = 0;
    // Alternating which side goes first: the VM's virtual disk has a cache of its own behind it.
    for (int i = 0; i < std::max(4, runs - 1); ++i) {
      const auto ours = [&] {
        left = std::max(left, drop_from_cache(path));
        Buffer file("DISK:" + path, size, dtypes::uint8);
        file.allocate();
        const auto t = Clock::now();
        copy(dst, file);
        llvm.synchronize();
        lib.push_back(seconds(t));
      };
      const auto dd = [&] {
        left = std::max(left, drop_from_cache(path));
        base.push_back(dd_direct(path, size));
        left = std::max(left, drop_from_cache(path));
        base_into.push_back(dd_direct(path, size, dest));
      };
      if (i % 2) {
        ours();
        dd();
      } else {
        dd();
        ours();
      }
    }
    const double l = median(lib), b = median(base);
    row(fmt::format("{} file -> LLVM buffer, cold ({:.0f}% left cached) (vs dd iflag=direct bs=8M)", label, left * 100),
        gbps(size, l), gbps(size, b), fmt::format("{:.2f}x", b / l), ">= 0.9x", b / l >= 0.9);
    // dd's 8 MiB buffer stays in the last-level cache; a loader's destination cannot.
    const double bi = median(base_into);
    row("  the same vs those dd reads landing in the destination buffer", gbps(size, l), gbps(size, bi),
        fmt::format("{:.2f}x", bi / l), "(reference)", true);
  }

  // ---- load_safetensors vs copy ----
  {
    // 64 tensors of size/64 bytes (float32), written as a safetensors file.
    const std::size_t tensors = 64, each = size / tensors;
    std::string json = "{";
    for (std::size_t i = 0; i < tensors; ++i)
      json += fmt::format("{}\"layer.{}.weight\":{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                          i ? "," : "", i, each / 4, i * each, (i + 1) * each);
    json += "}";
    json.resize((json.size() + 7) / 8 * 8, ' ');
    std::vector<std::byte> head(8 + json.size());
    for (int i = 0; i < 8; ++i) head[i] = static_cast<std::byte>(json.size() >> (8 * i));
    std::memcpy(head.data() + 8, json.data(), json.size());
    const std::string st_path = (dir / "model.safetensors").string();
    std::filesystem::remove(path);  // one 1 GiB file at a time
    make_file(st_path, head.size() + size, head.size(), head);
    // Both sides allocate their destinations from the LRU cache, bounded so that both stay cached
    // (each run then writes memory that is there already, as a server reloading weights).
    ScopedOverride bound("TINYDEV_LRU_MAX_BYTES", "4G");
    std::vector<double> lib, base;
    for (int i = 0; i <= runs; ++i) {
      auto t = Clock::now();
      {
        Buffer file("DISK:" + st_path, head.size() + size, dtypes::uint8);
        Buffer all(llvm.name(), size, dtypes::uint8);
        copy(all, file.allocate().view(size, dtypes::uint8, head.size()));
        llvm.synchronize();
        base.push_back(seconds(t));
      }
      t = Clock::now();
      const auto loaded = load_safetensors(st_path, llvm.name());
      lib.push_back(seconds(t));
      if (i == 0) {  // the first run faults the destinations in
        lib.clear();
        base.clear();
      }
    }
    const double l = median(lib), b = median(base);
    row(fmt::format("load_safetensors ({}: tinydev load) of a {} file, {} tensors (vs one copy of the bytes)",
                    "warm", label, tensors),
        fmt::format("{:.0f} ms", l * 1e3), fmt::format("{:.0f} ms", b * 1e3), fmt::format("{:.2f}x", l / b),
        "<= 1.05x time", l <= 1.05 * b);
  }
}

}  // namespace tinydev::bench
