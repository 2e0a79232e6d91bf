// A library that looks like CUDA 11.8's NVRTC to the loader (every function tinydev resolves is
// here) and says so through nvrtcVersion: the CUDA backend must refuse it with an error saying
// which NVRTC it needs (Note [CUDA at run time]). Nothing in it compiles.
#include <nvrtc.h>

#include <cstddef>

#define FAKE_NVRTC_EXPORT extern "C" __attribute__((visibility("default")))

FAKE_NVRTC_EXPORT nvrtcResult nvrtcVersion(int* major, int* minor) {
  *major = 11;
  *minor = 8;
  return NVRTC_SUCCESS;
}
FAKE_NVRTC_EXPORT const char* nvrtcGetErrorString(nvrtcResult) { return "the fake NVRTC 11.8 compiles nothing"; }
FAKE_NVRTC_EXPORT nvrtcResult nvrtcGetNumSupportedArchs(int* count) {
  *count = 0;
  return NVRTC_SUCCESS;
}
FAKE_NVRTC_EXPORT nvrtcResult nvrtcGetSupportedArchs(int*) { return NVRTC_SUCCESS; }
FAKE_NVRTC_EXPORT nvrtcResult nvrtcCreateProgram(nvrtcProgram*, const char*, const char*, int, const char* const*,
                                                 const char* const*) {
  return NVRTC_ERROR_INTERNAL_ERROR;
}
FAKE_NVRTC_EXPORT nvrtcResult nvrtcDestroyProgram(nvrtcProgram*) { return NVRTC_SUCCESS; }
FAKE_NVRTC_EXPORT nvrtcResult nvrtcCompileProgram(nvrtcProgram, int, const char* const*) {
  return NVRTC_ERROR_INTERNAL_ERROR;
}
FAKE_NVRTC_EXPORT nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram, std::size_t*) { return NVRTC_ERROR_INTERNAL_ERROR; }
FAKE_NVRTC_EXPORT nvrtcResult nvrtcGetProgramLog(nvrtcProgram, char*) { return NVRTC_ERROR_INTERNAL_ERROR; }
FAKE_NVRTC_EXPORT nvrtcResult nvrtcGetPTXSize(nvrtcProgram, std::size_t*) { return NVRTC_ERROR_INTERNAL_ERROR; }
FAKE_NVRTC_EXPORT nvrtcResult nvrtcGetPTX(nvrtcProgram, char*) { return NVRTC_ERROR_INTERNAL_ERROR; }
FAKE_NVRTC_EXPORT nvrtcResult nvrtcGetCUBINSize(nvrtcProgram, std::size_t*) { return NVRTC_ERROR_INTERNAL_ERROR; }
FAKE_NVRTC_EXPORT nvrtcResult nvrtcGetCUBIN(nvrtcProgram, char*) { return NVRTC_ERROR_INTERNAL_ERROR; }
