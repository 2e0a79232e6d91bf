// tests/conformance/conformance.hpp: run one test body on every backend this build has.
#pragma once

#include "support.hpp"

namespace tinydev::testing {

// Calls `body(device)` once per backend in a Catch section named after it. A backend that cannot
// open here is skipped with a warning that names the reason.
template <class Body>
void for_each_backend(Body&& body) {
  const std::vector<std::string> types = Device.backends();
  REQUIRE_FALSE(types.empty());
  for (const std::string& type : types) {
    Compiled* dev = nullptr;
    try {
      dev = &Device[type];
    } catch (const DeviceUnavailable& e) {
      WARN("skipping " << type << ": " << e.what());
      continue;
    }
    DYNAMIC_SECTION(type) { body(*dev); }
  }
}

// The same kernel in each source language a CPU backend takes.
struct KernelSource {
  std::string llvm_ir;
  std::string c;
  const std::string& for_device(const Compiled& dev) const {
    switch (dev.source_language()) {
      case SourceLanguage::LLVMIR: return llvm_ir;
      case SourceLanguage::C: return c;
      default: FAIL("no test kernel for " << to_string(dev.source_language()));
    }
    return c;
  }
};

}  // namespace tinydev::testing
