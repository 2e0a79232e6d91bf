// libFuzzer target: the safetensors header reader. The input is a whole file; parsing it never
// crashes, hangs or allocates what the file claims, fails only with InvalidArgument, and a header
// it accepts keeps the promises of parse_safetensors_header: the tensors, in file order, tile the
// data section exactly, each of its shape's size.
#include <cstdint>
#include <cstdlib>
#include <span>

#include "tinydev/error.hpp"
#include "tinydev/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  try {
    const tinydev::SafetensorsHeader h = tinydev::parse_safetensors_header(file, size);
    if (h.data_offset != 8 + h.header_bytes || h.data_offset > size) std::abort();
    std::uint64_t covered = 0;
    for (const tinydev::SafetensorsTensor& t : h.tensors) {
      if (t.begin != covered || t.end < t.begin || t.name.empty()) std::abort();
      std::uint64_t numel = 1;
      for (std::uint64_t d : t.shape) numel *= d;
      if (numel * t.dtype.itemsize != t.nbytes()) std::abort();
      covered = t.end;
    }
    if (h.data_offset + covered != size) std::abort();
  } catch (const tinydev::InvalidArgument&) {
    // a clean refusal
  }
  return 0;
}
