#include "cuda_compiler.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>

#include <filesystem>
#include <memory>
#include <regex>

#include "cuda_api.hpp"
#include "tinydev/error.hpp"

namespace tinydev::cuda {

namespace {

// Where the toolkit's headers are (cuda_fp16.h, cuda_bf16.h), for kernels that include them: first
// those of the toolkit the loaded NVRTC belongs to (its library's folder's ../include, or
// ../../include for the targets/<arch>/lib layout), so a machine with two toolkits compiles with
// the headers of the NVRTC that compiles; then the usual places.
std::vector<std::string> include_options() {
  std::vector<std::filesystem::path> candidates;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<const void*>(nvrtc().nvrtcVersion), &info) != 0 && info.dli_fname) {
    std::error_code ec;
    const std::filesystem::path library = std::filesystem::canonical(info.dli_fname, ec);
    if (!ec) {
      candidates.push_back(library.parent_path().parent_path() / "include");
      candidates.push_back(library.parent_path().parent_path().parent_path().parent_path() / "include");
    }
  }
  candidates.emplace_back("/usr/local/cuda/include");
  candidates.emplace_back("/opt/cuda/include");
  std::vector<std::string> out;
  for (const std::filesystem::path& dir : candidates) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(dir / "cuda_fp16.h", ec)) continue;
    const std::string option = fmt::format("-I{}", std::filesystem::canonical(dir, ec).string());
    if (!ec && std::find(out.begin(), out.end(), option) == out.end()) out.push_back(option);
  }
  return out;
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
  options_ = {fmt::format("--gpu-architecture={}", target)};
  for (std::string& inc : include_options()) options_.push_back(std::move(inc));
  identity_ = fmt::format("nvrtc {}.{} {} {} opts:{}", api.major, api.minor, target, ptx_ ? "ptx" : "cubin",
                          fmt::join(options_, " "));
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
  auto fail = [&](nvrtcResult r, std::string_view what) -> CompileError {
    return CompileError(fmt::format("NVRTC: {} failed: {}", what, api.nvrtcGetErrorString(r)), "");
  };
  if (nvrtcResult r = api.nvrtcCreateProgram(&guard.program, src.c_str(), "kernel.cu", 0, nullptr, nullptr);
      r != NVRTC_SUCCESS)
    throw fail(r, "nvrtcCreateProgram");
  std::vector<const char*> opts;
  for (const std::string& o : options_) opts.push_back(o.c_str());
  const nvrtcResult compiled = api.nvrtcCompileProgram(guard.program, static_cast<int>(opts.size()), opts.data());
  std::size_t log_size = 0;
  std::string log;
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
