// tests/corpus/corpus_reduce.cpp: reductions (float4 sum and max accumulators, a reduce over axis 0,
// an unrolled reduction), softmax and layernorm as tinygrad fuses them (several passes over a row
// in one kernel, exp2 with a log2(e) multiply, rsqrt as 1/sqrt), argmax and a masked cumsum.
#include <cmath>
#include <limits>
#include <string>

#include "corpus_util.hpp"

namespace corpus::detail {
namespace {

const std::string NEG_INF4 =
    "<float 0xFFF0000000000000, float 0xFFF0000000000000, float 0xFFF0000000000000, float 0xFFF0000000000000>";

Kernel sum4() {
  Kernel k;
  k.name = "r_16_64_4";
  k.what = "row sums of a 16x256 matrix with a float4 accumulator (vector phi in IR), lanes added at the end";
  k.c_source = std::string(c_float4) + R"(void r_16_64_4(float* restrict data0, const float* restrict data1) {
  for (int ridx0 = 0; ridx0 < 16; ridx0++) {
    float4 acc0 = (float4){0.0f,0.0f,0.0f,0.0f};
    for (int ridx1 = 0; ridx1 < 64; ridx1++) {
      float4 val0 = *((float4*)((data1+((ridx0<<8)+(ridx1<<2)))));
      acc0 = (acc0+val0);
    }
    data0[ridx0] = (((acc0[0]+acc0[1])+acc0[2])+acc0[3]);
  }
}
)";
  k.ir_source = ir_define("r_16_64_4", 2) + ir_loop("0", "16") +
                ir_loop("1", "64", {{"%acc0", "<4 x float>", "zeroinitializer", "%acc0_next"}}) + R"(  %alu0 = shl i32 %ridx0, 8
  %alu1 = shl i32 %ridx1, 2
  %alu2 = add nsw i32 %alu0, %alu1
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu2
  %val0 = load <4 x float>, ptr %idx0
  %acc0_next = fadd nsz arcp contract afn <4 x float> %acc0, %val0
)" + ir_endloop("1") + R"(  %gep0 = extractelement <4 x float> %acc0, i32 0
  %gep1 = extractelement <4 x float> %acc0, i32 1
  %gep2 = extractelement <4 x float> %acc0, i32 2
  %gep3 = extractelement <4 x float> %acc0, i32 3
  %alu3 = fadd nsz arcp contract afn float %gep0, %gep1
  %alu4 = fadd nsz arcp contract afn float %alu3, %gep2
  %alu5 = fadd nsz arcp contract afn float %alu4, %gep3
  %idx1 = getelementptr inbounds float, ptr %data0, i32 %ridx0
  store float %alu5, ptr %idx1
)" + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 16, true}, {Elem::f32, 16 * 256, false}};
  k.reference = [](Bufs& b, const Values&) {
    for (int r = 0; r < 16; ++r) {
      float lane[4] = {0, 0, 0, 0};  // one partial sum per float4 lane, as the kernel keeps them
      for (int i = 0; i < 256; ++i) lane[i % 4] += get<float>(b[1], r * 256 + i);
      put<float>(b[0], r, ((lane[0] + lane[1]) + lane[2]) + lane[3]);
    }
  };
  k.tolerance = 1e-6;
  return k;
}

Kernel max4() {
  Kernel k;
  k.name = "r_64_32_4";
  k.what = "row max of a 64x128 matrix: float4 accumulator from -inf, max as cmplt+where (vector fcmp/select in IR)";
  k.c_source = std::string(c_float4) + R"(void r_64_32_4(float* restrict data0, const float* restrict data1) {
  for (int ridx0 = 0; ridx0 < 64; ridx0++) {
    float4 acc0 = (float4){(-__builtin_inff()),(-__builtin_inff()),(-__builtin_inff()),(-__builtin_inff())};
    for (int ridx1 = 0; ridx1 < 32; ridx1++) {
      float4 val0 = *((float4*)((data1+((ridx0<<7)+(ridx1<<2)))));
      acc0 = (float4){((acc0[0]<val0[0])?val0[0]:acc0[0]),((acc0[1]<val0[1])?val0[1]:acc0[1]),((acc0[2]<val0[2])?val0[2]:acc0[2]),((acc0[3]<val0[3])?val0[3]:acc0[3])};
    }
    float alu0 = ((acc0[0]<acc0[1])?acc0[1]:acc0[0]);
    float alu1 = ((alu0<acc0[2])?acc0[2]:alu0);
    data0[ridx0] = ((alu1<acc0[3])?acc0[3]:alu1);
  }
}
)";
  k.ir_source = ir_define("r_64_32_4", 2) + ir_loop("0", "64") +
                ir_loop("1", "32", {{"%acc0", "<4 x float>", NEG_INF4, "%acc0_next"}}) + R"(  %alu0 = shl i32 %ridx0, 7
  %alu1 = shl i32 %ridx1, 2
  %alu2 = add nsw i32 %alu0, %alu1
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu2
  %val0 = load <4 x float>, ptr %idx0
  %alu3 = fcmp nsz arcp contract afn ult <4 x float> %acc0, %val0
  %acc0_next = select <4 x i1> %alu3, <4 x float> %val0, <4 x float> %acc0
)" + ir_endloop("1") + R"(  %gep0 = extractelement <4 x float> %acc0, i32 0
  %gep1 = extractelement <4 x float> %acc0, i32 1
  %gep2 = extractelement <4 x float> %acc0, i32 2
  %gep3 = extractelement <4 x float> %acc0, i32 3
  %alu4 = fcmp nsz arcp contract afn ult float %gep0, %gep1
  %alu5 = select i1 %alu4, float %gep1, float %gep0
  %alu6 = fcmp nsz arcp contract afn ult float %alu5, %gep2
  %alu7 = select i1 %alu6, float %gep2, float %alu5
  %alu8 = fcmp nsz arcp contract afn ult float %alu7, %gep3
  %alu9 = select i1 %alu8, float %gep3, float %alu7
  %idx1 = getelementptr inbounds float, ptr %data0, i32 %ridx0
  store float %alu9, ptr %idx1
)" + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 64, true}, {Elem::f32, 64 * 128, false, -100, 100}};
  k.reference = [](Bufs& b, const Values&) {
    for (int r = 0; r < 64; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < 128; ++i) m = std::max(m, get<float>(b[1], r * 128 + i));
      put<float>(b[0], r, m);
    }
  };
  return k;
}

Kernel axis0() {
  Kernel k;
  k.name = "r_8_64_4";
  k.what = "sum over axis 0 of a 64x32 matrix: float4 accumulator over column groups, float4 store";
  k.c_source = std::string(c_float4) + R"(void r_8_64_4(float* restrict data0, const float* restrict data1) {
  for (int ridx0 = 0; ridx0 < 8; ridx0++) {
    int alu0 = (ridx0<<2);
    float4 acc0 = (float4){0.0f,0.0f,0.0f,0.0f};
    for (int ridx1 = 0; ridx1 < 64; ridx1++) {
      float4 val0 = *((float4*)((data1+((ridx1<<5)+alu0))));
      acc0 = (acc0+val0);
    }
    *((float4*)((data0+alu0))) = acc0;
  }
}
)";
  k.ir_source = ir_define("r_8_64_4", 2) + ir_loop("0", "8") + "  %alu0 = shl i32 %ridx0, 2\n" +
                ir_loop("1", "64", {{"%acc0", "<4 x float>", "zeroinitializer", "%acc0_next"}}) + R"(  %alu1 = shl i32 %ridx1, 5
  %alu2 = add nsw i32 %alu1, %alu0
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu2
  %val0 = load <4 x float>, ptr %idx0
  %acc0_next = fadd nsz arcp contract afn <4 x float> %acc0, %val0
)" + ir_endloop("1") + R"(  %idx1 = getelementptr inbounds float, ptr %data0, i32 %alu0
  store <4 x float> %acc0, ptr %idx1
)" + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 32, true}, {Elem::f32, 64 * 32, false}};
  k.reference = [](Bufs& b, const Values&) {
    for (int c = 0; c < 32; ++c) {
      float s = 0;
      for (int r = 0; r < 64; ++r) s += get<float>(b[1], r * 32 + c);
      put<float>(b[0], c, s);
    }
  };
  k.tolerance = 1e-6;
  return k;
}

Kernel unrolled16() {
  Kernel k;
  k.name = "r_64_16";
  k.what = "sums of 16 consecutive floats with the reduction fully unrolled: 4 float4 loads, one 16-term expression";
  std::string c = std::string(c_float4) + "void r_64_16(float* restrict data0, const float* restrict data1) {\n"
                  "  for (int ridx0 = 0; ridx0 < 64; ridx0++) {\n    int alu0 = (ridx0<<4);\n";
  std::string sum;
  for (int v = 0; v < 4; ++v) {
    const std::string s = std::to_string(v);
    c += "    float4 val" + s + " = *((float4*)((data1+" + (v ? "(alu0+" + std::to_string(4 * v) + ")" : "alu0") + ")));\n";
    for (int l = 0; l < 4; ++l) sum += (sum.empty() ? "" : "+") + ("val" + s + "[" + std::to_string(l) + "]");
  }
  c += "    data0[ridx0] = (" + sum + ");\n  }\n}\n";
  k.c_source = c;
  std::string ir = ir_define("r_64_16", 2) + ir_loop("0", "64") + "  %alu0 = shl i32 %ridx0, 4\n";
  for (int v = 0; v < 4; ++v) {
    const std::string s = std::to_string(v);
    ir += "  %off" + s + " = add nsw i32 %alu0, " + std::to_string(4 * v) + "\n  %idx" + s +
          " = getelementptr inbounds float, ptr %data1, i32 %off" + s + "\n  %val" + s + " = load <4 x float>, ptr %idx" + s + "\n";
    for (int l = 0; l < 4; ++l) {
      const int t = 4 * v + l;
      const std::string e = "%e" + std::to_string(t);
      ir += "  " + e + " = extractelement <4 x float> %val" + s + ", i32 " + std::to_string(l) + "\n";
      if (t == 1) ir += "  %s1 = fadd nsz arcp contract afn float %e0, %e1\n";
      if (t > 1)
        ir += "  %s" + std::to_string(t) + " = fadd nsz arcp contract afn float %s" + std::to_string(t - 1) + ", " + e + "\n";
    }
  }
  ir += "  %out = getelementptr inbounds float, ptr %data0, i32 %ridx0\n  store float %s15, ptr %out\n";
  k.ir_source = ir + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 64, true}, {Elem::f32, 1024, false}};
  k.reference = [](Bufs& b, const Values&) {
    for (int r = 0; r < 64; ++r) {
      float s = 0;
      for (int i = 0; i < 16; ++i) s += get<float>(b[1], r * 16 + i);
      put<float>(b[0], r, s);
    }
  };
  k.tolerance = 1e-6;
  return k;
}

Kernel softmax() {
  Kernel k;
  k.name = "r_16_64_softmax";
  k.what = "softmax over the rows of 16x64: max pass, sum of exp2((x-max)*log2e) pass, multiply by the reciprocal";
  k.c_source = R"(void r_16_64_softmax(float* restrict data0, const float* restrict data1) {
  for (int ridx0 = 0; ridx0 < 16; ridx0++) {
    int alu0 = (ridx0<<6);
    float acc0 = (-__builtin_inff());
    for (int ridx1 = 0; ridx1 < 64; ridx1++) {
      float val0 = data1[(alu0+ridx1)];
      acc0 = ((acc0<val0)?val0:acc0);
    }
    float acc1 = 0.0f;
    for (int ridx2 = 0; ridx2 < 64; ridx2++) {
      float val1 = data1[(alu0+ridx2)];
      acc1 = (acc1+__builtin_exp2f(((val1+(acc0*(-1.0f)))*1.4426950408889634f)));
    }
    float alu1 = (1/acc1);
    for (int ridx3 = 0; ridx3 < 64; ridx3++) {
      int alu2 = (alu0+ridx3);
      float val2 = data1[alu2];
      data0[alu2] = (__builtin_exp2f(((val2+(acc0*(-1.0f)))*1.4426950408889634f))*alu1);
    }
  }
}
)";
  k.ir_source = ir_define("r_16_64_softmax", 2) + ir_loop("0", "16") + "  %alu0 = shl i32 %ridx0, 6\n" +
                ir_loop("1", "64", {{"%acc0", "float", "0xFFF0000000000000", "%acc0_next"}}) + R"(  %alu1 = add nsw i32 %alu0, %ridx1
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu1
  %val0 = load float, ptr %idx0
  %alu2 = fcmp nsz arcp contract afn ult float %acc0, %val0
  %acc0_next = select i1 %alu2, float %val0, float %acc0
)" + ir_endloop("1") + "  %alu3 = fmul nsz arcp contract afn float %acc0, -1.0\n" +
                ir_loop("2", "64", {{"%acc1", "float", "0.0", "%acc1_next"}}) + R"(  %alu4 = add nsw i32 %alu0, %ridx2
  %idx1 = getelementptr inbounds float, ptr %data1, i32 %alu4
  %val1 = load float, ptr %idx1
  %alu5 = fadd nsz arcp contract afn float %val1, %alu3
  %alu6 = fmul nsz arcp contract afn float %alu5, 0x3FF7154760000000
  %alu7 = call nsz arcp contract afn float @llvm.exp2.f32(float %alu6)
  %acc1_next = fadd nsz arcp contract afn float %acc1, %alu7
)" + ir_endloop("2") + "  %alu8 = fdiv nsz arcp contract afn float 1.0, %acc1\n" + ir_loop("3", "64") +
                R"(  %alu9 = add nsw i32 %alu0, %ridx3
  %idx2 = getelementptr inbounds float, ptr %data1, i32 %alu9
  %val2 = load float, ptr %idx2
  %alu10 = fadd nsz arcp contract afn float %val2, %alu3
  %alu11 = fmul nsz arcp contract afn float %alu10, 0x3FF7154760000000
  %alu12 = call nsz arcp contract afn float @llvm.exp2.f32(float %alu11)
  %alu13 = fmul nsz arcp contract afn float %alu12, %alu8
  %idx3 = getelementptr inbounds float, ptr %data0, i32 %alu9
  store float %alu13, ptr %idx3
)" + ir_endloop("3") + ir_endloop("0") + ir_end("declare float @llvm.exp2.f32(float)\n");
  k.buffers = {{Elem::f32, 1024, true}, {Elem::f32, 1024, false, -4, 4}};
  k.reference = [](Bufs& b, const Values&) {
    for (int r = 0; r < 16; ++r) {
      double m = -INFINITY, s = 0;
      for (int i = 0; i < 64; ++i) m = std::max(m, static_cast<double>(get<float>(b[1], r * 64 + i)));
      for (int i = 0; i < 64; ++i) s += std::exp(get<float>(b[1], r * 64 + i) - m);
      for (int i = 0; i < 64; ++i) put<float>(b[0], r * 64 + i, static_cast<float>(std::exp(get<float>(b[1], r * 64 + i) - m) / s));
    }
  };
  k.tolerance = 1e-6;  // float kernel (exp2 of a rounded argument) against a double reference
  return k;
}

Kernel layernorm() {
  Kernel k;
  k.name = "r_32_128_layernorm";
  k.what = "layernorm over rows of 32x128 with weight and bias: mean pass, variance pass, 1/sqrt(var+eps), affine";
  k.c_source = R"(void r_32_128_layernorm(float* restrict data0, const float* restrict data1, const float* restrict data2, const float* restrict data3) {
  for (int ridx0 = 0; ridx0 < 32; ridx0++) {
    int alu0 = (ridx0<<7);
    float acc0 = 0.0f;
    for (int ridx1 = 0; ridx1 < 128; ridx1++) {
      float val0 = data1[(alu0+ridx1)];
      acc0 = (acc0+val0);
    }
    float alu1 = (acc0*0.0078125f);
    float acc1 = 0.0f;
    for (int ridx2 = 0; ridx2 < 128; ridx2++) {
      float val1 = data1[(alu0+ridx2)];
      float alu2 = (val1+(alu1*(-1.0f)));
      acc1 = (acc1+(alu2*alu2));
    }
    float alu3 = (1/__builtin_sqrtf(((acc1*0.0078125f)+1e-05f)));
    for (int ridx3 = 0; ridx3 < 128; ridx3++) {
      int alu4 = (alu0+ridx3);
      float val2 = data1[alu4];
      float val3 = data2[ridx3];
      float val4 = data3[ridx3];
      data0[alu4] = ((((val2+(alu1*(-1.0f)))*alu3)*val3)+val4);
    }
  }
}
)";
  k.ir_source = ir_define("r_32_128_layernorm", 4) + ir_loop("0", "32") + "  %alu0 = shl i32 %ridx0, 7\n" +
                ir_loop("1", "128", {{"%acc0", "float", "0.0", "%acc0_next"}}) + R"(  %alu1 = add nsw i32 %alu0, %ridx1
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu1
  %val0 = load float, ptr %idx0
  %acc0_next = fadd nsz arcp contract afn float %acc0, %val0
)" + ir_endloop("1") + R"(  %alu2 = fmul nsz arcp contract afn float %acc0, 0x3F80000000000000
  %alu3 = fmul nsz arcp contract afn float %alu2, -1.0
)" + ir_loop("2", "128", {{"%acc1", "float", "0.0", "%acc1_next"}}) +
                R"(  %alu4 = add nsw i32 %alu0, %ridx2
  %idx1 = getelementptr inbounds float, ptr %data1, i32 %alu4
  %val1 = load float, ptr %idx1
  %alu5 = fadd nsz arcp contract afn float %val1, %alu3
  %alu6 = fmul nsz arcp contract afn float %alu5, %alu5
  %acc1_next = fadd nsz arcp contract afn float %acc1, %alu6
)" + ir_endloop("2") + R"(  %alu7 = fmul nsz arcp contract afn float %acc1, 0x3F80000000000000
  %alu8 = fadd nsz arcp contract afn float %alu7, 0x3EE4F8B580000000
  %alu9 = call nsz arcp contract afn float @llvm.sqrt.f32(float %alu8)
  %alu10 = fdiv nsz arcp contract afn float 1.0, %alu9
)" + ir_loop("3", "128") + R"(  %alu11 = add nsw i32 %alu0, %ridx3
  %idx2 = getelementptr inbounds float, ptr %data1, i32 %alu11
  %val2 = load float, ptr %idx2
  %idx3 = getelementptr inbounds float, ptr %data2, i32 %ridx3
  %val3 = load float, ptr %idx3
  %idx4 = getelementptr inbounds float, ptr %data3, i32 %ridx3
  %val4 = load float, ptr %idx4
  %alu12 = fadd nsz arcp contract afn float %val2, %alu3
  %alu13 = fmul nsz arcp contract afn float %alu12, %alu10
  %alu14 = fmul nsz arcp contract afn float %alu13, %val3
  %alu15 = fadd nsz arcp contract afn float %alu14, %val4
  %idx5 = getelementptr inbounds float, ptr %data0, i32 %alu11
  store float %alu15, ptr %idx5
)" + ir_endloop("3") + ir_endloop("0") + ir_end("declare float @llvm.sqrt.f32(float)\n");
  k.buffers = {{Elem::f32, 32 * 128, true}, {Elem::f32, 32 * 128, false}, {Elem::f32, 128, false, 0.5, 1.5},
               {Elem::f32, 128, false, -1, 1}};
  k.reference = [](Bufs& b, const Values&) {
    for (int r = 0; r < 32; ++r) {
      double mean = 0, var = 0;
      for (int i = 0; i < 128; ++i) mean += get<float>(b[1], r * 128 + i);
      mean /= 128;
      for (int i = 0; i < 128; ++i) var += (get<float>(b[1], r * 128 + i) - mean) * (get<float>(b[1], r * 128 + i) - mean);
      var /= 128;
      const double inv = 1.0 / std::sqrt(var + 1e-5);
      for (int i = 0; i < 128; ++i)
        put<float>(b[0], r * 128 + i,
                   static_cast<float>((get<float>(b[1], r * 128 + i) - mean) * inv * get<float>(b[2], i) + get<float>(b[3], i)));
    }
  };
  k.tolerance = 1e-5;  // float kernel against a double reference
  return k;
}

Kernel argmax() {
  Kernel k;
  k.name = "r_32_100_argmax";
  k.what = "argmax of each row of 32x100 the tinygrad way: max, then max of where(x!=max, 0, 100-i), index = 100-that";
  k.c_source = R"(void r_32_100_argmax(int* restrict data0, const float* restrict data1) {
  for (int ridx0 = 0; ridx0 < 32; ridx0++) {
    int alu0 = (ridx0*100);
    float acc0 = (-__builtin_inff());
    for (int ridx1 = 0; ridx1 < 100; ridx1++) {
      float val0 = data1[(alu0+ridx1)];
      acc0 = ((acc0<val0)?val0:acc0);
    }
    int acc1 = (-2147483647-1);
    for (int ridx2 = 0; ridx2 < 100; ridx2++) {
      float val1 = data1[(alu0+ridx2)];
      int alu1 = ((val1!=acc0)?0:(100+(ridx2*(-1))));
      acc1 = ((acc1<alu1)?alu1:acc1);
    }
    data0[ridx0] = (100+(acc1*(-1)));
  }
}
)";
  k.ir_source = ir_define("r_32_100_argmax", 2) + ir_loop("0", "32") + "  %alu0 = mul nsw i32 %ridx0, 100\n" +
                ir_loop("1", "100", {{"%acc0", "float", "0xFFF0000000000000", "%acc0_next"}}) + R"(  %alu1 = add nsw i32 %alu0, %ridx1
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu1
  %val0 = load float, ptr %idx0
  %alu2 = fcmp nsz arcp contract afn ult float %acc0, %val0
  %acc0_next = select i1 %alu2, float %val0, float %acc0
)" + ir_endloop("1") + ir_loop("2", "100", {{"%acc1", "i32", "-2147483648", "%acc1_next"}}) +
                R"(  %alu3 = add nsw i32 %alu0, %ridx2
  %idx1 = getelementptr inbounds float, ptr %data1, i32 %alu3
  %val1 = load float, ptr %idx1
  %alu4 = fcmp nsz arcp contract afn une float %val1, %acc0
  %alu5 = mul nsw i32 %ridx2, -1
  %alu6 = add nsw i32 %alu5, 100
  %alu7 = select i1 %alu4, i32 0, i32 %alu6
  %alu8 = icmp slt i32 %acc1, %alu7
  %acc1_next = select i1 %alu8, i32 %alu7, i32 %acc1
)" + ir_endloop("2") + R"(  %alu9 = mul nsw i32 %acc1, -1
  %alu10 = add nsw i32 %alu9, 100
  %idx2 = getelementptr inbounds i32, ptr %data0, i32 %ridx0
  store i32 %alu10, ptr %idx2
)" + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::i32, 32, true}, {Elem::f32, 3200, false, -10, 10}};
  k.reference = [](Bufs& b, const Values&) {
    for (int r = 0; r < 32; ++r) {
      int best = 0;
      for (int i = 1; i < 100; ++i)
        if (get<float>(b[1], r * 100 + i) > get<float>(b[1], r * 100 + best)) best = i;  // first index of the max
      put<std::int32_t>(b[0], r, best);
    }
  };
  return k;
}

Kernel cumsum() {
  Kernel k;
  k.name = "r_256_256_cumsum";
  k.what = "cumsum of 256 floats as tinygrad renders it: out[i] = sum over j of where(j<i+1, x[j], 0) (masked reduce)";
  k.c_source = R"(void r_256_256_cumsum(float* restrict data0, const float* restrict data1) {
  for (int ridx0 = 0; ridx0 < 256; ridx0++) {
    float acc0 = 0.0f;
    for (int ridx1 = 0; ridx1 < 256; ridx1++) {
      float val0 = ((ridx1<(ridx0+1))?data1[ridx1]:0.0f);
      acc0 = (acc0+val0);
    }
    data0[ridx0] = acc0;
  }
}
)";
  k.ir_source = ir_define("r_256_256_cumsum", 2) + ir_loop("0", "256") + "  %alu0 = add nsw i32 %ridx0, 1\n" +
                ir_loop("1", "256", {{"%acc0", "float", "0.0", "%acc0_next"}}) + R"(  %alu1 = icmp slt i32 %ridx1, %alu0
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %ridx1
  %val0_load = load float, ptr %idx0
  %val0 = select i1 %alu1, float %val0_load, float 0.0
  %acc0_next = fadd nsz arcp contract afn float %acc0, %val0
)" + ir_endloop("1") + R"(  %idx1 = getelementptr inbounds float, ptr %data0, i32 %ridx0
  store float %acc0, ptr %idx1
)" + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 256, true}, {Elem::f32, 256, false}};
  k.reference = [](Bufs& b, const Values&) {
    float s = 0;
    for (int i = 0; i < 256; ++i) put<float>(b[0], i, s += get<float>(b[1], i));
  };
  k.tolerance = 1e-6;
  return k;
}

}  // namespace

void add_reduce(std::vector<Kernel>& out) {
  out.push_back(sum4());
  out.push_back(max4());
  out.push_back(axis0());
  out.push_back(unrolled16());
  out.push_back(softmax());
  out.push_back(layernorm());
  out.push_back(argmax());
  out.push_back(cumsum());
}

}  // namespace corpus::detail
