// backends/cuda/cuda_state.hpp: what the CUDA backend's sources share about one GPU (internal:
// includes cuda.h through cuda_api.hpp, so only the backend's own sources include it).
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "cuda_api.hpp"
#include "tinydev/compile.hpp"
#include "tinydev/error.hpp"

namespace tinydev::cuda {

// What every object of one device shares. Lives as long as the device (the process).
struct DeviceState {
  DeviceState(const Driver& api, std::string name) : api(api), name(std::move(name)) {}
  const Driver& api;
  std::string name;
  int ordinal = 0;
  CUdevice device = 0;
  CUcontext context = nullptr;
  CUstream compute = nullptr, copy = nullptr;  // non-blocking streams, one per lane
  CUevent start = nullptr, end = nullptr;      // for timed direct launches
  CUmodule queue_module = nullptr;  // the queue kernels below (kQueuePtx in cuda_device.cpp)
  CUfunction timestamp = nullptr;    // tinydev_timestamp(u64*): stores %globaltimer
  // Without 64-bit stream memory operations (Note [CUDA queues]): tinydev_signal(u64*, u64) stores
  // the value; tinydev_wait(u64*, u64) spins until the word is at least the value.
  CUfunction signal = nullptr, wait = nullptr;
  int major = 0, minor = 0;        // compute capability, read once at open
  bool memops = false;             // CAN_USE_64_BIT_STREAM_MEM_OPS, and they worked at open
  std::string memops_refused;      // why they are off although the attribute says yes (Note [Probing stream memory operations])
  bool kernel_time_limit = false;  // KERNEL_EXEC_TIMEOUT: the driver ends kernels that run too long
  std::uint64_t total_memory = 0;  // cuDeviceTotalMem: the device allocator's cache bound (Note [CUDA cache bound])
  std::atomic<bool> released{false};  // Note [CUDA at exit]

  // Driver calls act on the calling thread's current context.
  void make_current() const {
    if (released.load(std::memory_order_acquire))
      throw Error(fmt::format("{}: the process is exiting and the device's context was released", name));
    check(api.cuCtxSetCurrent(context), "cuCtxSetCurrent", name);
  }
};

// A stream's lane of `parent`'s GPU (Note [CUDA streams] in cuda_stream.cpp): the same context,
// retained once more, and streams and events of its own.
std::shared_ptr<DeviceState> open_lane_state(const DeviceState& parent, const std::string& name);

// Errors after which the context is unusable (the driver returns them from every later call).
inline bool sticky(CUresult r) {
  switch (r) {
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case CUDA_ERROR_LAUNCH_FAILED:
    case CUDA_ERROR_LAUNCH_TIMEOUT:
    case CUDA_ERROR_ASSERT:
    case CUDA_ERROR_HARDWARE_STACK_ERROR:
    case CUDA_ERROR_ILLEGAL_INSTRUCTION:
    case CUDA_ERROR_MISALIGNED_ADDRESS:
    case CUDA_ERROR_INVALID_ADDRESS_SPACE:
    case CUDA_ERROR_INVALID_PC:
    case CUDA_ERROR_ECC_UNCORRECTABLE:
    case CUDA_ERROR_CONTAINED:
    case CUDA_ERROR_TENSOR_MEMORY_LEAK:
    case CUDA_ERROR_MPS_CLIENT_TERMINATED:
    case CUDA_ERROR_EXTERNAL_DEVICE:
      return true;
    default:
      return false;
  }
}

// Launches `function` on `stream` with the packed argument buffer (the driver copies it); a
// kernel without parameters gets no buffer.
inline CUresult launch(const DeviceState& s, CUfunction function, CUstream stream, const std::byte* args, std::size_t bytes,
                Dim3 g, Dim3 l) {
  void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, const_cast<std::byte*>(args), CU_LAUNCH_PARAM_BUFFER_SIZE, &bytes,
                   CU_LAUNCH_PARAM_END};
  return s.api.cuLaunchKernel(function, g[0], g[1], g[2], l[0], l[1], l[2], 0, stream, nullptr,
                              bytes ? extra : nullptr);
}

}  // namespace tinydev::cuda
