// backends/cuda/cuda_api.hpp: the CUDA driver API and NVRTC, opened with dlopen at run time (Note
// [CUDA at run time]). The only header of tinydev that includes cuda.h and nvrtc.h; only the CUDA
// backend's sources include it, and they use the headers for types only: nothing links libcuda or
// its stub.
//
// Note [CUDA at run time]
// A program linked to libcuda's stub does not even start on a machine without a driver, and a
// library that embedders link statically must not make their program need a GPU. So libcuda.so.1
// (or the file TINYDEV_CUDA_DRIVER names, e.g. a fake driver for tests) and libnvrtc (13, then 12)
// are opened on first use and every function is resolved from one declarative table. The table
// takes the versioned names the CUDA 13 headers select (`cuMemAlloc` is `cuMemAlloc_v2`):
// stringizing the macro-expanded name gives the symbol, and `decltype(&::name)` gives its type, so
// the types stay the headers' own. Where a driver lacks the newest symbol of a function whose
// older one has the same type, the older one is taken (Note [Older driver symbols] in
// cuda_api.cpp), so drivers of CUDA 12.0 and later open.
//
// Ownership: the loaded libraries are never closed (the driver may still run exit handlers).
// Thread safety: loading is serialized and happens once it succeeds (a failure is retried by the
// next call); the tables are immutable afterwards.
#pragma once

#include <cuda.h>
#include <nvrtc.h>

// The table's types are those of the CUDA 12.0 headers or newer (CUDA_KERNEL_NODE_PARAMS_v2 and
// the graph calls that take it are 12.0's).
#if CUDA_VERSION < 12000
#error "tinydev's CUDA backend needs the CUDA 12.0 headers or newer: set CUDA_PATH to a newer toolkit, or configure with -DTINYDEV_WITH_CUDA=OFF"
#endif
// Headers older than CUDA 12.4 do not declare cuFuncGetParamInfo, an optional function of the
// table: declared here for its type only (it is resolved with dlsym, never linked).
#if CUDA_VERSION < 12040
extern "C" CUresult CUDAAPI cuFuncGetParamInfo(CUfunction func, size_t paramIndex, size_t* paramOffset, size_t* paramSize);
#endif

#include <string>
#include <string_view>
#include <vector>

namespace tinydev::cuda {

// Every driver function the backend calls. Adding one here is all it takes to use it.
#define TINYDEV_CUDA_DRIVER_FUNCTIONS(X) \
  X(cuInit)                              \
  X(cuDriverGetVersion)                  \
  X(cuGetErrorName)                      \
  X(cuGetErrorString)                    \
  X(cuDeviceGetCount)                    \
  X(cuDeviceGet)                         \
  X(cuDeviceGetName)                     \
  X(cuDeviceGetAttribute)                \
  X(cuDeviceTotalMem)                    \
  X(cuDeviceCanAccessPeer)               \
  X(cuDevicePrimaryCtxRetain)            \
  X(cuDevicePrimaryCtxRelease)           \
  X(cuCtxSetCurrent)                     \
  X(cuCtxGetCurrent)                     \
  X(cuCtxSynchronize)                    \
  X(cuCtxEnablePeerAccess)               \
  X(cuMemGetInfo)                        \
  X(cuMemAlloc)                          \
  X(cuMemFree)                           \
  X(cuMemHostAlloc)                      \
  X(cuMemFreeHost)                       \
  X(cuMemcpyHtoD)                        \
  X(cuMemcpyDtoH)                        \
  X(cuMemcpyAsync)                       \
  X(cuMemHostGetDevicePointer)           \
  X(cuModuleLoadData)                    \
  X(cuModuleUnload)                      \
  X(cuModuleGetFunction)                 \
  X(cuLaunchKernel)                      \
  X(cuStreamCreate)                      \
  X(cuStreamDestroy)                     \
  X(cuStreamSynchronize)                 \
  X(cuStreamQuery)                       \
  X(cuStreamBatchMemOp)                  \
  X(cuLaunchHostFunc)                    \
  X(cuGraphCreate)                       \
  X(cuGraphDestroy)                      \
  X(cuGraphAddKernelNode)                \
  X(cuGraphAddMemcpyNode)                \
  X(cuGraphAddEmptyNode)                 \
  X(cuGraphInstantiate)                  \
  X(cuGraphExecDestroy)                  \
  X(cuGraphExecKernelNodeSetParams)      \
  X(cuGraphExecMemcpyNodeSetParams)      \
  X(cuGraphLaunch)                       \
  X(cuEventCreate)                       \
  X(cuEventDestroy)                      \
  X(cuEventRecord)                       \
  X(cuEventSynchronize)                  \
  X(cuEventElapsedTime)

// Driver functions the backend uses where the driver has them (newer than the oldest driver the
// required table needs); a missing one is nullptr and the feature it serves is off:
// cuFuncGetParamInfo (drivers of CUDA 12.4 and later) gives kernels their signatures.
#define TINYDEV_CUDA_OPTIONAL_DRIVER_FUNCTIONS(X) X(cuFuncGetParamInfo)

#define TINYDEV_NVRTC_FUNCTIONS(X) \
  X(nvrtcVersion)                  \
  X(nvrtcGetErrorString)           \
  X(nvrtcCreateProgram)            \
  X(nvrtcDestroyProgram)           \
  X(nvrtcCompileProgram)           \
  X(nvrtcGetProgramLogSize)        \
  X(nvrtcGetProgramLog)            \
  X(nvrtcGetPTXSize)               \
  X(nvrtcGetPTX)                   \
  X(nvrtcGetCUBINSize)             \
  X(nvrtcGetCUBIN)                  \
  X(nvrtcGetNumSupportedArchs)     \
  X(nvrtcGetSupportedArchs)

struct Driver {
#define TINYDEV_CUDA_MEMBER(name) decltype(&::name) name = nullptr;
  TINYDEV_CUDA_DRIVER_FUNCTIONS(TINYDEV_CUDA_MEMBER)
  TINYDEV_CUDA_OPTIONAL_DRIVER_FUNCTIONS(TINYDEV_CUDA_MEMBER)  // nullptr where the driver lacks it
  std::string path;  // the library the functions came from
  int version = 0;   // cuDriverGetVersion: 13000 for CUDA 13.0
};

struct Nvrtc {
  TINYDEV_NVRTC_FUNCTIONS(TINYDEV_CUDA_MEMBER)
#undef TINYDEV_CUDA_MEMBER
  std::string path;
  int major = 0, minor = 0;  // nvrtcVersion
  std::vector<int> archs;    // nvrtcGetSupportedArchs: the compute capabilities it compiles for, 75 for 7.5
};

// The driver, loaded and initialized (cuInit) once. Throws DeviceUnavailable saying which of these
// it is: no driver library (no NVIDIA driver installed), a driver too old for a function the
// backend needs (naming it), or cuInit failing (no GPU, a driver/kernel-module mismatch).
const Driver& driver();

// NVRTC, loaded once: TINYDEV_CUDA_NVRTC when set, else libnvrtc.so.13 then .12, with NVRTC 12
// first where the driver is 12.x (NVRTC 13's output needs a CUDA 13 driver) or a GPU is older than
// compute capability 7.5 (NVRTC 13 compiles for 7.5 and newer only). Throws DeviceUnavailable when
// none can be opened, or a function is missing. Needs no GPU and no driver.
const Nvrtc& nvrtc();

// "CUDA_ERROR_OUT_OF_MEMORY: out of memory" for `result`, from the driver.
std::string describe(CUresult result);

// Throws Error("<device>: <what> failed: <name>: <string>") when result is not CUDA_SUCCESS.
void check(CUresult result, std::string_view what, std::string_view device);

}  // namespace tinydev::cuda
