// tools/demo_kernels.hpp: small kernels in each source language, shared by the CLI demo, the
// benchmarks and the tests. Kernel ABI (docs/kernel-abi.md): buffers first, then int32 values.
#pragma once

#include <string>
#include <string_view>

#include "tinydev/compile.hpp"
#include "tinydev/error.hpp"

namespace tinydev::kernels {

// out[i] = a[i] + b[i] for i < n: `void add(float* out, float* a, float* b, int32 n)`.
inline std::string add_f32(SourceLanguage language, std::string_view name = "add") {
  std::string n(name);
  switch (language) {
    case SourceLanguage::LLVMIR:
      return "define void @" + n + R"((ptr noalias align 32 %out, ptr noalias align 32 %a, ptr noalias align 32 %b, i32 %n) {
entry:
  %empty = icmp sle i32 %n, 0
  br i1 %empty, label %exit, label %loop
loop:
  %i = phi i32 [ 0, %entry ], [ %next, %loop ]
  %idx = zext i32 %i to i64
  %pa = getelementptr inbounds float, ptr %a, i64 %idx
  %pb = getelementptr inbounds float, ptr %b, i64 %idx
  %po = getelementptr inbounds float, ptr %out, i64 %idx
  %va = load float, ptr %pa, align 4
  %vb = load float, ptr %pb, align 4
  %sum = fadd float %va, %vb
  store float %sum, ptr %po, align 4
  %next = add nuw nsw i32 %i, 1
  %done = icmp eq i32 %next, %n
  br i1 %done, label %exit, label %loop
exit:
  ret void
}
)";
    case SourceLanguage::C:
      return "void " + n +
             "(float* restrict out, const float* restrict a, const float* restrict b, int n) {\n"
             "  for (int i = 0; i < n; i++) out[i] = a[i] + b[i];\n}\n";
    default:
      throw InvalidArgument(std::string("no add kernel for source language ") +
                            std::string(to_string(language)));
  }
}

}  // namespace tinydev::kernels
