// The CLANG backend: C source in, compiled by the newest clang on PATH in a subprocess (source on
// stdin, object on stdout: no temporary files, a TINYDEV_COMPILE_TIMEOUT limit), loaded by the CPU
// object runtime (the fast ELF loader on x86-64; ORC's JITLink for the rest in programs that also
// link the LLVM backend). Links no LLVM itself: Note [ORC only with the LLVM backend].
#include <fmt/format.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <filesystem>
#include <exception>
#include <thread>

#include "cpu_blob.hpp"
#include "cpu_hcq.hpp"
#include "elf_loader.hpp"
#include "host.hpp"
#include "object_runtime.hpp"
#include "subprocess.hpp"
#include "tinydev/compile.hpp"
#include "tinydev/config.hpp"
#include "tinydev/device.hpp"
#include "tinydev/error.hpp"

// Note [ORC only with the LLVM backend]
// ORC's JITLink (tinydev_orc) links what the fast ELF loader declines. It drags in libLLVM (about
// 130 MB mapped, with z3, ICU and libxml2), which a program that only wants CLANG should not pay
// for. So CLANG refers to the ORC linker's factory weakly: in a program that links the LLVM
// backend too (tinydev::tinydev, or tinydev::llvm beside tinydev::clang) the reference resolves
// and CLANG falls back to ORC as before; in a CLANG-only program it is null, nothing of LLVM is
// linked or loaded, and an object the fast loader declines is an error that says so.
namespace tinydev::cpu {
std::shared_ptr<ObjectLinker> make_orc_linker(std::string device_name) __attribute__((weak));
}

namespace tinydev {

namespace {

// Newest first: clang 19 compiles __bf16 arithmetic, clang 14 does not.
std::vector<std::string> clang_candidates() {
  std::vector<std::string> names;
  for (int v = 30; v >= 14; --v) names.push_back(fmt::format("clang-{}", v));
  names.emplace_back("clang");
  return names;
}

// -march=native makes some clang releases warn about the host's own feature set
// (-Winvalid-feature-combination, "avx10.1" on recent Intel hosts): noise in every compile log,
// silenced, with -Wno-unknown-warning-option for the clangs that do not know that warning.
#define TINYDEV_CLANG_QUIET_FLAGS "-Wno-unknown-warning-option", "-Wno-invalid-feature-combination"
const std::vector<std::string> kFlags = {"-c",          "-O2",         "-march=native", TINYDEV_CLANG_QUIET_FLAGS,
                                         "-ffreestanding", "-fno-math-errno", "-fPIC",   "-x",            "c",
                                         "-",           "-o",          "-"};

// Note [C signatures from clang]
// A kernel's signature (how many buffers, how many int32 values) is read from clang's own LLVM IR
// for the translation unit, made by a second clang process that runs beside the compile with the
// compile's own flags (so __OPTIMIZE__, __PIC__ and the target macros are the same and the same
// translation unit is read), writing IR with LLVM's passes off instead of an object. What C spells
// a parameter (`int a[]`, a typedef'd pointer, a return type on another line, a definition inside
// `#if 0` or a comment) is clang's business, and the IR's `define` lines say exactly what the
// object exports. The two processes overlap, so a cold compile costs about what it did; cached
// compiles run neither.
const std::vector<std::string> kSignatureFlags = {"-S",          "-emit-llvm",     "-O2",        "-Xclang",
                                                  "-disable-llvm-passes", "-march=native", TINYDEV_CLANG_QUIET_FLAGS, "-ffreestanding",
                                                  "-fno-math-errno", "-fPIC",  "-x",         "c",
                                                  "-",           "-o",             "-"};

class ClangCompiler final : public Compiler {
 public:
  ClangCompiler(std::string path, std::string version)
      : Compiler("compile_clang"), path_(std::move(path)), version_(std::move(version)) {
    const cpu::HostTarget& t = cpu::host_target();
    // -march=native makes the host CPU part of the output, so it is part of the key.
    identity_ = fmt::format("{} [{}] {} {} host:{:016x} flags:{} signatures:clang-ir blob:TDVCPU01a", path_,
                            version_, t.triple, t.cpu, XXH3_64bits(t.fingerprint.data(), t.fingerprint.size()),
                            fmt::join(kFlags, " "));
  }

  std::string identity() const override { return identity_; }
  const std::string& path() const noexcept { return path_; }
  const std::string& version() const noexcept { return version_; }

  Blob compile(std::string_view source) override {
    const int timeout_s = settings().compile_timeout_s;
    // Note [C signatures from clang]: the IR for the signatures is made beside the object.
    std::vector<std::string> ir_argv{path_};
    ir_argv.insert(ir_argv.end(), kSignatureFlags.begin(), kSignatureFlags.end());
    // A plain thread, not std::async: future<ProcessResult> would be a std template instance a
    // plugin exports (tinydev/export.hpp).
    clang_backend::ProcessResult signatures;
    std::exception_ptr signatures_failed;
    std::thread ir([&] {
      try {
        signatures = clang_backend::run_process(ir_argv, source, std::chrono::seconds(timeout_s));
      } catch (...) {
        signatures_failed = std::current_exception();
      }
    });
    std::vector<std::string> argv{path_};
    argv.insert(argv.end(), kFlags.begin(), kFlags.end());
    clang_backend::ProcessResult r;
    try {
      r = clang_backend::run_process(argv, source, std::chrono::seconds(timeout_s));
    } catch (...) {
      ir.join();
      throw;
    }
    ir.join();
    if (signatures_failed) std::rethrow_exception(signatures_failed);
    check_finished(r, timeout_s, "compiling the kernel");
    // What came back is about to be cached and run: it must be an object for this host, or the
    // compile failed whatever the exit code says (a wrapper script, a broken install).
    const auto object = std::as_bytes(std::span(r.out.data(), r.out.size()));
    if (std::string why = cpu::check_elf_object(object, cpu::host_elf_machine()); !why.empty())
      throw CompileError(fmt::format("{} exited 0 but did not produce an object file for this host ({}); its "
                                     "output began '{}'",
                                     path_, why, quote_for_message(std::string_view(r.out).substr(0, 64), 64)),
                         r.err);
    check_finished(signatures, timeout_s, "writing the kernel's LLVM IR (for its signatures)");
    return cpu::wrap_object(object, cpu::ir_signatures(signatures.out));
  }

 private:
  // Throws the CompileError for a clang run that timed out, flooded its output or failed.
  void check_finished(const clang_backend::ProcessResult& r, int timeout_s, std::string_view doing) const {
    if (r.timed_out)
      throw CompileError(fmt::format("{} did not finish {} within {} s and was killed: "
                                     "raise TINYDEV_COMPILE_TIMEOUT if the kernel is that large",
                                     path_, doing, timeout_s),
                         r.err);
    if (r.output_overflow)
      throw CompileError(fmt::format("{} wrote more than {} bytes {} and was killed", path_,
                                     clang_backend::kMaxOutputBytes, doing),
                         r.err.substr(0, 4096));
    if (r.exit_code != 0)
      throw CompileError(fmt::format("{} failed {} ({})", path_, doing,
                                     r.exit_code < 0 ? std::string("its exit status was lost: was SIGCHLD ignored?")
                                                     : fmt::format("exit code {}", r.exit_code)),
                         r.err);
  }

  std::string path_, version_, identity_;
};

// Note [clang's identity, cached]
// The compile cache key needs clang's version, and `clang --version` costs 15-20 ms: most of what
// opening the device cost. The first line it prints is cached in the compile cache (whose entries
// are trusted only when this user wrote them, Note [Cache trust]) under what identifies the
// installed compiler: the binary's resolved path, device, inode, size and mtime, and those of the
// libclang-cpp and libLLVM libraries beside it (Debian's clang prints the version of its
// libclang-cpp, which is upgraded apart from the binary). A reinstalled or replaced clang changes
// one of them and is asked again. A binary that is not named clang* once resolved (a ccache or
// version-manager wrapper, whose target can change under it) is asked every time, as is every
// clang while TINYDEV_DISABLE_COMPILER_CACHE is set. A cached answer that is not one printable
// line is ignored.
std::string clang_version_probe(const std::string& path) {
  std::string probe;
  auto add_file = [&probe](const std::string& file) {
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0) return false;
    probe += fmt::format("{}\n{}\n{}\n{}\n{}.{:09}\n", file, st.st_dev, st.st_ino, st.st_size, st.st_mtim.tv_sec,
                         st.st_mtim.tv_nsec);
    return true;
  };
  std::error_code ec;
  const std::filesystem::path resolved = std::filesystem::canonical(path, ec);
  bool cacheable = !ec && resolved.filename().string().starts_with("clang") && !settings().disable_compiler_cache &&
                   add_file(resolved.string());
  if (cacheable) {
    std::vector<std::string> libraries;
    for (const auto& entry : std::filesystem::directory_iterator(resolved.parent_path().parent_path() / "lib", ec)) {
      const std::string name = entry.path().filename().string();
      if ((name.starts_with("libclang-cpp.so") || name.starts_with("libLLVM")) && name.find(".so") != std::string::npos)
        libraries.push_back(entry.path().string());
    }
    std::sort(libraries.begin(), libraries.end());
    for (const std::string& library : libraries) add_file(library);
  }
  constexpr std::string_view kKey = "clang_version", kIdentity = "`clang --version`, first line (v2)";
  if (cacheable) {
    if (std::optional<Blob> hit = DiskCache::global().get(kKey, kIdentity, probe)) {
      std::string line(reinterpret_cast<const char*>(hit->data()), hit->size());
      const bool printable = !line.empty() && line.size() < 512 &&
                             std::all_of(line.begin(), line.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
      if (printable) return line;
    }
  }
  clang_backend::ProcessResult r = clang_backend::run_process(
      {path, "--version"}, "", std::chrono::seconds(std::min(30, settings().compile_timeout_s)));
  if (r.exit_code != 0 || r.timed_out) return {};
  std::string first_line = r.out.substr(0, r.out.find('\n'));
  if (first_line.empty()) first_line = "(printed no version)";
  for (char& c : first_line)
    if (c < 0x20 || c >= 0x7f) c = '?';
  if (first_line.size() >= 512) first_line.resize(511);
  if (cacheable) DiskCache::global().put(kKey, kIdentity, probe, std::as_bytes(std::span(first_line)));
  return first_line;
}

std::unique_ptr<ClangCompiler> find_clang() {
  std::vector<std::string> tried = clang_candidates();
  for (const std::string& name : tried) {
    std::string path = clang_backend::find_on_path(name);
    if (path.empty()) continue;
    std::string version = clang_version_probe(path);
    if (version.empty()) continue;
    return std::make_unique<ClangCompiler>(path, version);
  }
  throw DeviceUnavailable(fmt::format(
      "CLANG: no clang compiler on PATH (looked for {} ... clang-14, clang): install one, e.g. "
      "`apt-get install clang-19`",
      tried.front()));
}

class ClangDevice final : public cpu::CpuHCQDevice {
 public:
  ClangDevice(const std::string& name, std::unique_ptr<ClangCompiler> compiler)
      : CpuHCQDevice(name, std::move(compiler), SourceLanguage::C, [](const std::string& device, cpu::CallOrdering* ordering) {
          // ORC takes what the fast loader declines where the program has it (Note [ORC only
          // with the LLVM backend], Note [Two object loaders]).
          std::shared_ptr<cpu::ObjectLinker> linker;
          if (cpu::make_orc_linker) linker = cpu::make_orc_linker(device);
          return std::make_unique<cpu::ObjectRuntime>(device, ordering, std::move(linker));
        }) {}

  std::map<std::string, std::string> properties() const override {
    auto props = CpuHCQDevice::properties();
    auto& c = static_cast<ClangCompiler&>(compiler());
    props["compiler"] = fmt::format("{} ({})", c.path(), c.version());
    return props;
  }
};

}  // namespace

std::unique_ptr<Compiled> open_clang_device(const std::string& canonical_name) {
  return std::make_unique<ClangDevice>(canonical_name, find_clang());
}

}  // namespace tinydev
