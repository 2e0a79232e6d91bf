// tools/demo_kernels.hpp: small kernels in each source language, shared by the CLI demo, the
// benchmarks and the tests. Kernel ABI (docs/kernel-abi.md): buffers first, then int32 values.
#pragma once

#include <string>
#include <string_view>

#include "tinydev/compile.hpp"
#include "tinydev/error.hpp"

namespace tinydev::kernels {

// out[i] = a[i] + b[i] for i < n: `void add(float* out, float* a, float* b, int32 n)`.
// `define void @name(params)` running `body` once for each %i in [0, %n), with %idx = %i as i64.
// `params` must declare `i32 %n`; `body` is LLVM IR lines (each indented, newline-terminated).
inline std::string llvm_counted_loop(std::string_view name, std::string_view params, std::string_view body) {
  std::string ir = "define void @" + std::string(name) + "(" + std::string(params) + ") {\n";
  ir += "entry:\n  %empty = icmp sle i32 %n, 0\n  br i1 %empty, label %exit, label %loop\n";
  ir += "loop:\n  %i = phi i32 [ 0, %entry ], [ %next, %loop ]\n  %idx = zext i32 %i to i64\n";
  ir += body;
  ir += "  %next = add nuw nsw i32 %i, 1\n  %done = icmp eq i32 %next, %n\n";
  ir += "  br i1 %done, label %exit, label %loop\nexit:\n  ret void\n}\n";
  return ir;
}

inline std::string add_f32(SourceLanguage language, std::string_view name = "add") {
  std::string n(name);
  switch (language) {
    case SourceLanguage::LLVMIR:
      return llvm_counted_loop(n, "ptr noalias align 32 %out, ptr noalias align 32 %a, ptr noalias align 32 %b, i32 %n",
                               "  %pa = getelementptr inbounds float, ptr %a, i64 %idx\n"
                               "  %pb = getelementptr inbounds float, ptr %b, i64 %idx\n"
                               "  %po = getelementptr inbounds float, ptr %out, i64 %idx\n"
                               "  %va = load float, ptr %pa, align 4\n"
                               "  %vb = load float, ptr %pb, align 4\n"
                               "  %sum = fadd float %va, %vb\n"
                               "  store float %sum, ptr %po, align 4\n");
    case SourceLanguage::C:
      return "void " + n +
             "(float* restrict out, const float* restrict a, const float* restrict b, int n) {\n"
             "  for (int i = 0; i < n; i++) out[i] = a[i] + b[i];\n}\n";
    case SourceLanguage::CUDA:
      // A grid-stride loop: correct for any launch size (one thread with the default LaunchParams),
      // fast with a grid of blocks.
      return "extern \"C\" __global__ void " + n +
             "(float* __restrict__ out, const float* __restrict__ a, const float* __restrict__ b, int n) {\n"
             "  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)\n"
             "    out[i] = a[i] + b[i];\n}\n";
    default:
      throw InvalidArgument(std::string("no add kernel for source language ") +
                            std::string(to_string(language)));
  }
}

}  // namespace tinydev::kernels
