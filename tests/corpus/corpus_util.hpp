// tests/corpus/corpus_util.hpp: helpers shared by the corpus family files (not part of the public
// interface): typed access to byte buffers, half/bfloat16 conversions (round to nearest even) and
// the per-family registration functions.
#pragma once
#include "corpus.hpp"

#include <cstring>
#include <string>
#include <vector>

namespace corpus::detail {
using Bytes = std::vector<std::byte>;
using Bufs = std::vector<Bytes>;
using Values = std::vector<std::int32_t>;

// element i of a buffer, read / written through memcpy (no aliasing games)
template <class T> T get(const Bytes& b, std::size_t i) {
  T v;
  std::memcpy(&v, b.data() + i * sizeof(T), sizeof(T));
  return v;
}
template <class T> void put(Bytes& b, std::size_t i, T v) { std::memcpy(b.data() + i * sizeof(T), &v, sizeof(T)); }

std::uint32_t f32_bits(float f);
float bits_f32(std::uint32_t u);
std::uint16_t f32_to_f16(float f);   // IEEE binary16, round to nearest even, subnormals kept
float f16_to_f32(std::uint16_t h);
std::uint16_t f32_to_bf16(float f);  // bfloat16, round to nearest even
float bf16_to_f32(std::uint16_t h);

// LLVM IR spelling of a float constant (the double hex of the float value, as LLVM wants it)
std::string ir_float(float f);

// Pieces of LLVMRenderer-shaped IR. A loop `id` counts %ridx<id> from 0 while `icmp ult` bound,
// with blocks loop_entry_<id>, loop_latch_<id> (the phis), loop_body_<id>, loop_footer_<id>,
// loop_exit_<id>. Each IrPhi is a loop-carried value: `name` = phi [init from entry, next from footer].
struct IrPhi {
  std::string name, type, init, next;
};
std::string ir_loop(const std::string& id, const std::string& bound, const std::vector<IrPhi>& phis = {});
std::string ir_endloop(const std::string& id);
// "define void @name(ptr noalias align 32 %data0, ..., i32 %v, ...) #0\n{\n"
std::string ir_define(const std::string& name, int nbufs, const std::vector<std::string>& int_args = {});
// "  ret void\n}\n", then `decls` (intrinsic declarations) and the attribute group
std::string ir_end(const std::string& decls = "");
// ClangRenderer's float4 typedef line
inline constexpr const char* c_float4 = "typedef float float4 __attribute__((aligned(16),vector_size(16)));\n";

void add_linalg(std::vector<Kernel>& out);     // matmul, conv2d, gemv, transpose
void add_reduce(std::vector<Kernel>& out);     // sum/max/axis reductions, softmax, layernorm, argmax, cumsum
void add_elementwise(std::vector<Kernel>& out);// casts, where, unary math, int/bit ops, threefry
void add_grid(std::vector<Kernel>& out);       // core_id grid kernels and symbolic int kernels
}  // namespace corpus::detail
