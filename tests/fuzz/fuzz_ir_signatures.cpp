// libFuzzer target: the LLVM IR signature reader (cpu::ir_signatures) that the CLANG backend runs on
// clang's IR for a C kernel. Any text gives a list of signatures (possibly empty) without
// crashing; every name is non-empty and the signatures survive the blob header.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "cpu_blob.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view ir(reinterpret_cast<const char*>(data), size);
  const auto kernels = tinydev::cpu::ir_signatures(ir);
  for (const auto& k : kernels)
    if (k.name.empty() || k.name.size() > size) std::abort();
  const tinydev::Blob wrapped = tinydev::cpu::wrap_object({}, kernels);
  const auto unwrapped = tinydev::cpu::unwrap_object(wrapped);
  if (unwrapped.kernels.size() != kernels.size()) std::abort();
  for (std::size_t i = 0; i < kernels.size(); ++i)
    if (unwrapped.kernels[i].name != kernels[i].name || !(unwrapped.kernels[i].signature == kernels[i].signature))
      std::abort();
  return 0;
}
