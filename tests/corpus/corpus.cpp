// tests/corpus/corpus.cpp: the corpus registry plus random inputs, comparisons and the
// half/bfloat16 helpers used by the references. The kernels live in corpus_*.cpp.
#include "corpus.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <type_traits>

#include "corpus_util.hpp"

namespace corpus {
namespace detail {

std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::uint16_t f32_to_f16(float f) {
  const std::uint32_t x = f32_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to infinity
  const int e = static_cast<int>(ax >> 23) - 127;
  if (e >= -14) {  // normal half: keep 10 of the 23 mantissa bits, round the other 13
    const std::uint32_t mant = ax & 0x7fffffu;
    std::uint32_t h = (static_cast<std::uint32_t>(e + 15) << 10) | (mant >> 13);
    const std::uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;  // a carry moves into the exponent, as it should
    return static_cast<std::uint16_t>(sign | h);
  }
  if (e < -25) return static_cast<std::uint16_t>(sign);  // below half the smallest subnormal
  // subnormal half: count units of 2^-24; value = mant * 2^(e-23), so units = mant >> -(e+1)
  const std::uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
  const int s = -(e + 1);  // 14..24
  std::uint32_t q = mant >> s;
  const std::uint32_t rem = mant & ((1u << s) - 1u), halfway = 1u << (s - 1);
  if (rem > halfway || (rem == halfway && (q & 1u))) q++;
  return static_cast<std::uint16_t>(sign | q);
}

float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float bf16_to_f32(std::uint16_t h) { return bits_f32(static_cast<std::uint32_t>(h) << 16); }

std::string ir_float(float f) {
  const double d = f;
  std::uint64_t u;
  std::memcpy(&u, &d, 8);
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%016llX", static_cast<unsigned long long>(u));
  return buf;
}

std::string ir_loop(const std::string& id, const std::string& bound, const std::vector<IrPhi>& phis) {
  const std::string r = "%ridx" + id;
  std::string s = "  br label %loop_entry_" + id + "\nloop_entry_" + id + ":\n  br label %loop_latch_" + id +
                  "\nloop_latch_" + id + ":\n  " + r + " = phi i32 [ 0, %loop_entry_" + id + " ], [ " + r +
                  "phi, %loop_footer_" + id + " ]\n";
  for (const IrPhi& p : phis)
    s += "  " + p.name + " = phi " + p.type + " [ " + p.init + ", %loop_entry_" + id + " ], [ " + p.next +
         ", %loop_footer_" + id + " ]\n";
  s += "  " + r + "cmp = icmp ult i32 " + r + ", " + bound + "\n  br i1 " + r + "cmp, label %loop_body_" + id +
       ", label %loop_exit_" + id + "\nloop_body_" + id + ":\n";
  return s;
}

std::string ir_endloop(const std::string& id) {
  return "  br label %loop_footer_" + id + "\nloop_footer_" + id + ":\n  %ridx" + id + "phi = add i32 %ridx" + id +
         ", 1\n  br label %loop_latch_" + id + "\nloop_exit_" + id + ":\n";
}

std::string ir_define(const std::string& name, int nbufs, const std::vector<std::string>& int_args) {
  std::string s = "define void @" + name + "(";
  for (int i = 0; i < nbufs; ++i) s += (i ? ", " : "") + std::string("ptr noalias align 32 %data") + std::to_string(i);
  for (const auto& a : int_args) s += ", i32 %" + a;
  return s + ") #0\n{\n";
}

std::string ir_end(const std::string& decls) {
  return "  ret void\n}\n" + decls +
         "attributes #0 = { alwaysinline nounwind \"no-builtins\" \"no-trapping-math\"=\"true\" }\n";
}

}  // namespace detail

std::size_t elem_bytes(Elem e) {
  switch (e) {
    case Elem::f64: case Elem::i64: case Elem::u64: return 8;
    case Elem::f32: case Elem::i32: case Elem::u32: return 4;
    case Elem::f16: case Elem::bf16: return 2;
    case Elem::i8: case Elem::u8: case Elem::boolean: return 1;
  }
  return 0;
}

const std::vector<Kernel>& kernels() {
  static const std::vector<Kernel> all = [] {
    std::vector<Kernel> v;
    detail::add_linalg(v);
    detail::add_reduce(v);
    detail::add_elementwise(v);
    detail::add_grid(v);
    return v;
  }();
  return all;
}

namespace {
using detail::put;

template <class T> void fill_int(std::vector<std::byte>& b, const Buffer& buf, std::mt19937_64& rng) {
  using Wide = std::conditional_t<std::is_signed_v<T>, long long, unsigned long long>;
  const double tmin = static_cast<double>(std::numeric_limits<T>::min());
  const double tmax = static_cast<double>(std::numeric_limits<T>::max());
  const double lo = std::max(std::ceil(buf.lo), tmin), hi = std::min(std::floor(buf.hi), tmax);
  // hi may be 2^64 or 2^63 after rounding to double: clamp in the integer domain
  const Wide wlo = lo <= tmin ? static_cast<Wide>(std::numeric_limits<T>::min()) : static_cast<Wide>(lo);
  const Wide whi = hi >= tmax ? static_cast<Wide>(std::numeric_limits<T>::max()) : static_cast<Wide>(hi);
  std::uniform_int_distribution<Wide> dist(wlo, std::max(wlo, whi));
  for (std::size_t i = 0; i < buf.count; ++i) put<T>(b, i, static_cast<T>(dist(rng)));
}
}  // namespace

std::vector<std::vector<std::byte>> random_buffers(const Kernel& k, std::mt19937_64& rng) {
  std::vector<std::vector<std::byte>> out;
  for (const Buffer& buf : k.buffers) {
    std::vector<std::byte> b(buf.count * elem_bytes(buf.elem));
    if (buf.output) {
      for (auto& x : b) x = static_cast<std::byte>(rng() & 0xff);
      out.push_back(std::move(b));
      continue;
    }
    std::uniform_real_distribution<double> real(buf.lo, buf.hi);
    switch (buf.elem) {
      case Elem::f32: for (std::size_t i = 0; i < buf.count; ++i) put<float>(b, i, static_cast<float>(real(rng))); break;
      case Elem::f64: for (std::size_t i = 0; i < buf.count; ++i) put<double>(b, i, real(rng)); break;
      case Elem::f16: for (std::size_t i = 0; i < buf.count; ++i) put<std::uint16_t>(b, i, detail::f32_to_f16(static_cast<float>(real(rng)))); break;
      case Elem::bf16: for (std::size_t i = 0; i < buf.count; ++i) put<std::uint16_t>(b, i, detail::f32_to_bf16(static_cast<float>(real(rng)))); break;
      case Elem::i32: fill_int<std::int32_t>(b, buf, rng); break;
      case Elem::u32: fill_int<std::uint32_t>(b, buf, rng); break;
      case Elem::i8: fill_int<std::int8_t>(b, buf, rng); break;
      case Elem::u8: fill_int<std::uint8_t>(b, buf, rng); break;
      case Elem::i64: fill_int<std::int64_t>(b, buf, rng); break;
      case Elem::u64: fill_int<std::uint64_t>(b, buf, rng); break;
      case Elem::boolean: {
        Buffer c = buf;
        c.lo = std::max(0.0, buf.lo), c.hi = std::min(1.0, buf.hi);
        fill_int<std::uint8_t>(b, c, rng);
        break;
      }
    }
    out.push_back(std::move(b));
  }
  return out;
}

std::string compare_output(const Kernel& k, std::size_t index, const std::vector<std::byte>& got,
                           const std::vector<std::byte>& want) {
  using detail::get;
  const Buffer& buf = k.buffers.at(index);
  const std::size_t eb = elem_bytes(buf.elem);
  const auto where = [&](std::size_t i) {
    return "buffer " + std::to_string(index) + " element " + std::to_string(i) + ": got ";
  };
  if (got.size() != buf.count * eb || want.size() != buf.count * eb)
    return "buffer " + std::to_string(index) + ": size " + std::to_string(got.size()) + " / " +
           std::to_string(want.size()) + " bytes, expected " + std::to_string(buf.count * eb);
  for (std::size_t i = 0; i < buf.count; ++i) {
    if (std::memcmp(got.data() + i * eb, want.data() + i * eb, eb) == 0) continue;  // bit-identical
    char msg[160];
    switch (buf.elem) {
      case Elem::f32: case Elem::f64: case Elem::f16: case Elem::bf16: {
        double g = 0, w = 0;
        if (buf.elem == Elem::f32) g = get<float>(got, i), w = get<float>(want, i);
        if (buf.elem == Elem::f64) g = get<double>(got, i), w = get<double>(want, i);
        if (buf.elem == Elem::f16) g = detail::f16_to_f32(get<std::uint16_t>(got, i)), w = detail::f16_to_f32(get<std::uint16_t>(want, i));
        if (buf.elem == Elem::bf16) g = detail::bf16_to_f32(get<std::uint16_t>(got, i)), w = detail::bf16_to_f32(get<std::uint16_t>(want, i));
        if (std::isnan(g) && std::isnan(w)) continue;
        const double err = std::fabs(g - w) / std::max(1.0, std::fabs(w));
        if (g == w || err <= k.tolerance) continue;  // g == w: +0 / -0
        std::snprintf(msg, sizeof msg, "%.9g want %.9g (error %.3g, tolerance %.3g)", g, w, err, k.tolerance);
        return where(i) + msg;
      }
      case Elem::i32: std::snprintf(msg, sizeof msg, "%d want %d", get<std::int32_t>(got, i), get<std::int32_t>(want, i)); break;
      case Elem::u32: std::snprintf(msg, sizeof msg, "%u want %u", get<std::uint32_t>(got, i), get<std::uint32_t>(want, i)); break;
      case Elem::i8: std::snprintf(msg, sizeof msg, "%d want %d", get<std::int8_t>(got, i), get<std::int8_t>(want, i)); break;
      case Elem::u8: case Elem::boolean: std::snprintf(msg, sizeof msg, "%u want %u", get<std::uint8_t>(got, i), get<std::uint8_t>(want, i)); break;
      case Elem::i64: std::snprintf(msg, sizeof msg, "%lld want %lld", static_cast<long long>(get<std::int64_t>(got, i)), static_cast<long long>(get<std::int64_t>(want, i))); break;
      case Elem::u64: std::snprintf(msg, sizeof msg, "%llu want %llu", static_cast<unsigned long long>(get<std::uint64_t>(got, i)), static_cast<unsigned long long>(get<std::uint64_t>(want, i))); break;
    }
    return where(i) + msg;
  }
  return "";
}

}  // namespace corpus
