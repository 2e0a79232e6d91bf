// Conversion helpers that compiled kernels call and that libgcc may lack (bfloat16 needs GCC 13).
// Note [Half helpers ABI]
// LLVM 15+ passes and returns _Float16 and __bf16 in the low 16 bits of an SSE register on x86-64
// (an FP/SIMD register on AArch64). g++ 12 has _Float16 but no __bf16, so the bfloat16 helpers
// return their bits as a _Float16: same register, same bits.
#include <cstdint>
#include <cstring>

namespace tinydev::cpu::detail {

namespace {

// Rounds a finite or special double to a binary format with `ebits` exponent and `mbits` mantissa
// bits, round-to-nearest-even (one rounding, so double -> half is exact-correct, not via float).
std::uint16_t round_to(double value, int ebits, int mbits) {
  std::uint64_t d;
  std::memcpy(&d, &value, 8);
  const std::uint16_t sign = static_cast<std::uint16_t>((d >> 63) << (ebits + mbits));
  const std::uint64_t abs = d & 0x7fffffffffffffffull;
  const std::uint16_t emax_field = static_cast<std::uint16_t>((1u << ebits) - 1);
  const int bias = (1 << (ebits - 1)) - 1;
  const std::uint64_t mant52 = abs & ((1ull << 52) - 1);
  if ((abs >> 52) == 0x7ff) {  // inf or nan (nan stays quiet nan with its top payload bits)
    std::uint16_t payload = mant52 ? static_cast<std::uint16_t>((1u << (mbits - 1)) | (mant52 >> (52 - mbits))) : 0;
    return static_cast<std::uint16_t>(sign | (emax_field << mbits) | payload);
  }
  if ((abs >> 52) == 0) return sign;  // zero or double subnormal: far below any 16-bit format
  const int e = static_cast<int>(abs >> 52) - 1023;
  const std::uint64_t m = mant52 | (1ull << 52);
  const int emin = 1 - bias;
  int shift = 52 - mbits;
  std::uint64_t base = 0;
  if (e >= emin) {
    base = static_cast<std::uint64_t>(e - emin) << mbits;
  } else {
    shift += emin - e;
    if (shift > 53) return sign;
  }
  std::uint64_t q = m >> shift;
  const std::uint64_t rem = m & ((1ull << shift) - 1);
  const std::uint64_t half = 1ull << (shift - 1);
  if (rem > half || (rem == half && (q & 1))) q += 1;
  std::uint64_t bits = base + q;  // the implicit bit carries into the exponent field
  if (bits >= (static_cast<std::uint64_t>(emax_field) << mbits)) bits = static_cast<std::uint64_t>(emax_field) << mbits;
  return static_cast<std::uint16_t>(sign | bits);
}

_Float16 from_bits(std::uint16_t bits) {
  _Float16 out;
  std::memcpy(&out, &bits, 2);
  return out;
}

}  // namespace

extern "C" {
float tinydev_extendhfsf2(_Float16 h) {
  std::uint16_t b;
  std::memcpy(&b, &h, 2);
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x8000) << 16;
  const std::uint32_t exp = (b >> 10) & 0x1f, mant = b & 0x3ff;
  std::uint32_t out;
  if (exp == 0x1f) {
    out = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    out = sign | ((exp + 112) << 23) | (mant << 13);
  } else {
    float f = static_cast<float>(mant) * 0x1p-24f;  // subnormal or zero: exact in float
    std::memcpy(&out, &f, 4);
    out |= sign;
  }
  float f;
  std::memcpy(&f, &out, 4);
  return f;
}
_Float16 tinydev_truncsfhf2(float f) { return from_bits(round_to(f, 5, 10)); }
_Float16 tinydev_truncdfhf2(double d) { return from_bits(round_to(d, 5, 10)); }
_Float16 tinydev_truncsfbf2(float f) { return from_bits(round_to(f, 8, 7)); }
_Float16 tinydev_truncdfbf2(double d) { return from_bits(round_to(d, 8, 7)); }
std::uint16_t tinydev_f2h_ieee(float f) { return round_to(f, 5, 10); }
float tinydev_h2f_ieee(std::uint16_t b) { return tinydev_extendhfsf2(from_bits(b)); }
}

}  // namespace tinydev::cpu::detail
