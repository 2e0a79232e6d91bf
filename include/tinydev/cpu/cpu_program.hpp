// include/tinydev/cpu/cpu_program.hpp: a loaded CPU kernel, as
// every CPU backend's runtime hands it out, and how it is called (Note [CPU kernel calls], Note
// [CPU grid ABI] in cpu_program.cpp). Includes no LLVM.
//
// Ownership: a CpuProgram owns (shares) the memory its code lives in; the code is freed with the
// last handle. It keeps a pointer to its device's CallOrdering: devices outlive their programs'
// calls (devices live as long as the process).
// Thread safety: a CpuProgram may be called from any thread, concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "tinydev/compile.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::cpu {

// The most arguments (buffers + values, + the grid index) a CPU kernel call takes.
inline constexpr std::size_t kMaxKernelArgs = 64;

// Lets a device order direct Program calls after its queued work.
class CallOrdering {
 public:
  virtual void before_direct_call() = 0;

 protected:
  ~CallOrdering() = default;
};

// A loaded CPU kernel. Direct calls (operator()) run on the caller's thread once the device's
// queued work finished; queues launch it on their workers through launch().
class CpuProgram final : public Program {
 public:
  CpuProgram(std::string name, std::string device, std::shared_ptr<void> code, void* fn,
             std::optional<KernelSignature> signature, CallOrdering* ordering);

  std::optional<double> operator()(std::span<const Allocation> buffers, std::span<const std::int32_t> values = {},
                                   const LaunchParams& params = {}) override;
  std::optional<KernelSignature> signature() const noexcept override { return signature_; }
  const std::string& device() const noexcept { return device_; }
  // The kernel's entry point, callable with the kernel ABI (Note [CPU kernel calls]), for callers
  // that dispatch it themselves. Valid while this program is alive.
  void* host_function() const noexcept { return fn_; }

  // Throws InvalidArgument when these counts and grid cannot be launched.
  void check_launch(std::size_t buffers, std::size_t values, const Dim3& global) const;
  // Runs the kernel on `count` packed arguments, once per grid index (Note [CPU grid ABI]).
  void launch(const std::uint64_t* args, std::size_t count, const Dim3& global) const;

 private:
  std::string device_;
  std::shared_ptr<void> code_;  // owns the memory fn_ lives in
  void* fn_;
  std::optional<KernelSignature> signature_;
  CallOrdering* ordering_;
};

// A CpuProgram whose last handle retires it rather than deleting it at once, so execs queued
// before still find it (Note [Program retirement] in cpu_hcq.cpp). What the CPU runtimes use.
std::shared_ptr<CpuProgram> make_cpu_program(std::string name, std::string device, std::shared_ptr<void> code,
                                             void* fn, std::optional<KernelSignature> signature,
                                             CallOrdering* ordering);

}  // namespace tinydev::cpu

TINYDEV_API_END
