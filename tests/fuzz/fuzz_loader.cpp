// libFuzzer target: the CPU object loaders. The input is a kernel blob (wrapped with signatures or
// a bare object) loaded as kernel "add" on every CPU device this build has: the fast ELF loader,
// and ORC for well-formed objects it declines. Any input loads or fails with a tinydev::Error;
// nothing crashes, hangs or allocates without bound (Note [Object validation]).
#include <cstdint>
#include <cstdlib>

#include "tinydev/tinydev.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::vector<std::string> devices = [] {
    std::vector<std::string> out;
    for (const char* name : {"LLVM", "CLANG"}) {
      try {
        tinydev::Device[name];
        out.emplace_back(name);
      } catch (const tinydev::Error&) {
      }
    }
    if (out.empty()) std::abort();
    return out;
  }();
  const auto blob = std::as_bytes(std::span(data, size));
  for (const std::string& name : devices) {
    try {
      auto program = tinydev::Device[name].runtime().load("add", blob);
      if (!program) std::abort();
    } catch (const tinydev::Error&) {
    }
  }
  return 0;
}
