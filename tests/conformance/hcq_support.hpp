// tests/conformance/hcq_support.hpp: the HCQ subset of the conformance suite. Its bodies are
// generic lambdas (`[](auto& dev)`), instantiated for every HCQ device type this build's backends
// declare (tinydev_add_backend's HCQ_DEVICE), so they use only what the HCQ contract guarantees
// (tinydev/hcq_concepts.hpp).
#pragma once

#include <tuple>

#include "conformance.hpp"
#include "demo_kernels.hpp"
#include "tinydev/hcq.hpp"

namespace tinydev::testing {

namespace detail {
template <class Body, class... Devices>
bool call_as_hcq_device(Compiled& dev, Body& body, std::tuple<Devices...>*) {
  return ([&] {
    if (auto* hcq = dynamic_cast<Devices*>(&dev)) {
      body(*hcq);
      return true;
    }
    return false;
  }() || ...);
}
}  // namespace detail

// Runs `body(device)` on every HCQ device of this build that meets `needs` (kernels by default),
// as its concrete type.
template <class Body>
void for_each_hcq_device(Body&& body, Needs needs = Needs{.kernels = true}) {
  needs.hcq = true;
  for_each_backend(needs, [&](Compiled& dev) {
    if (!detail::call_as_hcq_device(dev, body, static_cast<HCQDeviceTypes*>(nullptr)))
      FAIL(dev.name() << " says it is an HCQ device, but its backend declared no HCQ_DEVICE type to "
                         "tinydev_add_backend, so the HCQ suite cannot use it");
  });
}

// Another device of `dev`'s backend and type ("LLVM:1" for "LLVM", "CUDA:1" for "CUDA"), for tests of two devices; skips
// and returns nullptr when there is none.
template <class Dev>
Dev* second_device(Dev& dev) {
  const std::string type = dev.name().substr(0, dev.name().find(':'));
  try {
    auto* other = dynamic_cast<Dev*>(&Device[type + ":1"]);
    REQUIRE(other);
    return other;
  } catch (const DeviceUnavailable& e) {
    skip("needs a second " + type + " device: " + e.what());
    return nullptr;
  }
}

// The device's program type, as its compute queue takes it.
template <class Dev>
using ProgramOf = typename Dev::compute_queue_type::program_type;

template <class Dev>
std::shared_ptr<ProgramOf<Dev>> load_program(Dev& dev, const std::string& name, const KernelSource& k) {
  auto program = std::dynamic_pointer_cast<ProgramOf<Dev>>(dev.load_kernel(name, k.for_device(dev)));
  REQUIRE(program);
  return program;
}

// The device's allocator as the HCQ allocator template it is.
template <class Dev>
HCQAllocator<Dev>& hcq_allocator(Dev& dev) {
  auto* allocator = dynamic_cast<HCQAllocator<Dev>*>(&dev.allocator());
  REQUIRE(allocator);
  return *allocator;
}

// dst[0] = src[0] + 1
inline KernelSource inc_kernel(const std::string& name) {
  return {"define void @" + name + "(ptr %dst, ptr %src) {\n  %v = load i32, ptr %src\n  %r = add i32 %v, 1\n"
              "  store i32 %r, ptr %dst\n  ret void\n}\n",
          "void " + name + "(int* dst, const int* src) { dst[0] = src[0] + 1; }\n",
          "extern \"C\" __global__ void " + name + "(int* dst, const int* src) { dst[0] = src[0] + 1; }\n"};
}

// out[idx] = k + idx, one grid index per call (Note [CPU grid ABI]); on CUDA idx is the thread's
// global index.
inline const KernelSource kFill{
    "define void @fill(ptr %out, i32 %k, i32 %idx) {\n  %i = sext i32 %idx to i64\n"
    "  %p = getelementptr inbounds i32, ptr %out, i64 %i\n  %v = add i32 %k, %idx\n  store i32 %v, ptr %p\n"
    "  ret void\n}\n",
    "void fill(int* out, int k, int idx) { out[idx] = k + idx; }\n",
    "extern \"C\" __global__ void fill(int* out, int k) {\n"
    "  int idx = blockIdx.x * blockDim.x + threadIdx.x;\n  out[idx] = k + idx;\n}\n"};

// out[i] = a[i] * k for i < n
inline const KernelSource kScale{
    kernels::llvm_counted_loop("scale", "ptr %out, ptr %a, i32 %k, i32 %n",
                               "  %pa = getelementptr inbounds float, ptr %a, i64 %idx\n"
                               "  %va = load float, ptr %pa\n  %kf = sitofp i32 %k to float\n  %r = fmul float %va, %kf\n"
                               "  %po = getelementptr inbounds float, ptr %out, i64 %idx\n  store float %r, ptr %po\n"),
    "void scale(float* out, const float* a, int k, int n) { for (int i = 0; i < n; i++) out[i] = a[i] * (float)k; }\n",
    "extern \"C\" __global__ void scale(float* out, const float* a, int k, int n) {\n"
    "  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = a[i] * (float)k;\n"
    "}\n"};

// A one-int32 buffer holding 0, and its value read back.
inline Buffer int_counter(const Compiled& dev) {
  const std::int32_t zero = 0;
  Buffer b(dev.name(), 1, dtypes::int32);
  b.allocate().copyin(std::span<const std::int32_t>(&zero, 1));
  return b;
}
inline std::int32_t read_int(const Buffer& b) {
  std::int32_t v = 0;
  b.copyout(std::span<std::int32_t>(&v, 1));
  return v;
}

}  // namespace tinydev::testing
