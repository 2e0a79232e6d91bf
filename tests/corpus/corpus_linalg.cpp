// tests/corpus/corpus_linalg.cpp: matmul (4x4 upcast accumulators, float4 loads), conv2d (masked
// padding loads), an unrolled 3x3 conv, a float4 gemv and a transpose.
#include <string>

#include "corpus_util.hpp"

namespace corpus::detail {
namespace {

const std::string FM = "nsz arcp contract afn";  // LLVMRenderer's float flags

int log2i(int n) {
  int l = 0;
  while ((1 << l) < n) ++l;
  return l;
}

// C = A @ B for N x N row-major float matrices. Each (ridx0, ridx1) owns a 4x4 output tile:
// rows 4*ridx0..+3 (upcast of A's rows), columns 4*ridx1..+3 (float4 of B's row), 16 accumulators.
Kernel matmul(int N) {
  const int lg = log2i(N), Q = N / 4;
  const std::string n = std::to_string(N), name = "matmul_" + n;
  std::string c = c_float4;
  c += "void " + name + "(float* restrict data0, const float* restrict data1, const float* restrict data2) {\n";
  c += "  for (int ridx0 = 0; ridx0 < " + std::to_string(Q) + "; ridx0++) {\n";
  c += "    int alu0 = (ridx0<<" + std::to_string(lg + 2) + ");\n";
  c += "    for (int ridx1 = 0; ridx1 < " + std::to_string(Q) + "; ridx1++) {\n";
  c += "      int alu1 = (ridx1<<2);\n";
  for (int k = 0; k < 16; ++k) c += "      float acc" + std::to_string(k) + " = 0.0f;\n";
  c += "      for (int ridx2 = 0; ridx2 < " + n + "; ridx2++) {\n";
  c += "        int alu2 = (alu0+ridx2);\n";
  c += "        float val0 = data1[alu2];\n";
  for (int i = 1; i < 4; ++i)
    c += "        float val" + std::to_string(i) + " = data1[(alu2+" + std::to_string(i * N) + ")];\n";
  c += "        float4 val4 = *((float4*)((data2+((ridx2<<" + std::to_string(lg) + ")+alu1))));\n";
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const std::string a = "acc" + std::to_string(i * 4 + j);
      c += "        " + a + " = (" + a + "+(val" + std::to_string(i) + "*val4[" + std::to_string(j) + "]));\n";
    }
  c += "      }\n      int alu3 = (alu0+alu1);\n";
  for (int i = 0; i < 4; ++i) {
    const std::string at = i ? "(alu3+" + std::to_string(i * N) + ")" : "alu3";
    c += "      *((float4*)((data0+" + at + "))) = (float4){acc" + std::to_string(4 * i) + ",acc" +
         std::to_string(4 * i + 1) + ",acc" + std::to_string(4 * i + 2) + ",acc" + std::to_string(4 * i + 3) + "};\n";
  }
  c += "    }\n  }\n}\n";

  std::string ir = ir_define(name, 3);
  ir += ir_loop("0", std::to_string(Q));
  ir += "  %alu0 = shl i32 %ridx0, " + std::to_string(lg + 2) + "\n";
  ir += ir_loop("1", std::to_string(Q));
  ir += "  %alu1 = shl i32 %ridx1, 2\n";
  std::vector<IrPhi> accs;
  for (int k = 0; k < 16; ++k) {
    const std::string a = "%acc" + std::to_string(k);
    accs.push_back({a, "float", "0.0", a + "_next"});
  }
  ir += ir_loop("2", n, accs);
  ir += "  %alu2 = add nsw i32 %alu0, %ridx2\n";
  for (int i = 0; i < 4; ++i) {
    const std::string s = std::to_string(i);
    if (i) ir += "  %alu2_" + s + " = add nsw i32 %alu2, " + std::to_string(i * N) + "\n";
    ir += "  %idx" + s + " = getelementptr inbounds float, ptr %data1, i32 " + (i ? "%alu2_" + s : "%alu2") + "\n";
    ir += "  %val" + s + " = load float, ptr %idx" + s + "\n";
  }
  ir += "  %alu4 = shl i32 %ridx2, " + std::to_string(lg) + "\n  %alu5 = add nsw i32 %alu4, %alu1\n";
  ir += "  %idx4 = getelementptr inbounds float, ptr %data2, i32 %alu5\n  %val4 = load <4 x float>, ptr %idx4\n";
  for (int j = 0; j < 4; ++j)
    ir += "  %gep" + std::to_string(j) + " = extractelement <4 x float> %val4, i32 " + std::to_string(j) + "\n";
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const std::string k = std::to_string(i * 4 + j);
      ir += "  %mul" + k + " = fmul " + FM + " float %val" + std::to_string(i) + ", %gep" + std::to_string(j) + "\n";
      ir += "  %acc" + k + "_next = fadd " + FM + " float %acc" + k + ", %mul" + k + "\n";
    }
  ir += ir_endloop("2");
  ir += "  %alu6 = add nsw i32 %alu0, %alu1\n";
  for (int i = 0; i < 4; ++i) {
    const std::string s = std::to_string(i);
    std::string at = "%alu6";
    if (i) {
      ir += "  %alu6_" + s + " = add nsw i32 %alu6, " + std::to_string(i * N) + "\n";
      at = "%alu6_" + s;
    }
    ir += "  %out" + s + " = getelementptr inbounds float, ptr %data0, i32 " + at + "\n";
    std::string prev = "poison";
    for (int j = 0; j < 4; ++j) {
      const std::string v = "%vec" + s + "_" + std::to_string(j);
      ir += "  " + v + " = insertelement <4 x float> " + prev + ", float %acc" + std::to_string(i * 4 + j) + ", i32 " +
            std::to_string(j) + "\n";
      prev = v;
    }
    ir += "  store <4 x float> " + prev + ", ptr %out" + s + "\n";
  }
  ir += ir_endloop("1");
  ir += ir_endloop("0");
  ir += ir_end();

  Kernel k;
  k.name = name;
  k.what = n + "x" + n + " float matmul, 4x4 upcast: 16 scalar accumulators, float4 loads of B, float4 stores";
  k.c_source = c;
  k.ir_source = ir;
  const std::size_t NN = static_cast<std::size_t>(N) * N;
  k.buffers = {{Elem::f32, NN, true}, {Elem::f32, NN, false, -1, 1}, {Elem::f32, NN, false, -1, 1}};
  k.reference = [N](Bufs& b, const Values&) {
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < N; ++j) {
        float acc = 0.0f;
        for (int kk = 0; kk < N; ++kk) acc += get<float>(b[1], i * N + kk) * get<float>(b[2], kk * N + j);
        put<float>(b[0], i * N + j, acc);
      }
  };
  // same summation order as the kernel; the kernel may fuse multiply-adds (FMA), the reference may not
  k.tolerance = N >= 256 ? 1e-4 : 2e-5;
  return k;
}

// out[oc][y][x] = bias[oc] + sum_{ci,ky,kx} in[ci][y+ky-1][x+kx-1] * w[oc][ci][ky][kx], zero padding 1
void conv_ref(Bufs& b, int C, int O, int H, int W, int K, int pad) {
  const int OH = H + 2 * pad - K + 1, OW = W + 2 * pad - K + 1;
  for (int o = 0; o < O; ++o)
    for (int y = 0; y < OH; ++y)
      for (int x = 0; x < OW; ++x) {
        float acc = 0.0f;
        for (int ci = 0; ci < C; ++ci)
          for (int ky = 0; ky < K; ++ky)
            for (int kx = 0; kx < K; ++kx) {
              const int iy = y + ky - pad, ix = x + kx - pad;
              if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
              acc += get<float>(b[1], (ci * H + iy) * W + ix) * get<float>(b[2], ((o * C + ci) * K + ky) * K + kx);
            }
        if (b.size() > 3) acc += get<float>(b[3], o);
        put<float>(b[0], (o * OH + y) * OW + x, acc);
      }
}

Kernel conv2d() {
  Kernel k;
  k.name = "conv2d";
  k.what = "conv2d 1x4x16x16 * 8x4x3x3 + bias, padding 1 as masked loads (where in C, branch+phi in IR), 4 upcast "
           "output channels, alloca accumulators in IR";
  k.c_source = std::string(c_float4) + R"(void conv2d(float* restrict data0, const float* restrict data1, const float* restrict data2, const float* restrict data3) {
  for (int ridx0 = 0; ridx0 < 2; ridx0++) {
    for (int ridx1 = 0; ridx1 < 16; ridx1++) {
      for (int ridx2 = 0; ridx2 < 16; ridx2++) {
        float acc0 = 0.0f;
        float acc1 = 0.0f;
        float acc2 = 0.0f;
        float acc3 = 0.0f;
        for (int ridx3 = 0; ridx3 < 4; ridx3++) {
          for (int ridx4 = 0; ridx4 < 3; ridx4++) {
            int alu0 = (ridx1+ridx4+(-1));
            _Bool alu1 = ((-1<alu0)&(alu0<16));
            for (int ridx5 = 0; ridx5 < 3; ridx5++) {
              int alu2 = (ridx2+ridx5+(-1));
              _Bool alu3 = (alu1&((-1<alu2)&(alu2<16)));
              float val0 = (alu3?data1[((ridx3*256)+(alu0*16)+alu2)]:0.0f);
              int alu4 = ((ridx0*144)+(ridx3*9)+(ridx4*3)+ridx5);
              float val1 = data2[alu4];
              float val2 = data2[(alu4+36)];
              float val3 = data2[(alu4+72)];
              float val4 = data2[(alu4+108)];
              acc0 = (acc0+(val0*val1));
              acc1 = (acc1+(val0*val2));
              acc2 = (acc2+(val0*val3));
              acc3 = (acc3+(val0*val4));
            }
          }
        }
        float4 val5 = *((float4*)((data3+(ridx0<<2))));
        int alu5 = ((ridx0<<10)+(ridx1<<4)+ridx2);
        data0[alu5] = (acc0+val5[0]);
        data0[(alu5+256)] = (acc1+val5[1]);
        data0[(alu5+512)] = (acc2+val5[2]);
        data0[(alu5+768)] = (acc3+val5[3]);
      }
    }
  }
}
)";
  std::string ir = ir_define("conv2d", 4);
  ir += "  %reg_0 = alloca [4 x float]\n";
  ir += ir_loop("0", "2") + ir_loop("1", "16") + ir_loop("2", "16");
  for (int j = 0; j < 4; ++j) {
    const std::string s = std::to_string(j);
    ir += "  %acc" + s + " = getelementptr inbounds float, ptr %reg_0, i32 " + s + "\n  store float 0.0, ptr %acc" + s + "\n";
  }
  ir += ir_loop("3", "4") + ir_loop("4", "3");
  ir += R"(  %alu0_a = add nsw i32 %ridx1, %ridx4
  %alu0 = add nsw i32 %alu0_a, -1
  %alu1_a = icmp slt i32 -1, %alu0
  %alu1_b = icmp slt i32 %alu0, 16
  %alu1 = and i1 %alu1_a, %alu1_b
)";
  ir += ir_loop("5", "3");
  ir += R"(  %alu2_a = add nsw i32 %ridx2, %ridx5
  %alu2 = add nsw i32 %alu2_a, -1
  %alu3_a = icmp slt i32 -1, %alu2
  %alu3_b = icmp slt i32 %alu2, 16
  %alu3_c = and i1 %alu3_a, %alu3_b
  %alu3 = and i1 %alu1, %alu3_c
  %alu6_a = mul nsw i32 %ridx3, 256
  %alu6_b = mul nsw i32 %alu0, 16
  %alu6_c = add nsw i32 %alu6_a, %alu6_b
  %alu6 = add nsw i32 %alu6_c, %alu2
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu6
  br label %val0_entry
val0_entry:
  br i1 %alu3, label %val0_load, label %val0_exit
val0_load:
  %val0_yes = load float, ptr %idx0
  br label %val0_exit
val0_exit:
  %val0 = phi float [ %val0_yes, %val0_load ], [ 0.0, %val0_entry ]
  %alu4_a = mul nsw i32 %ridx0, 144
  %alu4_b = mul nsw i32 %ridx3, 9
  %alu4_c = mul nsw i32 %ridx4, 3
  %alu4_d = add nsw i32 %alu4_a, %alu4_b
  %alu4_e = add nsw i32 %alu4_d, %alu4_c
  %alu4 = add nsw i32 %alu4_e, %ridx5
)";
  for (int j = 0; j < 4; ++j) {
    const std::string s = std::to_string(j), w = "%w" + s;
    ir += "  %alu4_" + s + " = add nsw i32 %alu4, " + std::to_string(36 * j) + "\n";
    ir += "  %idxw" + s + " = getelementptr inbounds float, ptr %data2, i32 %alu4_" + s + "\n";
    ir += "  " + w + " = load float, ptr %idxw" + s + "\n";
    ir += "  %prod" + s + " = fmul " + FM + " float %val0, " + w + "\n";
    ir += "  %old" + s + " = load float, ptr %acc" + s + "\n";
    ir += "  %new" + s + " = fadd " + FM + " float %old" + s + ", %prod" + s + "\n";
    ir += "  store float %new" + s + ", ptr %acc" + s + "\n";
  }
  ir += ir_endloop("5") + ir_endloop("4") + ir_endloop("3");
  ir += R"(  %alu7 = shl i32 %ridx0, 2
  %idxb = getelementptr inbounds float, ptr %data3, i32 %alu7
  %val5 = load <4 x float>, ptr %idxb
  %alu5_a = shl i32 %ridx0, 10
  %alu5_b = shl i32 %ridx1, 4
  %alu5_c = add nsw i32 %alu5_a, %alu5_b
  %alu5 = add nsw i32 %alu5_c, %ridx2
)";
  for (int j = 0; j < 4; ++j) {
    const std::string s = std::to_string(j);
    ir += "  %fin" + s + " = load float, ptr %acc" + s + "\n";
    ir += "  %bias" + s + " = extractelement <4 x float> %val5, i32 " + s + "\n";
    ir += "  %res" + s + " = fadd " + FM + " float %fin" + s + ", %bias" + s + "\n";
    ir += "  %alu5_" + s + " = add nsw i32 %alu5, " + std::to_string(256 * j) + "\n";
    ir += "  %out" + s + " = getelementptr inbounds float, ptr %data0, i32 %alu5_" + s + "\n";
    ir += "  store float %res" + s + ", ptr %out" + s + "\n";
  }
  ir += ir_endloop("2") + ir_endloop("1") + ir_endloop("0") + ir_end();
  k.ir_source = ir;
  k.buffers = {{Elem::f32, 2048, true}, {Elem::f32, 1024, false}, {Elem::f32, 288, false, -1, 1}, {Elem::f32, 8, false}};
  k.reference = [](Bufs& b, const Values&) { conv_ref(b, 4, 8, 16, 16, 3, 1); };
  k.tolerance = 1e-5;  // same order as the reference, FMA contraction only
  return k;
}

Kernel conv2d_unrolled() {
  Kernel k;
  k.name = "r_2_6_6_3_3";
  k.what = "conv2d 1x1x8x8 * 2x1x3x3, no padding, the 3x3 reduction fully unrolled into one expression";
  k.c_source = R"(void r_2_6_6_3_3(float* restrict data0, const float* restrict data1, const float* restrict data2) {
  for (int ridx0 = 0; ridx0 < 2; ridx0++) {
    int alu0 = (ridx0*9);
    float val0 = data2[alu0];
    float val1 = data2[(alu0+1)];
    float val2 = data2[(alu0+2)];
    float val3 = data2[(alu0+3)];
    float val4 = data2[(alu0+4)];
    float val5 = data2[(alu0+5)];
    float val6 = data2[(alu0+6)];
    float val7 = data2[(alu0+7)];
    float val8 = data2[(alu0+8)];
    for (int ridx1 = 0; ridx1 < 6; ridx1++) {
      for (int ridx2 = 0; ridx2 < 6; ridx2++) {
        int alu1 = ((ridx1<<3)+ridx2);
        float val9 = data1[alu1];
        float val10 = data1[(alu1+1)];
        float val11 = data1[(alu1+2)];
        float val12 = data1[(alu1+8)];
        float val13 = data1[(alu1+9)];
        float val14 = data1[(alu1+10)];
        float val15 = data1[(alu1+16)];
        float val16 = data1[(alu1+17)];
        float val17 = data1[(alu1+18)];
        data0[((ridx0*36)+(ridx1*6)+ridx2)] = ((val9*val0)+(val10*val1)+(val11*val2)+(val12*val3)+(val13*val4)+(val14*val5)+(val15*val6)+(val16*val7)+(val17*val8));
      }
    }
  }
}
)";
  std::string ir = ir_define("r_2_6_6_3_3", 3) + ir_loop("0", "2");
  ir += "  %alu0 = mul nsw i32 %ridx0, 9\n";
  for (int t = 0; t < 9; ++t) {
    const std::string s = std::to_string(t);
    ir += "  %wi" + s + " = add nsw i32 %alu0, " + s + "\n  %wp" + s + " = getelementptr inbounds float, ptr %data2, i32 %wi" +
          s + "\n  %w" + s + " = load float, ptr %wp" + s + "\n";
  }
  ir += ir_loop("1", "6") + ir_loop("2", "6");
  ir += "  %alu1_a = shl i32 %ridx1, 3\n  %alu1 = add nsw i32 %alu1_a, %ridx2\n";
  const int off[9] = {0, 1, 2, 8, 9, 10, 16, 17, 18};
  for (int t = 0; t < 9; ++t) {
    const std::string s = std::to_string(t);
    ir += "  %xi" + s + " = add nsw i32 %alu1, " + std::to_string(off[t]) + "\n  %xp" + s +
          " = getelementptr inbounds float, ptr %data1, i32 %xi" + s + "\n  %x" + s + " = load float, ptr %xp" + s + "\n";
    ir += "  %p" + s + " = fmul " + FM + " float %x" + s + ", %w" + s + "\n";
    if (t == 1) ir += "  %s1 = fadd " + FM + " float %p0, %p1\n";
    if (t > 1) ir += "  %s" + s + " = fadd " + FM + " float %s" + std::to_string(t - 1) + ", %p" + s + "\n";
  }
  ir += "  %o_a = mul nsw i32 %ridx0, 36\n  %o_b = mul nsw i32 %ridx1, 6\n  %o_c = add nsw i32 %o_a, %o_b\n"
        "  %o = add nsw i32 %o_c, %ridx2\n  %op = getelementptr inbounds float, ptr %data0, i32 %o\n"
        "  store float %s8, ptr %op\n";
  ir += ir_endloop("2") + ir_endloop("1") + ir_endloop("0") + ir_end();
  k.ir_source = ir;
  k.buffers = {{Elem::f32, 72, true}, {Elem::f32, 64, false}, {Elem::f32, 18, false}};
  k.reference = [](Bufs& b, const Values&) { conv_ref(b, 1, 2, 8, 8, 3, 0); };
  k.tolerance = 1e-5;  // FMA contraction inside the 9-term expression; sums can cancel to near 0
  return k;
}

Kernel gemv() {
  Kernel k;
  k.name = "r_128_64_4";
  k.what = "gemv y = A(128x256) x, float4 loads of A and x, a float4 accumulator (vector fmul/fadd in IR), lanes summed";
  k.c_source = std::string(c_float4) + R"(void r_128_64_4(float* restrict data0, const float* restrict data1, const float* restrict data2) {
  for (int ridx0 = 0; ridx0 < 128; ridx0++) {
    float4 acc0 = (float4){0.0f,0.0f,0.0f,0.0f};
    for (int ridx1 = 0; ridx1 < 64; ridx1++) {
      int alu0 = (ridx1<<2);
      float4 val0 = *((float4*)((data1+((ridx0<<8)+alu0))));
      float4 val1 = *((float4*)((data2+alu0)));
      acc0 = (acc0+(val0*val1));
    }
    data0[ridx0] = (((acc0[0]+acc0[1])+acc0[2])+acc0[3]);
  }
}
)";
  k.ir_source = ir_define("r_128_64_4", 3) + ir_loop("0", "128") +
                ir_loop("1", "64", {{"%acc0", "<4 x float>", "zeroinitializer", "%acc0_next"}}) +
                R"(  %alu0 = shl i32 %ridx1, 2
  %alu1 = shl i32 %ridx0, 8
  %alu2 = add nsw i32 %alu1, %alu0
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu2
  %val0 = load <4 x float>, ptr %idx0
  %idx1 = getelementptr inbounds float, ptr %data2, i32 %alu0
  %val1 = load <4 x float>, ptr %idx1
  %alu3 = fmul nsz arcp contract afn <4 x float> %val0, %val1
  %acc0_next = fadd nsz arcp contract afn <4 x float> %acc0, %alu3
)" + ir_endloop("1") +
                R"(  %gep0 = extractelement <4 x float> %acc0, i32 0
  %gep1 = extractelement <4 x float> %acc0, i32 1
  %gep2 = extractelement <4 x float> %acc0, i32 2
  %gep3 = extractelement <4 x float> %acc0, i32 3
  %alu4 = fadd nsz arcp contract afn float %gep0, %gep1
  %alu5 = fadd nsz arcp contract afn float %alu4, %gep2
  %alu6 = fadd nsz arcp contract afn float %alu5, %gep3
  %idx2 = getelementptr inbounds float, ptr %data0, i32 %ridx0
  store float %alu6, ptr %idx2
)" + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 128, true}, {Elem::f32, 128 * 256, false}, {Elem::f32, 256, false}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 128; ++i) {
      float lane[4] = {0, 0, 0, 0};  // the kernel keeps one partial sum per float4 lane
      for (int kk = 0; kk < 256; ++kk) lane[kk % 4] += get<float>(b[1], i * 256 + kk) * get<float>(b[2], kk);
      put<float>(b[0], i, ((lane[0] + lane[1]) + lane[2]) + lane[3]);
    }
  };
  k.tolerance = 5e-5;  // FMA contraction in the vector accumulator, 64 steps per lane
  return k;
}

Kernel transpose() {
  Kernel k;
  k.name = "E_32_8_4";
  k.what = "transpose of a 32x32 float matrix: 4 strided scalar loads packed into a float4 store (insertelement)";
  k.c_source = std::string(c_float4) + R"(void E_32_8_4(float* restrict data0, const float* restrict data1) {
  for (int ridx0 = 0; ridx0 < 32; ridx0++) {
    for (int ridx1 = 0; ridx1 < 8; ridx1++) {
      int alu0 = ((ridx1<<7)+ridx0);
      float val0 = data1[alu0];
      float val1 = data1[(alu0+32)];
      float val2 = data1[(alu0+64)];
      float val3 = data1[(alu0+96)];
      *((float4*)((data0+((ridx0<<5)+(ridx1<<2))))) = (float4){val0,val1,val2,val3};
    }
  }
}
)";
  k.ir_source = ir_define("E_32_8_4", 2) + ir_loop("0", "32") + ir_loop("1", "8") + R"(  %alu0_a = shl i32 %ridx1, 7
  %alu0 = add nsw i32 %alu0_a, %ridx0
  %idx0 = getelementptr inbounds float, ptr %data1, i32 %alu0
  %val0 = load float, ptr %idx0
  %alu1 = add nsw i32 %alu0, 32
  %idx1 = getelementptr inbounds float, ptr %data1, i32 %alu1
  %val1 = load float, ptr %idx1
  %alu2 = add nsw i32 %alu0, 64
  %idx2 = getelementptr inbounds float, ptr %data1, i32 %alu2
  %val2 = load float, ptr %idx2
  %alu3 = add nsw i32 %alu0, 96
  %idx3 = getelementptr inbounds float, ptr %data1, i32 %alu3
  %val3 = load float, ptr %idx3
  %vec_0 = insertelement <4 x float> poison, float %val0, i32 0
  %vec_1 = insertelement <4 x float> %vec_0, float %val1, i32 1
  %vec_2 = insertelement <4 x float> %vec_1, float %val2, i32 2
  %vec = insertelement <4 x float> %vec_2, float %val3, i32 3
  %alu4 = shl i32 %ridx0, 5
  %alu5 = shl i32 %ridx1, 2
  %alu6 = add nsw i32 %alu4, %alu5
  %idx4 = getelementptr inbounds float, ptr %data0, i32 %alu6
  store <4 x float> %vec, ptr %idx4
)" + ir_endloop("1") + ir_endloop("0") + ir_end();
  k.buffers = {{Elem::f32, 1024, true}, {Elem::f32, 1024, false}};
  k.reference = [](Bufs& b, const Values&) {
    for (int i = 0; i < 32; ++i)
      for (int j = 0; j < 32; ++j) put<float>(b[0], j * 32 + i, get<float>(b[1], i * 32 + j));
  };
  return k;
}

}  // namespace

void add_linalg(std::vector<Kernel>& out) {
  out.push_back(matmul(64));
  out.push_back(matmul(256));
  out.push_back(matmul(512));
  out.push_back(conv2d());
  out.push_back(conv2d_unrolled());
  out.push_back(gemv());
  out.push_back(transpose());
}

}  // namespace corpus::detail
