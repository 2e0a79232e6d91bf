// tests/conformance/hcq_support.hpp: kernels and helpers for the HCQ suite.
#pragma once

#include "conformance.hpp"
#include "cpu_hcq.hpp"
#include "demo_kernels.hpp"

namespace tinydev::testing {

using cpu::CpuHCQDevice;

// Runs `body` on every HCQ device of this build (the CPU devices here).
template <class Body>
void for_each_hcq_device(Body&& body) {
  for_each_backend([&](Compiled& dev) {
    auto* hcq = dynamic_cast<CpuHCQDevice*>(&dev);
    if (!hcq) {
      WARN("skipping " << dev.name() << ": not an HCQ device");
      return;
    }
    body(*hcq);
  });
}

// dst[0] = src[0] + 1
inline KernelSource inc_kernel(const std::string& name) {
  return {"define void @" + name + "(ptr %dst, ptr %src) {\n  %v = load i32, ptr %src\n  %r = add i32 %v, 1\n"
              "  store i32 %r, ptr %dst\n  ret void\n}\n",
          "void " + name + "(int* dst, const int* src) { dst[0] = src[0] + 1; }\n"};
}

// out[idx] = k + idx, one grid index per call (Note [CPU grid ABI]).
inline const KernelSource kFill{
    "define void @fill(ptr %out, i32 %k, i32 %idx) {\n  %i = sext i32 %idx to i64\n"
    "  %p = getelementptr inbounds i32, ptr %out, i64 %i\n  %v = add i32 %k, %idx\n  store i32 %v, ptr %p\n"
    "  ret void\n}\n",
    "void fill(int* out, int k, int idx) { out[idx] = k + idx; }\n"};

// out[i] = a[i] * k for i < n
inline const KernelSource kScale{
    kernels::llvm_counted_loop("scale", "ptr %out, ptr %a, i32 %k, i32 %n",
                               "  %pa = getelementptr inbounds float, ptr %a, i64 %idx\n"
                               "  %va = load float, ptr %pa\n  %kf = sitofp i32 %k to float\n  %r = fmul float %va, %kf\n"
                               "  %po = getelementptr inbounds float, ptr %out, i64 %idx\n  store float %r, ptr %po\n"),
    "void scale(float* out, const float* a, int k, int n) { for (int i = 0; i < n; i++) out[i] = a[i] * (float)k; }\n"};

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

// Records `body` into a compute queue ordered on the device's timeline (wait for the last value,
// signal the next) and submits it.
template <class Body>
void submit_ordered(CpuHCQDevice& dev, Body&& body) {
  std::lock_guard lock(dev.submit_mutex());
  const std::uint64_t v = dev.next_timeline_value();
  auto q = dev.compute_queue();
  q.wait(dev.timeline_signal(), v - 1);
  body(q);
  q.signal(dev.timeline_signal(), v).submit(dev);
}

inline std::shared_ptr<cpu::CpuProgram> load_cpu(CpuHCQDevice& dev, const std::string& name, const KernelSource& k) {
  return std::dynamic_pointer_cast<cpu::CpuProgram>(dev.load_kernel(name, k.for_device(dev)));
}

}  // namespace tinydev::testing
