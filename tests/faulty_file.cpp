// tests/faulty_file.cpp: FaultyFile (faulty_file.hpp), a FUSE file system whose reads of a
// chosen range fail with EIO. Built with libfuse3 where the build found it (TINYDEV_TEST_HAVE_FUSE3),
// and as "cannot mount: why" otherwise.
#include "faulty_file.hpp"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#if TINYDEV_TEST_HAVE_FUSE3
#define FUSE_USE_VERSION 31
#include <fuse.h>
#endif

namespace tinydev::testing {

struct FaultyFile::State {
  std::vector<std::byte> bytes;
  std::uint64_t bad_begin = 0, bad_end = 0;
  std::string folder, file;
  std::atomic<std::uint64_t> failed{0};
#if TINYDEV_TEST_HAVE_FUSE3
  fuse* fs = nullptr;
  std::thread server;
  std::mutex mutex;
  std::condition_variable stopped_cv;
  bool stopped = false;  // fuse_loop returned
#endif
};

#if TINYDEV_TEST_HAVE_FUSE3
namespace {

constexpr const char* kName = "/data";

FaultyFile::State& state() { return *static_cast<FaultyFile::State*>(fuse_get_context()->private_data); }

int fs_getattr(const char* path, struct stat* st, fuse_file_info*) {
  std::memset(st, 0, sizeof *st);
  st->st_uid = ::geteuid();
  st->st_gid = ::getegid();
  if (std::strcmp(path, "/") == 0) {
    st->st_mode = S_IFDIR | 0755;
    st->st_nlink = 2;
    return 0;
  }
  if (std::strcmp(path, kName) == 0) {
    st->st_mode = S_IFREG | 0444;
    st->st_nlink = 1;
    st->st_size = static_cast<off_t>(state().bytes.size());
    return 0;
  }
  return -ENOENT;
}

int fs_open(const char* path, fuse_file_info* fi) {
  if (std::strcmp(path, kName) != 0) return -ENOENT;
  // Read-only, as a file the user may not write (DISK opens it read-only then).
  if ((fi->flags & O_ACCMODE) != O_RDONLY) return -EACCES;
  return 0;
}

int fs_read(const char* path, char* out, std::size_t size, off_t offset, fuse_file_info*) {
  if (std::strcmp(path, kName) != 0) return -ENOENT;
  FaultyFile::State& s = state();
  const auto begin = static_cast<std::uint64_t>(offset);
  if (begin >= s.bytes.size()) return 0;
  const std::uint64_t end = std::min<std::uint64_t>(begin + size, s.bytes.size());
  // A request touching a bad byte fails whole, as a disk's read of a bad sector does.
  if (begin < s.bad_end && end > s.bad_begin) {
    s.failed.fetch_add(1, std::memory_order_relaxed);
    return -EIO;
  }
  std::memcpy(out, s.bytes.data() + begin, end - begin);
  return static_cast<int>(end - begin);
}

int fs_readdir(const char* path, void* entries, fuse_fill_dir_t fill, off_t, fuse_file_info*, fuse_readdir_flags) {
  if (std::strcmp(path, "/") != 0) return -ENOENT;
  fill(entries, ".", nullptr, 0, fuse_fill_dir_flags{});
  fill(entries, "..", nullptr, 0, fuse_fill_dir_flags{});
  fill(entries, kName + 1, nullptr, 0, fuse_fill_dir_flags{});
  return 0;
}

}  // namespace
#endif

std::variant<std::unique_ptr<FaultyFile>, std::string> FaultyFile::mount(std::vector<std::byte> bytes,
                                                                         std::uint64_t bad_begin,
                                                                         std::uint64_t bad_end) {
#if !TINYDEV_TEST_HAVE_FUSE3
  (void)bytes, (void)bad_begin, (void)bad_end;
  return std::string("this build has no libfuse3 to make a failing file with (the GPU bundle leaves it out; "
                     "elsewhere install libfuse3-dev and reconfigure)");
#else
  // The unmount below is umount2, which needs root; as another user libfuse would mount through
  // fusermount3 and could not be unmounted here safely.
  if (::geteuid() != 0) return std::string("mounting the FUSE file system of a failing file needs root here");
  if (::access("/dev/fuse", R_OK | W_OK) != 0)
    return "/dev/fuse cannot be opened (" + std::string(std::strerror(errno)) + "): no FUSE in this kernel or container";
  auto s = std::make_unique<State>();
  s->bytes = std::move(bytes);
  s->bad_begin = bad_begin;
  s->bad_end = bad_end;
  std::string templ = (std::filesystem::temp_directory_path() / "tinydev-faulty-XXXXXX").string();
  if (!::mkdtemp(templ.data())) return "mkdtemp failed: " + std::string(std::strerror(errno));
  s->folder = templ;
  s->file = s->folder + kName;

  static const fuse_operations ops = [] {
    fuse_operations o{};
    o.getattr = fs_getattr;
    o.open = fs_open;
    o.read = fs_read;
    o.readdir = fs_readdir;
    return o;
  }();
  char arg0[] = "tinydev-faulty-file";
  char* argv[] = {arg0, nullptr};
  fuse_args args = FUSE_ARGS_INIT(1, argv);
  s->fs = fuse_new(&args, &ops, sizeof ops, s.get());
  fuse_opt_free_args(&args);
  if (!s->fs) {
    ::rmdir(s->folder.c_str());
    return std::string("fuse_new failed (see its message above)");
  }
  if (fuse_mount(s->fs, s->folder.c_str()) != 0) {
    fuse_destroy(s->fs);
    ::rmdir(s->folder.c_str());
    return std::string("fuse_mount failed (see its message above): mounting is not allowed here?");
  }
  State* raw = s.get();
  s->server = std::thread([raw] {
    fuse_loop(raw->fs);  // until the unmount ends the connection
    std::lock_guard lock(raw->mutex);
    raw->stopped = true;
    raw->stopped_cv.notify_all();
  });
  return std::unique_ptr<FaultyFile>(new FaultyFile(std::move(s)));
#endif
}

FaultyFile::FaultyFile(std::unique_ptr<State> state) : state_(std::move(state)) {}

FaultyFile::~FaultyFile() {
#if TINYDEV_TEST_HAVE_FUSE3
  State& s = *state_;
  // A lazy unmount: the kernel ends the connection once nobody has the file open, and fuse_loop
  // then returns. (fuse_unmount first would close the device's descriptor under the server
  // thread's read.)
  if (::umount2(s.folder.c_str(), MNT_DETACH) != 0)
    std::fprintf(stderr, "FaultyFile: umount2(%s) failed: %s\n", s.folder.c_str(), std::strerror(errno));
  bool stopped;
  {
    std::unique_lock lock(s.mutex);
    stopped = s.stopped_cv.wait_for(lock, std::chrono::seconds(10), [&] { return s.stopped; });
  }
  if (!stopped) {
    std::fprintf(stderr, "FaultyFile: %s is still open 10 s after its unmount: its server thread is left running\n",
                 s.file.c_str());
    s.server.detach();
    (void)state_.release();  // the thread still uses it
    return;
  }
  s.server.join();
  fuse_unmount(s.fs);  // closes the device's descriptor; the mount is gone already
  fuse_destroy(s.fs);
  ::rmdir(s.folder.c_str());
#endif
}

const std::string& FaultyFile::path() const noexcept { return state_->file; }
const std::vector<std::byte>& FaultyFile::bytes() const noexcept { return state_->bytes; }
std::uint64_t FaultyFile::failed_reads() const noexcept { return state_->failed.load(std::memory_order_relaxed); }

}  // namespace tinydev::testing
