// tests/corpus/corpus_elementwise.cpp: elementwise (E_) kernels: half / bfloat16 / int / bool casts,
// where and cmplt, a long chain of float ops, unary math through builtins and llvm intrinsics,
// integer division and modulo, bit ops, double and int64 / uint8 arithmetic, threefry2x32, a maxpool.
#include <cmath>
#include <string>

#include "corpus_util.hpp"

namespace corpus::detail {
namespace {

const std::string FM = "nsz arcp contract afn";

// "  %name_idx = gep T, ptr %dataB, i32 %ridx0\n  %name = load T, ptr %name_idx\n"
std::string ld(const std::string& name, const std::string& type, int buf, const std::string& idx = "%ridx0") {
  return "  " + name + "_p = getelementptr inbounds " + type + ", ptr %data" + std::to_string(buf) + ", i32 " + idx +
         "\n  " + name + " = load " + type + ", ptr " + name + "_p\n";
}
std::string st(const std::string& value, const std::string& type, int buf, const std::string& tag,
               const std::string& idx = "%ridx0") {
  return "  %st" + tag + " = getelementptr inbounds " + type + ", ptr %data" + std::to_string(buf) + ", i32 " + idx +
         "\n  store " + type + " " + value + ", ptr %st" + tag + "\n";
}

Kernel half_casts() {
  Kernel k;
  k.name = "E_256_4_half";
  k.what = "float4 <-> half4 casts with __builtin_convertvector / vector fptrunc+fpext, incl. overflow to inf and "
           "half subnormals";
  k.c_source = std::string(c_float4) + R"(typedef _Float16 half;
typedef _Float16 half4 __attribute__((aligned(8),vector_size(8)));
void E_256_4_half(half* restrict data0, half* restrict data1, float* restrict data2, const float* restrict data3, const float* restrict data4, const half* restrict data5) {
  for (int ridx0 = 0; ridx0 < 256; ridx0++) {
    int alu0 = (ridx0<<2);
    float4 val0 = *((float4*)((data3+alu0)));
    float4 val1 = *((float4*)((data4+alu0)));
    half4 val2 = *((half4*)((data5+alu0)));
    *((half4*)((data0+alu0))) = __builtin_convertvector(val0, half4);
    *((half4*)((data1+alu0))) = __builtin_convertvector(val1, half4);
    *((float4*)((data2+alu0))) = __builtin_convertvector(val2, float4);
  }
}
)";
  k.ir_source = ir_define("E_256_4_half", 6) + ir_loop("0", "256") + "  %alu0 = shl i32 %ridx0, 2\n" +
                R"(  %val0_p = getelementptr inbounds float, ptr %data3, i32 %alu0
  %val0 = load <4 x float>, ptr %val0_p
  %val1_p = getelementptr inbounds float, ptr %data4, i32 %alu0
  %val1 = load <4 x float>, ptr %val1_p
  %val2_p = getelementptr inbounds half, ptr %data5, i32 %alu0
  %val2 = load <4 x half>, ptr %val2_p
  %cast0 = fptrunc <4 x float> %val0 to <4 x half>
  %cast1 = fptrunc <4 x float> %val1 to <4 x half>
  %cast2 = fpext <4 x half> %val2 to <4 x float>
  %st0 = getelementptr inbounds half, ptr %data0, i32 %alu0
  store <4 x half> %cast0, ptr %st0
  %st1 = getelementptr inbounds half, ptr %data1, i32 %alu0
  store <4 x half> %cast1, ptr %st1
  %st2 = getelementptr inbounds float, ptr %data2, i32 %alu0
  store <4 x float> %cast2, ptr %st2
)" + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f16, 1024, true},           {Elem::f16, 1024, true},
               {Elem::f32, 1024, true},           {Elem::f32, 1024, false, -70000, 70000},
               {Elem::f32, 1024, false, -2e-4, 2e-4}, {Elem::f16, 1024, false, -1000, 1000}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 1024; ++i) {
      put<std::uint16_t>(b[0], i, f32_to_f16(get<float>(b[3], i)));
      put<std::uint16_t>(b[1], i, f32_to_f16(get<float>(b[4], i)));
      put<float>(b[2], i, f16_to_f32(get<std::uint16_t>(b[5], i)));
    }
  };
  return k;
}

Kernel bf16_casts() {
  Kernel k;
  k.name = "E_1024_bf16";
  k.what = "float -> bfloat16 as round-to-nearest-even bit ops on uint (bitcast, shifts), bfloat16 -> float via "
           "__bf16 / fpext bfloat";
  k.c_source = R"(void E_1024_bf16(unsigned short* restrict data0, float* restrict data1, const float* restrict data2, const __bf16* restrict data3) {
  for (int ridx0 = 0; ridx0 < 1024; ridx0++) {
    float val0 = data2[ridx0];
    __bf16 val1 = data3[ridx0];
    unsigned int alu0 = __builtin_bit_cast(unsigned int, val0);
    data0[ridx0] = ((unsigned short)(((alu0+32767u)+((alu0>>16u)&1u))>>16u));
    data1[ridx0] = ((float)(val1));
  }
}
)";
  k.ir_source = ir_define("E_1024_bf16", 4) + ir_loop("0", "1024") + ld("%val0", "float", 2) + ld("%val1", "bfloat", 3) +
                R"(  %alu0 = bitcast float %val0 to i32
  %alu1 = add i32 %alu0, 32767
  %alu2 = lshr i32 %alu0, 16
  %alu3 = and i32 %alu2, 1
  %alu4 = add i32 %alu1, %alu3
  %alu5 = lshr i32 %alu4, 16
  %alu6 = trunc i32 %alu5 to i16
  %alu7 = fpext bfloat %val1 to float
)" + st("%alu6", "i16", 0, "0") +
                st("%alu7", "float", 1, "1") + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::bf16, 1024, true}, {Elem::f32, 1024, true}, {Elem::f32, 1024, false, -300, 300},
               {Elem::bf16, 1024, false, -300, 300}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 1024; ++i) {
      put<std::uint16_t>(b[0], i, f32_to_bf16(get<float>(b[2], i)));
      put<float>(b[1], i, bf16_to_f32(get<std::uint16_t>(b[3], i)));
    }
  };
  return k;
}

Kernel int_casts() {
  Kernel k;
  k.name = "E_1024_casts";
  k.what = "float->int (fptosi), int->float (sitofp), int->char (trunc), uchar->bool (cmpne 0), float->double, "
           "int->long (sext), uchar->uint (zext), uchar->float (uitofp)";
  k.c_source = R"(void E_1024_casts(int* restrict data0, float* restrict data1, signed char* restrict data2, _Bool* restrict data3, double* restrict data4, long* restrict data5, unsigned int* restrict data6, float* restrict data7, const float* restrict data8, const int* restrict data9, const unsigned char* restrict data10) {
  for (int ridx0 = 0; ridx0 < 1024; ridx0++) {
    float val0 = data8[ridx0];
    int val1 = data9[ridx0];
    unsigned char val2 = data10[ridx0];
    data0[ridx0] = ((int)(val0));
    data1[ridx0] = ((float)(val1));
    data2[ridx0] = ((signed char)(val1));
    data3[ridx0] = ((_Bool)(val2));
    data4[ridx0] = ((double)(val0));
    data5[ridx0] = ((long)(val1));
    data6[ridx0] = ((unsigned int)(val2));
    data7[ridx0] = ((float)(val2));
  }
}
)";
  k.ir_source = ir_define("E_1024_casts", 11) + ir_loop("0", "1024") + ld("%val0", "float", 8) + ld("%val1", "i32", 9) +
                ld("%val2", "i8", 10) + R"(  %cast0 = fptosi float %val0 to i32
  %cast1 = sitofp i32 %val1 to float
  %cast2 = trunc i32 %val1 to i8
  %cast3 = icmp ne i8 %val2, 0
  %cast3_st = zext i1 %cast3 to i8
  %cast4 = fpext float %val0 to double
  %cast5 = sext i32 %val1 to i64
  %cast6 = zext i8 %val2 to i32
  %cast7 = uitofp i8 %val2 to float
)" + st("%cast0", "i32", 0, "0") + st("%cast1", "float", 1, "1") + st("%cast2", "i8", 2, "2") +
                st("%cast3_st", "i8", 3, "3") + st("%cast4", "double", 4, "4") + st("%cast5", "i64", 5, "5") +
                st("%cast6", "i32", 6, "6") + st("%cast7", "float", 7, "7") + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::i32, 1024, true},  {Elem::f32, 1024, true},  {Elem::i8, 1024, true},
               {Elem::boolean, 1024, true}, {Elem::f64, 1024, true}, {Elem::i64, 1024, true},
               {Elem::u32, 1024, true},  {Elem::f32, 1024, true},  {Elem::f32, 1024, false, -1000, 1000},
               {Elem::i32, 1024, false, -1e9, 1e9}, {Elem::u8, 1024, false, 0, 3}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 1024; ++i) {
      const float f = get<float>(b[8], i);
      const std::int32_t n = get<std::int32_t>(b[9], i);
      const std::uint8_t u = get<std::uint8_t>(b[10], i);
      put<std::int32_t>(b[0], i, static_cast<std::int32_t>(f));
      put<float>(b[1], i, static_cast<float>(n));
      put<std::int8_t>(b[2], i, static_cast<std::int8_t>(n));
      put<std::uint8_t>(b[3], i, u != 0 ? 1 : 0);
      put<double>(b[4], i, f);
      put<std::int64_t>(b[5], i, n);
      put<std::uint32_t>(b[6], i, u);
      put<float>(b[7], i, static_cast<float>(u));
    }
  };
  return k;
}

Kernel where_cmp() {
  Kernel k;
  k.name = "E_1024_where";
  k.what = "where/cmplt/cmpne: relu, select on a bool buffer, clamp, int cmplt to bool, (x!=y)&c, int max via where";
  k.c_source = R"(void E_1024_where(float* restrict data0, float* restrict data1, float* restrict data2, _Bool* restrict data3, _Bool* restrict data4, int* restrict data5, const float* restrict data6, const float* restrict data7, const int* restrict data8, const int* restrict data9, const _Bool* restrict data10) {
  for (int ridx0 = 0; ridx0 < 1024; ridx0++) {
    float val0 = data6[ridx0];
    float val1 = data7[ridx0];
    int val2 = data8[ridx0];
    int val3 = data9[ridx0];
    _Bool val4 = data10[ridx0];
    data0[ridx0] = ((val0<0.0f)?0.0f:val0);
    data1[ridx0] = (val4?val0:val1);
    data2[ridx0] = ((val0<(-1.0f))?(-1.0f):((1.0f<val0)?1.0f:val0));
    _Bool alu0 = (val2<val3);
    data3[ridx0] = alu0;
    data4[ridx0] = ((val2!=val3)&val4);
    data5[ridx0] = (alu0?val3:val2);
  }
}
)";
  k.ir_source = ir_define("E_1024_where", 11) + ir_loop("0", "1024") + ld("%val0", "float", 6) + ld("%val1", "float", 7) +
                ld("%val2", "i32", 8) + ld("%val3", "i32", 9) + ld("%val4", "i1", 10) + R"(  %alu0 = fcmp nsz arcp contract afn ult float %val0, 0.0
  %alu1 = select i1 %alu0, float 0.0, float %val0
  %alu2 = select i1 %val4, float %val0, float %val1
  %alu3 = fcmp nsz arcp contract afn ult float %val0, -1.0
  %alu4 = fcmp nsz arcp contract afn ult float 1.0, %val0
  %alu5 = select i1 %alu4, float 1.0, float %val0
  %alu6 = select i1 %alu3, float -1.0, float %alu5
  %alu7 = icmp slt i32 %val2, %val3
  %alu7_st = zext i1 %alu7 to i8
  %alu8 = icmp ne i32 %val2, %val3
  %alu9 = and i1 %alu8, %val4
  %alu9_st = zext i1 %alu9 to i8
  %alu10 = select i1 %alu7, i32 %val3, i32 %val2
)" + st("%alu1", "float", 0, "0") +
                st("%alu2", "float", 1, "1") + st("%alu6", "float", 2, "2") + st("%alu7_st", "i8", 3, "3") +
                st("%alu9_st", "i8", 4, "4") + st("%alu10", "i32", 5, "5") + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 1024, true},     {Elem::f32, 1024, true},          {Elem::f32, 1024, true},
               {Elem::boolean, 1024, true}, {Elem::boolean, 1024, true},      {Elem::i32, 1024, true},
               {Elem::f32, 1024, false},    {Elem::f32, 1024, false},         {Elem::i32, 1024, false, -3, 3},
               {Elem::i32, 1024, false, -3, 3}, {Elem::boolean, 1024, false, 0, 1}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 1024; ++i) {
      const float a = get<float>(b[6], i), c = get<float>(b[7], i);
      const std::int32_t x = get<std::int32_t>(b[8], i), y = get<std::int32_t>(b[9], i);
      const bool flag = get<std::uint8_t>(b[10], i) != 0;
      put<float>(b[0], i, a > 0 ? a : 0.0f);
      put<float>(b[1], i, flag ? a : c);
      put<float>(b[2], i, std::min(1.0f, std::max(-1.0f, a)));
      put<std::uint8_t>(b[3], i, x < y);
      put<std::uint8_t>(b[4], i, x != y && flag);
      put<std::int32_t>(b[5], i, std::max(x, y));
    }
  };
  return k;
}

Kernel many_ops() {
  Kernel k;
  k.name = "E_2048_many";
  k.what = "a long elementwise chain: mul, add, abs via where, reciprocal, max via where, neg as *-1, square";
  k.c_source = R"(void E_2048_many(float* restrict data0, const float* restrict data1, const float* restrict data2, const float* restrict data3) {
  for (int ridx0 = 0; ridx0 < 2048; ridx0++) {
    float val0 = data1[ridx0];
    float val1 = data2[ridx0];
    float val2 = data3[ridx0];
    float alu0 = ((val0<0.0f)?(val0*(-1.0f)):val0);
    float alu1 = ((val0*val1)+val2);
    float alu2 = (alu1*(1/(alu0+1.0f)));
    float alu3 = ((alu2<val1)?val1:alu2);
    float alu4 = (alu3+(val2*(-0.5f)));
    data0[ridx0] = ((alu4*alu4)+(val0*(-1.0f)));
  }
}
)";
  k.ir_source = ir_define("E_2048_many", 4) + ir_loop("0", "2048") + ld("%val0", "float", 1) + ld("%val1", "float", 2) +
                ld("%val2", "float", 3) + R"(  %alu0_c = fcmp nsz arcp contract afn ult float %val0, 0.0
  %alu0_n = fmul nsz arcp contract afn float %val0, -1.0
  %alu0 = select i1 %alu0_c, float %alu0_n, float %val0
  %alu1_m = fmul nsz arcp contract afn float %val0, %val1
  %alu1 = fadd nsz arcp contract afn float %alu1_m, %val2
  %alu2_a = fadd nsz arcp contract afn float %alu0, 1.0
  %alu2_r = fdiv nsz arcp contract afn float 1.0, %alu2_a
  %alu2 = fmul nsz arcp contract afn float %alu1, %alu2_r
  %alu3_c = fcmp nsz arcp contract afn ult float %alu2, %val1
  %alu3 = select i1 %alu3_c, float %val1, float %alu2
  %alu4_m = fmul nsz arcp contract afn float %val2, -0.5
  %alu4 = fadd nsz arcp contract afn float %alu3, %alu4_m
  %alu5 = fmul nsz arcp contract afn float %alu4, %alu4
  %alu6 = fmul nsz arcp contract afn float %val0, -1.0
  %alu7 = fadd nsz arcp contract afn float %alu5, %alu6
)" + st("%alu7", "float", 0, "0") + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 2048, true}, {Elem::f32, 2048, false}, {Elem::f32, 2048, false}, {Elem::f32, 2048, false}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 2048; ++i) {
      const double a = get<float>(b[1], i), c = get<float>(b[2], i), d = get<float>(b[3], i);
      const double t = std::max((a * c + d) / (std::fabs(a) + 1.0), c) - 0.5 * d;
      put<float>(b[0], i, static_cast<float>(t * t - a));
    }
  };
  k.tolerance = 1e-5;  // float kernel against a double reference
  return k;
}

Kernel unary() {
  Kernel k;
  k.name = "E_1024_unary";
  k.what = "unary math: __builtin_sqrtf/exp2f/log2f/sinf in C, llvm.sqrt/exp2/log2/sin.f32 in IR";
  k.c_source = R"(void E_1024_unary(float* restrict data0, float* restrict data1, float* restrict data2, float* restrict data3, const float* restrict data4) {
  for (int ridx0 = 0; ridx0 < 1024; ridx0++) {
    float val0 = data4[ridx0];
    data0[ridx0] = __builtin_sqrtf(val0);
    data1[ridx0] = __builtin_exp2f(val0);
    data2[ridx0] = __builtin_log2f(val0);
    data3[ridx0] = __builtin_sinf((val0*1.5f));
  }
}
)";
  k.ir_source = ir_define("E_1024_unary", 5) + ir_loop("0", "1024") + ld("%val0", "float", 4) + R"(  %alu0 = call nsz arcp contract afn float @llvm.sqrt.f32(float %val0)
  %alu1 = call nsz arcp contract afn float @llvm.exp2.f32(float %val0)
  %alu2 = call nsz arcp contract afn float @llvm.log2.f32(float %val0)
  %alu3 = fmul nsz arcp contract afn float %val0, 1.5
  %alu4 = call nsz arcp contract afn float @llvm.sin.f32(float %alu3)
)" + st("%alu0", "float", 0, "0") +
                st("%alu1", "float", 1, "1") + st("%alu2", "float", 2, "2") + st("%alu4", "float", 3, "3") +
                ir_endloop("0") +
                ir_end("declare float @llvm.sqrt.f32(float)\ndeclare float @llvm.exp2.f32(float)\n"
                       "declare float @llvm.log2.f32(float)\ndeclare float @llvm.sin.f32(float)\n");
  k.buffers = {{Elem::f32, 1024, true}, {Elem::f32, 1024, true}, {Elem::f32, 1024, true}, {Elem::f32, 1024, true},
               {Elem::f32, 1024, false, 0.125, 8}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 1024; ++i) {
      const float x = get<float>(b[4], i);
      put<float>(b[0], i, static_cast<float>(std::sqrt(static_cast<double>(x))));
      put<float>(b[1], i, static_cast<float>(std::exp2(static_cast<double>(x))));
      put<float>(b[2], i, static_cast<float>(std::log2(static_cast<double>(x))));
      put<float>(b[3], i, static_cast<float>(std::sin(static_cast<double>(x * 1.5f))));
    }
  };
  k.tolerance = 1e-6;  // libm float functions against double ones (an ulp or so)
  return k;
}

Kernel idiv() {
  Kernel k;
  k.name = "E_1024_idiv";
  k.what = "integer division and modulo: signed / and % (sdiv/srem), unsigned (udiv/urem), arithmetic shift right";
  k.c_source = R"(void E_1024_idiv(int* restrict data0, int* restrict data1, unsigned int* restrict data2, unsigned int* restrict data3, int* restrict data4, const int* restrict data5, const int* restrict data6, const unsigned int* restrict data7) {
  for (int ridx0 = 0; ridx0 < 1024; ridx0++) {
    int val0 = data5[ridx0];
    int val1 = data6[ridx0];
    unsigned int val2 = data7[ridx0];
    data0[ridx0] = (val0/val1);
    data1[ridx0] = (val0%val1);
    data2[ridx0] = (val2/((unsigned int)(val1)));
    data3[ridx0] = (val2%13u);
    data4[ridx0] = (val0>>2);
  }
}
)";
  k.ir_source = ir_define("E_1024_idiv", 8) + ir_loop("0", "1024") + ld("%val0", "i32", 5) + ld("%val1", "i32", 6) +
                ld("%val2", "i32", 7) + R"(  %alu0 = sdiv i32 %val0, %val1
  %alu1 = srem i32 %val0, %val1
  %alu2 = udiv i32 %val2, %val1
  %alu3 = urem i32 %val2, 13
  %alu4 = ashr i32 %val0, 2
)" + st("%alu0", "i32", 0, "0") + st("%alu1", "i32", 1, "1") +
                st("%alu2", "i32", 2, "2") + st("%alu3", "i32", 3, "3") + st("%alu4", "i32", 4, "4") +
                ir_endloop("0") + ir_end();
  k.buffers = {{Elem::i32, 1024, true},  {Elem::i32, 1024, true},          {Elem::u32, 1024, true},
               {Elem::u32, 1024, true},  {Elem::i32, 1024, true},          {Elem::i32, 1024, false, -100000, 100000},
               {Elem::i32, 1024, false, 1, 37}, {Elem::u32, 1024, false, 0, 4294967295.0}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 1024; ++i) {
      const std::int32_t a = get<std::int32_t>(b[5], i), d = get<std::int32_t>(b[6], i);
      const std::uint32_t u = get<std::uint32_t>(b[7], i);
      put<std::int32_t>(b[0], i, a / d);  // C++ truncates toward zero, as C does
      put<std::int32_t>(b[1], i, a % d);
      put<std::uint32_t>(b[2], i, u / static_cast<std::uint32_t>(d));
      put<std::uint32_t>(b[3], i, u % 13u);
      put<std::int32_t>(b[4], i, static_cast<std::int32_t>(std::floor(a / 4.0)));  // arithmetic shift = floor division
    }
  };
  return k;
}

Kernel bitops() {
  Kernel k;
  k.name = "E_1024_bits";
  k.what = "bit ops on uint/int: and, or, xor, variable rotate (shl/lshr by y&31), ashr, not (xor -1), wrapping mul";
  k.c_source = R"(void E_1024_bits(unsigned int* restrict data0, unsigned int* restrict data1, int* restrict data2, unsigned int* restrict data3, unsigned int* restrict data4, const unsigned int* restrict data5, const unsigned int* restrict data6) {
  for (int ridx0 = 0; ridx0 < 1024; ridx0++) {
    unsigned int val0 = data5[ridx0];
    unsigned int val1 = data6[ridx0];
    unsigned int alu0 = (val1&31u);
    data0[ridx0] = ((val0&val1)^(val0|252645135u));
    data1[ridx0] = ((val0<<alu0)|(val0>>((32u-alu0)&31u)));
    data2[ridx0] = (((int)(val0))>>7);
    data3[ridx0] = (val0^4294967295u);
    data4[ridx0] = (val0*2654435761u);
  }
}
)";
  k.ir_source = ir_define("E_1024_bits", 7) + ir_loop("0", "1024") + ld("%val0", "i32", 5) + ld("%val1", "i32", 6) +
                R"(  %alu0 = and i32 %val1, 31
  %alu1 = and i32 %val0, %val1
  %alu2 = or i32 %val0, 252645135
  %alu3 = xor i32 %alu1, %alu2
  %alu4 = shl i32 %val0, %alu0
  %alu5 = sub i32 32, %alu0
  %alu6 = and i32 %alu5, 31
  %alu7 = lshr i32 %val0, %alu6
  %alu8 = or i32 %alu4, %alu7
  %alu9 = ashr i32 %val0, 7
  %alu10 = xor i32 %val0, -1
  %alu11 = mul i32 %val0, -1640531535
)" + st("%alu3", "i32", 0, "0") + st("%alu8", "i32", 1, "1") +
                st("%alu9", "i32", 2, "2") + st("%alu10", "i32", 3, "3") + st("%alu11", "i32", 4, "4") +
                ir_endloop("0") + ir_end();
  k.buffers = {{Elem::u32, 1024, true}, {Elem::u32, 1024, true}, {Elem::i32, 1024, true}, {Elem::u32, 1024, true},
               {Elem::u32, 1024, true}, {Elem::u32, 1024, false, 0, 4294967295.0}, {Elem::u32, 1024, false, 0, 4294967295.0}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 1024; ++i) {
      const std::uint32_t x = get<std::uint32_t>(b[5], i), y = get<std::uint32_t>(b[6], i);
      const unsigned r = y % 32;
      put<std::uint32_t>(b[0], i, (x & y) ^ (x | 0x0f0f0f0fu));
      put<std::uint32_t>(b[1], i, r == 0 ? x : (x << r) | (x >> (32 - r)));
      put<std::int32_t>(b[2], i, static_cast<std::int32_t>(std::floor(static_cast<std::int32_t>(x) / 128.0)));
      put<std::uint32_t>(b[3], i, ~x);
      put<std::uint32_t>(b[4], i, static_cast<std::uint32_t>(static_cast<std::uint64_t>(x) * 2654435761u));
    }
  };
  return k;
}

Kernel f64() {
  Kernel k;
  k.name = "E_512_f64";
  k.what = "double math: sqrt(a*a+b*b) + a/b with __builtin_sqrt / llvm.sqrt.f64 and fdiv double";
  k.c_source = R"(void E_512_f64(double* restrict data0, const double* restrict data1, const double* restrict data2) {
  for (int ridx0 = 0; ridx0 < 512; ridx0++) {
    double val0 = data1[ridx0];
    double val1 = data2[ridx0];
    data0[ridx0] = (__builtin_sqrt(((val0*val0)+(val1*val1)))+(val0/val1));
  }
}
)";
  k.ir_source = ir_define("E_512_f64", 3) + ir_loop("0", "512") + ld("%val0", "double", 1) + ld("%val1", "double", 2) +
                R"(  %alu0 = fmul nsz arcp contract afn double %val0, %val0
  %alu1 = fmul nsz arcp contract afn double %val1, %val1
  %alu2 = fadd nsz arcp contract afn double %alu0, %alu1
  %alu3 = call nsz arcp contract afn double @llvm.sqrt.f64(double %alu2)
  %alu4 = fdiv nsz arcp contract afn double %val0, %val1
  %alu5 = fadd nsz arcp contract afn double %alu3, %alu4
)" + st("%alu5", "double", 0, "0") + ir_endloop("0") +
                ir_end("declare double @llvm.sqrt.f64(double)\n");
  k.buffers = {{Elem::f64, 512, true}, {Elem::f64, 512, false, -2, 2}, {Elem::f64, 512, false, 1, 3}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 512; ++i) {
      const double x = get<double>(b[1], i), y = get<double>(b[2], i);
      put<double>(b[0], i, std::hypot(x, y) + x / y);
    }
  };
  k.tolerance = 1e-14;  // FMA contraction / reciprocal (arcp) differences in double
  return k;
}

Kernel int64_u8() {
  Kernel k;
  k.name = "E_512_long_uchar";
  k.what = "int64 mul/add/ashr and wrapping uint8 add/mul and int8 sub (i8 arithmetic in IR, int promotion in C)";
  k.c_source = R"(void E_512_long_uchar(long* restrict data0, unsigned char* restrict data1, signed char* restrict data2, const long* restrict data3, const long* restrict data4, const unsigned char* restrict data5, const unsigned char* restrict data6) {
  for (int ridx0 = 0; ridx0 < 512; ridx0++) {
    long val0 = data3[ridx0];
    long val1 = data4[ridx0];
    unsigned char val2 = data5[ridx0];
    unsigned char val3 = data6[ridx0];
    data0[ridx0] = ((val0*3l)+(val1*val1)+((val0>>4l)*(-1l)));
    unsigned char alu0 = ((unsigned char)(val2+val3));
    data1[ridx0] = ((unsigned char)(alu0*3));
    data2[ridx0] = ((signed char)(val2-val3));
  }
}
)";
  k.ir_source = ir_define("E_512_long_uchar", 7) + ir_loop("0", "512") + ld("%val0", "i64", 3) + ld("%val1", "i64", 4) +
                ld("%val2", "i8", 5) + ld("%val3", "i8", 6) + R"(  %alu0 = mul nsw i64 %val0, 3
  %alu1 = mul nsw i64 %val1, %val1
  %alu2 = add nsw i64 %alu0, %alu1
  %alu3 = ashr i64 %val0, 4
  %alu4 = mul nsw i64 %alu3, -1
  %alu5 = add nsw i64 %alu2, %alu4
  %alu6 = add i8 %val2, %val3
  %alu7 = mul i8 %alu6, 3
  %alu8 = sub i8 %val2, %val3
)" + st("%alu5", "i64", 0, "0") + st("%alu7", "i8", 1, "1") +
                st("%alu8", "i8", 2, "2") + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::i64, 512, true}, {Elem::u8, 512, true}, {Elem::i8, 512, true},
               {Elem::i64, 512, false, -1e12, 1e12}, {Elem::i64, 512, false, -1e6, 1e6},
               {Elem::u8, 512, false, 0, 255}, {Elem::u8, 512, false, 0, 255}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 512; ++i) {
      const std::int64_t a = get<std::int64_t>(b[3], i), c = get<std::int64_t>(b[4], i);
      const unsigned x = get<std::uint8_t>(b[5], i), y = get<std::uint8_t>(b[6], i);
      const std::int64_t floor16 = a >= 0 ? a / 16 : -((-a + 15) / 16);  // a >> 4
      put<std::int64_t>(b[0], i, a * 3 + c * c - floor16);
      put<std::uint8_t>(b[1], i, static_cast<std::uint8_t>(((x + y) % 256) * 3 % 256));
      put<std::int8_t>(b[2], i, static_cast<std::int8_t>(static_cast<int>(x) - static_cast<int>(y)));  // modular (C++20)
    }
  };
  return k;
}

Kernel half_relu() {
  Kernel k;
  k.name = "E_1024_half";
  k.what = "half in, half out, math in float: (half)max((float)h*1.5+0.25, 0) (fpext/fptrunc half in IR)";
  k.c_source = R"(typedef _Float16 half;
void E_1024_half(half* restrict data0, const half* restrict data1) {
  for (int ridx0 = 0; ridx0 < 1024; ridx0++) {
    half val0 = data1[ridx0];
    float alu0 = ((((float)(val0))*1.5f)+0.25f);
    data0[ridx0] = ((half)(((alu0<0.0f)?0.0f:alu0)));
  }
}
)";
  k.ir_source = ir_define("E_1024_half", 2) + ir_loop("0", "1024") + ld("%val0", "half", 1) + R"(  %cast0 = fpext half %val0 to float
  %alu0 = fmul nsz arcp contract afn float %cast0, 1.5
  %alu1 = fadd nsz arcp contract afn float %alu0, 0.25
  %alu2 = fcmp nsz arcp contract afn ult float %alu1, 0.0
  %alu3 = select i1 %alu2, float 0.0, float %alu1
  %cast1 = fptrunc float %alu3 to half
)" + st("%cast1", "half", 0, "0") + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f16, 1024, true}, {Elem::f16, 1024, false, -4, 4}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 1024; ++i) {
      const float y = f16_to_f32(get<std::uint16_t>(b[1], i)) * 1.5f + 0.25f;  // exact in float for half inputs
      put<std::uint16_t>(b[0], i, f32_to_f16(y > 0 ? y : 0.0f));
    }
  };
  return k;
}

Kernel gelu() {
  Kernel k;
  k.name = "E_2048_gelu";
  k.what = "quick gelu x*sigmoid(1.702x) with sigmoid as 1/(1+exp2(x*-1.702*log2e)), exp2 intrinsic";
  k.c_source = R"(void E_2048_gelu(float* restrict data0, const float* restrict data1) {
  for (int ridx0 = 0; ridx0 < 2048; ridx0++) {
    float val0 = data1[ridx0];
    data0[ridx0] = (val0*(1/(1.0f+__builtin_exp2f(((val0*(-1.702f))*1.4426950408889634f)))));
  }
}
)";
  k.ir_source = ir_define("E_2048_gelu", 2) + ir_loop("0", "2048") + ld("%val0", "float", 1) +
                "  %alu0 = fmul " + FM + " float %val0, " + ir_float(-1.702f) + "\n  %alu1 = fmul " + FM + " float %alu0, " +
                ir_float(1.4426950408889634f) + "\n" + R"(  %alu2 = call nsz arcp contract afn float @llvm.exp2.f32(float %alu1)
  %alu3 = fadd nsz arcp contract afn float %alu2, 1.0
  %alu4 = fdiv nsz arcp contract afn float 1.0, %alu3
  %alu5 = fmul nsz arcp contract afn float %val0, %alu4
)" + st("%alu5", "float", 0, "0") + ir_endloop("0") +
                ir_end("declare float @llvm.exp2.f32(float)\n");
  k.buffers = {{Elem::f32, 2048, true}, {Elem::f32, 2048, false, -6, 6}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 2048; ++i) {
      const double x = get<float>(b[1], i);
      put<float>(b[0], i, static_cast<float>(x / (1.0 + std::exp(-1.702 * x))));
    }
  };
  k.tolerance = 2e-6;  // float kernel against a double reference
  return k;
}

Kernel maxpool() {
  Kernel k;
  k.name = "r_4_8_8_2_2";
  k.what = "2x2 max pool of 4x16x16 -> 4x8x8, the 2x2 window unrolled into a chain of cmplt+where";
  k.c_source = R"(void r_4_8_8_2_2(float* restrict data0, const float* restrict data1) {
  for (int ridx0 = 0; ridx0 < 4; ridx0++) {
    for (int ridx1 = 0; ridx1 < 8; ridx1++) {
      for (int ridx2 = 0; ridx2 < 8; ridx2++) {
        int alu0 = ((ridx0<<8)+(ridx1<<5)+(ridx2<<1));
        float val0 = data1[alu0];
        float val1 = data1[(alu0+1)];
        float val2 = data1[(alu0+16)];
        float val3 = data1[(alu0+17)];
        float alu1 = ((val0<val1)?val1:val0);
        float alu2 = ((alu1<val2)?val2:alu1);
        data0[((ridx0<<6)+(ridx1<<3)+ridx2)] = ((alu2<val3)?val3:alu2);
      }
    }
  }
}
)";
  k.ir_source = ir_define("r_4_8_8_2_2", 2) + ir_loop("0", "4") + ir_loop("1", "8") + ir_loop("2", "8") + R"(  %alu0_a = shl i32 %ridx0, 8
  %alu0_b = shl i32 %ridx1, 5
  %alu0_c = shl i32 %ridx2, 1
  %alu0_d = add nsw i32 %alu0_a, %alu0_b
  %alu0 = add nsw i32 %alu0_d, %alu0_c
  %off1 = add nsw i32 %alu0, 1
  %off2 = add nsw i32 %alu0, 16
  %off3 = add nsw i32 %alu0, 17
)" + ld("%val0", "float", 1, "%alu0") +
                ld("%val1", "float", 1, "%off1") + ld("%val2", "float", 1, "%off2") + ld("%val3", "float", 1, "%off3") +
                R"(  %alu1_c = fcmp nsz arcp contract afn ult float %val0, %val1
  %alu1 = select i1 %alu1_c, float %val1, float %val0
  %alu2_c = fcmp nsz arcp contract afn ult float %alu1, %val2
  %alu2 = select i1 %alu2_c, float %val2, float %alu1
  %alu3_c = fcmp nsz arcp contract afn ult float %alu2, %val3
  %alu3 = select i1 %alu3_c, float %val3, float %alu2
  %o_a = shl i32 %ridx0, 6
  %o_b = shl i32 %ridx1, 3
  %o_c = add nsw i32 %o_a, %o_b
  %o = add nsw i32 %o_c, %ridx2
)" + st("%alu3", "float", 0, "0", "%o") +
                ir_endloop("2") + ir_endloop("1") + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 256, true}, {Elem::f32, 1024, false}};
  k.reference = [](Bufs& b, const Values&) {
    for (int c = 0; c < 4; ++c)
      for (int y = 0; y < 8; ++y)
        for (int x = 0; x < 8; ++x) {
          float m = get<float>(b[1], c * 256 + 2 * y * 16 + 2 * x);
          for (int dy = 0; dy < 2; ++dy)
            for (int dx = 0; dx < 2; ++dx) m = std::max(m, get<float>(b[1], c * 256 + (2 * y + dy) * 16 + 2 * x + dx));
          put<float>(b[0], c * 64 + y * 8 + x, m);
        }
  };
  return k;
}

// tinygrad's threefry2x32: x (uint64) split in halves x0 (low) x1 (high), key likewise into k0, k1;
// ks = {k1, k0^k1^0x1BD11BDA, k0}; start from (x0+ks[2], x1+ks[0]); 5 groups of 4 rounds
// (a += b; b = rotl(b, r) ^ a) with rotations {13,15,26,6} / {17,29,16,24} alternating, after group i:
// a += ks[i%3], b += ks[(i+1)%3] + i+1. Result: (uint64)b << 32 | a.
std::uint64_t threefry_ref(std::uint64_t x, std::uint64_t key) {
  const std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
  const std::uint32_t ks[3] = {k1, k0 ^ k1 ^ 0x1BD11BDAu, k0};
  std::uint32_t a = static_cast<std::uint32_t>(x) + ks[2], b = static_cast<std::uint32_t>(x >> 32) + ks[0];
  const int rot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  for (int i = 0; i < 5; ++i) {
    for (int r : rot[i % 2]) {
      a += b;
      b = ((b << r) | (b >> (32 - r))) ^ a;
    }
    a += ks[i % 3];
    b += ks[(i + 1) % 3] + static_cast<std::uint32_t>(i + 1);
  }
  return (static_cast<std::uint64_t>(b) << 32) | a;
}

Kernel threefry() {
  Kernel k;
  k.name = "E_1024_threefry";
  k.what = "threefry2x32 (tinygrad's random): uint64 split into uint32 halves, 20 rounds of add/rotate/xor with 5 "
           "key injections, fully unrolled";
  const int rot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  // C: ks names alu1 (k1), alu2 (k0^k1^C), alu0 (k0)
  const std::string ks_c[3] = {"alu1", "alu2", "alu0"}, ks_ir[3] = {"%alu1", "%alu2", "%alu0"};
  std::string c = R"(void E_1024_threefry(unsigned long* restrict data0, const unsigned long* restrict data1, const unsigned long* restrict data2) {
  unsigned long val0 = data2[0];
  unsigned int alu0 = ((unsigned int)((val0&4294967295ul)));
  unsigned int alu1 = ((unsigned int)(((val0>>32ul)&4294967295ul)));
  unsigned int alu2 = ((alu0^alu1)^466688986u);
  for (int ridx0 = 0; ridx0 < 1024; ridx0++) {
    unsigned long val1 = data1[ridx0];
    unsigned int alu3 = (((unsigned int)((val1&4294967295ul)))+alu0);
    unsigned int alu4 = (((unsigned int)(((val1>>32ul)&4294967295ul)))+alu1);
)";
  std::string ir = ir_define("E_1024_threefry", 3) + R"(  %val0 = load i64, ptr %data2
  %alu0 = trunc i64 %val0 to i32
  %alu1_s = lshr i64 %val0, 32
  %alu1 = trunc i64 %alu1_s to i32
  %alu2_x = xor i32 %alu0, %alu1
  %alu2 = xor i32 %alu2_x, 466688986
)" + ir_loop("0", "1024") + R"(  %val1_p = getelementptr inbounds i64, ptr %data1, i32 %ridx0
  %val1 = load i64, ptr %val1_p
  %alu3_t = trunc i64 %val1 to i32
  %alu3 = add i32 %alu3_t, %alu0
  %alu4_s = lshr i64 %val1, 32
  %alu4_t = trunc i64 %alu4_s to i32
  %alu4 = add i32 %alu4_t, %alu1
)";
  int n = 5;
  std::string xa = "alu3", xb = "alu4";
  auto fresh = [&] { return "alu" + std::to_string(n++); };
  for (int i = 0; i < 5; ++i) {
    for (int r : rot[i % 2]) {
      const std::string na = fresh(), nb = fresh(), rs = std::to_string(r), ls = std::to_string(32 - r);
      c += "    unsigned int " + na + " = (" + xa + "+" + xb + ");\n";
      c += "    unsigned int " + nb + " = (((" + xb + "<<" + rs + "u)+(" + xb + ">>" + ls + "u))^" + na + ");\n";
      ir += "  %" + na + " = add i32 %" + xa + ", %" + xb + "\n";
      ir += "  %" + nb + "_l = shl i32 %" + xb + ", " + rs + "\n  %" + nb + "_r = lshr i32 %" + xb + ", " + ls + "\n";
      ir += "  %" + nb + "_o = add i32 %" + nb + "_l, %" + nb + "_r\n  %" + nb + " = xor i32 %" + nb + "_o, %" + na + "\n";
      xa = na, xb = nb;
    }
    const std::string na = fresh(), nb = fresh(), inc = std::to_string(i + 1);
    c += "    unsigned int " + na + " = (" + xa + "+" + ks_c[i % 3] + ");\n";
    c += "    unsigned int " + nb + " = (" + xb + "+" + ks_c[(i + 1) % 3] + "+" + inc + "u);\n";
    ir += "  %" + na + " = add i32 %" + xa + ", " + ks_ir[i % 3] + "\n";
    ir += "  %" + nb + "_k = add i32 %" + xb + ", " + ks_ir[(i + 1) % 3] + "\n  %" + nb + " = add i32 %" + nb + "_k, " + inc + "\n";
    xa = na, xb = nb;
  }
  c += "    data0[ridx0] = ((((unsigned long)(" + xb + "))<<32ul)|((unsigned long)(" + xa + ")));\n  }\n}\n";
  ir += "  %hi = zext i32 %" + xb + " to i64\n  %hi_s = shl i64 %hi, 32\n  %lo = zext i32 %" + xa +
        " to i64\n  %res = or i64 %hi_s, %lo\n" + st("%res", "i64", 0, "0") + ir_endloop("0") + ir_end();
  k.c_source = c;
  k.ir_source = ir;
  k.buffers = {{Elem::u64, 1024, true}, {Elem::u64, 1024, false, 0, 1.8446744073709552e19},
               {Elem::u64, 1, false, 0, 1.8446744073709552e19}};
  k.reference = [](Bufs& b, const Values&) {
    const std::uint64_t key = get<std::uint64_t>(b[2], 0);
    for (int i = 0; i < 1024; ++i) put<std::uint64_t>(b[0], i, threefry_ref(get<std::uint64_t>(b[1], i), key));
  };
  return k;
}

}  // namespace

void add_elementwise(std::vector<Kernel>& out) {
  out.push_back(half_casts());
  out.push_back(bf16_casts());
  out.push_back(int_casts());
  out.push_back(where_cmp());
  out.push_back(many_ops());
  out.push_back(unary());
  out.push_back(idiv());
  out.push_back(bitops());
  out.push_back(f64());
  out.push_back(int64_u8());
  out.push_back(half_relu());
  out.push_back(gelu());
  out.push_back(maxpool());
  out.push_back(threefry());
}

}  // namespace corpus::detail
