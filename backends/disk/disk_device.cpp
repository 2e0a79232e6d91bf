// The DISK backend (tinygrad's ops_disk, docs/disk.md): "DISK:/path" and "DISK:shm:name" are
// devices whose buffers are byte ranges of one file. The file opens with its first buffer and
// closes with its last; it is mapped (as_buffer is zero copy), written with pwrite (which creates
// and grows it), and read into host memory or the staging ring of the device it is copied to:
// pages in the page cache copied from the mapping, the others with io_uring (several reads in
// flight, O_DIRECT where the file system allows it), or pread where io_uring cannot work.
#include <fcntl.h>
#include <fmt/format.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#ifdef TINYDEV_HAVE_LIBURING
#include <liburing.h>
#endif

#include "signal_chain.hpp"
#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/device.hpp"
#include "tinydev/error.hpp"

namespace tinydev {
namespace {

constexpr std::uint64_t kPage = 4096;           // O_DIRECT alignment (offsets, lengths, memory)
constexpr std::size_t kChunk = 2u << 20;        // one read into host memory
constexpr unsigned kMaxInFlight = 16;           // reads in flight into host memory
constexpr unsigned kRingEntries = 64;           // >= any number of reads in flight

std::uint64_t align_down(std::uint64_t v) { return v & ~(kPage - 1); }
std::uint64_t align_up(std::uint64_t v) { return (v + kPage - 1) & ~(kPage - 1); }
bool aligned(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & (kPage - 1)) == 0; }
std::string os_error(int err) { return std::strerror(err); }

// The size of the file open as `fd`, whose fstat is `st`: a block device's from lseek (fstat
// says 0 for it); nullopt where lseek fails.
std::optional<std::uint64_t> file_size(int fd, const struct stat& st) {
  if (!S_ISBLK(st.st_mode)) return static_cast<std::uint64_t>(st.st_size);
  const off_t end = ::lseek(fd, 0, SEEK_END);  // every read names its offset: the position is unused
  if (end < 0) return std::nullopt;
  return static_cast<std::uint64_t>(end);
}

// The size of the file open as `fd` now, or nullopt when it cannot be had.
std::optional<std::uint64_t> current_file_size(int fd) {
  struct stat st{};
  if (::fstat(fd, &st) != 0) return std::nullopt;
  return file_size(fd, st);
}

// The IoError of a read of `length` bytes at `offset` that failed with `err`. EIO is the disk's
// (or the file system's) own report that it could not read them, which strerror does not say.
IoError read_failed(std::string_view who, std::size_t length, std::uint64_t offset, int err) {
  return IoError(fmt::format("{}: reading {} bytes at offset {} failed: {}{}", who, length, offset, os_error(err),
                             err == EIO ? " (the disk or file system could not read them: a failing disk, or a "
                                          "network file system that went away?)"
                                        : ""));
}

// Reads `length` bytes at `offset` with pread, retrying short reads and EINTR: the bytes read (fewer
// only at the end of the file), or -errno.
std::int64_t pread_full(int fd, std::byte* dest, std::size_t length, std::uint64_t offset) {
  std::size_t done = 0;
  while (done < length) {
    const ssize_t n = ::pread(fd, dest + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -errno;
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  return static_cast<std::int64_t>(done);
}

// ---- io_uring, one ring per thread -------------------------------------------------------------------

// Note [One ring per thread]
// A ring is set up once per thread that reads (not per read: a safetensors file of a thousand
// small tensors would pay for a thousand rings) and torn down when the thread exits. A ring is
// not shared between threads, so reads on two threads never wait for each other's completions.
//
// fork(): a child inherits every thread's ring (the descriptor and the mappings of the queues,
// which are shared with the parent) but none of the threads that own them, so no thread exit
// would ever tear those down: a server that forks workers after loading weights would leave
// each worker holding the parent's rings, and the parent's rings alive as long as any worker.
// Every ring is therefore listed, and a pthread_atfork child handler unmaps and closes the
// child's copies (which leaves the parent's rings as they are: munmap and close act on the
// child's own mappings and descriptor). A thread of the child that reads sets up its own ring.
//
// A ring joins the list and leaves it in the same critical section as its setup and teardown,
// so no fork sees a ring that is set up and not listed. A thread-local destructor that reads from
// DISK after the thread's ring was torn down gets pread (t_ring_gone), not a new ring left listed
// after its memory is gone.
//
// Setup failures: ENOSYS, EPERM, EACCES and EINVAL say io_uring cannot work in this process (an
// old kernel, seccomp, a container or the io_uring_disabled sysctl that forbids it): the process
// says so once and reads with pread from then on. Any other (EMFILE, ENFILE, ENOMEM, EAGAIN: out
// of descriptors or locked memory for the moment) costs only that read, which uses pread; the
// thread's next read tries again. kMaxPassingFailures of those in a row, with no setup between
// that worked, count as "cannot work" too: before Linux 5.12 rings are charged to
// RLIMIT_MEMLOCK, and a limit too small for one ring fails every setup with ENOMEM for good.
#ifdef TINYDEV_HAVE_LIBURING
constexpr int kMaxPassingFailures = 16;
std::atomic<int> g_uring_error{0};            // the errno of a setup that said io_uring cannot work here
std::atomic<int> g_uring_passing_error{0};    // the errno of the latest setup that failed for the moment
std::atomic<int> g_uring_passing_streak{0};   // such failures since the last setup that worked

bool uring_cannot_work(int err) { return err == ENOSYS || err == EPERM || err == EACCES || err == EINVAL; }

struct ThreadRing;
// Every set-up ring of the process, for the fork handler. Leaked on purpose: threads, whose
// rings leave the list as they exit, may outlive static destruction.
struct RingList {
  std::mutex mutex;
  std::vector<ThreadRing*> rings;
};
RingList& ring_list() {
  static RingList* list = new RingList;
  return *list;
}
void forget_rings_in_child();
thread_local bool t_ring_gone = false;  // trivially destructible: readable after ~ThreadRing

struct ThreadRing {
  io_uring ring{};
  bool ready = false;
  ~ThreadRing() {
    t_ring_gone = true;
    if (!ready) return;
    std::lock_guard lock(ring_list().mutex);
    std::erase(ring_list().rings, this);
    tear_down();
  }
  // Unmaps and closes the ring (this process's copy of it). The caller holds the list's mutex and
  // takes the ring off the list.
  void tear_down() noexcept {
    io_uring_queue_exit(&ring);
    ready = false;
  }
  io_uring* get() {
    if (ready) return &ring;
    if (g_uring_error.load(std::memory_order_relaxed) != 0) return nullptr;
    static std::once_flag fork_handler;
    std::call_once(fork_handler, [] {
      pthread_atfork([] { ring_list().mutex.lock(); }, [] { ring_list().mutex.unlock(); }, &forget_rings_in_child);
    });
    int rc;
    {
      std::lock_guard lock(ring_list().mutex);
      ring_list().rings.reserve(ring_list().rings.size() + 1);  // may throw: nothing set up yet
      rc = io_uring_queue_init(kRingEntries, &ring, 0);
      if (rc == 0) {
        ring_list().rings.push_back(this);  // reserved: cannot throw
        ready = true;
      }
    }
    if (rc == 0) {
      g_uring_passing_error.store(0, std::memory_order_relaxed);
      g_uring_passing_streak.store(0, std::memory_order_relaxed);
      return &ring;
    }
    const int err = -rc;
    const int streak = uring_cannot_work(err) ? 0 : g_uring_passing_streak.fetch_add(1) + 1;
    if (streak == 0 || streak >= kMaxPassingFailures) {
      if (g_uring_error.exchange(err) == 0)
        debug_log(1, "DISK", "io_uring is not available here ({}{}): reading with pread", os_error(err),
                  streak ? fmt::format(", {} ring setups in a row", streak) : std::string());
    } else {
      g_uring_passing_error.store(err, std::memory_order_relaxed);
      debug_log(streak == 1 ? 1 : 2, "DISK",
                "setting up an io_uring ring failed for now ({}): this read uses pread, the next tries again",
                os_error(err));
    }
    return nullptr;
  }
};
thread_local ThreadRing t_ring;

// The pthread_atfork child handler (Note [One ring per thread]): the list's mutex is held (by
// the prepare handler, on this thread), and this is the child's only thread.
void forget_rings_in_child() {
  RingList& list = ring_list();
  for (ThreadRing* r : list.rings) r->tear_down();
  list.rings.clear();
  list.mutex.unlock();
}
#endif

// The io_uring ring of this thread, or nullptr (pread) when TINYDEV_DISK_IO=pread or io_uring
// cannot work here.
#ifdef TINYDEV_HAVE_LIBURING
io_uring* thread_ring() {
  if (!settings().disk_io_uring || t_ring_gone) return nullptr;
  return t_ring.get();
}
#endif

std::string describe_io_method() {
  if (!settings().disk_io_uring) return "pread (TINYDEV_DISK_IO=pread)";
#ifdef TINYDEV_HAVE_LIBURING
  if (int err = g_uring_error.load(std::memory_order_relaxed))
    return fmt::format("pread (io_uring is not available here: {})", os_error(err));
  if (int err = g_uring_passing_error.load(std::memory_order_relaxed))
    return fmt::format("io_uring (the latest ring setup failed for now, {}: that read used pread)", os_error(err));
  return "io_uring";
#else
  return "pread (this build has no liburing)";
#endif
}

// ---- the reads ---------------------------------------------------------------------------------------

// One read of the file into host memory.
struct ReadRequest {
  std::byte* dest = nullptr;
  std::uint64_t file_offset = 0;
  std::size_t length = 0;  // bytes asked of the kernel (a multiple of the page for O_DIRECT)
  std::size_t needed = 0;  // of those, the bytes that must arrive (the rest pads the range's end)
  bool direct = false;
};

// Descriptors of an open file, as one read uses them.
struct FileFds {
  int fd = -1;         // buffered reads and writes
  int direct_fd = -1;  // O_DIRECT reads, or -1 where the file system does not allow them
  const std::byte* map = nullptr;
  std::uint64_t map_bytes = 0;
};

// Keeps up to `depth` reads in flight (io_uring) or runs them one by one (pread), completing each in
// the order the kernel finishes them. Callers: submit while room(), then complete() one.
class ReadQueue {
 public:
  ReadQueue(const FileFds& fds, unsigned depth, std::string_view who) : fds_(fds), who_(who) {
#ifdef TINYDEV_HAVE_LIBURING
    ring_ = thread_ring();
#endif
    depth_ = ring_ ? std::min(depth, kRingEntries) : 1;
  }
  ReadQueue(const ReadQueue&) = delete;
  ReadQueue& operator=(const ReadQueue&) = delete;
  // A queue that still has reads in flight waits for them: the kernel must not write into memory
  // the caller is about to give back.
  ~ReadQueue() {
    while (in_flight_ > 0) (void)next_completion();
  }

  bool room() const noexcept { return in_flight_ < depth_; }
  unsigned in_flight() const noexcept { return in_flight_; }

  void submit(const ReadRequest& r, std::size_t tag) {
    requests_.push_back({r, tag});
    const std::size_t id = requests_.size() - 1;
#ifdef TINYDEV_HAVE_LIBURING
    if (ring_) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring_);
      if (!sqe) {  // the ring holds kRingEntries >= depth_ and each read is submitted at once
        requests_.pop_back();
        throw IoError(fmt::format("{}: no free io_uring submission entry with {} reads in flight (a bug)", who_,
                                  in_flight_));
      }
      io_uring_prep_read(sqe, r.direct ? fds_.direct_fd : fds_.fd, r.dest, static_cast<unsigned>(r.length),
                         r.file_offset);
      io_uring_sqe_set_data64(sqe, id);
      // The entry is in the ring now, so it must reach the kernel: a submit that fails for good
      // would leave it to be sent with someone else's next read, into memory nobody owns then.
      int rc;
      for (int attempt = 0; (rc = io_uring_submit(ring_)) < 0 && attempt < 1000; ++attempt) {
        if (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) break;
        if (rc != -EINTR) ::usleep(100);
      }
      if (rc < 0) {
        log_message(LogLevel::error, who_,
                    fmt::format("io_uring_submit failed ({}) with a read queued in the ring: aborting", std::strerror(-rc)));
        std::abort();
      }
      ++in_flight_;
      return;
    }
#endif
    ready_.push_back({id, pread_full(r.direct ? fds_.direct_fd : fds_.fd, r.dest, r.length, r.file_offset)});
    ++in_flight_;
  }

  // One finished read: its request, its tag and, when it failed or the file ended before its
  // `needed` bytes, the IoError (the read is over either way: nothing writes its memory any more).
  struct Completion {
    ReadRequest request;
    std::size_t tag = 0;
    std::exception_ptr error;
  };
  // Waits for one read to finish.
  Completion complete() {
    auto [id, res] = next_completion();
    const auto [r, tag] = requests_[id];
    Completion out{r, tag, nullptr};
    // Some file systems take O_DIRECT at open and refuse it per read (EINVAL, or EAGAIN where
    // io_uring treats the file as non-blocking): read that piece buffered.
    if ((res == -EINVAL || res == -EAGAIN) && r.direct) res = pread_full(fds_.fd, r.dest, r.length, r.file_offset);
    try {
      if (res < 0)
        throw read_failed(who_, r.length, r.file_offset, static_cast<int>(-res));
      if (static_cast<std::uint64_t>(res) < r.needed) {
        // A short read: the rest with pread (the kernel may split a read), and the end of the
        // file if pread finds it too.
        const std::int64_t more = pread_full(fds_.fd, r.dest + res, r.needed - static_cast<std::size_t>(res),
                                             r.file_offset + static_cast<std::uint64_t>(res));
        if (more < 0)
          throw read_failed(who_, r.length, r.file_offset, static_cast<int>(-more));
        if (static_cast<std::uint64_t>(res + more) < r.needed) {
          const std::optional<std::uint64_t> size = current_file_size(fds_.fd);
          throw IoError(fmt::format("{}: the file ended at byte {} while reading bytes {} to {}: the file is {} "
                                    "bytes now, shorter than the buffer opened on it (was it truncated?)",
                                    who_, r.file_offset + static_cast<std::uint64_t>(res + more), r.file_offset,
                                    r.file_offset + r.needed, size ? fmt::format("{}", *size) : std::string("?")));
        }
      }
    } catch (...) {
      out.error = std::current_exception();
    }
    return out;
  }

 private:
  std::pair<std::size_t, std::int64_t> next_completion() {
    --in_flight_;
#ifdef TINYDEV_HAVE_LIBURING
    if (ring_) {
      io_uring_cqe* cqe = nullptr;
      int rc;
      do rc = io_uring_wait_cqe(ring_, &cqe);
      while (rc == -EINTR);
      if (rc < 0) {
        // Only a broken ring fails here; the reads may still be running, so nothing is safe to
        // free: this is fatal to the process rather than a silent overwrite later.
        log_message(LogLevel::error, who_,
                    fmt::format("io_uring_wait_cqe failed ({}) with reads in flight: aborting", std::strerror(-rc)));
        std::abort();
      }
      const std::pair<std::size_t, std::int64_t> out{io_uring_cqe_get_data64(cqe), cqe->res};
      io_uring_cqe_seen(ring_, cqe);
      return out;
    }
#endif
    const auto out = ready_.front();
    ready_.pop_front();
    return out;
  }

  FileFds fds_;
  std::string_view who_;
#ifdef TINYDEV_HAVE_LIBURING
  io_uring* ring_ = nullptr;
#else
  void* ring_ = nullptr;
#endif
  unsigned depth_ = 1, in_flight_ = 0;
  std::vector<std::pair<ReadRequest, std::size_t>> requests_;
  std::deque<std::pair<std::size_t, std::int64_t>> ready_;  // pread's completions
};

// Whether [offset, offset + length) is in the page cache, by mincore on the mapping: those ranges
// are copied from the mapping (Note [Copies from the mapping]), the others read with O_DIRECT (no
// copy through the cache). Four pages are asked (first, last and two between), not all of them: a
// mincore of a whole 2 MiB piece costs about as much as 5% of its copy, and a page that turns
// out not to be cached is read in by the copy's page fault, which is slower but right.
bool resident(const FileFds& fds, std::uint64_t offset, std::size_t length) {
  // Wholly inside the mapping, or not copied from it: the file may be longer than the buffers
  // opened on it, and the mapping covers only what they asked for.
  if (!fds.map || length == 0 || offset >= fds.map_bytes || length > fds.map_bytes - offset) return false;
  const std::uint64_t first = align_down(offset);
  const std::uint64_t last = align_down(std::min<std::uint64_t>(offset + length, fds.map_bytes) - 1);
  const std::uint64_t pages = (last - first) / kPage + 1;
  for (std::uint64_t k = 0; k < std::min<std::uint64_t>(pages, 4); ++k) {
    const std::uint64_t page = pages <= 4 ? k : k * (pages - 1) / 3;
    unsigned char in_core = 0;
    if (::mincore(const_cast<std::byte*>(fds.map) + first + page * kPage, kPage, &in_core) != 0 || !(in_core & 1))
      return false;
  }
  return true;
}

// Note [Copies from the mapping]
// A range whose pages are all in the page cache is copied from the file's mapping with memcpy:
// that is what a user's mmap + memcpy costs, where a read(2) of cached pages runs at about half
// the speed (it copies page by page through the kernel), and io_uring only gets it back by
// handing reads to its worker threads, at a cost per call. The danger of a mapping is a file
// that shrinks under the copy (another process truncates it): the read past the new end raises
// SIGBUS. So the copy runs guarded: a SIGBUS handler, installed once and chained to whatever
// handler was there before, jumps back out of a guarded copy whose source range faulted on this
// thread, and the copy is then an IoError; any other SIGBUS goes to the previous handler untouched.
// The guard of this thread: volatile, and fenced around the copy, because the signal handler
// reads it between any two instructions of the copy.
thread_local sigjmp_buf* volatile t_guard = nullptr;
thread_local const std::byte* volatile t_guard_begin = nullptr;
thread_local const std::byte* volatile t_guard_end = nullptr;
thread_local volatile int t_guard_code = 0;  // the si_code of the SIGBUS that ended a guarded copy
thread_local const std::byte* volatile t_guard_fault = nullptr;  // and the address it faulted at
struct sigaction g_previous_sigbus;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const auto* address = static_cast<const std::byte*>(info ? info->si_addr : nullptr);
  sigjmp_buf* guard = t_guard;
  if (guard && info && info->si_code > 0 && address >= t_guard_begin && address < t_guard_end) {
    t_guard = nullptr;
    t_guard_code = info->si_code;
    t_guard_fault = address;
    siglongjmp(*guard, 1);
  }
  detail::pass_signal_on(g_previous_sigbus, sig, info, context);  // not ours
}

// Copies `size` bytes of the mapping at `src` to `dest`; false when the file shrank under the copy.
bool guarded_copy(std::byte* dest, const std::byte* src, std::size_t size) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction action{};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGBUS, &action, &g_previous_sigbus);
  });
  sigjmp_buf guard;
  if (sigsetjmp(guard, 1) != 0) return false;  // the handler jumped here: SIGBUS in the range
  t_guard_begin = src;
  t_guard_end = src + size;
  t_guard = &guard;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  // From 4 MiB up, streaming stores (Note [Streaming copies] in src/memory.cpp): a 16 MiB tensor
  // of a model copies at twice the speed of memcpy's regular stores.
  if (size >= (4u << 20)) detail::streaming_copy(dest, src, size);
  else std::memcpy(dest, src, size);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_guard = nullptr;
  return true;
}

// ---- one file ------------------------------------------------------------------------------------

// The file of one DISK device (the seed's DiskDevice state): opened by the first buffer, closed
// by the last. Thread-safe; one mutex guards the open state, and reads and writes run outside it
// on descriptors that stay open while the caller's buffer lives.
class DiskFile {
 public:
  DiskFile(std::string device, std::string path) : device_(std::move(device)), path_(std::move(path)) {
    shm_ = path_.starts_with("shm:");
    if (shm_) {
      std::string name = path_.substr(4);
      name.erase(0, name.find_first_not_of('/'));
      shm_name_ = "/" + name;
      if (shm_name_.size() < 2 || shm_name_.find('/', 1) != std::string::npos || shm_name_.size() > 255)
        throw InvalidArgument(fmt::format("{}: a shared-memory name is one path component of 1 to 254 characters "
                                          "without '/', e.g. DISK:shm:weights",
                                          device_));
    }
  }
  ~DiskFile() { close_locked(); }

  // The seed's _might_open: the first buffer opens the file (creating nothing: a missing file is
  // created by the first write); later ones may not ask for more than the first did.
  void open_for(std::uint64_t size) {
    std::lock_guard lock(mutex_);
    if (opened_size_ && size > *opened_size_)
      throw InvalidArgument(fmt::format("{}: can't reopen with a larger size: it was opened with {} bytes and is now "
                                        "asked for {}; free every buffer on it first, or open the largest first",
                                        device_, *opened_size_, size));
    if (!opened_size_) {
      open_locked(/*create=*/false);
      opened_size_ = size;
      try {
        if (fd_ >= 0) map_locked();
      } catch (...) {
        opened_size_.reset();  // nothing is open: the next buffer starts over
        throw;
      }
    }
    ++buffers_;
  }
  // The seed's _might_close.
  void close_one() noexcept {
    std::lock_guard lock(mutex_);
    if (buffers_ > 0 && --buffers_ == 0) close_locked();
  }

  // Descriptors for reading [offset, offset + size), checked against the file's size now.
  FileFds for_read(std::uint64_t offset, std::uint64_t size) {
    std::lock_guard lock(mutex_);
    if (fd_ < 0 && opened_size_) {  // missing when opened: someone may have created it since
      open_locked(/*create=*/false);
      if (fd_ >= 0) map_locked();
    }
    if (fd_ < 0)
      throw IoError(fmt::format("{}: no such file (nothing wrote it yet): check the path, or copy into a buffer on "
                                "it first",
                                device_));
    struct stat st{};
    if (::fstat(fd_, &st) != 0) throw IoError(fmt::format("{}: fstat failed: {}", device_, os_error(errno)));
    const std::uint64_t bytes = file_size(fd_, st).value_or(0);
    if (size > bytes || offset > bytes - size)
      throw IoError(fmt::format("{}: reading bytes {} to {}, but the file is {} bytes: it is shorter than the "
                                "buffer opened on it; open a smaller buffer or check the file",
                                device_, offset, offset + size, bytes));
    return FileFds{fd_, direct_fd_, map_, map_bytes_};
  }

  // The descriptor to write [offset, offset + size) with: the file created if it did not exist.
  int for_write() {
    std::lock_guard lock(mutex_);
    if (fd_ < 0) {
      open_locked(/*create=*/true);
      map_locked();
    }
    if (!writable_)
      throw InvalidArgument(fmt::format("{}: cannot write: the file opened read-only ({}); write to a copy, or "
                                        "make it writable",
                                        device_, readonly_reason_));
    return fd_;
  }

  std::span<std::byte> window(std::uint64_t offset, std::uint64_t size) {
    for_read(offset, size);  // the range must be in the file: past its end the mapping faults
    std::lock_guard lock(mutex_);
    if (size > map_bytes_ || offset > map_bytes_ - size)  // and in the mapping, which covers the buffers' sizes
      throw InvalidArgument(fmt::format("{}: a window on bytes {} to {}, past the {} bytes mapped for the buffers "
                                        "opened on it",
                                        device_, offset, offset + size, map_bytes_));
    return {map_ + offset, size};
  }

  std::string reads() const {
    std::lock_guard lock(mutex_);
    std::string how = "cached pages copied from the mapping, the rest read with " + describe_io_method();
    if (fd_ < 0) return how;
    if (direct_fd_ >= 0) return how + " and O_DIRECT";
    return how + (shm_ ? ", buffered (shared memory)" : ", buffered (the file system refuses O_DIRECT)");
  }
  const std::string& device() const noexcept { return device_; }
  std::map<std::string, std::string> properties() const {
    std::lock_guard lock(mutex_);
    return {{"file", shm_ ? "shared memory " + shm_name_ : path_},
            {"opened", opened_size_ ? fmt::format("{} bytes by {} buffers, {}", *opened_size_, buffers_,
                                                  fd_ < 0 ? "file not created yet" : writable_ ? "read-write" : "read-only")
                                    : std::string("no buffer open")}};
  }

 private:
  int open_path(int flags, mode_t mode) const {
    return shm_ ? ::shm_open(shm_name_.c_str(), flags, mode) : ::open(path_.c_str(), flags, mode);
  }

  void open_locked(bool create) {
    // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
    const int base = O_CLOEXEC | O_NOCTTY | (shm_ ? 0 : O_NONBLOCK);
    int fd = open_path(O_RDWR | base | (create ? O_CREAT : 0), shm_ ? 0600 : 0666);
    writable_ = fd >= 0;
    if (fd < 0 && !create && (errno == EACCES || errno == EROFS || errno == EPERM || errno == ETXTBSY)) {
      readonly_reason_ = fmt::format("opening it for writing: {}", os_error(errno));
      fd = open_path(O_RDONLY | base, 0);
    }
    if (fd < 0) {
      const int err = errno;
      if (err == ENOENT && !create) return;  // created by the first write
      if (err == EISDIR)
        throw InvalidArgument(fmt::format("{}: {} is a folder; a DISK device is one file", device_, path_));
      // A socket (or a device file with no device behind it) cannot be opened at all.
      if (err == ENXIO)
        throw InvalidArgument(fmt::format("{}: {} is not a regular file or a block device ({}); a DISK device reads "
                                          "and writes files",
                                          device_, path_, os_error(err)));
      throw IoError(fmt::format("{}: cannot {} {}: {}", device_, create ? "create" : "open", shm_ ? shm_name_ : path_,
                                os_error(err)));
    }
    struct stat st{};
    if (::fstat(fd, &st) != 0 || !(S_ISREG(st.st_mode) || S_ISBLK(st.st_mode))) {
      ::close(fd);
      throw InvalidArgument(fmt::format("{}: {} is not a regular file or a block device; a DISK device reads and "
                                        "writes files",
                                        device_, path_));
    }
    if (!shm_) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    fd_ = fd;
    // O_DIRECT on a second descriptor of the same file (reads only). Opened by path, so it is
    // checked to be the same file; shared memory (tmpfs) has no O_DIRECT.
    if (!shm_) {
      const int direct = ::open(path_.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
      struct stat dst{};
      if (direct >= 0 && ::fstat(direct, &dst) == 0 && dst.st_dev == st.st_dev && dst.st_ino == st.st_ino) {
        ::fcntl(direct, F_SETFL, ::fcntl(direct, F_GETFL) & ~O_NONBLOCK);
        direct_fd_ = direct;
      } else {
        if (direct >= 0) ::close(direct);
        debug_log(2, device_, "the file system does not allow O_DIRECT here ({}): buffered reads",
                  direct < 0 ? os_error(errno) : std::string("the path now names another file"));
      }
    }
  }

  void map_locked() {
    map_bytes_ = align_up(*opened_size_);
    void* p = ::mmap(nullptr, map_bytes_, PROT_READ | (writable_ ? PROT_WRITE : 0), MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      map_bytes_ = 0;
      close_fds_locked();
      throw IoError(fmt::format("{}: mapping {} bytes failed: {}", device_, *opened_size_, os_error(err)));
    }
    map_ = static_cast<std::byte*>(p);
    (void)::madvise(p, map_bytes_, MADV_HUGEPAGE);  // where transparent huge pages are on
  }

  void close_fds_locked() noexcept {
    if (direct_fd_ >= 0) ::close(direct_fd_);
    if (fd_ >= 0) ::close(fd_);
    fd_ = direct_fd_ = -1;
  }
  void close_locked() noexcept {
    if (map_) ::munmap(map_, map_bytes_);
    map_ = nullptr;
    map_bytes_ = 0;
    close_fds_locked();
    opened_size_.reset();
    writable_ = false;
    readonly_reason_.clear();
  }

  const std::string device_, path_;
  bool shm_ = false;
  std::string shm_name_;
  mutable std::mutex mutex_;
  int fd_ = -1, direct_fd_ = -1;
  std::byte* map_ = nullptr;
  std::uint64_t map_bytes_ = 0;
  std::optional<std::uint64_t> opened_size_;
  std::uint64_t buffers_ = 0;
  bool writable_ = false;
  std::string readonly_reason_;
};

// ---- the allocator --------------------------------------------------------------------------------

// The seed's DiskAllocator. An allocation is a range of the file: va_addr is its file offset (0
// for a buffer, the absolute offset for a view), `backend` a tag of its own (the allocator's
// record of live allocations tells buffers apart by it).
class DiskAllocator final : public Allocator, public FileReader {
 public:
  DiskAllocator(std::string device, std::string path) : file_(std::move(device), std::move(path)) {}

  void copyin(Allocation dest, std::span<const std::byte> src) override {
    detail::check_fits(src.size(), dest, "copyin", describe());
    const int fd = file_.for_write();
    std::size_t done = 0;
    while (done < src.size()) {
      const ssize_t n = ::pwrite(fd, src.data() + done, src.size() - done, static_cast<off_t>(dest.va_addr + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        throw IoError(fmt::format("{}: writing {} bytes at offset {} failed: {}", file_.device(), src.size() - done,
                                  dest.va_addr + done, n < 0 ? os_error(errno) : std::string("no progress")));
      done += static_cast<std::size_t>(n);
    }
  }
  void copyout(std::span<std::byte> dest, Allocation src) override {
    detail::check_fits(dest.size(), src, "copyout", describe());
    read_into(dest.data(), src, dest.size());
  }
  bool supports_offset() const noexcept override { return true; }
  Allocation offset(Allocation base, std::size_t size, std::size_t offset) override {
    return detail::sub_allocation(base, size, offset, describe());
  }
  std::optional<std::span<std::byte>> as_buffer(Allocation allocation) override {
    return file_.window(allocation.va_addr, allocation.size);
  }
  std::string describe() const override { return file_.device() + " allocator"; }
  FileReader* file_reader() noexcept override { return this; }

  // ---- FileReader ----
  // The error of a guarded copy that ended in SIGBUS (Note [Copies from the mapping]). The kernel
  // reports a read past a truncated end and a failed read of the page (a failing disk, a network
  // file system gone) alike, as BUS_ADRERR: reading the faulting byte with pread tells them apart
  // (EIO there is an I/O error; end of file, or the byte now there, a file that shrank, perhaps
  // rewritten since).
  IoError shrank(const FileFds& fds, std::uint64_t offset, std::uint64_t size) const {
    if (t_guard_code != BUS_ADRERR)
      return IoError(fmt::format("{}: a memory or I/O error (SIGBUS code {}) while bytes {} to {} were copied from "
                                 "the file's mapping",
                                 file_.device(), static_cast<int>(t_guard_code), offset, offset + size));
    const std::byte* fault = t_guard_fault;
    if (fault >= fds.map && fault < fds.map + fds.map_bytes) {
      const auto at = static_cast<off_t>(fault - fds.map);
      std::byte byte;
      ssize_t r;
      do r = ::pread(fds.fd, &byte, 1, at);
      while (r < 0 && errno == EINTR);
      const int error = r < 0 ? errno : 0;
      if (error == EIO)
        return IoError(fmt::format("{}: an I/O error while bytes {} to {} were copied from the file's mapping: byte {} "
                                   "cannot be read ({}; a failing disk, or a network file system that went away?)",
                                   file_.device(), offset, offset + size, at, std::strerror(error)));
      if (error != 0)
        return IoError(fmt::format("{}: a read of bytes {} to {} from the file's mapping failed at byte {}, and "
                                   "reading that byte again failed too: {}",
                                   file_.device(), offset, offset + size, at, std::strerror(error)));
      // The byte reads now and the file holds it: either the file was cut and written again
      // between the fault and this read, or reading the page in failed once (a network file
      // system; a large folio, read in whole, with one bad block in it). Nothing tells the two
      // apart afterwards, so the message names both.
      const std::optional<std::uint64_t> now = current_file_size(fds.fd);
      if (r == 1 && now && static_cast<std::uint64_t>(at) < *now)
        return IoError(fmt::format("{}: bytes {} to {} could not be copied from the file's mapping: the page of "
                                   "byte {} could not be read in, yet the file holds that byte now: the file shrank "
                                   "and grew again meanwhile (another process rewriting it?), or the disk or file "
                                   "system failed once (a network file system?); read it again",
                                   file_.device(), offset, offset + size, at));
    }
    return IoError(fmt::format("{}: the file shrank while bytes {} to {} were copied from it (another process "
                               "truncated it?)",
                               file_.device(), offset, offset + size));
  }

  void read_into(std::byte* dest, const Allocation& src, std::size_t size) override {
    detail::check_fits(size, src, "a read", describe());  // never past the buffer asked for
    const FileFds fds = file_.for_read(src.va_addr, size);
    ReadQueue queue(fds, kMaxInFlight, file_.device());
    const std::uint64_t begin = src.va_addr, end = begin + size;
    std::uint64_t pos = begin;
    while (pos < end || queue.in_flight() > 0) {
      while (pos < end && queue.room()) {
        // Pieces that O_DIRECT can take whole: page-aligned in the file and in memory.
        std::uint64_t length;
        if (pos % kPage) length = std::min(align_up(pos), end) - pos;          // the head
        else if (end - pos < kPage) length = end - pos;                         // the tail
        else length = std::min<std::uint64_t>(kChunk, align_down(end) - pos);   // the body
        ReadRequest r{dest + (pos - begin), pos, static_cast<std::size_t>(length), static_cast<std::size_t>(length)};
        if (resident(fds, pos, length)) {  // Note [Copies from the mapping]
          // One memcpy for the whole cached run: large copies use non-temporal stores, which
          // chunk-sized ones do not, at about twice the speed.
          std::uint64_t run_end = pos + length;
          while (run_end < end && run_end - pos < (1u << 30) &&
                 resident(fds, run_end, static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, end - run_end))))
            run_end = std::min<std::uint64_t>(run_end + kChunk, end);
          if (!guarded_copy(r.dest, fds.map + pos, run_end - pos)) throw shrank(fds, pos, run_end - pos);
          pos = run_end;
          continue;
        }
        pos += length;
        r.direct = fds.direct_fd >= 0 && length % kPage == 0 && r.file_offset % kPage == 0 && aligned(r.dest);
        queue.submit(r, 0);
      }
      // On a failed read the queue's destructor waits for the others before the error leaves.
      if (queue.in_flight() == 0) continue;
      if (auto done = queue.complete(); done.error) std::rethrow_exception(done.error);
    }
  }

  void read_sharded(const Allocation& src, std::size_t size, StagingSink& sink) override {
    detail::check_fits(size, src, "a read", describe());  // never past the buffer asked for
    const FileFds fds = file_.for_read(src.va_addr, size);
    const std::size_t slot = sink.slot_bytes();
    // Reads are whole pages from a page boundary when a slot holds at least one page (so that
    // O_DIRECT can take them); the first slot then starts `lead` bytes before the range.
    const bool paged = slot >= kPage;
    const std::uint64_t step = std::min<std::uint64_t>(paged ? slot - slot % kPage : slot, 1u << 30);
    const std::uint64_t begin = src.va_addr, end = begin + size;
    const std::uint64_t first = paged ? align_down(begin) : begin, last = paged ? align_up(end) : end;
    // The slots being read, by tag. After a failure nothing more is read, the reads in flight
    // finish, and every slot they hold is given back instead of landing.
    std::vector<std::optional<StagingSink::Slot>> taken(kRingEntries);
    std::exception_ptr failure;
    const auto fail = [&](std::exception_ptr e) {
      if (!failure) failure = std::move(e);
    };
    {
      ReadQueue queue(fds, kRingEntries, file_.device());
      std::uint64_t pos = first;
      while ((pos < last && !failure) || queue.in_flight() > 0) {
        while (!failure && pos < last && queue.room()) {
          std::optional<StagingSink::Slot> s;
          try {
            s = queue.in_flight() == 0 ? std::optional(sink.take()) : sink.try_take();
          } catch (...) {
            fail(std::current_exception());
            break;
          }
          if (!s) break;  // every slot is still copied: wait for a read to finish first
          std::size_t tag = 0;
          while (taken[tag]) ++tag;  // in flight <= depth <= kRingEntries, so one is free
          const std::uint64_t length = std::min(step, last - pos);
          const std::uint64_t lead = pos < begin ? begin - pos : 0;
          const std::uint64_t useful = std::min(length - lead, end - (pos + lead));
          ReadRequest r{s->data, pos, static_cast<std::size_t>(length), static_cast<std::size_t>(lead + useful)};
          if (resident(fds, pos + lead, useful)) {  // Note [Copies from the mapping]: no read at all
            try {
              if (!guarded_copy(s->data + lead, fds.map + pos + lead, useful)) throw shrank(fds, pos + lead, useful);
              pos += length;
              sink.landed(*s, static_cast<std::size_t>(pos - length + lead - begin), static_cast<std::size_t>(lead),
                          static_cast<std::size_t>(useful));
            } catch (...) {
              sink.abandon(*s);
              fail(std::current_exception());
              break;
            }
            continue;
          }
          r.direct = paged && fds.direct_fd >= 0 && aligned(s->data);
          try {
            queue.submit(r, tag);
            taken[tag] = s;
          } catch (...) {
            sink.abandon(*s);
            fail(std::current_exception());
            break;
          }
          pos += length;
        }
        if (queue.in_flight() == 0) continue;
        ReadQueue::Completion done = queue.complete();
        const StagingSink::Slot s = *taken[done.tag];
        taken[done.tag].reset();
        if (done.error) fail(done.error);
        if (failure) {
          sink.abandon(s);
          continue;
        }
        const ReadRequest& r = done.request;
        const std::uint64_t lead = r.file_offset < begin ? begin - r.file_offset : 0;
        try {
          sink.landed(s, static_cast<std::size_t>(r.file_offset + lead - begin), static_cast<std::size_t>(lead),
                      static_cast<std::size_t>(r.needed - lead));
        } catch (...) {
          sink.abandon(s);
          fail(std::current_exception());
        }
      }
    }
    if (failure) std::rethrow_exception(failure);
  }

  std::string describe_reads() const override { return file_.reads(); }
  std::map<std::string, std::string> properties() const { return file_.properties(); }

 protected:
  Allocation alloc_impl(std::size_t size, const BufferOptions&) override {
    file_.open_for(size);
    return Allocation{0, size, new char{}};  // the tag: freed with the allocation
  }
  void free_impl(Allocation allocation, std::size_t, const BufferOptions&) override {
    delete static_cast<char*>(allocation.backend);
    file_.close_one();
  }

 private:
  DiskFile file_;
};

// A DISK device compiles and runs nothing (the seed passes None for both).
class DiskRuntime final : public Runtime {
 public:
  explicit DiskRuntime(std::string device) : device_(std::move(device)) {}
  std::shared_ptr<Program> load(std::string_view kernel_name, std::span<const std::byte>) override {
    throw InvalidArgument(fmt::format("{} runs no kernels, so {} cannot be loaded on it: copy the buffers to a "
                                      "device that computes (tinydev::copy)",
                                      device_, quote_for_message(kernel_name)));
  }

 private:
  std::string device_;
};

class DiskDevice final : public Compiled {
 public:
  DiskDevice(const std::string& name, std::shared_ptr<DiskAllocator> allocator)
      : Compiled(name, allocator, std::make_shared<Compiler>(), std::make_shared<DiskRuntime>(name),
                 SourceLanguage::None),
        disk_(std::move(allocator)) {}
  DeviceCapabilities capabilities() const override { return DeviceCapabilities{}; }
  std::map<std::string, std::string> properties() const override {
    auto props = Compiled::properties();
    props.merge(disk_->properties());
    props["reads"] = disk_->describe_reads();
    return props;
  }

 private:
  std::shared_ptr<DiskAllocator> disk_;
};

}  // namespace

std::unique_ptr<Compiled> open_disk_device(const std::string& canonical_name) {
  const std::string path = canonical_name.substr(canonical_name.find(':') + 1);
  if (canonical_name.find(':') == std::string::npos || path.empty())
    throw InvalidArgument(fmt::format("{} names no file: a DISK device is DISK:/path/to/file or DISK:shm:name",
                                      quote_for_message(canonical_name)));
  return std::make_unique<DiskDevice>(canonical_name, std::make_shared<DiskAllocator>(canonical_name, path));
}

}  // namespace tinydev
