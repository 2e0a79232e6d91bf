// Embedding rows (docs/embedding.md): what a program pays for linking tinydev. A trivial CLANG-only
// program (embed_clang_only.cpp: tinydev::core + tinydev::clang, no LLVM) against the same work in
// plain C++ (embed_plain.cpp), each a fresh process, alternated: peak RSS (each prints its own
// VmHWM) and start-to-exit time.
// Then the compile time of a translation unit including <tinydev/tinydev.hpp> against one
// including only the standard headers tinydev's public headers use.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "bench_support.hpp"

namespace tinydev::bench {

namespace {

struct ChildRun {
  double seconds;
  double peak_rss_mb;  // VmHWM the child printed on exit; 0 when it printed none
  int status;
};

// Runs argv to its end. Its peak RSS is what it reports itself (VmHWM of its own memory map):
// wait4's ru_maxrss would count the pages of this process, which the child shares from fork until
// exec.
ChildRun run_program(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int out[2];
  if (::pipe(out) != 0) throw Error("bench_embedding: pipe failed");
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid < 0) throw Error("bench_embedding: fork failed");
  if (pid == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(out[1]);
  std::string printed;
  char buf[256];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) printed.append(buf, static_cast<std::size_t>(n));
  ::close(out[0]);
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) throw Error("bench_embedding: waitpid failed");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double rss_mb = 0;
  if (auto at = printed.find("VmHWM:"); at != std::string::npos) rss_mb = std::strtod(printed.c_str() + at + 6, nullptr) / 1024.0;
  return {seconds, rss_mb, status};
}

// The standard headers the public headers include (<vector>, <mutex>, ...; not fmt's).
std::vector<std::string> std_headers_of_api(const std::filesystem::path& include_dir) {
  std::set<std::string> found;
  const std::regex include_line(R"(^#include <([a-z_]+)>)");
  for (const auto& entry : std::filesystem::directory_iterator(include_dir / "tinydev")) {
    std::ifstream in(entry.path());
    for (std::string line; std::getline(in, line);) {
      std::smatch m;
      if (std::regex_search(line, m, include_line)) found.insert(m[1]);
    }
  }
  return {found.begin(), found.end()};
}

}  // namespace

void bench_embedding(const RowFn& row) {
  const std::string clang_only = TINYDEV_BENCH_EMBED_CLANG_ONLY, plain = TINYDEV_BENCH_EMBED_PLAIN;
  const ChildRun warm = run_program({clang_only});  // compiles the kernel once: the cache is warm after
  if (!WIFEXITED(warm.status) || WEXITSTATUS(warm.status) != 0) {
    row("trivial CLANG-only program", "n/a", "n/a", "n/a",
        fmt::format("skipped: it exited {} (4: no clang here; 3: libLLVM mapped)",
                    WIFEXITED(warm.status) ? WEXITSTATUS(warm.status) : -1),
        false);
    return;
  }
  const int rounds = g_quick ? 6 : 30;
  std::vector<double> lib_rss, base_rss, lib_s, base_s;
  for (int i = 0; i < rounds; ++i) {
    const ChildRun l = run_program({clang_only});
    const ChildRun b = run_program({plain});
    if (l.status != 0 || b.status != 0) throw Error("bench_embedding: a child failed");
    lib_rss.push_back(l.peak_rss_mb), base_rss.push_back(b.peak_rss_mb);
    lib_s.push_back(l.seconds), base_s.push_back(b.seconds);
  }
  const Percentiles lr = percentiles(lib_rss), br = percentiles(base_rss);
  const Percentiles ls = percentiles(lib_s), bs = percentiles(base_s);
  row("peak RSS of a trivial CLANG-only program, p50 (vs the same in plain C++)", fmt::format("{:.1f} MB", lr.p50),
      fmt::format("{:.1f} MB", br.p50), fmt::format("+{:.1f} MB", lr.p50 - br.p50), "< +10 MB",
      lr.p50 - br.p50 < 10.0);
  row("  start to exit, p50 (p99), warm compile cache", fmt::format("{:.1f} ({:.1f}) ms", ls.p50 * 1e3, ls.p99 * 1e3),
      fmt::format("{:.1f} ({:.1f}) ms", bs.p50 * 1e3, bs.p99 * 1e3), fmt::format("{:.1f}x", ls.p50 / bs.p50), "report",
      true);

  // Compile time: g++ -O2 -c of main() over <tinydev/tinydev.hpp>, against main() over the standard
  // headers the API uses, alternated.
  const std::filesystem::path include_dir = TINYDEV_BENCH_INCLUDE_DIR;
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("tinydev-bench-tu-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "with_tinydev.cpp") << "#include <tinydev/tinydev.hpp>\nint main() { return static_cast<int>(tinydev::Device.backends().size()); }\n";
    std::ofstream std_only(dir / "std_only.cpp");
    for (const std::string& h : std_headers_of_api(include_dir)) std_only << "#include <" << h << ">\n";
    std_only << "int main() { std::vector<std::string> v; return static_cast<int>(v.size()); }\n";
  }
  const std::string cxx = TINYDEV_BENCH_CXX;
  const int compiles = g_quick ? 2 : 5;
  std::vector<double> lib_c, base_c;
  for (int i = 0; i < compiles; ++i) {
    const ChildRun l = run_program({cxx, "-std=c++20", "-O2", "-I" + include_dir.string(), "-c",
                                    (dir / "with_tinydev.cpp").string(), "-o", (dir / "a.o").string()});
    const ChildRun b = run_program({cxx, "-std=c++20", "-O2", "-c", (dir / "std_only.cpp").string(), "-o",
                                    (dir / "b.o").string()});
    if (l.status != 0 || b.status != 0) throw Error("bench_embedding: a compile failed");
    lib_c.push_back(l.seconds), base_c.push_back(b.seconds);
  }
  std::filesystem::remove_all(dir);
  const double lc = percentiles(lib_c).p50, bc = percentiles(base_c).p50;
  row("compile of a TU including <tinydev/tinydev.hpp>, p50 (vs its std headers)", fmt::format("{:.2f} s", lc),
      fmt::format("{:.2f} s", bc), fmt::format("{:.2f}x", lc / bc), "<= 1.3x", lc / bc <= 1.3);
}

}  // namespace tinydev::bench
