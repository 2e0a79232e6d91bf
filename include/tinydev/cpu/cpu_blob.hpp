// include/tinydev/cpu/cpu_blob.hpp: what the CPU compilers return
// and the compile cache stores: the object file, prefixed by the kernels' signatures (how many
// buffers, how many int32 values) so that launches with the wrong counts are errors instead of
// undefined behaviour.
//
//   magic "TDVCPU01" | u32 count | count x (u16 name length, name, u16 buffers, u16 values) |
//   u16 padding | padding zero bytes (to 8-byte alignment) | object
//
// A blob without the magic is taken as a bare object file with unknown signatures.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tinydev/compile.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::cpu {

struct KernelInfo {
  std::string name;
  KernelSignature signature;
};

Blob wrap_object(std::span<const std::byte> object, const std::vector<KernelInfo>& kernels);

struct UnwrappedBlob {
  std::span<const std::byte> object;
  std::vector<KernelInfo> kernels;
  std::optional<KernelSignature> signature_of(std::string_view name) const;
};
// Throws InvalidArgument for a blob with the magic and a malformed header.
UnwrappedBlob unwrap_object(std::span<const std::byte> blob);

// Signatures of the non-internal function definitions in LLVM IR text (`define ... @name(ptr %a,
// ..., i32 %n)`), the kernel ABI's reading of them: `ptr` parameters are buffers, `i32` ones int32
// values. Functions that do not fit the ABI (a buffer after a value, a float, 64-bit or aggregate
// value, byval/sret parameters, variadics) are left out: their launches are not checked. The
// CLANG backend reads C kernels' signatures from clang's own IR for the translation unit (Note
// [C signatures from clang]), so what C spells a parameter (`int a[]`, a typedef'd pointer, a
// return type on the line before) never matters.
std::vector<KernelInfo> ir_signatures(std::string_view ir);

}  // namespace tinydev::cpu

TINYDEV_API_END
