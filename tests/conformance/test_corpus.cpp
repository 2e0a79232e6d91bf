// The generator-style kernel corpus (tests/corpus): every kernel, in the device's language, against
// its plain C++ reference on fresh random data; and the LLVM device's machine code against
// clang-19 -O2 -march=native's for the same IR, which must give bit-identical outputs (Note
// [clang's -O2 pipeline] in backends/llvm/llvm_device.cpp).
#include <random>

#include "conformance.hpp"
#include "corpus.hpp"
#include "cpu_blob.hpp"
#include "subprocess.hpp"

using namespace tinydev;
using namespace tinydev::testing;

namespace {

struct Loaded {
  std::vector<Buffer> buffers;
  std::vector<Allocation> allocations;
};

// Device buffers holding `host`'s bytes.
Loaded upload(Compiled& dev, const std::vector<std::vector<std::byte>>& host) {
  Loaded out;
  for (const auto& bytes : host) {
    Buffer& b = out.buffers.emplace_back(dev.name(), bytes.size(), dtypes::uint8);
    b.allocate().copyin(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()));
    out.allocations.push_back(b.allocation());
  }
  return out;
}

std::vector<std::byte> download(Buffer& b) {
  std::vector<std::byte> bytes(b.size());
  b.copyout(std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(bytes.data()), bytes.size()));
  return bytes;
}

}  // namespace

TEST_CASE("corpus: every generator-style kernel matches its C++ reference on random data", "[corpus]") {
  for_each_backend(Needs{.kernels = true}, [](Compiled& dev) {
    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    std::mt19937_64 rng(seed);
    REQUIRE(corpus::kernels().size() >= 30);
    for (const corpus::Kernel& k : corpus::kernels()) {
      INFO(k.name << ": " << k.what);
      const std::string& source = dev.source_language() == SourceLanguage::C ? k.c_source : k.ir_source;
      auto prg = dev.load_kernel(k.name, source);
      auto host = corpus::random_buffers(k, rng);
      Loaded loaded = upload(dev, host);
      (*prg)(loaded.allocations, k.values, LaunchParams{.global = {k.grid, 1, 1}});
      auto want = host;
      k.reference(want, k.values);
      for (std::size_t i = 0; i < k.buffers.size(); ++i) {
        if (!k.buffers[i].output) continue;
        const std::string why = corpus::compare_output(k, i, download(loaded.buffers[i]), want[i]);
        CHECK(why == "");
      }
    }
  });
}

TEST_CASE("corpus: the LLVM device's code gives outputs bit-identical to clang-19 -O2 -march=native on the same IR",
          "[corpus]") {
  if (!in_this_run("LLVM")) return;
  const std::string clang = clang_backend::find_on_path("clang-19");
  if (clang.empty()) {
    skip("clang-19 is not on PATH (scripts/test installs it): nothing to compare the LLVM device with");
    return;
  }
  Compiled& dev = Device["LLVM"];
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  int identical = 0;
  for (const corpus::Kernel& k : corpus::kernels()) {
    INFO(k.name << ": " << k.what);
    const clang_backend::ProcessResult r = clang_backend::run_process(
        {clang, "-c", "-O2", "-march=native", "-fPIC", "-x", "ir", "-", "-o", "-"}, k.ir_source, std::chrono::seconds(120));
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const Blob by_clang = cpu::wrap_object(std::as_bytes(std::span(r.out.data(), r.out.size())), {});
    auto ours = dev.load_kernel(k.name, k.ir_source);
    auto theirs = dev.runtime().load(k.name, by_clang);
    const auto host = corpus::random_buffers(k, rng);
    Loaded a = upload(dev, host), b = upload(dev, host);
    (*ours)(a.allocations, k.values, LaunchParams{.global = {k.grid, 1, 1}});
    (*theirs)(b.allocations, k.values, LaunchParams{.global = {k.grid, 1, 1}});
    bool same = true;
    for (std::size_t i = 0; i < k.buffers.size(); ++i) {
      if (!k.buffers[i].output) continue;
      const auto x = download(a.buffers[i]), y = download(b.buffers[i]);
      const bool equal = x == y;
      if (!equal) {
        std::size_t at = 0;
        while (at < x.size() && x[at] == y[at]) ++at;
        FAIL_CHECK("output " << i << " differs from clang's first at byte " << at);
      }
      same = same && equal;
    }
    identical += same;
  }
  CHECK(identical == static_cast<int>(corpus::kernels().size()));
}
