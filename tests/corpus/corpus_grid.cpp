// tests/corpus/corpus_grid.cpp: core_id grid kernels (a trailing `int core_id` picks the slice one
// call computes) and kernels with symbolic int arguments used in loop bounds and indexing.
#include <cmath>
#include <string>

#include "corpus_util.hpp"

namespace corpus::detail {
namespace {

Kernel grid_fma() {
  Kernel k;
  k.name = "E_4_64_4";
  k.what = "grid of 4: core_id picks a 256-element slice of a*b+c, float4 loads/stores (vector fmul/fadd in IR)";
  k.c_source = std::string(c_float4) + R"(void E_4_64_4(float* restrict data0, const float* restrict data1, const float* restrict data2, const float* restrict data3, const int core_id) {
  for (int ridx0 = 0; ridx0 < 64; ridx0++) {
    int alu0 = ((core_id<<8)+(ridx0<<2));
    float4 val0 = *((float4*)((data1+alu0)));
    float4 val1 = *((float4*)((data2+alu0)));
    float4 val2 = *((float4*)((data3+alu0)));
    *((float4*)((data0+alu0))) = ((val0*val1)+val2);
  }
}
)";
  k.ir_source = ir_define("E_4_64_4", 4, {"core_id"}) + ir_loop("0", "64") + R"(  %alu0_a = shl i32 %core_id, 8
  %alu0_b = shl i32 %ridx0, 2
  %alu0 = add nsw i32 %alu0_a, %alu0_b
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu0
  %val0 = load <4 x float>, ptr %idx0
  %idx1 = getelementptr inbounds float, ptr %data2, i32 %alu0
  %val1 = load <4 x float>, ptr %idx1
  %idx2 = getelementptr inbounds float, ptr %data3, i32 %alu0
  %val2 = load <4 x float>, ptr %idx2
  %alu1 = fmul nsz arcp contract afn <4 x float> %val0, %val1
  %alu2 = fadd nsz arcp contract afn <4 x float> %alu1, %val2
  %idx3 = getelementptr inbounds float, ptr %data0, i32 %alu0
  store <4 x float> %alu2, ptr %idx3
)" + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 1024, true}, {Elem::f32, 1024, false}, {Elem::f32, 1024, false}, {Elem::f32, 1024, false}};
  k.grid = 4;
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 1024; ++i)
      put<float>(b[0], i, static_cast<float>(static_cast<double>(get<float>(b[1], i)) * get<float>(b[2], i) + get<float>(b[3], i)));
  };
  k.tolerance = 1e-6;  // fused or unfused multiply-add
  return k;
}

Kernel grid_rmsnorm() {
  Kernel k;
  k.name = "r_8_4_64_rmsnorm";
  k.what = "grid of 8: each core_id normalizes 4 rows of 32x64 (RMSNorm: sum of squares, 1/sqrt, scale by weight)";
  k.c_source = R"(void r_8_4_64_rmsnorm(float* restrict data0, const float* restrict data1, const float* restrict data2, const int core_id) {
  for (int ridx0 = 0; ridx0 < 4; ridx0++) {
    int alu0 = ((core_id<<8)+(ridx0<<6));
    float acc0 = 0.0f;
    for (int ridx1 = 0; ridx1 < 64; ridx1++) {
      float val0 = data1[(alu0+ridx1)];
      acc0 = (acc0+(val0*val0));
    }
    float alu1 = (1/__builtin_sqrtf(((acc0*0.015625f)+1e-06f)));
    for (int ridx2 = 0; ridx2 < 64; ridx2++) {
      int alu2 = (alu0+ridx2);
      float val1 = data1[alu2];
      float val2 = data2[ridx2];
      data0[alu2] = ((val1*alu1)*val2);
    }
  }
}
)";
  k.ir_source = ir_define("r_8_4_64_rmsnorm", 3, {"core_id"}) + ir_loop("0", "4") + R"(  %alu0_a = shl i32 %core_id, 8
  %alu0_b = shl i32 %ridx0, 6
  %alu0 = add nsw i32 %alu0_a, %alu0_b
)" + ir_loop("1", "64", {{"%acc0", "float", "0.0", "%acc0_next"}}) +
                R"(  %alu3 = add nsw i32 %alu0, %ridx1
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu3
  %val0 = load float, ptr %idx0
  %alu4 = fmul nsz arcp contract afn float %val0, %val0
  %acc0_next = fadd nsz arcp contract afn float %acc0, %alu4
)" + ir_endloop("1") + R"(  %alu5 = fmul nsz arcp contract afn float %acc0, 0x3F90000000000000
  %alu6 = fadd nsz arcp contract afn float %alu5, 0x3EB0C6F7A0000000
  %alu7 = call nsz arcp contract afn float @llvm.sqrt.f32(float %alu6)
  %alu1 = fdiv nsz arcp contract afn float 1.0, %alu7
)" + ir_loop("2", "64") + R"(  %alu2 = add nsw i32 %alu0, %ridx2
  %idx1 = getelementptr inbounds float, ptr %data1, i32 %alu2
  %val1 = load float, ptr %idx1
  %idx2 = getelementptr inbounds float, ptr %data2, i32 %ridx2
  %val2 = load float, ptr %idx2
  %alu8 = fmul nsz arcp contract afn float %val1, %alu1
  %alu9 = fmul nsz arcp contract afn float %alu8, %val2
  %idx3 = getelementptr inbounds float, ptr %data0, i32 %alu2
  store float %alu9, ptr %idx3
)" + ir_endloop("2") + ir_endloop("0") + ir_end("declare float @llvm.sqrt.f32(float)\n");
  k.buffers = {{Elem::f32, 32 * 64, true}, {Elem::f32, 32 * 64, false}, {Elem::f32, 64, false, 0.5, 1.5}};
  k.grid = 8;
  k.reference = [](Bufs& b, const Values&) {
    for (int r = 0; r < 32; ++r) {
      double ss = 0;
      for (int i = 0; i < 64; ++i) ss += static_cast<double>(get<float>(b[1], r * 64 + i)) * get<float>(b[1], r * 64 + i);
      const double inv = 1.0 / std::sqrt(ss / 64 + 1e-6);
      for (int i = 0; i < 64; ++i)
        put<float>(b[0], r * 64 + i, static_cast<float>(get<float>(b[1], r * 64 + i) * inv * get<float>(b[2], i)));
    }
  };
  k.tolerance = 1e-5;  // float kernel against a double reference
  return k;
}

Kernel grid_n() {
  Kernel k;
  k.name = "E_n_core";
  k.what = "grid of 4 plus a symbolic length n: each core_id takes ceil(n/4) elements (idiv, min via where, clamp at "
           "0), x*3-1; n is the last value before core_id";
  k.c_source = R"(void E_n_core(float* restrict data0, const float* restrict data1, const int n, const int core_id) {
  int alu0 = ((n+3)/4);
  int alu1 = (core_id*alu0);
  int alu2 = (alu1+alu0);
  int alu3 = ((n<alu2)?n:alu2);
  int alu4 = (alu3+(alu1*(-1)));
  int alu5 = ((alu4<0)?0:alu4);
  for (int ridx0 = 0; ridx0 < alu5; ridx0++) {
    int alu6 = (alu1+ridx0);
    float val0 = data1[alu6];
    data0[alu6] = ((val0*3.0f)+(-1.0f));
  }
}
)";
  k.ir_source = ir_define("E_n_core", 2, {"n", "core_id"}) + R"(  %alu0_a = add nsw i32 %n, 3
  %alu0 = sdiv i32 %alu0_a, 4
  %alu1 = mul nsw i32 %core_id, %alu0
  %alu2 = add nsw i32 %alu1, %alu0
  %alu3_c = icmp slt i32 %n, %alu2
  %alu3 = select i1 %alu3_c, i32 %n, i32 %alu2
  %alu4_n = mul nsw i32 %alu1, -1
  %alu4 = add nsw i32 %alu3, %alu4_n
  %alu5_c = icmp slt i32 %alu4, 0
  %alu5 = select i1 %alu5_c, i32 0, i32 %alu4
)" + ir_loop("0", "%alu5") + R"(  %alu6 = add nsw i32 %alu1, %ridx0
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu6
  %val0 = load float, ptr %idx0
  %alu7 = fmul nsz arcp contract afn float %val0, 3.0
  %alu8 = fadd nsz arcp contract afn float %alu7, -1.0
  %idx1 = getelementptr inbounds float, ptr %data0, i32 %alu6
  store float %alu8, ptr %idx1
)" + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 512, true}, {Elem::f32, 512, false}};
  k.values = {497};
  k.grid = 4;
  k.reference = [](Bufs& b, const Values& v) {
    for (int i = 0; i < v[0]; ++i) put<float>(b[0], i, static_cast<float>(3.0 * get<float>(b[1], i) - 1.0));
  };
  k.tolerance = 1e-6;  // fused or unfused multiply-add
  return k;
}

Kernel symbolic_offset() {
  Kernel k;
  k.name = "E_n_start";
  k.what = "symbolic start and length: out[i] = in[start+i]*2+1 for i < n (two int args, loop bound %n)";
  k.c_source = R"(void E_n_start(float* restrict data0, const float* restrict data1, const int start, const int n) {
  for (int ridx0 = 0; ridx0 < n; ridx0++) {
    float val0 = data1[(start+ridx0)];
    data0[ridx0] = ((val0*2.0f)+1.0f);
  }
}
)";
  k.ir_source = ir_define("E_n_start", 2, {"start", "n"}) + ir_loop("0", "%n") + R"(  %alu0 = add nsw i32 %start, %ridx0
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu0
  %val0 = load float, ptr %idx0
  %alu1 = fmul nsz arcp contract afn float %val0, 2.0
  %alu2 = fadd nsz arcp contract afn float %alu1, 1.0
  %idx1 = getelementptr inbounds float, ptr %data0, i32 %ridx0
  store float %alu2, ptr %idx1
)" + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 256, true}, {Elem::f32, 512, false}};
  k.values = {100, 200};
  k.reference = [](Bufs& b, const Values& v) {
    for (int i = 0; i < v[1]; ++i) put<float>(b[0], i, get<float>(b[1], v[0] + i) * 2.0f + 1.0f);  // *2 is exact
  };
  return k;
}

Kernel cumsum_n() {
  Kernel k;
  k.name = "r_n_cumsum";
  k.what = "running cumsum over the first n elements: a loop-carried accumulator (phi) stored every iteration";
  k.c_source = R"(void r_n_cumsum(float* restrict data0, const float* restrict data1, const int n) {
  float acc0 = 0.0f;
  for (int ridx0 = 0; ridx0 < n; ridx0++) {
    float val0 = data1[ridx0];
    acc0 = (acc0+val0);
    data0[ridx0] = acc0;
  }
}
)";
  k.ir_source = ir_define("r_n_cumsum", 2, {"n"}) + ir_loop("0", "%n", {{"%acc0", "float", "0.0", "%acc0_next"}}) +
                R"(  %idx0 = getelementptr inbounds float, ptr %data1, i32 %ridx0
  %val0 = load float, ptr %idx0
  %acc0_next = fadd nsz arcp contract afn float %acc0, %val0
  %idx1 = getelementptr inbounds float, ptr %data0, i32 %ridx0
  store float %acc0_next, ptr %idx1
)" + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 512, true}, {Elem::f32, 512, false}};
  k.values = {300};
  k.reference = [](Bufs& b, const Values& v) {
    float s = 0;
    for (int i = 0; i < v[0]; ++i) put<float>(b[0], i, s += get<float>(b[1], i));
  };
  k.tolerance = 1e-6;
  return k;
}

Kernel dot_n() {
  Kernel k;
  k.name = "r_n_dot";
  k.what = "dot product of the first n elements (symbolic loop bound), scalar phi accumulator, one output";
  k.c_source = R"(void r_n_dot(float* restrict data0, const float* restrict data1, const float* restrict data2, const int n) {
  float acc0 = 0.0f;
  for (int ridx0 = 0; ridx0 < n; ridx0++) {
    float val0 = data1[ridx0];
    float val1 = data2[ridx0];
    acc0 = (acc0+(val0*val1));
  }
  data0[0] = acc0;
}
)";
  k.ir_source = ir_define("r_n_dot", 3, {"n"}) + ir_loop("0", "%n", {{"%acc0", "float", "0.0", "%acc0_next"}}) +
                R"(  %idx0 = getelementptr inbounds float, ptr %data1, i32 %ridx0
  %val0 = load float, ptr %idx0
  %idx1 = getelementptr inbounds float, ptr %data2, i32 %ridx0
  %val1 = load float, ptr %idx1
  %alu0 = fmul nsz arcp contract afn float %val0, %val1
  %acc0_next = fadd nsz arcp contract afn float %acc0, %alu0
)" + ir_endloop("0") + "  store float %acc0, ptr %data0\n" + ir_end();
  k.buffers = {{Elem::f32, 1, true}, {Elem::f32, 1024, false, -1, 1}, {Elem::f32, 1024, false, -1, 1}};
  k.values = {777};
  k.reference = [](Bufs& b, const Values& v) {
    float s = 0;
    for (int i = 0; i < v[0]; ++i) s += get<float>(b[1], i) * get<float>(b[2], i);
    put<float>(b[0], 0, s);
  };
  k.tolerance = 5e-5;  // same order; FMA contraction only, but 777 terms whose roundings then drift apart
  return k;
}

// tinygrad's LLVMRenderer also rendered float ops with `reassoc` (its MFLAGS had it for a time):
// then the loop vectorizer may reorder the reduction, so the sum's rounding depends on whether
// the pipeline vectorizes and how wide. The bit-identity test against clang catches a pipeline
// that does not (Note [clang's -O2 pipeline]).
Kernel dot_reassoc() {
  Kernel k;
  k.name = "r_1024_dot_reassoc";
  k.what = "dot product of 1024 elements with reassoc fast-math flags (vectorizable reduction: the order is the pipeline's)";
  k.c_source = R"(void r_1024_dot_reassoc(float* restrict data0, const float* restrict data1, const float* restrict data2) {
  float acc0 = 0.0f;
  for (int ridx0 = 0; ridx0 < 1024; ridx0++) {
    float val0 = data1[ridx0];
    float val1 = data2[ridx0];
    acc0 = (acc0+(val0*val1));
  }
  data0[0] = acc0;
}
)";
  k.ir_source = ir_define("r_1024_dot_reassoc", 3) + ir_loop("0", "1024", {{"%acc0", "float", "0.0", "%acc0_next"}}) +
                R"(  %idx0 = getelementptr inbounds float, ptr %data1, i32 %ridx0
  %val0 = load float, ptr %idx0
  %idx1 = getelementptr inbounds float, ptr %data2, i32 %ridx0
  %val1 = load float, ptr %idx1
  %alu0 = fmul reassoc nsz arcp contract afn float %val0, %val1
  %acc0_next = fadd reassoc nsz arcp contract afn float %acc0, %alu0
)" + ir_endloop("0") + "  store float %acc0, ptr %data0\n" + ir_end();
  k.buffers = {{Elem::f32, 1, true}, {Elem::f32, 1024, false, -1, 1}, {Elem::f32, 1024, false, -1, 1}};
  k.reference = [](Bufs& b, const Values&) {
    double s = 0;
    for (int i = 0; i < 1024; ++i) s += static_cast<double>(get<float>(b[1], i)) * get<float>(b[2], i);
    put<float>(b[0], 0, static_cast<float>(s));
  };
  k.tolerance = 5e-4;  // any summation order of 1024 products in [-1, 1], against a double sum
  return k;
}

}  // namespace

void add_grid(std::vector<Kernel>& out) {
  out.push_back(grid_fma());
  out.push_back(grid_rmsnorm());
  out.push_back(grid_n());
  out.push_back(symbolic_offset());
  out.push_back(cumsum_n());
  out.push_back(dot_n());
  out.push_back(dot_reassoc());
}

}  // namespace corpus::detail
