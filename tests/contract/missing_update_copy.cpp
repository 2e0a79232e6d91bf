// Compiled by ctest ("hcq contract: ..."), expected to FAIL: a copy queue without _update_copy must
// be one static_assert naming the missing requirement (tinydev/hcq_concepts.hpp), not pages of
// template errors. Everything else here satisfies the contract.
#include "tinydev/hcq.hpp"
using namespace tinydev;
// A program, a compute queue and a copy queue that lacks _update_copy.
struct P : Program { P() : Program("p") {} std::optional<double> operator()(std::span<const Allocation>, std::span<const std::int32_t>, const LaunchParams&) override { return {}; } const std::string& device() const { static std::string d; return d; } };
struct C : HWComputeQueue<C, int, P> {
  void _signal(const Signal&, std::uint64_t) {} void _wait(const Signal&, std::uint64_t) {} void _timestamp(const Signal&) {}
  void _update_signal(std::size_t, const std::optional<Signal>&, const std::optional<std::uint64_t>&) {}
  void _update_wait(std::size_t, const std::optional<Signal>&, const std::optional<std::uint64_t>&) {}
  void _submit(Compiled&) {} void _exec(const P&, const Kernargs&, Dim3, Dim3) {} void _update_exec(std::size_t, Dim3, Dim3) {}
};
struct K : HWCopyQueue<K, int> {
  void _signal(const Signal&, std::uint64_t) {} void _wait(const Signal&, std::uint64_t) {} void _timestamp(const Signal&) {}
  void _update_signal(std::size_t, const std::optional<Signal>&, const std::optional<std::uint64_t>&) {}
  void _update_wait(std::size_t, const std::optional<Signal>&, const std::optional<std::uint64_t>&) {}
  void _submit(Compiled&) {} void _copy(const Allocation&, const Allocation&, std::size_t) {}
};
struct D : HCQCompiled<C, K> { using HCQCompiled::HCQCompiled; std::uint64_t device_to_cpu_ns(std::uint64_t n, bool) const override { return n; } };
void instantiate() { D d("x", nullptr, nullptr, nullptr, SourceLanguage::None, nullptr); }
