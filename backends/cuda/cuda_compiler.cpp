#include "cuda_compiler.hpp"

#include <dlfcn.h>
#include <sys/stat.h>
#include <fmt/format.h>

#include <algorithm>

#include <filesystem>
#include <memory>
#include <regex>

#include "cuda_api.hpp"
#include "tinydev/error.hpp"
#include "tinydev/log.hpp"

namespace tinydev::cuda {

namespace {

// Where the toolkit's headers are (cuda_fp16.h, cuda_bf16.h), for kernels that include them: first
// those of the toolkit the loaded NVRTC belongs to (its library's folder's ../include, or
// ../../include for the targets/<arch>/lib layout), so a machine with two toolkits compiles with
// the headers of the NVRTC that compiles; then the usual places.
// The file the loaded NVRTC's code is in, links resolved; empty if the loader does not say.
std::filesystem::path loaded_nvrtc_file() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<const void*>(nvrtc().nvrtcVersion), &info) == 0 || !info.dli_fname) return {};
  std::error_code ec;
  std::filesystem::path library = std::filesystem::canonical(info.dli_fname, ec);
  return ec ? std::filesystem::path() : library;
}

std::vector<std::string> include_options() {
  std::vector<std::filesystem::path> candidates;
  std::size_t own = 0;  // how many of the candidates are the loaded NVRTC's toolkit's
  if (const std::filesystem::path library = loaded_nvrtc_file(); !library.empty()) {
    candidates.push_back(library.parent_path().parent_path() / "include");
    candidates.push_back(library.parent_path().parent_path().parent_path().parent_path() / "include");
    own = candidates.size();
  }
  candidates.emplace_back("/usr/local/cuda/include");
  candidates.emplace_back("/opt/cuda/include");
  std::vector<std::string> out;
  bool own_headers = false;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const std::filesystem::path& dir = candidates[i];
    std::error_code ec;
    if (!std::filesystem::is_regular_file(dir / "cuda_fp16.h", ec)) continue;
    const std::string option = fmt::format("-I{}", std::filesystem::canonical(dir, ec).string());
    if (!ec && std::find(out.begin(), out.end(), option) == out.end()) out.push_back(option);
    own_headers |= !ec && i < own;
  }
  // Headers of another toolkit may not match this NVRTC (a compile error, never wrong code).
  if (!own_headers && !out.empty())
    debug_log(1, "CUDA", "the loaded NVRTC's toolkit has no cuda_fp16.h: kernels include the headers of {}",
              out.front().substr(2));
  return out;
}

// Note [NVRTC includes]
// NVRTC adds the folder of the program's name to the include path by default; a program from a
// string is named "kernel.cu", so `#include "x.h"` would read x.h from the process's working
// directory (a folder such as /tmp that others may write), and the compile cache, whose key
// holds no such file, would keep what it compiled to for every later working directory. So
// --no-source-include: a kernel's includes come from the toolkit's headers only. Those change
// under an NVRTC of the same major.minor when the toolkit is patched in place, so the key also
// carries the size and modification time of the NVRTC library and of the half-precision headers
// kernels include (a reinstalled toolkit compiles afresh; a missing file is "-").
std::string file_fingerprint(const std::string& path) {
  struct stat st{};
  if (path.empty() || ::stat(path.c_str(), &st) != 0) return "-";
  return fmt::format("{}:{}.{}", st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
}

// Destroys an NVRTC program on every path.
struct ProgramGuard {
  const Nvrtc& api;
  nvrtcProgram program = nullptr;
  ~ProgramGuard() {
    if (program) api.nvrtcDestroyProgram(&program);
  }
};

}  // namespace

std::string arch_for(int major, int minor) { return fmt::format("sm_{}{}", major, minor); }

CudaCompiler::CudaCompiler(std::string arch, bool ptx)
    : Compiler(ptx ? "compile_cuda_ptx" : "compile_cuda"), arch_(std::move(arch)), ptx_(ptx) {
  static const std::regex kArch("sm_[0-9]{2,3}[af]?");
  if (!std::regex_match(arch_, kArch))
    throw InvalidArgument(fmt::format("CUDA: '{}' is not a GPU architecture: pass sm_ and the compute capability, "
                                      "e.g. sm_90 for 9.0",
                                      quote_for_message(arch_)));
  const Nvrtc& api = nvrtc();  // DeviceUnavailable when there is none
  // PTX for the virtual architecture runs on this GPU and newer ones; CUBIN is this GPU's own code.
  const std::string target = ptx_ ? "compute_" + arch_.substr(3) : arch_;
  // Note [NVRTC includes]: no include folder but the toolkit's, and the files' fingerprints in
  // the cache key.
  options_ = {fmt::format("--gpu-architecture={}", target), "--no-source-include"};
  std::vector<std::string> folders = include_options();
  for (const std::string& inc : folders) options_.push_back(inc);
  std::string fingerprints = file_fingerprint(loaded_nvrtc_file().string());
  for (const std::string& inc : folders)
    for (const char* header : {"cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp"})
      fingerprints += " " + file_fingerprint((std::filesystem::path(inc.substr(2)) / header).string());
  identity_ = fmt::format("nvrtc {}.{} {} {} opts:{} files:{}", api.major, api.minor, target, ptx_ ? "ptx" : "cubin",
                          fmt::join(options_, " "), fingerprints);
}

std::string CudaCompiler::nvrtc_version() const {
  const Nvrtc& api = nvrtc();
  return fmt::format("{}.{}", api.major, api.minor);
}

std::string CudaCompiler::nvrtc_library() const { return nvrtc().path; }

std::string CudaCompiler::unsupported_reason() const {
  const Nvrtc& api = nvrtc();
  if (api.archs.empty()) return "";  // NVRTC did not say: its own error says it at compile
  // sm_90a and sm_100f are 9.0 and 10.0 with extra features: the number decides.
  const int capability = std::stoi(arch_.substr(3, arch_.find_first_not_of("0123456789", 3) - 3));
  if (std::find(api.archs.begin(), api.archs.end(), capability) != api.archs.end()) return "";
  const auto [lowest, highest] = std::minmax_element(api.archs.begin(), api.archs.end());
  std::string advice;
  if (capability < *lowest && api.major >= 13)
    advice = "CUDA 13 dropped GPUs older than compute capability 7.5: install CUDA 12's NVRTC (libnvrtc.so.12, "
             "chosen first for such GPUs) or set TINYDEV_CUDA_NVRTC to it";
  else if (capability < *lowest)
    advice = "this GPU is older than any this NVRTC supports: set TINYDEV_CUDA_NVRTC to an older CUDA toolkit's NVRTC";
  else if (capability > *highest)
    advice = "this GPU is newer than this NVRTC: install a newer CUDA toolkit's NVRTC or set TINYDEV_CUDA_NVRTC to it";
  else
    advice = "this NVRTC does not list it among its architectures: check the compute capability, or set "
             "TINYDEV_CUDA_NVRTC to an NVRTC that lists it";
  return fmt::format("NVRTC {}.{} ({}) cannot compile for {}: it compiles for sm_{} to sm_{}, not all between; {}",
                     api.major, api.minor, api.path, arch_, *lowest, *highest, advice);
}

Blob CudaCompiler::compile(std::string_view source) {
  const Nvrtc& api = nvrtc();
  if (std::string reason = unsupported_reason(); !reason.empty()) throw CompileError(reason, "");
  ProgramGuard guard{api};
  const std::string src(source);  // NVRTC wants a NUL-terminated string
  std::string log;  // NVRTC's, once compiled: it goes with every later error
  auto fail = [&](nvrtcResult r, std::string_view what) -> CompileError {
    return CompileError(fmt::format("NVRTC: {} failed for {}: {}", what, arch_, api.nvrtcGetErrorString(r)), log);
  };
  if (nvrtcResult r = api.nvrtcCreateProgram(&guard.program, src.c_str(), "kernel.cu", 0, nullptr, nullptr);
      r != NVRTC_SUCCESS)
    throw fail(r, "nvrtcCreateProgram");
  std::vector<const char*> opts;
  for (const std::string& o : options_) opts.push_back(o.c_str());
  const nvrtcResult compiled = api.nvrtcCompileProgram(guard.program, static_cast<int>(opts.size()), opts.data());
  std::size_t log_size = 0;
  if (api.nvrtcGetProgramLogSize(guard.program, &log_size) == NVRTC_SUCCESS && log_size > 1) {
    log.resize(log_size);
    if (api.nvrtcGetProgramLog(guard.program, log.data()) != NVRTC_SUCCESS) log.clear();
    while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  }
  if (compiled != NVRTC_SUCCESS)
    throw CompileError(fmt::format("NVRTC could not compile the kernel for {} ({})", arch_,
                                   api.nvrtcGetErrorString(compiled)),
                       log);
  std::size_t size = 0;
  Blob out;
  if (ptx_) {
    if (nvrtcResult r = api.nvrtcGetPTXSize(guard.program, &size); r != NVRTC_SUCCESS) throw fail(r, "nvrtcGetPTXSize");
    out.resize(size);
    if (nvrtcResult r = api.nvrtcGetPTX(guard.program, reinterpret_cast<char*>(out.data())); r != NVRTC_SUCCESS)
      throw fail(r, "nvrtcGetPTX");
  } else {
    if (nvrtcResult r = api.nvrtcGetCUBINSize(guard.program, &size); r != NVRTC_SUCCESS)
      throw fail(r, "nvrtcGetCUBINSize");
    out.resize(size);
    if (nvrtcResult r = api.nvrtcGetCUBIN(guard.program, reinterpret_cast<char*>(out.data())); r != NVRTC_SUCCESS)
      throw fail(r, "nvrtcGetCUBIN");
  }
  if (out.empty()) throw CompileError(fmt::format("NVRTC returned no {} for {}", ptx_ ? "PTX" : "CUBIN", arch_), log);
  return out;
}

}  // namespace tinydev::cuda
