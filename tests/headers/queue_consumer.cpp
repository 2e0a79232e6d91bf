// A consumer of the HCQ queue API, compiled by scripts/check-headers against the installed headers
// with -Wall -Wextra -Wshadow -Wpedantic -Werror (g++ 12 and clang++-19, C++20 and C++23), then run:
// it instantiates the queue, signal and timeline templates in a consumer's translation unit, where
// their warnings would land. Exits 0 when every result is right.
#include <tinydev/cpu/cpu_hcq.hpp>
#include <tinydev/cpu/cpu_program.hpp>
#include <tinydev/tinydev.hpp>

#include <cstdio>
#include <random>
#include <span>
#include <vector>

namespace {

constexpr const char* kScale = R"(
define void @scale(ptr %out, ptr %in, i32 %n, i32 %k) {
entry:
  %empty = icmp sle i32 %n, 0
  br i1 %empty, label %exit, label %loop
loop:
  %i = phi i32 [ 0, %entry ], [ %next, %loop ]
  %pi = getelementptr i32, ptr %in, i32 %i
  %po = getelementptr i32, ptr %out, i32 %i
  %x = load i32, ptr %pi
  %y = mul i32 %x, %k
  store i32 %y, ptr %po
  %next = add i32 %i, 1
  %done = icmp eq i32 %next, %n
  br i1 %done, label %exit, label %loop
exit:
  ret void
})";

}  // namespace

int main() {
  using namespace tinydev;
  auto& dev = dynamic_cast<cpu::CpuHCQDevice&>(Device["LLVM"]);
  auto scale = dev.load_kernel("scale", kScale);
  auto& program = dynamic_cast<cpu::CpuProgram&>(*scale);

  std::mt19937 rng(std::random_device{}());
  const int n = 4096;
  const std::int32_t k = 2 + static_cast<std::int32_t>(rng() % 7);
  std::vector<std::int32_t> input(n), output(n);
  for (auto& v : input) v = static_cast<std::int32_t>(rng() % 1000);
  Buffer in("LLVM", n, dtypes::int32), tmp("LLVM", n, dtypes::int32), out("LLVM", n, dtypes::int32);
  in.allocate().copyin(std::span<const std::int32_t>(input));
  tmp.allocate();
  out.allocate();

  // copy in -> tmp on the copy queue, then out = tmp * k on the compute queue, each ordered on the
  // timeline; a signal of our own marks the end.
  Signal done = dev.alloc_signal(0);
  {
    auto reservation = dev.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    dev.copy_queue()
        .wait(dev.timeline_signal(), value - 1)
        .copy(tmp.allocation(), in.allocation(), in.nbytes())
        .signal(dev.timeline_signal(), value)
        .submit(dev);
    reservation.submitted();
  }
  {
    auto reservation = dev.reserve_timeline_value();
    const std::uint64_t value = reservation.value();
    Kernargs kernargs = dev.alloc_kernargs(2, 2);
    const Allocation args[] = {out.allocation(), tmp.allocation()};
    const std::int32_t vals[] = {n, k};
    fill_kernargs(program, kernargs, args, vals);
    dev.compute_queue()
        .wait(dev.timeline_signal(), value - 1)
        .exec(program, kernargs, {1, 1, 1}, {1, 1, 1})
        .signal(dev.timeline_signal(), value)
        .signal(done, 1)
        .submit(dev);
    reservation.submitted();
  }
  done.wait(1);
  dev.synchronize();
  dev.free_signal(done);
  out.copyout(std::span<std::int32_t>(output));
  int wrong = 0;
  for (int i = 0; i < n; ++i) wrong += output[i] != input[i] * k;
  std::printf("queue_consumer: %d of %d wrong\n", wrong, n);
  return wrong == 0 ? 0 : 1;
}
