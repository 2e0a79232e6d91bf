// Kernels on every backend, checked against a CPU reference on fresh random data.
#include <cmath>

#include "conformance.hpp"
#include "demo_kernels.hpp"

using namespace tinydev;
using namespace tinydev::testing;

namespace {

std::vector<float> run_add(Compiled& dev, const std::vector<float>& a, const std::vector<float>& b) {
  const std::size_t n = a.size();
  auto prg = dev.load_kernel("add", kernels::add_f32(dev.source_language()));
  Buffer ba(dev.name(), n, dtypes::float32), bb(dev.name(), n, dtypes::float32),
      bo(dev.name(), n, dtypes::float32);
  ba.allocate().copyin(std::span<const float>(a));
  bb.allocate().copyin(std::span<const float>(b));
  bo.allocate();
  const Allocation bufs[] = {bo.allocation(), ba.allocation(), bb.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  (*prg)(bufs, vals);
  std::vector<float> out(n);
  bo.copyout(std::span<float>(out));
  return out;
}

// A kernel with 10 buffers and 4 int32 values: 14 arguments, so 8 of them travel on the stack.
KernelSource many_args_kernel() {
  KernelSource k;
  std::string params = "ptr %out";
  for (int j = 1; j <= 9; ++j) params += ", ptr %b" + std::to_string(j);
  params += ", i32 %k1, i32 %k2, i32 %k3, i32 %n";
  std::string body;
  for (int j = 1; j <= 9; ++j) {
    body += "  %p" + std::to_string(j) + " = getelementptr inbounds i32, ptr %b" + std::to_string(j) + ", i64 %idx\n";
    body += "  %v" + std::to_string(j) + " = load i32, ptr %p" + std::to_string(j) + "\n";
  }
  body += "  %s1 = add i32 %v1, 0\n";
  for (int j = 2; j <= 9; ++j)
    body += "  %s" + std::to_string(j) + " = add i32 %s" + std::to_string(j - 1) + ", %v" + std::to_string(j) + "\n";
  body += "  %m = mul i32 %s9, %k1\n  %a2 = add i32 %m, %k2\n  %r = sub i32 %a2, %k3\n";
  body += "  %po = getelementptr inbounds i32, ptr %out, i64 %idx\n  store i32 %r, ptr %po\n";
  k.llvm_ir = kernels::llvm_counted_loop("many", params, body);
  std::string cparams = "int* restrict out";
  for (int j = 1; j <= 9; ++j) cparams += ", const int* restrict b" + std::to_string(j);
  cparams += ", int k1, int k2, int k3, int n";
  std::string sum = "b1[i]";
  for (int j = 2; j <= 9; ++j) sum += " + b" + std::to_string(j) + "[i]";
  k.c = "void many(" + cparams + ") {\n  for (int i = 0; i < n; i++) out[i] = (" + sum +
        ") * k1 + k2 - k3;\n}\n";
  return k;
}

const KernelSource kMath{
    "declare float @exp2f(float)\ndeclare float @llvm.sqrt.f32(float)\n" +
        kernels::llvm_counted_loop("math", "ptr %out, ptr %a, ptr %b, i32 %n",
                                   "  %pa = getelementptr inbounds float, ptr %a, i64 %idx\n"
                                   "  %pb = getelementptr inbounds float, ptr %b, i64 %idx\n"
                                   "  %va = load float, ptr %pa\n"
                                   "  %vb = load float, ptr %pb\n"
                                   "  %s = call float @llvm.sqrt.f32(float %va)\n"
                                   "  %e = call float @exp2f(float %vb)\n"
                                   "  %r = fadd float %s, %e\n"
                                   "  %po = getelementptr inbounds float, ptr %out, i64 %idx\n"
                                   "  store float %r, ptr %po\n"),
    "float sqrtf(float);\nfloat exp2f(float);\n"
    "void math(float* restrict out, const float* restrict a, const float* restrict b, int n) {\n"
    "  for (int i = 0; i < n; i++) out[i] = sqrtf(a[i]) + exp2f(b[i]);\n}\n"};

// half and bfloat16 conversions from float and from double: these call the conversion helpers
// (__truncdfhf2, __truncdfbf2, ...) that the loader must resolve.
const KernelSource kConvert{
    kernels::llvm_counted_loop(
        "convert", "ptr %h_from_f, ptr %h_from_d, ptr %bf_from_f, ptr %bf_from_d, ptr %f_from_h, ptr %f, ptr %d, i32 %n",
        "  %pf = getelementptr inbounds float, ptr %f, i64 %idx\n"
        "  %pd = getelementptr inbounds double, ptr %d, i64 %idx\n"
        "  %vf = load float, ptr %pf\n"
        "  %vd = load double, ptr %pd\n"
        "  %h1 = fptrunc float %vf to half\n"
        "  %h2 = fptrunc double %vd to half\n"
        "  %b1 = fptrunc float %vf to bfloat\n"
        "  %b2 = fptrunc double %vd to bfloat\n"
        "  %back = fpext half %h1 to float\n"
        "  %q1 = getelementptr inbounds half, ptr %h_from_f, i64 %idx\n"
        "  store half %h1, ptr %q1\n"
        "  %q2 = getelementptr inbounds half, ptr %h_from_d, i64 %idx\n"
        "  store half %h2, ptr %q2\n"
        "  %q3 = getelementptr inbounds bfloat, ptr %bf_from_f, i64 %idx\n"
        "  store bfloat %b1, ptr %q3\n"
        "  %q4 = getelementptr inbounds bfloat, ptr %bf_from_d, i64 %idx\n"
        "  store bfloat %b2, ptr %q4\n"
        "  %q5 = getelementptr inbounds float, ptr %f_from_h, i64 %idx\n"
        "  store float %back, ptr %q5\n"),
    "void convert(_Float16* h_from_f, _Float16* h_from_d, __bf16* bf_from_f, __bf16* bf_from_d,\n"
    "             float* f_from_h, const float* f, const double* d, int n) {\n"
    "  for (int i = 0; i < n; i++) {\n"
    "    h_from_f[i] = (_Float16)f[i]; h_from_d[i] = (_Float16)d[i];\n"
    "    bf_from_f[i] = (__bf16)f[i]; bf_from_d[i] = (__bf16)d[i];\n"
    "    f_from_h[i] = (float)h_from_f[i];\n"
    "  }\n}\n"};

std::uint16_t half_bits(_Float16 h) {
  std::uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

double bf16_value(std::uint16_t bits) {
  std::uint32_t w = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

// Reference double -> bfloat16, round to nearest even, by brute force over the neighbours.
std::uint16_t bf16_reference(double d) {
  float f = static_cast<float>(d);
  std::uint32_t w;
  std::memcpy(&w, &f, 4);
  std::uint16_t best = static_cast<std::uint16_t>(w >> 16);
  for (int delta : {-1, 1}) {
    std::uint16_t cand = static_cast<std::uint16_t>(static_cast<int>(w >> 16) + delta);
    double eb = std::fabs(bf16_value(best) - d), ec = std::fabs(bf16_value(cand) - d);
    if (ec < eb || (ec == eb && (cand & 1) == 0)) best = cand;
  }
  return best;
}

}  // namespace

TEST_CASE("kernels: add on random data matches the CPU reference", "[kernels]") {
  for_each_backend(Needs{.add_kernel = true}, [](Compiled& dev) {
    for (std::size_t n : {std::size_t{1}, std::size_t{1000}, std::size_t{1} << 20}) {
      const std::uint64_t seed = fresh_seed();
      INFO("n " << n << " seed " << seed);
      auto a = random_floats(n, seed), b = random_floats(n, seed ^ 0x9e3779b97f4a7c15ull);
      auto out = run_add(dev, a, b);
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < n; ++i) wrong += out[i] != a[i] + b[i];
      CHECK(wrong == 0);
    }
  });
}

TEST_CASE("kernels: 14 arguments (most on the stack) arrive in order", "[kernels]") {
  const KernelSource k = many_args_kernel();
  for_each_backend(Needs{.kernels = true}, [&](Compiled& dev) {
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    std::mt19937_64 rng(seed);
    const std::size_t n = 257;
    std::vector<std::vector<std::int32_t>> ins(9, std::vector<std::int32_t>(n));
    std::vector<Buffer> bufs;
    bufs.emplace_back(dev.name(), n, dtypes::int32);
    bufs[0].allocate();
    for (auto& in : ins) {
      for (auto& x : in) x = static_cast<std::int32_t>(rng() % 2001) - 1000;
      bufs.emplace_back(dev.name(), n, dtypes::int32);
      bufs.back().allocate().copyin(std::span<const std::int32_t>(in));
    }
    const std::int32_t k1 = static_cast<std::int32_t>(rng() % 100) - 50;
    const std::int32_t k2 = static_cast<std::int32_t>(rng() % 100000);
    const std::int32_t k3 = -static_cast<std::int32_t>(rng() % 100000);
    std::vector<Allocation> allocs;
    for (auto& b : bufs) allocs.push_back(b.allocation());
    const std::int32_t vals[] = {k1, k2, k3, static_cast<std::int32_t>(n)};
    auto prg = dev.load_kernel("many", k.for_device(dev));
    (*prg)(allocs, vals);
    std::vector<std::int32_t> out(n);
    bufs[0].copyout(std::span<std::int32_t>(out));
    for (std::size_t i = 0; i < n; ++i) {
      std::int32_t sum = 0;
      for (auto& in : ins) sum += in[i];
      REQUIRE(out[i] == sum * k1 + k2 - k3);
    }
  });
}

TEST_CASE("kernels: libm calls resolve (sqrtf and exp2f)", "[kernels]") {
  for_each_backend(Needs{.kernels = true}, [](Compiled& dev) {
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const std::size_t n = 4099;
    auto a = random_floats(n, seed, 0.f, 1000.f), b = random_floats(n, seed + 1, -20.f, 20.f);
    Buffer ba(dev.name(), n, dtypes::float32), bb(dev.name(), n, dtypes::float32),
        bo(dev.name(), n, dtypes::float32);
    ba.allocate().copyin(std::span<const float>(a));
    bb.allocate().copyin(std::span<const float>(b));
    bo.allocate();
    auto prg = dev.load_kernel("math", kMath.for_device(dev));
    const Allocation bufs[] = {bo.allocation(), ba.allocation(), bb.allocation()};
    const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
    (*prg)(bufs, vals);
    std::vector<float> out(n);
    bo.copyout(std::span<float>(out));
    for (std::size_t i = 0; i < n; ++i) {
      const double want = std::sqrt(double(a[i])) + std::exp2(double(b[i]));
      REQUIRE(std::fabs(out[i] - want) <= 4e-6 * std::fabs(want) + 1e-6);
    }
  });
}

TEST_CASE("kernels: half and bfloat16 conversions round to nearest even", "[kernels]") {
  for_each_backend(Needs{.kernels = true}, [](Compiled& dev) {
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    std::mt19937_64 rng(seed);
    const std::size_t n = 2048;
    std::vector<float> f(n);
    std::vector<double> d(n);
    for (std::size_t i = 0; i < n; ++i) {
      // Magnitudes from half's subnormal range up to past its largest finite value (65504).
      const double scale = std::ldexp(1.0, static_cast<int>(rng() % 44) - 28);
      d[i] = (static_cast<double>(rng() % (1ull << 53)) / (1ull << 53) * 2 - 1) * scale;
      f[i] = static_cast<float>(d[i] * 1.37);
    }
    Buffer hf(dev.name(), n, dtypes::float16), hd(dev.name(), n, dtypes::float16),
        bff(dev.name(), n, dtypes::bfloat16), bfd(dev.name(), n, dtypes::bfloat16),
        fh(dev.name(), n, dtypes::float32), bf(dev.name(), n, dtypes::float32),
        bd(dev.name(), n, dtypes::float64);
    for (Buffer* b : {&hf, &hd, &bff, &bfd, &fh}) b->allocate();
    bf.allocate().copyin(std::span<const float>(f));
    bd.allocate().copyin(std::span<const double>(d));
    auto prg = dev.load_kernel("convert", kConvert.for_device(dev));
    const Allocation bufs[] = {hf.allocation(),  hd.allocation(), bff.allocation(), bfd.allocation(),
                               fh.allocation(),  bf.allocation(), bd.allocation()};
    const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
    (*prg)(bufs, vals);
    std::vector<std::uint16_t> h_from_f(n), h_from_d(n), bf_from_f(n), bf_from_d(n);
    std::vector<float> f_from_h(n);
    hf.copyout(std::span<std::uint16_t>(h_from_f));
    hd.copyout(std::span<std::uint16_t>(h_from_d));
    bff.copyout(std::span<std::uint16_t>(bf_from_f));
    bfd.copyout(std::span<std::uint16_t>(bf_from_d));
    fh.copyout(std::span<float>(f_from_h));
    for (std::size_t i = 0; i < n; ++i) {
      INFO("i " << i << " f " << f[i] << " d " << d[i]);
      REQUIRE(h_from_f[i] == half_bits(static_cast<_Float16>(f[i])));
      REQUIRE(h_from_d[i] == half_bits(static_cast<_Float16>(d[i])));
      REQUIRE(bf_from_f[i] == bf16_reference(f[i]));
      REQUIRE(bf_from_d[i] == bf16_reference(d[i]));
      REQUIRE(f_from_h[i] == static_cast<float>(static_cast<_Float16>(f[i])));
    }
  });
}

TEST_CASE("kernels: a kernel on views reads and writes the base at the offsets", "[kernels]") {
  for_each_backend(Needs{.add_kernel = true}, [](Compiled& dev) {
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    const std::size_t n = 1024;
    auto data = random_floats(3 * n, seed);
    Buffer base(dev.name(), 3 * n, dtypes::float32);
    base.allocate().copyin(std::span<const float>(data));
    Buffer a = base.view(n, dtypes::float32, 0), b = base.view(n, dtypes::float32, n * 4),
           out = base.view(n, dtypes::float32, 2 * n * 4);
    for (Buffer* v : {&a, &b, &out}) v->ensure_allocated();
    auto prg = dev.load_kernel("add", kernels::add_f32(dev.source_language()));
    const Allocation bufs[] = {out.allocation(), a.allocation(), b.allocation()};
    const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
    (*prg)(bufs, vals);
    HostBytes all = base.as_buffer(true);
    if (dev.capabilities().host_visible_memory) CHECK(all.is_zero_copy());
    for (std::size_t i = 0; i < n; ++i) REQUIRE(all.as<float>()[2 * n + i] == data[i] + data[n + i]);
  });
}

TEST_CASE("kernels: two programs with the same kernel name and different code coexist", "[kernels]") {
  const KernelSource plus_one{
      "define void @k(ptr %o, ptr %a) {\n  %v = load i32, ptr %a\n  %r = add i32 %v, 1\n"
      "  store i32 %r, ptr %o\n  ret void\n}\n",
      "void k(int* o, const int* a) { *o = *a + 1; }\n"};
  const KernelSource times_two{
      "define void @k(ptr %o, ptr %a) {\n  %v = load i32, ptr %a\n  %r = mul i32 %v, 2\n"
      "  store i32 %r, ptr %o\n  ret void\n}\n",
      "void k(int* o, const int* a) { *o = *a * 2; }\n"};
  for_each_backend(Needs{.kernels = true}, [&](Compiled& dev) {
    const std::int32_t x = static_cast<std::int32_t>(fresh_seed() % 100000);
    auto p1 = dev.load_kernel("k", plus_one.for_device(dev));
    auto p2 = dev.load_kernel("k", times_two.for_device(dev));
    Buffer in(dev.name(), 1, dtypes::int32), o1(dev.name(), 1, dtypes::int32), o2(dev.name(), 1, dtypes::int32);
    in.allocate().copyin(std::span<const std::int32_t>(&x, 1));
    o1.allocate();
    o2.allocate();
    const Allocation b1[] = {o1.allocation(), in.allocation()};
    const Allocation b2[] = {o2.allocation(), in.allocation()};
    (*p2)(b2);
    (*p1)(b1);
    std::int32_t r1 = 0, r2 = 0;
    o1.copyout(std::span<std::int32_t>(&r1, 1));
    o2.copyout(std::span<std::int32_t>(&r2, 1));
    CHECK(r1 == x + 1);
    CHECK(r2 == x * 2);
    p1.reset();  // unloading one leaves the other working
    (*p2)(b2);
    o2.copyout(std::span<std::int32_t>(&r2, 1));
    CHECK(r2 == x * 2);
  });
}

TEST_CASE("kernels: IR in the style code generators emit (vectors and fast-math and attribute groups)", "[kernels]") {
  // Shaped like tinygrad's LLVM renderer output: opaque pointers, `noalias align 32` parameters,
  // <4 x float> loads, fast-math flags, an attribute group, a row-sum reduction loop.
  const std::string ir = R"(define void @r_64_16_4(ptr noalias align 32 %data0, ptr noalias align 32 %data1) #0
{
entry:
  br label %loop_row
loop_row:
  %ridx0 = phi i32 [ 0, %entry ], [ %ridx0_next, %row_end ]
  %rowbase = mul i32 %ridx0, 64
  br label %loop_red
loop_red:
  %ridx1 = phi i32 [ 0, %loop_row ], [ %ridx1_next, %loop_red ]
  %acc = phi <4 x float> [ zeroinitializer, %loop_row ], [ %acc_next, %loop_red ]
  %off = mul i32 %ridx1, 4
  %idx = add i32 %rowbase, %off
  %idx64 = sext i32 %idx to i64
  %ptr = getelementptr inbounds float, ptr %data1, i64 %idx64
  %val = load <4 x float>, ptr %ptr, align 16
  %acc_next = fadd nsz arcp contract afn reassoc <4 x float> %acc, %val
  %ridx1_next = add i32 %ridx1, 1
  %red_done = icmp eq i32 %ridx1_next, 16
  br i1 %red_done, label %row_end, label %loop_red
row_end:
  %sum = call nsz arcp contract afn reassoc float @llvm.vector.reduce.fadd.v4f32(float 0.0, <4 x float> %acc_next)
  %out64 = sext i32 %ridx0 to i64
  %outp = getelementptr inbounds float, ptr %data0, i64 %out64
  store float %sum, ptr %outp, align 4
  %ridx0_next = add i32 %ridx0, 1
  %rows_done = icmp eq i32 %ridx0_next, 64
  br i1 %rows_done, label %exit, label %loop_row
exit:
  ret void
}
declare float @llvm.vector.reduce.fadd.v4f32(float, <4 x float>)
attributes #0 = { nounwind "no-builtins" "no-trapping-math"="true" }
)";
  on_backend_taking(SourceLanguage::LLVMIR, [&](Compiled& dev) {
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    auto in = random_floats(64 * 64, seed, -1.f, 1.f);
    Buffer bi(dev.name(), in.size(), dtypes::float32), bo(dev.name(), 64, dtypes::float32);
    bi.allocate().copyin(std::span<const float>(in));
    bo.allocate();
    auto prg = dev.load_kernel("r_64_16_4", ir);
    const Allocation bufs[] = {bo.allocation(), bi.allocation()};
    (*prg)(bufs);
    std::vector<float> out(64);
    bo.copyout(std::span<float>(out));
    for (int r = 0; r < 64; ++r) {
      double want = 0;
      for (int c = 0; c < 64; ++c) want += in[r * 64 + c];
      REQUIRE(std::fabs(out[r] - want) < 1e-4);
    }
  });
}

TEST_CASE("kernels: C in the style code generators emit (vector types and builtins and bfloat16)", "[kernels]") {
  // Shaped like tinygrad's C renderer output: ext_vector_type float4, restrict, __builtin_* math,
  // <stdint.h> from the compiler's freestanding headers, a __bf16 output.
  const std::string c = R"(#include <stdint.h>
typedef float float4 __attribute__((aligned(16), ext_vector_type(4)));
void E_4_16(float* restrict data0, __bf16* restrict data1, const float* restrict data2) {
  for (int32_t ridx0 = 0; ridx0 < 16; ridx0++) {
    float4 val0 = *((float4*)(data2 + ridx0 * 4));
    float4 alu0 = val0 * val0 + (float4){1.0f, 1.0f, 1.0f, 1.0f};
    data0[ridx0] = __builtin_sqrtf(alu0.x + alu0.y + alu0.z + alu0.w);
    data1[ridx0] = (__bf16)data0[ridx0];
  }
}
)";
  on_backend_taking(SourceLanguage::C, [&](Compiled& dev) {
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    auto in = random_floats(64, seed, -3.f, 3.f);
    Buffer bi(dev.name(), 64, dtypes::float32), bo(dev.name(), 16, dtypes::float32), bb(dev.name(), 16, dtypes::bfloat16);
    bi.allocate().copyin(std::span<const float>(in));
    bo.allocate();
    bb.allocate();
    auto prg = dev.load_kernel("E_4_16", c);
    REQUIRE(prg->signature() == KernelSignature{3, 0});
    const Allocation bufs[] = {bo.allocation(), bb.allocation(), bi.allocation()};
    (*prg)(bufs);
    std::vector<float> out(16);
    std::vector<std::uint16_t> half(16);
    bo.copyout(std::span<float>(out));
    bb.copyout(std::span<std::uint16_t>(half));
    for (int r = 0; r < 16; ++r) {
      double sum = 0;
      for (int k = 0; k < 4; ++k) sum += double(in[r * 4 + k]) * in[r * 4 + k] + 1.0;
      REQUIRE(std::fabs(out[r] - std::sqrt(sum)) < 1e-4 * std::sqrt(sum));
      REQUIRE(half[r] == bf16_reference(out[r]));
    }
  });
}

TEST_CASE("kernels: 8 threads compile and load and run concurrently on one device", "[kernels]") {
  for_each_backend(Needs{.add_kernel = true}, [](Compiled& dev) {
    const std::uint64_t seed = fresh_seed();
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t)
      threads.emplace_back([&, t] {
        const std::size_t n = 5000 + static_cast<std::size_t>(t);
        auto a = random_floats(n, seed + t), b = random_floats(n, seed + 100 + t);
        for (int rep = 0; rep < 3; ++rep) {
          auto out = run_add(dev, a, b);
          for (std::size_t i = 0; i < n; ++i) wrong += out[i] != a[i] + b[i];
        }
      });
    for (auto& th : threads) th.join();
    CHECK(wrong == 0);
  });
}
