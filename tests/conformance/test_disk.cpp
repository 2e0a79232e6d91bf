// DISK devices, tinydev::copy and safetensors (docs/disk.md): byte-exact copies from files into
// every HCQ device (staged through the ring and read straight in, with io_uring and with pread),
// the file's life cycle and errors, shared memory, concurrent appends, and safetensors files
// written here and loaded back.
#include <dlfcn.h>
#include <fcntl.h>
#include <linux/loop.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <variant>

#include <fmt/format.h>

#include "faulty_file.hpp"
#include "hcq_support.hpp"
#include "tinydev/safetensors.hpp"

using namespace tinydev;
using namespace tinydev::testing;

namespace {

void write_file(const std::string& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

std::vector<std::byte> read_back(const Buffer& b) {
  std::vector<std::byte> out(b.nbytes());
  b.copyout(out);
  return out;
}

bool equal_at(const std::vector<std::byte>& got, const std::vector<std::byte>& data, std::size_t offset) {
  return got.size() + offset <= data.size() && std::equal(got.begin(), got.end(), data.begin() + offset);
}

// The staging ring's default shape, put back by tests that change it.
template <class Dev>
struct StagingShapeRestore {
  Dev& dev;
  ~StagingShapeRestore() {
    hcq_allocator(dev).set_force_staging(false);
    // The reshape waits for the ring's copies: on a device a test left faulted that throws, which
    // must fail this test, not end the run from a destructor.
    try {
      hcq_allocator(dev).set_staging_shape(HCQAllocator<Dev>::kDefaultBatchSize, HCQAllocator<Dev>::kDefaultBatchCount);
    } catch (const std::exception& e) {
      FAIL_CHECK("restoring the staging ring's shape failed: " << e.what());
    }
  }
};

// A thread of the test's own that runs what it is given, one call at a time, and ends only when
// destroyed: its io_uring ring, set up by its first DISK read, lives as long as it, and a test can
// start it and end it while descriptors are free (under UBSan a thread's start and end check its
// state's type, which opens a pipe). An exception of a call reaches the caller of run().
class ParkedThread {
 public:
  ParkedThread() : thread_([this] { serve(); }) {}
  ~ParkedThread() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }
  ParkedThread(const ParkedThread&) = delete;
  ParkedThread& operator=(const ParkedThread&) = delete;

  void run(std::function<void()> work) {
    std::unique_lock lock(mutex_);
    work_ = std::move(work);
    error_ = nullptr;
    changed_.notify_all();
    changed_.wait(lock, [&] { return !work_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void serve() {
    std::unique_lock lock(mutex_);
    while (true) {
      changed_.wait(lock, [&] { return stop_ || work_; });
      if (!work_) return;
      try {
        work_();
      } catch (...) {
        error_ = std::current_exception();
      }
      work_ = nullptr;
      changed_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable changed_;
  std::function<void()> work_;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is ready
};

// No free file descriptor for this process while it lives (RLIMIT_NOFILE 0): the next one asked
// for fails with EMFILE.
struct NoFreeDescriptors {
  struct rlimit was{};
  NoFreeDescriptors() {
    ::getrlimit(RLIMIT_NOFILE, &was);
    const struct rlimit none{0, was.rlim_max};
    ::setrlimit(RLIMIT_NOFILE, &none);
  }
  ~NoFreeDescriptors() { ::setrlimit(RLIMIT_NOFILE, &was); }
  NoFreeDescriptors(const NoFreeDescriptors&) = delete;
  NoFreeDescriptors& operator=(const NoFreeDescriptors&) = delete;
};

// The io_uring rings this process holds, as /proc/self shows them: descriptors and mappings.
struct RingHandles {
  int descriptors = 0, mappings = 0;
};
RingHandles ring_handles() {
  RingHandles h;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(entry.path(), ec);
    if (!ec && target.string().find("io_uring") != std::string::npos) h.descriptors += 1;
  }
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (line.find("io_uring") != std::string::npos) h.mappings += 1;
  return h;
}

// Drops the file's pages from the page cache, so that DISK reads of it go to the disk (io_uring
// or pread) instead of copying from the mapping. False where the kernel kept any of them (pages
// some process has mapped stay).
bool evict_from_page_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st{};
  bool evicted = ::fsync(fd) == 0 && ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0 && ::fstat(fd, &st) == 0;
  if (evicted && st.st_size > 0) {
    void* map = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
      evicted = false;
    } else {
      std::vector<unsigned char> in_core((static_cast<std::size_t>(st.st_size) + 4095) / 4096);
      evicted = ::mincore(map, static_cast<std::size_t>(st.st_size), in_core.data()) == 0 &&
                std::none_of(in_core.begin(), in_core.end(), [](unsigned char c) { return c & 1; });
      ::munmap(map, static_cast<std::size_t>(st.st_size));
    }
  }
  ::close(fd);
  return evicted;
}
// The whole of a DISK buffer read into page-aligned host memory: its reads are O_DIRECT and
// leave nothing in the page cache (a buffered read's read-ahead would, and a later read would
// copy those pages from the mapping, which keeps them there).
bool reads_back_as(const Buffer& file, const std::vector<std::byte>& data) {
  const std::unique_ptr<std::byte, decltype(&std::free)> host(
      static_cast<std::byte*>(std::aligned_alloc(4096, (data.size() + 4095) / 4096 * 4096)), &std::free);
  file.copyout(std::span(host.get(), data.size()));
  return std::memcmp(host.get(), data.data(), data.size()) == 0;
}

// A loop device over a file: a block device to read without a disk of our own. Bound with
// LO_FLAGS_AUTOCLEAR in the same call (LOOP_CONFIGURE, Linux 5.8), so it is detached when its last
// descriptor closes and a test that dies leaves none behind; older kernels bind, then set the flag.
// Needs root and /dev/loop-control; `why_not` says what was missing.
struct LoopDevice {
  std::string path, why_not;
  int fd = -1;
  explicit LoopDevice(const std::string& backing_file) {
    const auto failed = [](const std::string& what) { return what + ": " + std::strerror(errno); };
    const int control = ::open("/dev/loop-control", O_RDWR | O_CLOEXEC);
    if (control < 0) {
      why_not = failed("/dev/loop-control");
      return;
    }
    const int backing = ::open(backing_file.c_str(), O_RDWR | O_CLOEXEC);
    if (backing < 0) why_not = failed(backing_file);
    for (int attempt = 0; attempt < 8 && fd < 0 && backing >= 0; ++attempt) {  // another may take the free one
      const int number = ::ioctl(control, LOOP_CTL_GET_FREE);
      if (number < 0) {
        why_not = failed("LOOP_CTL_GET_FREE");
        break;
      }
      path = "/dev/loop" + std::to_string(number);
      fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) {
        why_not = failed(path);
        break;
      }
      loop_config config{};
      config.fd = static_cast<std::uint32_t>(backing);
      config.info.lo_flags = LO_FLAGS_AUTOCLEAR;
      if (::ioctl(fd, LOOP_CONFIGURE, &config) == 0) break;
      if (errno == EINVAL || errno == ENOTTY) {  // a kernel without LOOP_CONFIGURE
        loop_info64 info{};
        info.lo_flags = LO_FLAGS_AUTOCLEAR;
        if (::ioctl(fd, LOOP_SET_FD, backing) == 0) {
          if (::ioctl(fd, LOOP_SET_STATUS64, &info) == 0) break;
          why_not = failed("LOOP_SET_STATUS64 on " + path);
          ::ioctl(fd, LOOP_CLR_FD, 0);
        } else {
          why_not = failed("LOOP_SET_FD on " + path);
        }
      } else {
        why_not = failed("LOOP_CONFIGURE on " + path);  // EBUSY: taken meanwhile, try the next
      }
      ::close(fd);
      fd = -1;
    }
    if (backing >= 0) ::close(backing);
    ::close(control);
    if (fd < 0 && why_not.empty()) why_not = "no loop device could be set up";
  }
  ~LoopDevice() {
    if (fd >= 0) ::close(fd);  // autoclear detaches it once DISK has closed it too
  }
  bool ready() const { return fd >= 0; }
};

}  // namespace

TEST_CASE("disk: copies from a file are byte-exact at offsets 314 991 2048 4096 and 64 MiB at 0 and 551", "[disk]") {
  for_each_hcq_device([](auto& dev) {
    TempDir dir;
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const auto data = random_bytes((64u << 20) + 551 + 3 * 4096 + 77, seed);
    const std::string path = dir.str() + "/weights.bin";
    write_file(path, data);
    StagingShapeRestore<std::remove_reference_t<decltype(dev)>> restore{dev};
    struct Case {
      std::size_t offset, size;
    };
    const Case cases[] = {{314, 4096 + 17}, {991, 3 * 4096 + 5}, {2048, 4096}, {4096, 5 * 4096 + 1},
                          {0, 64u << 20}, {551, 64u << 20}};
    for (const char* io : {"auto", "pread"}) {
      ScopedOverride method("TINYDEV_DISK_IO", io);
      for (bool staged : {false, true}) {
        hcq_allocator(dev).set_force_staging(staged);
        Buffer file("DISK:" + path, data.size(), dtypes::uint8);
        file.allocate();
        for (const Case& c : cases) {
          INFO(io << (staged ? " staged" : " direct") << ": offset " << c.offset << ", " << c.size << " bytes");
          Buffer dst(dev.name(), c.size, dtypes::uint8);
          CHECK(copy(dst, file.view(c.size, dtypes::uint8, c.offset)) == CopyPath::copy_from_disk);
          CHECK(equal_at(read_back(dst), data, c.offset));
        }
      }
    }
    // A ring of three one-page slots turns over many times; slots under a page read unaligned.
    for (const auto [slot, count] : {std::pair<std::size_t, std::size_t>{8192, 3}, {1000, 4}}) {
      INFO("ring of " << count << " x " << slot << " bytes");
      hcq_allocator(dev).set_staging_shape(slot, count);
      hcq_allocator(dev).set_force_staging(true);
      Buffer file("DISK:" + path, data.size(), dtypes::uint8);
      Buffer dst(dev.name(), (1u << 20) + 13, dtypes::uint8);
      copy(dst, file.allocate().view((1u << 20) + 13, dtypes::uint8, 991));
      CHECK(equal_at(read_back(dst), data, 991));
    }
  }, Needs{});
}

TEST_CASE("disk: copy picks the seed's path and checks sizes and dtypes before a byte moves", "[disk]") {
  for_each_hcq_device([](auto& dev) {
    TempDir dir;
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const auto data = random_bytes(3 * 4096, seed);
    const std::string path = dir.str() + "/small.bin";
    write_file(path, data);
    Buffer file("DISK:" + path, data.size(), dtypes::uint8);
    file.allocate();
    // Under 4 KiB: read into the destination's host memory (or through the host where it has none).
    Buffer small(dev.name(), 1000, dtypes::uint8);
    const CopyPath small_path = copy(small, file.view(1000, dtypes::uint8, 17));
    CHECK(small_path == (dev.capabilities().host_visible_memory ? CopyPath::as_buffer : CopyPath::copyin));
    CHECK(equal_at(read_back(small), data, 17));
    // Device to device of one backend: transfer.
    const auto fresh = random_bytes(8192, seed + 1);
    Buffer a(dev.name(), 2048, dtypes::float32), b(dev.name(), 2048, dtypes::float32);
    a.allocate().copyin(fresh);
    CHECK(copy(b, a) == CopyPath::transfer);
    CHECK(read_back(b) == fresh);
    // Host memory of another backend (NULL) to the device: through the host.
    Buffer host("NULL", 2048, dtypes::float32);
    host.allocate().copyin(fresh);
    Buffer c(dev.name(), 2048, dtypes::float32);
    CHECK(copy(c, host) == CopyPath::copyin);
    CHECK(read_back(c) == fresh);
    // The device into a file: a copyin of the file (a write); file to file likewise.
    const std::string out_path = dir.str() + "/out.bin";
    Buffer out("DISK:" + out_path, 2048, dtypes::float32);
    CHECK(copy(out, c) == CopyPath::copyin);
    CHECK(read_back(out) == fresh);
    Buffer out2("DISK:" + dir.str() + "/out2.bin", 2048, dtypes::float32);
    CHECK(copy(out2, out) == CopyPath::copyin);
    CHECK(read_back(out2) == fresh);
    // Mismatched sizes or dtypes, and an unallocated source, move nothing.
    Buffer wrong_size(dev.name(), 2047, dtypes::float32), wrong_dtype(dev.name(), 2048, dtypes::int32);
    CHECK_THROWS_AS(copy(wrong_size, a), InvalidArgument);
    CHECK_FALSE(wrong_size.is_allocated());
    CHECK_THROWS_WITH(copy(wrong_dtype, a), Catch::Contains("dtypes must match"));
    CHECK_THROWS_WITH(copy(b, Buffer(dev.name(), 2048, dtypes::float32)), Catch::Contains("unallocated"));
    CHECK(read_back(b) == fresh);
  }, Needs{});
}

TEST_CASE("disk: a file shorter than asked is an IoError that leaves the device and ring working", "[disk]") {
  for_each_hcq_device([](auto& dev) {
    TempDir dir;
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const auto data = random_bytes(10000, seed);
    const std::string path = dir.str() + "/short.bin";
    write_file(path, data);
    StagingShapeRestore<std::remove_reference_t<decltype(dev)>> restore{dev};
    for (bool staged : {false, true}) {
      hcq_allocator(dev).set_force_staging(staged);
      Buffer file("DISK:" + path, 3 * 10000, dtypes::uint8);  // the file holds a third of it
      file.allocate();
      Buffer dst(dev.name(), 3 * 10000, dtypes::uint8);
      CHECK_THROWS_AS(copy(dst, file), IoError);
      CHECK_THROWS_WITH(copy(dst, file), Catch::Contains("shorter"));
      std::vector<std::byte> host(3 * 10000);
      CHECK_THROWS_AS(file.copyout(host), IoError);
      CHECK_THROWS_AS(file.as_buffer(true), IoError);
      // What the file does hold still copies, and the ring still works.
      Buffer part(dev.name(), 9000, dtypes::uint8);
      copy(part, file.view(9000, dtypes::uint8, 1000));
      CHECK(equal_at(read_back(part), data, 1000));
      const auto more = random_bytes((2u << 20) + 5, seed + 1);
      Buffer staged_copy(dev.name(), more.size(), dtypes::uint8);
      staged_copy.allocate().copyin(more);
      CHECK(read_back(staged_copy) == more);
    }
  }, Needs{});
}

TEST_CASE("disk: a read the disk fails (EIO) is an IoError saying so that leaves the device the ring and other "
          "buffers working", "[disk]") {
  for_each_hcq_device([](auto& dev) {
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    // One bad page in a 4 MiB file served by FUSE (faulty_file.hpp). The ranges read whole stay
    // 256 KiB away from it, past any read-ahead request or page-cache folio that could take it in.
    constexpr std::size_t kSize = 4u << 20, kBadBegin = (1u << 20) + 3 * 4096, kBadEnd = kBadBegin + 4096;
    constexpr std::size_t kHeadEnd = kBadBegin - (256u << 10), kTailBegin = kBadEnd + (256u << 10) + 5;
    auto mounted = FaultyFile::mount(random_bytes(kSize, seed), kBadBegin, kBadEnd);
    if (const auto* why = std::get_if<std::string>(&mounted)) {
      skip("no failing file to read: " + *why);
      return;
    }
    FaultyFile& disk = *std::get<std::unique_ptr<FaultyFile>>(mounted);
    const std::vector<std::byte>& data = disk.bytes();
    StagingShapeRestore<std::remove_reference_t<decltype(dev)>> restore{dev};
    const auto other_data = random_bytes(3 * 4096 + 7, seed + 1);  // a buffer the failures must not touch
    Buffer other(dev.name(), other_data.size(), dtypes::uint8);
    other.allocate().copyin(other_data);
    for (const char* io : {"auto", "pread"}) {
      ScopedOverride method("TINYDEV_DISK_IO", io);
      for (bool staged : {false, true}) {
        INFO(io << (staged ? " staged" : " direct"));
        hcq_allocator(dev).set_force_staging(staged);
        const std::uint64_t failed_before = disk.failed_reads();
        {  // every DISK buffer goes before the next round: the file is closed with the last one
          Buffer file("DISK:" + disk.path(), kSize, dtypes::uint8);
          file.allocate();
          Buffer dst(dev.name(), kSize, dtypes::uint8);
          CHECK_THROWS_AS(copy(dst, file), IoError);
          CHECK_THROWS_WITH(copy(dst, file), Catch::Contains(std::strerror(EIO)) && Catch::Contains("failing disk"));
          std::vector<std::byte> host(3 * 4096);
          Buffer over_bad = file.view(host.size(), dtypes::uint8, kBadBegin - 4096);
          CHECK_THROWS_WITH(over_bad.allocate().copyout(host), Catch::Contains(std::strerror(EIO)));
          // What lies before and after the bad page still reads, on the device and to the host.
          Buffer head(dev.name(), kHeadEnd - 100, dtypes::uint8);
          copy(head, file.view(kHeadEnd - 100, dtypes::uint8, 100));
          CHECK(equal_at(read_back(head), data, 100));
          Buffer tail(dev.name(), kSize - kTailBegin, dtypes::uint8);
          copy(tail, file.view(kSize - kTailBegin, dtypes::uint8, kTailBegin));
          CHECK(equal_at(read_back(tail), data, kTailBegin));
          std::vector<std::byte> near(5000);
          Buffer after_bad = file.view(near.size(), dtypes::uint8, kTailBegin + 4096);
          after_bad.allocate().copyout(near);
          CHECK(equal_at(near, data, kTailBegin + 4096));
          // And the ring still stages.
          const auto more = random_bytes((2u << 20) + 5, seed + 2);
          Buffer staged_copy(dev.name(), more.size(), dtypes::uint8);
          staged_copy.allocate().copyin(more);
          CHECK(read_back(staged_copy) == more);
        }
        CHECK(disk.failed_reads() > failed_before);  // the errors came from the disk
      }
    }
    CHECK(read_back(other) == other_data);
  }, Needs{});
}

TEST_CASE("disk: a read into CUDA whose staged copy cannot be queued faults the device naming the driver's error and "
          "after recover() the ring goes on", "[disk]") {
  for_each_hcq_device([](auto& dev) {
    // Only the fake driver (tests/cuda/fake_driver) fails a call on demand.
    const char* driver = std::getenv("TINYDEV_CUDA_DRIVER");
    void* fake = driver && dev.name().starts_with("CUDA") ? ::dlopen(driver, RTLD_NOW | RTLD_NOLOAD) : nullptr;
    auto* calls = fake ? reinterpret_cast<long (*)(const char*)>(::dlsym(fake, "fake_cuda_calls")) : nullptr;
    if (fake) ::dlclose(fake);  // the backend keeps it loaded
    if (!calls) {
      skip("a copy submission fails on demand only on CUDA with the fake driver");
      return;
    }
    TempDir dir;
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const auto data = random_bytes((6u << 20) + 11, seed);  // several staging slots
    const std::string path = dir.str() + "/weights.bin";
    write_file(path, data);
    const auto other_data = random_bytes(70000, seed + 1);
    Buffer other(dev.name(), other_data.size(), dtypes::uint8);
    other.allocate().copyin(other_data);
    StagingShapeRestore<std::remove_reference_t<decltype(dev)>> restore{dev};
    hcq_allocator(dev).set_force_staging(true);
    Buffer file("DISK:" + path, data.size(), dtypes::uint8);
    file.allocate();
    Buffer dst(dev.name(), data.size(), dtypes::uint8);
    dst.allocate();
    for (int round = 0; round < 2; ++round) {
      INFO("round " << round);
      {
        // The second slot's copy fails to queue; the first slot's is queued by then.
        ScopedEnvironmentVariable fail("FAKE_CUDA_FAIL", fmt::format("cuMemcpyAsync@{}=1", calls("cuMemcpyAsync") + 2));
        CHECK_THROWS_WITH(copy(dst, file), Catch::Contains("cuMemcpyAsync") && Catch::Contains("CUDA_ERROR_INVALID_VALUE"));
      }
      CHECK_THROWS_AS(copy(dst, file), DeviceFault);
      CHECK_THAT(dev.recover(std::chrono::seconds(10)), Catch::Contains("cuMemcpyAsync"));
      CHECK(copy(dst, file) == CopyPath::copy_from_disk);
      CHECK(read_back(dst) == data);
    }
    CHECK(read_back(other) == other_data);
  }, Needs{});
}

TEST_CASE("disk: reading while another process appends to the file does not crash and reads what was there",
          "[disk]") {
  for_each_hcq_device([](auto& dev) {
    TempDir dir;
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const auto data = random_bytes(4u << 20, seed);
    const std::string path = dir.str() + "/growing.bin";
    write_file(path, data);
    const auto tail = random_bytes(64u << 10, seed + 1);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {  // only system calls here: the child of a threaded process
      const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND);
      for (int i = 0; fd >= 0 && i < 400; ++i)
        if (::write(fd, tail.data(), tail.size()) != static_cast<ssize_t>(tail.size())) ::_exit(2);
      ::_exit(fd >= 0 ? 0 : 1);
    }
    for (int i = 0; i < 20; ++i) {
      Buffer file("DISK:" + path, data.size(), dtypes::uint8);
      Buffer dst(dev.name(), data.size(), dtypes::uint8);
      copy(dst, file.allocate());
      CHECK(read_back(dst) == data);
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }, Needs{});
}

TEST_CASE("disk: reading while another process truncates and rewrites the file is the bytes or an IoError and never a "
          "crash",
          "[disk]") {
  for_each_hcq_device([](auto& dev) {
    TempDir dir;
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const auto data = random_bytes(8u << 20, seed);
    const std::string path = dir.str() + "/shrinking.bin";
    write_file(path, data);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {  // only system calls here: the child of a threaded process
      const int fd = ::open(path.c_str(), O_WRONLY);
      for (int i = 0; fd >= 0 && i < 300; ++i) {
        if (::ftruncate(fd, static_cast<off_t>(i % 3) << 20) != 0) ::_exit(2);
        if (::pwrite(fd, data.data(), data.size(), 0) != static_cast<ssize_t>(data.size())) ::_exit(3);
      }
      ::_exit(fd >= 0 ? 0 : 1);
    }
    StagingShapeRestore<std::remove_reference_t<decltype(dev)>> restore{dev};
    int copied = 0, refused = 0;
    for (int i = 0; i < 60; ++i) {
      hcq_allocator(dev).set_force_staging(i % 2 == 1);
      Buffer file("DISK:" + path, data.size(), dtypes::uint8);
      Buffer dst(dev.name(), data.size(), dtypes::uint8);
      try {
        copy(dst, file.allocate());
        ++copied;
      } catch (const IoError& e) {
        CHECK_THAT(e.what(), Catch::Contains("shorter") || Catch::Contains("shrank") || Catch::Contains("ended"));
        ++refused;
      }
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    CHECK(copied + refused == 60);
    // The file whole again: the device and its ring work.
    write_file(path, data);
    Buffer file("DISK:" + path, data.size(), dtypes::uint8);
    Buffer dst(dev.name(), data.size(), dtypes::uint8);
    copy(dst, file.allocate());
    CHECK(read_back(dst) == data);
  }, Needs{});
}

TEST_CASE("disk: views of views take absolute offsets and writes create and grow the file and reopening larger is an "
          "error",
          "[disk][host]") {
  TempDir dir;
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const std::string path = dir.str() + "/new.bin";
  const std::string name = "DISK:" + path;
  {
    Buffer b(name, 10000, dtypes::uint8);
    b.allocate();
    CHECK_FALSE(std::filesystem::exists(path));  // nothing is created until a write
    std::vector<std::byte> host(10000);
    CHECK_THROWS_WITH(b.copyout(host), Catch::Contains("no such file"));
    Buffer vv = b.view(5000, dtypes::uint8, 1000).view(100, dtypes::uint8, 200);
    CHECK(vv.offset() == 1200);
    const auto patch = random_bytes(100, seed);
    vv.allocate().copyin(patch);
    CHECK(std::filesystem::file_size(path) == 1300);  // created, grown to the end of the write
    CHECK(read_back(vv) == patch);
    CHECK_THROWS_AS(b.copyout(host), IoError);  // 10000 asked, 1300 there
    const auto whole = random_bytes(10000, seed + 1);
    b.copyin(whole);
    CHECK(read_back(b) == whole);
    CHECK(read_back(vv) == std::vector<std::byte>(whole.begin() + 1200, whole.begin() + 1300));
    // Zero copy through the mapping sees the writes.
    HostBytes window = b.as_buffer(true, true);
    CHECK(window.is_zero_copy());
    CHECK(std::equal(whole.begin(), whole.end(), window.data()));
    // As the seed: a second buffer may not ask for more than the first opened.
    Buffer larger(name, 20000, dtypes::uint8);
    CHECK_THROWS_WITH(larger.allocate(), Catch::Contains("larger"));
    CHECK_FALSE(larger.is_allocated());
    Buffer same(name, 10000, dtypes::uint8);
    CHECK(read_back(same.allocate()) == whole);
  }
  // Every buffer gone, the file closed: now it may be opened larger.
  Buffer larger(name, 20000, dtypes::uint8);
  larger.allocate();
  CHECK(std::filesystem::file_size(path) == 10000);
  CHECK_THROWS_AS(Buffer("DISK", 16, dtypes::uint8).allocate(), InvalidArgument);
  CHECK_THROWS_WITH(Buffer("DISK:" + dir.str(), 16, dtypes::uint8).allocate(), Catch::Contains("folder"));
  CHECK(Device[name].capabilities() == DeviceCapabilities{});
  CHECK_THROWS_AS(Device[name].runtime().load("k", {}), InvalidArgument);
}

TEST_CASE("disk: a file another process creates after the buffer opened is read at the next read", "[disk][host]") {
  TempDir dir;
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const std::string path = dir.str() + "/later.bin";
  Buffer b("DISK:" + path, 5000, dtypes::uint8);
  b.allocate();
  std::vector<std::byte> host(5000);
  CHECK_THROWS_WITH(b.copyout(host), Catch::Contains("no such file"));
  const auto data = random_bytes(5000, seed);
  write_file(path, data);  // not through tinydev
  CHECK(read_back(b) == data);
  CHECK(std::equal(data.begin(), data.end(), b.as_buffer(true, true).data()));
}

TEST_CASE("disk: DISK buffers are not counted in mem_used", "[disk][host]") {
  TempDir dir;
  const auto before = GlobalCounters::mem_used.load();
  Buffer b("DISK:" + dir.str() + "/counted.bin", 1u << 20, dtypes::uint8);
  b.allocate().copyin(random_bytes(1u << 20, fresh_seed()));
  CHECK(GlobalCounters::mem_used.load() == before);
}

TEST_CASE("disk: a read-only file opens read-only and a write to it is a clear error", "[disk][host]") {
  TempDir dir;
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const auto data = random_bytes(8192, seed);
  const std::string path = dir.str() + "/readonly.bin";
  write_file(path, data);
  ::chmod(path.c_str(), 0444);
  ::chmod(dir.str().c_str(), 0755);
  const auto check = [&] {
    Buffer file("DISK:" + path, data.size(), dtypes::uint8);
    file.allocate();
    CHECK(read_back(file) == data);
    CHECK_THROWS_WITH(file.copyin(data), Catch::Contains("read-only"));
    CHECK(read_back(file) == data);
  };
  if (::geteuid() != 0) return check();
  // root opens anything for writing: the check runs in a child that gave root up.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int rc = 1;
    try {
      if (::setgid(65534) == 0 && ::setuid(65534) == 0) {
        Buffer file("DISK:" + path, data.size(), dtypes::uint8);
        file.allocate();
        std::vector<std::byte> back(data.size());
        file.copyout(back);
        rc = back == data ? 3 : 4;
        try {
          file.copyin(data);
        } catch (const InvalidArgument& e) {
          if (std::strstr(e.what(), "read-only")) rc = 0;
        }
      }
    } catch (...) {
      rc = 5;
    }
    ::_exit(rc);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

// Note [One ring per thread]: a forked child must not keep the parent's rings (a server forking
// workers after loading weights would otherwise pin every ring of the parent in every worker), and
// a ring setup that fails for the moment (out of descriptors) must not turn io_uring off for good.
TEST_CASE("disk: a forked child lets go of every thread's io_uring ring and a ring setup that fails for now reads "
          "with pread and tries again until sixteen in a row",
          "[disk][host]") {
  TempDir dir;
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const auto data = random_bytes((1u << 20) + 3 * 4096, seed);  // whole pages: every read is O_DIRECT
  const std::string path = dir.str() + "/rings.bin";
  write_file(path, data);
  ScopedOverride method("TINYDEV_DISK_IO", "auto");
  Buffer file("DISK:" + path, data.size(), dtypes::uint8);
  file.allocate();
  const std::string reads = Device["DISK:" + path].properties().at("reads");
  if (reads.find("read with io_uring") == std::string::npos) {
    skip("DISK reads without io_uring here: " + reads);
    return;
  }
  if (!evict_from_page_cache(path)) {
    skip("the kernel keeps the test file's pages cached (posix_fadvise DONTNEED): reads would copy from the mapping");
    return;
  }
  // Reads on this thread and on one that stays alive over the fork: two rings.
  CHECK(reads_back_as(file, data));
  std::optional<ParkedThread> helper(std::in_place);
  bool helper_ok = false;
  helper->run([&] { helper_ok = evict_from_page_cache(path) && reads_back_as(file, data); });
  CHECK(helper_ok);
  const RingHandles parent = ring_handles();
  CHECK(parent.descriptors >= 2);
  CHECK(parent.mappings >= 2);

  int report[2];
  REQUIRE(::pipe2(report, O_CLOEXEC) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::alarm(60);  // a child that hangs dies, and the parent's read of its report ends
    ::close(report[0]);
    std::string failures;
    try {
      const RingHandles inherited = ring_handles();
      if (inherited.descriptors != 0 || inherited.mappings != 0)
        failures += fmt::format("after the fork the child holds {} io_uring descriptors and {} mappings; ",
                                inherited.descriptors, inherited.mappings);
      if (!evict_from_page_cache(path) || !reads_back_as(file, data)) failures += "the child's first read is wrong; ";
      if (const RingHandles own = ring_handles(); own.descriptors != 1)
        failures += fmt::format("after a read the child holds {} io_uring descriptors, not its own one; ",
                                own.descriptors);
      // A new thread's ring setup finds no free descriptor (EMFILE): its read uses pread. Once
      // descriptors are free again, its next read sets a ring up. (The threads start and end
      // while descriptors are free: ParkedThread.)
      if (!evict_from_page_cache(path)) failures += "the page cache kept the file; ";
      ParkedThread reader;
      bool first_ok = false;
      {
        NoFreeDescriptors none;
        reader.run([&] { first_ok = reads_back_as(file, data); });
      }
      if (!first_ok) failures += "the read without a free descriptor is wrong; ";
      if (const RingHandles h = ring_handles(); h.descriptors != 1)
        failures += fmt::format("the failed setup left {} io_uring descriptors, not 1; ", h.descriptors);
      const std::string said = Device["DISK:" + path].properties().at("reads");
      if (said.find("failed for now") == std::string::npos || said.find("not available") != std::string::npos)
        failures += "the device's reads say: " + said + "; ";
      bool evicted_again = false, second_ok = false;
      reader.run([&] {
        evicted_again = evict_from_page_cache(path);
        second_ok = reads_back_as(file, data);
      });
      if (!evicted_again) failures += "the page cache kept the file after the read with pread; ";
      if (!second_ok) failures += "the read after the failed setup is wrong; ";
      if (const RingHandles h = ring_handles(); h.descriptors != 2)
        failures += fmt::format("after the next read {} io_uring descriptors are held, not 2; ", h.descriptors);
      // Sixteen such failures in a row (another new thread, sixteen reads) turn io_uring off for
      // the process, as a memlock limit too small for any ring would on an old kernel.
      ParkedThread streaker;
      bool all_ok = true;
      {
        NoFreeDescriptors none;
        streaker.run([&] {
          for (int i = 0; i < 16; ++i) all_ok = reads_back_as(file, data) && all_ok;
        });
      }
      if (!all_ok) failures += "a read of the sixteen without a free descriptor is wrong; ";
      const std::string now = Device["DISK:" + path].properties().at("reads");
      if (now.find("pread (io_uring is not available here: ") == std::string::npos)
        failures += "after sixteen failed setups the device's reads say: " + now + "; ";
    } catch (const std::exception& e) {
      failures += std::string("threw: ") + e.what();
    } catch (...) {
      failures += "threw something that is not a std::exception";
    }
    const ssize_t written = ::write(report[1], failures.data(), failures.size());
    ::_exit(written == static_cast<ssize_t>(failures.size()) ? 0 : 1);
  }
  ::close(report[1]);
  std::string failures;
  char chunk[512];
  for (ssize_t n; (n = ::read(report[0], chunk, sizeof chunk)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    failures.append(chunk, static_cast<std::size_t>(n));
  }
  ::close(report[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  INFO("a child killed by signal 14 (SIGALRM) hung for a minute");
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(failures == "");
  // The parent's rings are untouched: both threads still read through theirs.
  helper_ok = false;
  helper->run([&] { helper_ok = evict_from_page_cache(path) && reads_back_as(file, data); });
  CHECK(helper_ok);
  CHECK(evict_from_page_cache(path));
  CHECK(reads_back_as(file, data));
  CHECK(ring_handles().descriptors == parent.descriptors);
  helper.reset();
  CHECK(ring_handles().descriptors == parent.descriptors - 1);  // the helper's ring went with it
}

// A block device (here a loop device) is a DISK file whose size fstat does not give (it says 0):
// reads, writes and the size checks take its size from lseek.
TEST_CASE("disk: a block device reads and writes byte-exact and a buffer longer than it is an IoError naming its size",
          "[disk][host]") {
  TempDir dir;
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  constexpr std::size_t kSize = 3u << 20;
  const auto data = random_bytes(kSize, seed);
  const std::string backing = dir.str() + "/backing.img";
  write_file(backing, data);
  LoopDevice loop(backing);
  if (!loop.ready()) {
    skip("no block device to read: " + loop.why_not);
    return;
  }
  const std::string name = "DISK:" + loop.path;
  {
    Buffer whole(name, kSize, dtypes::uint8);
    whole.allocate();
    for (const char* io : {"auto", "pread"}) {
      ScopedOverride method("TINYDEV_DISK_IO", io);
      INFO(io);
      CHECK(read_back(whole) == data);
      CHECK(reads_back_as(whole, data));  // O_DIRECT where the destination allows it
      std::vector<std::byte> part(5000);
      Buffer view = whole.view(part.size(), dtypes::uint8, 12345);
      view.allocate().copyout(part);
      CHECK(equal_at(part, data, 12345));
    }
    const auto fresh = random_bytes(3 * 4096 + 11, seed + 1);
    Buffer written = whole.view(fresh.size(), dtypes::uint8, 4096 + 7);
    written.allocate().copyin(fresh);
    CHECK(read_back(written) == fresh);
    CHECK(std::equal(fresh.begin(), fresh.end(), whole.as_buffer(true, true).data() + 4096 + 7));
  }
  // Opened again larger than the device: the read is refused before a byte moves, naming the
  // device's real size.
  Buffer longer(name, kSize + 4096, dtypes::uint8);
  longer.allocate();
  std::vector<std::byte> host(kSize + 4096);
  CHECK_THROWS_AS(longer.copyout(host), IoError);
  CHECK_THROWS_WITH(longer.copyout(host), Catch::Contains("the file is " + std::to_string(kSize) + " bytes"));
}

TEST_CASE("disk: shared-memory devices are created by a write and read back", "[disk]") {
  for_each_hcq_device([](auto& dev) {
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const std::string shm = "tinydev-test-" + std::to_string(::getpid()) + "-" + std::to_string(seed % 1000000);
    const auto data = random_bytes((1u << 20) + 4096 * 3, seed);
    {
      Buffer b("DISK:shm:" + shm, data.size(), dtypes::uint8);
      b.allocate().copyin(data);
      CHECK(read_back(b) == data);
      Buffer same("DISK:shm:/" + shm, data.size(), dtypes::uint8);  // the same object, a leading '/' or not
      CHECK(read_back(same.allocate()) == data);
      for (bool staged : {false, true}) {
        hcq_allocator(dev).set_force_staging(staged);
        Buffer dst(dev.name(), (1u << 20) + 1, dtypes::uint8);
        CHECK(copy(dst, b.view((1u << 20) + 1, dtypes::uint8, 4097)) == CopyPath::copy_from_disk);
        CHECK(equal_at(read_back(dst), data, 4097));
      }
      hcq_allocator(dev).set_force_staging(false);
    }
    ::shm_unlink(("/" + shm).c_str());
    CHECK_THROWS_AS(Buffer("DISK:shm:a/b", 1, dtypes::uint8).allocate(), InvalidArgument);
  }, Needs{});
}

// ---- safetensors ----------------------------------------------------------------------------------

TEST_CASE("disk: a safetensors file of every dtype and many shapes loads equal to what was written", "[disk]") {
  for_each_hcq_device([](auto& dev) {
    TempDir dir;
    std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const DType kinds[] = {dtypes::bool_,   dtypes::uint8,  dtypes::int8,    dtypes::int16, dtypes::uint16,
                           dtypes::float16, dtypes::bfloat16, dtypes::int32, dtypes::uint32, dtypes::float32,
                           dtypes::float64, dtypes::int64,  dtypes::uint64};
    const std::vector<std::vector<std::uint64_t>> shapes = {{}, {0}, {1}, {7}, {3, 5}, {2, 3, 4}, {1, 1, 1, 1, 1},
                                                            {1000, 33}};
    std::vector<std::vector<std::byte>> bytes;
    std::vector<SafetensorsEntry> entries;
    for (const DType& dt : kinds)
      for (const auto& shape : shapes) {
        std::uint64_t n = 1;
        for (auto d : shape) n *= d;
        bytes.push_back(random_bytes(n * dt.itemsize, ++seed));
        if (dt == dtypes::bool_)
          for (std::byte& b : bytes.back()) b &= std::byte{1};
      }
    std::size_t i = 0;
    for (const DType& dt : kinds)
      for (const auto& shape : shapes) {
        entries.push_back({fmt::format("{}.{}", safetensors_dtype_name(dt), i), dt, shape, bytes[i]});
        ++i;
      }
    const std::string path = dir.str() + "/model.safetensors";
    write_safetensors(path, entries, {{"format", "pt"}});
    CHECK(read_safetensors_header(path).metadata.at("format") == "pt");
    std::uint64_t last_bytes = 0, calls = 0;
    LoadProgress final_progress;
    const auto tensors = load_safetensors(path, dev.name(), [&](const LoadProgress& p) {
      CHECK(p.bytes_done >= last_bytes);
      last_bytes = p.bytes_done;
      ++calls;
      final_progress = p;
    });
    REQUIRE(tensors.size() == entries.size());
    CHECK(final_progress.bytes_done == final_progress.bytes_total);
    CHECK(final_progress.tensors_done == entries.size());
    CHECK(calls > entries.size());
    for (std::size_t k = 0; k < entries.size(); ++k) {
      INFO(entries[k].name);
      CHECK(tensors[k].name == entries[k].name);  // file order is the order written
      CHECK(tensors[k].shape == entries[k].shape);
      CHECK(tensors[k].buffer.dtype() == entries[k].dtype);
      CHECK(tensors[k].buffer.device() == dev.name());
      if (bytes[k].empty()) {
        CHECK_FALSE(tensors[k].buffer.is_allocated());
        continue;
      }
      CHECK(read_back(tensors[k].buffer) == bytes[k]);
    }
    // A tensor larger than the progress step (32 MiB) reports progress within it.
    const auto big = random_bytes((40u << 20) + 4, ++seed);
    const SafetensorsEntry one[] = {{"big", dtypes::float32, {(40u << 18) + 1}, big}};
    write_safetensors(path, one);
    calls = 0;
    const auto loaded = load_safetensors(path, dev.name(), [&](const LoadProgress&) { ++calls; });
    CHECK(calls >= 3);
    CHECK(read_back(loaded.at(0).buffer) == big);
  }, Needs{});
}

TEST_CASE("disk: a safetensors load from a failing disk is an IoError naming the tensor that frees what it loaded",
          "[disk]") {
  for_each_hcq_device([](auto& dev) {
    TempDir dir;
    std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const auto a = random_bytes(1u << 20, seed), b = random_bytes(3u << 20, seed + 1), c = random_bytes(1u << 20, seed + 2);
    const SafetensorsEntry entries[] = {{"layer.0.weight", dtypes::float32, {1u << 18}, a},
                                        {"layer.1.weight", dtypes::float16, {3u << 19}, b},
                                        {"layer.2.weight", dtypes::uint8, {1u << 20}, c}};
    const std::string path = dir.str() + "/model.safetensors";
    write_safetensors(path, entries);
    std::vector<std::byte> file_bytes(std::filesystem::file_size(path));
    std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(file_bytes.data()),
                                               static_cast<std::streamsize>(file_bytes.size()));
    // One bad page in the middle of the second tensor.
    const SafetensorsHeader header = read_safetensors_header(path);
    const std::uint64_t bad = (header.data_offset + header.tensors.at(1).begin + (3u << 19)) / 4096 * 4096;
    auto mounted = FaultyFile::mount(std::move(file_bytes), bad, bad + 4096);
    if (const auto* why = std::get_if<std::string>(&mounted)) {
      skip("no failing file to read: " + *why);
      return;
    }
    FaultyFile& disk = *std::get<std::unique_ptr<FaultyFile>>(mounted);
    const std::uint64_t live_before = dev.allocator().stats().live_allocations;
    CHECK_THROWS_AS(load_safetensors(disk.path(), dev.name()), IoError);
    CHECK_THROWS_WITH(load_safetensors(disk.path(), dev.name()),
                      Catch::Contains("tensor 'layer.1.weight'") && Catch::Contains(disk.path()) &&
                          Catch::Contains(std::strerror(EIO)));
    CHECK(disk.failed_reads() > 0);
    // The first tensor's buffer, loaded before the failure, is freed with the others.
    CHECK(dev.allocator().stats().live_allocations == live_before);
    // The same model from a sound disk loads whole.
    const auto loaded = load_safetensors(path, dev.name());
    REQUIRE(loaded.size() == 3);
    CHECK(read_back(loaded[0].buffer) == a);
    CHECK(read_back(loaded[1].buffer) == b);
    CHECK(read_back(loaded[2].buffer) == c);
  }, Needs{});
}

TEST_CASE("disk: malformed and hostile safetensors headers fail cleanly", "[disk][host]") {
  const auto file = [](std::string json, std::string data = {}, std::optional<std::uint64_t> claimed = {}) {
    std::string out(8, '\0');
    const std::uint64_t n = claimed.value_or(json.size());
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
    return out + json + data;
  };
  const auto parse = [](const std::string& f) {
    return parse_safetensors_header(std::as_bytes(std::span(f.data(), f.size())), f.size(), "test file");
  };
  const std::string t = R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]})";
  CHECK(parse(file("{" + t + "}", "xy")).tensors.size() == 1);
  CHECK(parse(file("{" + t + "}   ", "xy")).tensors.size() == 1);  // padding spaces
  struct Bad {
    std::string file, message;
  };
  const Bad bad[] = {
      {"short", "too short"},
      {file("{}", "", 1ull << 62), "claims"},
      {file("{}", "", 200'000'000), "claims"},
      {file("[]"), "start with '{'"},
      {file("{" + t, "xy"), "not valid JSON"},
      {file("{" + t + "}x", "xy"), "not valid JSON"},
      {file("{" + t + "," + t + "}", "xy"), "twice"},
      {file(R"({"a":[[[[[[[[1]]]]]]]]})"), "deeper"},
      {file(std::string(1, '{') + std::string(100000, '[')), "deeper"},
      {file(R"({"a":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", "x"), "no tinydev dtype"},
      {file(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "x"), "not a safetensors dtype"},
      {file(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "x"), "non-negative"},
      {file(R"({"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", "x"), "non-negative"},
      {file(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,1]}})", "x"), "overflows"},
      {file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,3]}})", "xyz"), "hold 3"},
      {file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[2,0]}})", "xy"), "not a range"},
      {file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "xy"), "not a range"},
      {file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "xy"), "overlap"},
      {file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "xy"), "gap"},
      {file("{" + t + "}", "xyz"), "no tensor names"},
      {file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"extra":1}})", "xy"), "unknown field"},
      {file(R"({"a":{"dtype":"U8","shape":[2]}})", "xy"), "lacks"},
      {file(R"({"a":7})"), "not an object"},
      {file(R"({"__metadata__":{"k":1}})"), "not a string"},
      {file("{\"a\xff\":1}"), "not valid JSON"},
  };
  for (const Bad& b : bad) {
    INFO(quote_for_message(b.file, 80));
    CHECK_THROWS_AS(parse(b.file), InvalidArgument);
    CHECK_THROWS_WITH(parse(b.file), Catch::Contains(b.message));
  }
  // From a file: a header length the file cannot hold is refused before anything is allocated,
  // and a load of a bad file leaves nothing behind.
  TempDir dir;
  const std::string path = dir.str() + "/hostile.safetensors";
  const std::string hostile = file("{}", "", ~0ull);
  write_file(path, std::as_bytes(std::span(hostile.data(), hostile.size())));
  CHECK_THROWS_WITH(read_safetensors_header(path), Catch::Contains("claims"));
  const auto used = GlobalCounters::mem_used.load();
  CHECK_THROWS_AS(load_safetensors(path, "NULL"), InvalidArgument);
  CHECK(GlobalCounters::mem_used.load() == used);
  CHECK_THROWS_AS(read_safetensors_header(dir.str() + "/missing.safetensors"), IoError);
  // The writer refuses what the reader would: a tensor named __metadata__, a size that overflows.
  const std::byte one[1] = {};
  const SafetensorsEntry named_metadata[] = {{"__metadata__", dtypes::uint8, {1}, one}};
  CHECK_THROWS_AS(write_safetensors(path, named_metadata), InvalidArgument);
  const SafetensorsEntry overflowing[] = {{"x", dtypes::uint8, {1ull << 32, 1ull << 32}, one}};
  CHECK_THROWS_AS(write_safetensors(path, overflowing), InvalidArgument);
}

TEST_CASE("disk: a read longer than its source buffer is InvalidArgument and a longer range is read from the file and not past its mapping", "[disk]") {
  for_each_hcq_device([](auto& dev) {
    TempDir dir;
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const std::size_t n = std::size_t{1} << 20;
    const auto data = random_bytes(n, seed);
    const std::string path = dir.str() + "/long.bin";
    write_file(path, data);  // in the page cache: reads would copy from the mapping
    StagingShapeRestore<std::remove_reference_t<decltype(dev)>> restore{dev};
    // A buffer on the first page only: the DISK device maps that page.
    Buffer file("DISK:" + path, 4096, dtypes::uint8);
    file.allocate();
    FileReader& reader = *Device["DISK:" + path].allocator().file_reader();
    const auto sentinel = random_bytes(n, seed + 1);
    Buffer dest(dev.name(), n, dtypes::uint8);
    dest.allocate().copyin(sentinel);
    for (const bool staged : {false, true}) {
      INFO((staged ? "staged through the ring" : "read straight in"));
      hcq_allocator(dev).set_force_staging(staged);
      CHECK_THROWS_WITH(dev.allocator().copy_from_disk(dest.allocation(), reader, file.allocation(), n),
                        Catch::Contains("a read of 1048576 bytes with an allocation of 4096 bytes"));
      CHECK(read_back(dest) == sentinel);
    }
    std::vector<std::byte> host(n);
    CHECK_THROWS_AS(reader.read_into(host.data(), file.allocation(), n), InvalidArgument);
    // A range of the file past the mapping (an allocation naming it, as a hostile caller could
    // make) is read from the file: the bytes are right and nothing is copied past the mapping.
    const Allocation longer{file.allocation().va_addr, n, file.allocation().backend};
    reader.read_into(host.data(), longer, n);
    CHECK(host == data);
    for (const bool staged : {false, true}) {
      hcq_allocator(dev).set_force_staging(staged);
      dev.allocator().copy_from_disk(dest.allocation(), reader, longer, n);
      dev.synchronize();
      CHECK(read_back(dest) == data);
      dest.copyin(sentinel);
    }
  }, Needs{});
}

TEST_CASE("disk: a safetensors file replaced while a DISK buffer holds the old one is an IoError and a DISK destination is refused", "[disk][host]") {
  TempDir dir;
  std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const std::string path = dir.str() + "/model.safetensors";
  const auto old_a = random_bytes(64 << 10, ++seed), old_b = random_bytes(4096, ++seed);
  const SafetensorsEntry v1[] = {{"a", dtypes::float32, {16 << 10}, old_a}, {"b", dtypes::uint8, {4096}, old_b}};
  write_safetensors(path, v1);
  const auto v1_size = std::filesystem::file_size(path);
  {
    // A buffer on the old file, as a server holding a DISK view of the weights would.
    Buffer keep("DISK:" + path, v1_size, dtypes::uint8);
    keep.allocate();
    // The new version, smaller and laid out otherwise, renamed over the path.
    const auto new_b = random_bytes(8192, ++seed);
    const SafetensorsEntry v2[] = {{"b", dtypes::int32, {2048}, new_b}};
    write_safetensors(path + ".tmp", v2);
    std::filesystem::rename(path + ".tmp", path);
    CHECK_THROWS_WITH(load_safetensors(path, "NULL"), Catch::Contains("changed while it was being loaded"));
  }
  // With the old file's buffer gone the DISK device opens the new file.
  const auto loaded = load_safetensors(path, "NULL");
  REQUIRE(loaded.size() == 1);
  CHECK(loaded[0].name == "b");
  CHECK(loaded[0].buffer.dtype() == dtypes::int32);
  // Onto a DISK device every tensor would land at the start of one file (here the model itself).
  const auto before = std::filesystem::file_size(path);
  std::vector<std::byte> head(64);
  {
    std::ifstream in(path, std::ios::binary);
    in.read(reinterpret_cast<char*>(head.data()), 64);
  }
  CHECK_THROWS_WITH(load_safetensors(path, "DISK:" + path), Catch::Contains("cannot load onto"));
  CHECK(std::filesystem::file_size(path) == before);
  std::vector<std::byte> after(64);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(after.data()), 64);
  CHECK(after == head);
}

TEST_CASE("disk: a socket path is InvalidArgument saying it is not a file", "[disk][host]") {
  TempDir dir;
  const std::string path = dir.str() + "/socket";
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  REQUIRE(path.size() < sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  CHECK_THROWS_WITH(Buffer("DISK:" + path, 16, dtypes::uint8).allocate(),
                    Catch::Contains("is not a regular file or a block device"));
  ::close(fd);
}
