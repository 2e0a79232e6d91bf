#include "subprocess.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <tuple>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "tinydev/error.hpp"

extern char** environ;

namespace tinydev::clang_backend {

namespace {

struct Pipe {
  int fd[2] = {-1, -1};
  Pipe() {
    if (::pipe2(fd, O_CLOEXEC) != 0)
      throw Error(fmt::format("cannot create a pipe: {}", std::strerror(errno)));
  }
  ~Pipe() {
    close_end(0);
    close_end(1);
  }
  void close_end(int i) {
    if (fd[i] >= 0) ::close(fd[i]);
    fd[i] = -1;
  }
};

// A child that exits without reading all of stdin must not kill us with SIGPIPE: block it in this
// thread around the write and swallow the one it raised (Note: process-wide handlers stay as they
// are, since an embedding server may rely on them).
ssize_t write_no_sigpipe(int fd, const char* data, std::size_t size) {
  sigset_t pipe_only, previous;
  sigemptyset(&pipe_only);
  sigaddset(&pipe_only, SIGPIPE);
  sigset_t pending;
  sigemptyset(&pending);
  ::sigpending(&pending);
  const bool was_pending = sigismember(&pending, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe_only, &previous);
  ssize_t w = ::write(fd, data, size);
  const int saved = errno;
  if (w < 0 && saved == EPIPE && !was_pending) {
    timespec zero{0, 0};
    while (::sigtimedwait(&pipe_only, nullptr, &zero) < 0 && errno == EINTR) {
    }
  }
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  errno = saved;
  return w;
}

}  // namespace

std::string find_on_path(const std::string& program) {
  if (program.find('/') != std::string::npos)
    return ::access(program.c_str(), X_OK) == 0 ? program : std::string();
  const char* path = std::getenv("PATH");
  std::string_view rest = path ? path : "/usr/local/bin:/usr/bin:/bin";
  while (true) {
    std::size_t colon = rest.find(':');
    std::string_view dir = rest.substr(0, colon);
    std::string candidate = fmt::format("{}/{}", dir.empty() ? std::string_view(".") : dir, program);
    struct stat st {};
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(candidate.c_str(), X_OK) == 0)
      return candidate;
    if (colon == std::string_view::npos) return {};
    rest.remove_prefix(colon + 1);
  }
}

ProcessResult run_process(const std::vector<std::string>& argv, std::string_view input,
                          std::chrono::milliseconds timeout) {
  Pipe in, out, err;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in.fd[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out.fd[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err.fd[1], STDERR_FILENO);
  // A process group of its own, so that a timeout kills the compiler and anything it started.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  int rc = ::posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0)
    throw Error(fmt::format("cannot start '{}': {}", argv[0], std::strerror(rc)));
  in.close_end(0);
  out.close_end(1);
  err.close_end(1);

  // Feed stdin and drain both outputs at once, so no pipe fills up and deadlocks the child.
  // Whatever happens below (an allocation failure included), the child is killed and reaped.
  struct Reaper {
    pid_t pid;
    bool armed = true;
    ~Reaper() {
      if (!armed) return;
      ::kill(-pid, SIGKILL);
      int status = 0;
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
  } reaper{pid};
  ProcessResult result;
  result.pid = pid;
  std::size_t written = 0;
  if (input.empty()) in.close_end(1);
  else ::fcntl(in.fd[1], F_SETFL, O_NONBLOCK);
  char chunk[65536];
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (out.fd[0] >= 0 || err.fd[0] >= 0) {
    pollfd fds[3];
    int n = 0;
    int idx_in = -1, idx_out = -1, idx_err = -1;
    if (in.fd[1] >= 0) { idx_in = n; fds[n++] = {in.fd[1], POLLOUT, 0}; }
    if (out.fd[0] >= 0) { idx_out = n; fds[n++] = {out.fd[0], POLLIN, 0}; }
    if (err.fd[0] >= 0) { idx_err = n; fds[n++] = {err.fd[0], POLLIN, 0}; }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      result.timed_out = true;
      break;
    }
    const int ready = ::poll(fds, static_cast<nfds_t>(n), static_cast<int>(std::min<std::int64_t>(left.count(), 1 << 30)));
    if (ready < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (ready == 0) continue;  // the deadline check above decides
    if (idx_in >= 0 && fds[idx_in].revents) {
      ssize_t w = write_no_sigpipe(in.fd[1], input.data() + written, input.size() - written);
      if (w > 0) written += static_cast<std::size_t>(w);
      if (w < 0 && errno != EAGAIN && errno != EINTR) in.close_end(1);  // child closed stdin
      if (written == input.size()) in.close_end(1);
    }
    for (auto [idx, pipe, sink] : {std::tuple{idx_out, &out, &result.out}, std::tuple{idx_err, &err, &result.err}}) {
      if (idx < 0 || !fds[idx].revents) continue;
      ssize_t r = ::read(pipe->fd[0], chunk, sizeof chunk);
      if (r > 0 && sink->size() + static_cast<std::size_t>(r) > kMaxOutputBytes) {
        result.output_overflow = true;  // a runaway or hostile compiler: stop it now
        result.timed_out = false;
        goto stop;
      }
      if (r > 0) sink->append(chunk, static_cast<std::size_t>(r));
      else if (r == 0 || (errno != EINTR && errno != EAGAIN)) pipe->close_end(0);
    }
  }
stop:
  in.close_end(1);
  // Reap it. A child that closed its output but does not exit still gets only the time left.
  int status = 0;
  bool reaped = false;
  while (!result.timed_out && !result.output_overflow) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      reaped = true;
      break;
    }
    if (r < 0 && errno != EINTR) break;  // ECHILD: someone else reaped it (SIGCHLD ignored)
    if (std::chrono::steady_clock::now() >= deadline) result.timed_out = true;
    else if (r == 0) ::usleep(1000);
  }
  reaper.armed = false;
  if (result.timed_out || result.output_overflow) {
    ::kill(-pid, SIGKILL);  // the group: the compiler and whatever it started
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    reaped = true;
  }
  if (!reaped) {
    result.exit_code = -1;  // the status is unknown: never taken for success
    return result;
  }
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

}  // namespace tinydev::clang_backend
