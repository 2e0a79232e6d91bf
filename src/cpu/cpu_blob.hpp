// src/cpu/cpu_blob.hpp (installed as <tinydev/cpu/cpu_blob.hpp>): what the CPU compilers return
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

// Signatures of the non-static function definitions in C source `void name(T* a, ..., int n)`
// (return type `void` on the line of the name): parameters with a '*' are buffers, integer ones
// int32 values. Functions it cannot read (buffers after values, float or 64-bit values, variadics)
// are left out: their launches are not checked. A scanner, not a C parser: braces in comments or
// strings at file scope confuse it (generated kernels have none).
std::vector<KernelInfo> c_signatures(std::string_view source);

}  // namespace tinydev::cpu
