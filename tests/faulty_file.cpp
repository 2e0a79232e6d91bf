// tests/faulty_file.cpp: FaultyFile (faulty_file.hpp), a FUSE file system whose reads of a
// chosen range fail with EIO. Built with libfuse3 where the build found it (TINYDEV_TEST_HAVE_FUSE3),
// and as "cannot mount: why" otherwise.
//
// Note [A FUSE server in a process of its own]
// The server runs in a child process (forked, not exec'd), never on a thread of the test: a
// process that serves its own file system and dies (a crash, ctest's SIGKILL at a timeout) while
// another of its threads waits in a FUSE request (an io_uring worker reading the file) never
// exits: the request, already taken by the dead server thread, waits for an answer in
// uninterruptible sleep, and the server's /dev/fuse descriptor, which would abort the connection
// when closed, closes only once every thread has exited. (Seen here: two SIGKILLs in five hung
// the process in D state until `umount -f`.) A child answers while the test dies; it dies with
// the test (PR_SET_PDEATHSIG), and its exit closes the descriptor, which ends the connection.
#include "faulty_file.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <sstream>
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
  std::atomic<std::uint64_t>* failed = nullptr;  // in memory shared with the server process
  pid_t server = -1;
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
    s.failed->fetch_add(1, std::memory_order_relaxed);
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

// The server process (Note [A FUSE server in a process of its own]): mounts, says so on `ready`
// (one byte, 0 for mounted; else the reason), serves until the unmount, exits.
[[noreturn]] void serve(FaultyFile::State& s, pid_t parent, int ready) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(1);  // the test died before the line above
  // A server that hangs (under AddressSanitizer a lock of its allocator that a thread of the
  // test held at the fork stays held here, as GCC 12's libasan takes none around fork()) dies
  // after 5 minutes, far past any test's use of it: the mount then fails, or the test's reads
  // fail with ENOTCONN, instead of waiting for the run's timeout.
  ::alarm(300);
  const auto fail = [&](const char* why) {
    ::write(ready, why, std::strlen(why));
    ::_exit(1);
  };
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
  fuse* fs = fuse_new(&args, &ops, sizeof ops, &s);
  if (!fs) fail("fuse_new failed (see its message above)");
  if (fuse_mount(fs, s.folder.c_str()) != 0)
    fail("fuse_mount failed (see its message above): mounting is not allowed here?");
  const char mounted = 0;
  ::write(ready, &mounted, 1);
  ::close(ready);
  fuse_loop(fs);  // until the unmount ends the connection
  fuse_unmount(fs);
  ::_exit(0);
}

// Mounts a crashed test run left (its server gone, so every access fails with ENOTCONN): unmount
// and remove them, or walking the temporary directory would fail on them. A live mount of a test
// running beside this one answers stat and is left alone.
void remove_dead_mounts(const std::string& prefix) {
  std::ifstream mountinfo("/proc/self/mountinfo");
  std::string line;
  std::vector<std::string> dead;
  while (std::getline(mountinfo, line)) {
    std::istringstream fields(line);
    std::string id, parent, device, root, point;
    if (!(fields >> id >> parent >> device >> root >> point) || !point.starts_with(prefix)) continue;
    struct stat st{};
    if (::stat(point.c_str(), &st) != 0 && errno == ENOTCONN) dead.push_back(point);
  }
  for (const std::string& point : dead)
    if (::umount2(point.c_str(), MNT_DETACH) == 0) ::rmdir(point.c_str());
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
  // fusermount3, which this fixture does not drive.
  if (::geteuid() != 0) return std::string("mounting the FUSE file system of a failing file needs root here");
  if (::access("/dev/fuse", R_OK | W_OK) != 0)
    return "/dev/fuse cannot be opened (" + std::string(std::strerror(errno)) +
           "): no FUSE in this kernel or container";
  const std::string prefix = (std::filesystem::temp_directory_path() / "tinydev-faulty-").string();
  remove_dead_mounts(prefix);
  auto s = std::make_unique<State>();
  s->bytes = std::move(bytes);
  s->bad_begin = bad_begin;
  s->bad_end = bad_end;
  void* shared = ::mmap(nullptr, sizeof(std::atomic<std::uint64_t>), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) return "mmap failed: " + std::string(std::strerror(errno));
  s->failed = new (shared) std::atomic<std::uint64_t>(0);
  std::string templ = prefix + "XXXXXX";
  if (!::mkdtemp(templ.data())) return "mkdtemp failed: " + std::string(std::strerror(errno));
  s->folder = templ;
  s->file = s->folder + kName;
  std::unique_ptr<FaultyFile> out(new FaultyFile(std::move(s)));  // from here the destructor cleans up
  State& st = *out->state_;
  int ready[2];
  if (::pipe2(ready, O_CLOEXEC) != 0) return "pipe2 failed: " + std::string(std::strerror(errno));
  const pid_t parent = ::getpid();
  st.server = ::fork();
  if (st.server == 0) {
    ::close(ready[0]);
    serve(st, parent, ready[1]);
  }
  ::close(ready[1]);
  if (st.server < 0) {
    ::close(ready[0]);
    return "fork failed: " + std::string(std::strerror(errno));
  }
  std::string answer;
  char buffer[256];
  ssize_t n;
  while ((n = ::read(ready[0], buffer, sizeof buffer)) > 0 || (n < 0 && errno == EINTR))
    if (n > 0) answer.append(buffer, static_cast<std::size_t>(n));
  ::close(ready[0]);
  if (answer.empty()) return std::string("the FUSE server process ended before it mounted");
  if (answer[0] != 0) return answer;  // the destructor reaps the server
  return out;
#endif
}

FaultyFile::FaultyFile(std::unique_ptr<State> state) : state_(std::move(state)) {}

FaultyFile::~FaultyFile() {
#if TINYDEV_TEST_HAVE_FUSE3
  State& s = *state_;
  if (s.server > 0) {
    // A lazy unmount: the kernel ends the connection once nobody has the file open, and the
    // server's fuse_loop then returns. Where the file is still open past 10 s, killing the server
    // ends the connection instead (its reads then fail with ENOTCONN).
    if (::umount2(s.folder.c_str(), MNT_DETACH) != 0 && errno != EINVAL)  // EINVAL: the server never mounted
      std::fprintf(stderr, "FaultyFile: umount2(%s) failed: %s\n", s.folder.c_str(), std::strerror(errno));
    int status = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    pid_t done;
    while ((done = ::waitpid(s.server, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (done == 0) {
      std::fprintf(stderr, "FaultyFile: %s is still open 10 s after its unmount: killing its server\n", s.file.c_str());
      ::kill(s.server, SIGKILL);
      ::waitpid(s.server, &status, 0);
    }
  }
  if (!s.folder.empty()) ::rmdir(s.folder.c_str());
  if (s.failed) ::munmap(s.failed, sizeof *s.failed);
#endif
}

const std::string& FaultyFile::path() const noexcept { return state_->file; }
const std::vector<std::byte>& FaultyFile::bytes() const noexcept { return state_->bytes; }
std::uint64_t FaultyFile::failed_reads() const noexcept {
  return state_->failed ? state_->failed->load(std::memory_order_relaxed) : 0;
}

}  // namespace tinydev::testing
