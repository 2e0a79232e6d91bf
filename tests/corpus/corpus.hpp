// tests/corpus/corpus.hpp: kernels written the way tinygrad's C (ClangRenderer) and LLVM IR
// (LLVMRenderer) renderers write them, each with a plain C++ reference. Every kernel comes as two
// sources that compute the same thing: a C translation unit (restrict pointers, const inputs,
// `float4` vector typedefs, `alu`/`val`/`acc` temporaries, `ridx` loops) and an LLVM 19 IR module
// (opaque pointers, `ptr noalias align 32` arguments, loop_entry/latch/body/footer/exit blocks with
// phi nodes, `nsz arcp contract afn` float flags, llvm.* intrinsics). The corpus covers matmul with
// upcast accumulators, conv2d, float4 reductions, softmax/layernorm, argmax, cumsum, half/bf16/int
// casts, threefry, where/cmplt, symbolic int arguments, core_id grid kernels and more.
//
// How a caller uses a kernel k:
//   * compile k.c_source (e.g. clang -O2 -ffreestanding -fno-math-errno -fPIC -shared) or
//     k.ir_source (clang -x ir ...), look up k.name;
//   * bufs = random_buffers(k, rng); give the kernel a copy of every buffer, each copy at least
//     32-byte aligned (the IR declares `align 32` on every pointer, as tinygrad's CPU allocator
//     promises);
//   * call name(buf0, ..., bufN, values..., [core_id]) -- for grid > 1 once per core_id 0..grid-1;
//   * run k.reference(bufs, k.values) on the original buffers and compare every output buffer
//     with compare_output(k, i, got, bufs[i]).
// Output elements a kernel does not write (symbolic-length kernels) keep their initial random
// contents, and so does the reference, so kernel and reference must start from the same buffers.
// The float math calls exp2f/log2f/sinf (from libm) through __builtin_* / llvm.* intrinsics.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>
namespace corpus {
enum class Elem { f32, f64, f16, bf16, i32, u32, i8, u8, i64, u64, boolean };  // storage type of one element
std::size_t elem_bytes(Elem e);
struct Buffer {
  Elem elem;
  std::size_t count;      // elements
  bool output;            // written by the kernel (compared); inputs are only read
  double lo = -2.0, hi = 2.0;  // random input range (ints: integers in [lo, hi]); outputs are filled with random garbage too
};
struct Kernel {
  std::string name;            // the exported function's name, the same in both sources
  std::string what;            // one line: what it computes and which renderer feature it exercises
  std::string c_source;        // tinygrad ClangRenderer style C (one translation unit, may contain static helpers / typedefs)
  std::string ir_source;       // tinygrad LLVMRenderer style LLVM IR text (LLVM 19, opaque pointers)
  std::vector<Buffer> buffers; // kernel arguments, in order (buffers come first in the ABI)
  std::vector<std::int32_t> values;  // int32 arguments after the buffers
  std::uint32_t grid = 1;      // > 1: launched as a grid; the kernel takes one more trailing int32 (core_id), called once per index 0..grid-1
  // Computes the expected contents of the output buffers from the inputs (bufs[i] = buffer i's bytes).
  std::function<void(std::vector<std::vector<std::byte>>& bufs, const std::vector<std::int32_t>& values)> reference;
  double tolerance = 0;        // max allowed |got - want| / max(1, |want|) for float outputs; 0 = exact
};
const std::vector<Kernel>& kernels();
// Random inputs for kernel k (fresh each call, per Buffer::lo/hi), outputs filled with random bytes too.
std::vector<std::vector<std::byte>> random_buffers(const Kernel& k, std::mt19937_64& rng);
// Compares output buffer `index`: "" if within tolerance, else a message naming the first differing element, got and want.
std::string compare_output(const Kernel& k, std::size_t index, const std::vector<std::byte>& got, const std::vector<std::byte>& want);
}  // namespace corpus
