// tests/fuzz/mutate.hpp: structure-aware damage to ELF objects, shared by the Catch2 loader test
// (10,000 mutated blobs per device) and the loader fuzz target's seeds. Header-only, no LLVM.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace tinydev::testing {

// One damaged copy of `object`: some random bytes, or a field-sized word of the ELF header or the
// section header table set to a boundary value (0, 1, all ones, the file size, a huge number), or a
// truncation. These are the places where a loader trusts a length, an offset or an index.
inline std::vector<std::byte> mutate_object(const std::vector<std::byte>& object, std::mt19937_64& rng) {
  std::vector<std::byte> out = object;
  if (out.size() < 64) return out;
  auto put = [&](std::size_t at, std::uint64_t value, std::size_t width) {
    if (at + width <= out.size()) std::memcpy(out.data() + at, &value, width);
  };
  const std::uint64_t boundary[] = {0, 1, 2, 7, 8, 0xff, 0xffff, 0xffffffffull, 0x7fffffffffffffffull,
                                    ~0ull, out.size(), out.size() - 1, out.size() + 1, 1ull << 40};
  std::uint64_t shoff = 0;
  std::memcpy(&shoff, out.data() + 0x28, 8);
  std::uint16_t shnum = 0;
  std::memcpy(&shnum, out.data() + 0x3c, 2);
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % 5) {
      case 0:  // random bytes anywhere
        for (int k = 0, n = 1 + static_cast<int>(rng() % 8); k < n; ++k)
          out[rng() % out.size()] = static_cast<std::byte>(rng() & 0xff);
        break;
      case 1:  // an ELF header field
        put(8 * (rng() % 8), boundary[rng() % std::size(boundary)], (rng() & 1) ? 8 : 2);
        break;
      case 2:  // a section header field (offset, size, link, info, alignment, entry size)
        if (shnum && shoff < out.size()) {
          const std::size_t sec = rng() % shnum;
          const std::size_t field = 4 + 8 * (rng() % 7);
          put(shoff + sec * 64 + field, boundary[rng() % std::size(boundary)], (rng() & 1) ? 8 : 4);
        }
        break;
      case 3: {  // a word inside a table (symbols, relocations) set to a boundary value
        const std::size_t at = (rng() % out.size()) & ~std::size_t{7};
        put(at, boundary[rng() % std::size(boundary)], 8);
        break;
      }
      default:  // truncation
        out.resize(64 + rng() % (out.size() - 63));
        break;
    }
  }
  return out;
}

}  // namespace tinydev::testing
