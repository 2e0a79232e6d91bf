// backends/cuda/cuda_compiler.hpp (installed as <tinydev/cuda/cuda_compiler.hpp>): CUDA C++ to
// CUBIN (or PTX) with NVRTC, opened at run time (Note [CUDA at run time]). Needs no GPU and no
// driver, so a framework can compile and warm the cache on a machine without one, as the seed
// allows; where there is a driver it asks only its version and never initializes it, so a process
// may fork workers that use the GPU after compiling. Includes no CUDA header.
//
// Thread safety: compile() and compile_cached() may be called concurrently (NVRTC programs are
// per call).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tinydev/compile.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::cuda {

class CudaCompiler final : public Compiler {
 public:
  // `arch` is the target, "sm_90" (compute capability 9.0), "sm_100a", ...: CUBIN for it, or, with
  // `ptx`, PTX for the matching virtual architecture (compute_90) that the driver JIT-compiles at
  // load. Throws InvalidArgument for a malformed arch and DeviceUnavailable when NVRTC cannot be
  // opened.
  explicit CudaCompiler(std::string arch, bool ptx);

  // Throws CompileError carrying NVRTC's log, or unsupported_reason().
  Blob compile(std::string_view source) override;
  // NVRTC's version, the target, the options and the size and modification time of the NVRTC
  // library and the toolkit's half-precision headers (Note [NVRTC includes]): what changes the output.
  std::string identity() const override { return identity_; }

  const std::string& arch() const noexcept { return arch_; }
  bool ptx() const noexcept { return ptx_; }
  // The options NVRTC gets: the seed's (--gpu-architecture, the toolkit's include folder) and
  // --no-source-include (no header from the working directory: Note [NVRTC includes]).
  const std::vector<std::string>& options() const noexcept { return options_; }
  // "13.0"
  std::string nvrtc_version() const;
  // The library NVRTC was opened from, as given to dlopen ("libnvrtc.so.13", or TINYDEV_CUDA_NVRTC).
  std::string nvrtc_library() const;
  // "" when the loaded NVRTC compiles for arch(); else why not and what to do (NVRTC 13 compiles
  // for compute capability 7.5 and newer only). compile() throws it as a CompileError.
  std::string unsupported_reason() const;

 private:
  std::string arch_;
  bool ptx_;
  std::vector<std::string> options_;
  std::string identity_;
};

// "sm_90" for compute capability (9, 0).
std::string arch_for(int major, int minor);

}  // namespace tinydev::cuda

TINYDEV_API_END
