// The CLANG backend: C source in, compiled by the newest clang on PATH in a subprocess (source on
// stdin, object on stdout: no temporary files, a TINYDEV_COMPILE_TIMEOUT limit), loaded by the CPU
// object runtime (the fast ELF loader on x86-64; ORC's JITLink for the rest in builds with LLVM).
#include <fmt/format.h>
#include <xxhash.h>

#include "cpu_blob.hpp"
#include "cpu_hcq.hpp"
#include "elf_loader.hpp"
#include "host.hpp"
#include "object_runtime.hpp"
#if TINYDEV_CLANG_WITH_ORC
#include "orc_linker.hpp"
#endif
#include "subprocess.hpp"
#include "tinydev/config.hpp"
#include "tinydev/device.hpp"
#include "tinydev/error.hpp"

namespace tinydev {

namespace {

// Newest first: clang 19 compiles __bf16 arithmetic, clang 14 does not.
std::vector<std::string> clang_candidates() {
  std::vector<std::string> names;
  for (int v = 30; v >= 14; --v) names.push_back(fmt::format("clang-{}", v));
  names.emplace_back("clang");
  return names;
}

const std::vector<std::string> kFlags = {"-c",          "-O2",         "-march=native", "-ffreestanding",
                                         "-fno-math-errno", "-fPIC",   "-x",            "c",
                                         "-",           "-o",          "-"};

class ClangCompiler final : public Compiler {
 public:
  ClangCompiler(std::string path, std::string version)
      : Compiler("compile_clang"), path_(std::move(path)), version_(std::move(version)) {
    const cpu::HostTarget& t = cpu::host_target();
    // -march=native makes the host CPU part of the output, so it is part of the key.
    identity_ = fmt::format("{} [{}] {} {} host:{:016x} flags:{} blob:TDVCPU01a", path_, version_, t.triple,
                            t.cpu, XXH3_64bits(t.fingerprint.data(), t.fingerprint.size()),
                            fmt::join(kFlags, " "));
  }

  std::string identity() const override { return identity_; }
  const std::string& path() const noexcept { return path_; }
  const std::string& version() const noexcept { return version_; }

  Blob compile(std::string_view source) override {
    std::vector<std::string> argv{path_};
    argv.insert(argv.end(), kFlags.begin(), kFlags.end());
    const int timeout_s = settings().compile_timeout_s;
    clang_backend::ProcessResult r = clang_backend::run_process(argv, source, std::chrono::seconds(timeout_s));
    if (r.timed_out)
      throw CompileError(fmt::format("{} did not finish compiling the kernel within {} s and was killed: "
                                     "raise TINYDEV_COMPILE_TIMEOUT if the kernel is that large",
                                     path_, timeout_s),
                         r.err);
    if (r.output_overflow)
      throw CompileError(fmt::format("{} wrote more than {} bytes while compiling the kernel and was killed",
                                     path_, clang_backend::kMaxOutputBytes),
                         r.err.substr(0, 4096));
    if (r.exit_code != 0)
      throw CompileError(fmt::format("{} failed to compile the kernel ({})", path_,
                                     r.exit_code < 0 ? std::string("its exit status was lost: was SIGCHLD ignored?")
                                                     : fmt::format("exit code {}", r.exit_code)),
                         r.err);
    // What came back is about to be cached and run: it must be an object for this host, or the
    // compile failed whatever the exit code says (a wrapper script, a broken install).
    const auto object = std::as_bytes(std::span(r.out.data(), r.out.size()));
    if (std::string why = cpu::check_elf_object(object, cpu::host_elf_machine()); !why.empty())
      throw CompileError(fmt::format("{} exited 0 but did not produce an object file for this host ({}); its "
                                     "output began '{}'",
                                     path_, why, quote_for_message(std::string_view(r.out).substr(0, 64), 64)),
                         r.err);
    return cpu::wrap_object(object, cpu::c_signatures(source));
  }

 private:
  std::string path_, version_, identity_;
};

std::unique_ptr<ClangCompiler> find_clang() {
  std::vector<std::string> tried = clang_candidates();
  for (const std::string& name : tried) {
    std::string path = clang_backend::find_on_path(name);
    if (path.empty()) continue;
    clang_backend::ProcessResult r = clang_backend::run_process(
        {path, "--version"}, "", std::chrono::seconds(std::min(30, settings().compile_timeout_s)));
    if (r.exit_code != 0 || r.timed_out) continue;
    std::string first_line = r.out.substr(0, r.out.find('\n'));
    return std::make_unique<ClangCompiler>(path, first_line);
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
          // ORC takes what the fast loader declines where the build has LLVM (Note [Two object loaders]).
#if TINYDEV_CLANG_WITH_ORC
          return std::make_unique<cpu::ObjectRuntime>(device, ordering, cpu::make_orc_linker(device));
#else
          return std::make_unique<cpu::ObjectRuntime>(device, ordering, nullptr);
#endif
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
