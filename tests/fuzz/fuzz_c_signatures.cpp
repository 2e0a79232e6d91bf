// libFuzzer target: the C signature reader of the CLANG backend. Any text gives a list of
// signatures (possibly empty) without crashing; every signature fits the kernel call limit.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "cpu_blob.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  for (const auto& k : tinydev::cpu::c_signatures(source)) {
    if (k.name.empty() || k.name.size() > size) std::abort();
  }
  // The blob header built from them reads back the same.
  auto kernels = tinydev::cpu::c_signatures(source);
  const tinydev::Blob wrapped = tinydev::cpu::wrap_object({}, kernels);
  const auto unwrapped = tinydev::cpu::unwrap_object(wrapped);
  if (unwrapped.kernels.size() != kernels.size()) std::abort();
  return 0;
}
