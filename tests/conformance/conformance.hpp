// tests/conformance/conformance.hpp: the conformance suite's harness. Each test body is written
// once against Compiled and runs on every backend of this build (or the one given with
// --backend), asking for the capabilities it needs (DeviceCapabilities in tinydev/device.hpp).
// A backend without them, one that cannot open here, or one that declares the test unsupported
// (tinydev_add_backend's UNSUPPORTED_TESTS) is skipped with the reason (Note [Skips reach ctest]).
#pragma once

#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "conformance_backends.hpp"  // generated: this build's backends and their declarations
#include "support.hpp"

namespace tinydev::testing {

// What a test needs of a device, on top of opening. Each field names a DeviceCapabilities field;
// `kernels` also needs a test kernel in the device's source language (KernelSource).
struct Needs {
  bool kernels = false;  // runs_kernels, and the suite has kernels in the device's language
  bool cuda_too = false;  // with kernels: every KernelSource this test uses has its CUDA version
  bool add_kernel = false;  // runs_kernels, and kernels::add_f32 exists in the device's language
  bool rejects_invalid_source = false;
  bool caches_compiles = false;
  bool checks_signatures = false;
  bool host_objects = false;
  bool native_graphs = false;
  bool host_visible_memory = false;
  bool hcq = false;
  std::optional<SourceLanguage> language{};  // exactly this source language
};

// Whether the suite has test kernels in `language` (KernelSource below).
inline bool has_test_kernels(SourceLanguage language) {
  return language == SourceLanguage::LLVMIR || language == SourceLanguage::C;
}

// Whether kernels::add_f32 (tools/demo_kernels.hpp) has the add kernel in `language`.
inline bool has_add_kernel(SourceLanguage language) {
  return has_test_kernels(language) || language == SourceLanguage::CUDA;
}

// Why `dev` cannot run a test with `needs`, or "" when it can.
inline std::string unmet_needs(const Compiled& dev, const Needs& needs) {
  const DeviceCapabilities caps = dev.capabilities();
  std::vector<std::string> missing;
  auto want = [&](bool needed, bool has, const char* what) {
    if (needed && !has) missing.emplace_back(what);
  };
  want(needs.kernels || needs.add_kernel, caps.runs_kernels, "programs that compute (runs_kernels)");
  if (needs.add_kernel && caps.runs_kernels && !has_add_kernel(dev.source_language()))
    missing.push_back("the add kernel in " + std::string(to_string(dev.source_language())) +
                      " (add it to tools/demo_kernels.hpp)");
  const bool cuda_ok = needs.cuda_too && dev.source_language() == SourceLanguage::CUDA;
  if (needs.kernels && caps.runs_kernels && !has_test_kernels(dev.source_language()) && !cuda_ok)
    missing.push_back("test kernels in " + std::string(to_string(dev.source_language())) +
                      " for this test (give its KernelSources a CUDA version and ask for Needs.cuda_too; "
                      "tests/conformance/conformance.hpp)");
  want(needs.rejects_invalid_source, caps.rejects_invalid_source, "a compiler that rejects invalid source");
  want(needs.caches_compiles, caps.caches_compiles, "compiles cached on disk");
  want(needs.checks_signatures, caps.checks_signatures, "programs that check their argument counts");
  want(needs.host_objects, caps.host_objects, "host object files (the CPU object runtime)");
  want(needs.native_graphs, caps.native_graphs, "native graphs");
  want(needs.host_visible_memory, caps.host_visible_memory, "host-visible memory");
  want(needs.hcq, caps.hcq, "an HCQ device");
  if (needs.language && dev.source_language() != *needs.language)
    missing.push_back(std::string(to_string(*needs.language)) + " source (it takes " +
                      std::string(to_string(dev.source_language())) + ")");
  std::string out;
  for (const std::string& m : missing) out += (out.empty() ? "needs " : ", ") + m;
  return out;
}

// The backends the suite runs on: --backend's, else every backend of this build. Backends that
// tests register at run time (fakes) are never among them.
inline std::vector<std::string> conformance_backends() {
  if (!selected_backend().empty()) return {selected_backend()};
  std::vector<std::string> types;
  for (const BuildBackend& b : build_backends()) types.emplace_back(b.type);
  return types;
}

// The reason `type` declares the current test unsupported, or "".
inline std::string declared_unsupported(const std::string& type) {
  for (const BuildBackend& b : build_backends())
    if (b.type == type)
      for (const UnsupportedTest& u : b.unsupported)
        if (u.test == current_test_name()) return std::string(u.reason);
  return "";
}

// The device the suite opens for `type`: the type itself, or for a type whose names are paths
// (DISK) a file of its own in a folder of this process under the temp folder, removed at exit.
// All lowercase, so that the suite's checks of name spellings find the same device.
inline std::string conformance_device_name(const std::string& type) {
  if (Device.suffix_kind(type) != DeviceSuffix::path) return type;
  struct Folder {
    std::filesystem::path path = std::filesystem::temp_directory_path() /
                                 ("tinydev-conformance-" + std::to_string(::getpid()));
    Folder() { std::filesystem::create_directories(path); }
    ~Folder() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Folder folder;
  std::string file = type;
  for (char& c : file) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return type + ":" + (folder.path / (file + ".bin")).string();
}

// Opens `type` for the current test, or skips it (saying why) and returns nullptr.
inline Compiled* open_for_test(const std::string& type, const Needs& needs) {
  if (std::string why = declared_unsupported(type); !why.empty()) {
    skip(type + " declares this test unsupported: " + why);
    return nullptr;
  }
  Compiled* dev = nullptr;
  try {
    dev = &Device[conformance_device_name(type)];
  } catch (const DeviceUnavailable& e) {
    skip(type + " cannot open here: " + e.what());
    return nullptr;
  }
  if (std::string why = unmet_needs(*dev, needs); !why.empty()) {
    skip(type + ": this test " + why);
    return nullptr;
  }
  return dev;
}

// Calls `body(device)` once per backend that meets `needs`, in a Catch section named after it.
template <class Body>
void for_each_backend(const Needs& needs, Body&& body) {
  const std::vector<std::string> types = conformance_backends();
  REQUIRE_FALSE(types.empty());
  for (const std::string& type : types) {
    Compiled* dev = open_for_test(type, needs);
    if (!dev) continue;
    DYNAMIC_SECTION(type) {
      // A body that skips (a second device missing, a partial capability) did not run the test.
      const int skips_before = skip_count();
      body(*dev);
      if (skip_count() == skips_before) note_ran();
    }
  }
}
template <class Body>
void for_each_backend(Body&& body) {
  for_each_backend(Needs{}, std::forward<Body>(body));
}

// Whether this run includes backend `type` (a test of one backend's own behaviour skips otherwise).
inline bool in_this_run(const std::string& type) {
  for (const std::string& t : conformance_backends())
    if (t == type) return true;
  skip("a test of the " + type + " backend, which this run does not include");
  return false;
}

// Runs `body(device)` on the one backend of this build that takes `language` (the tests of a
// language's idioms), or skips when the selected backends have none.
template <class Body>
void on_backend_taking(SourceLanguage language, Body&& body) {
  for_each_backend(Needs{.kernels = true, .language = language}, std::forward<Body>(body));
}

// The same kernel in each source language the suite has kernels for (has_test_kernels), and in
// CUDA C++ for the tests that ask for Needs.cuda_too. A CUDA kernel's `global` is its grid of
// blocks and `local` its block; the fake driver (tests/cuda/fake_driver) runs a host version
// registered under the kernel's name.
struct KernelSource {
  std::string llvm_ir;
  std::string c;
  std::string cuda{};
  const std::string& for_device(const Compiled& dev) const { return for_language(dev.source_language()); }
  const std::string& for_language(SourceLanguage language) const {
    switch (language) {
      case SourceLanguage::LLVMIR: return llvm_ir;
      case SourceLanguage::C: return c;
      case SourceLanguage::CUDA:
        if (!cuda.empty()) return cuda;
        [[fallthrough]];
      default: FAIL("no test kernel for " << to_string(language) << ": ask for Needs{.kernels = true}");
    }
    return c;
  }
};

}  // namespace tinydev::testing
