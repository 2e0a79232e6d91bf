// The README's example: open a device by name, compile a kernel through the cache, run it on
// random data and check the result. Built against an installed tinydev by scripts/test.
#include <tinydev/cpu/cpu_hcq.hpp>  // the CPU devices' HCQ types (queues, CpuProgram)
#include <tinydev/tinydev.hpp>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

int main() {
  using namespace tinydev;
  Compiled& dev = Device["llvm"];  // opened on first use, the same instance ever after
  auto add = dev.load_kernel("add", R"(
    define void @add(ptr %out, ptr %a, ptr %b, i32 %n) {
    entry:
      %empty = icmp sle i32 %n, 0
      br i1 %empty, label %exit, label %loop
    loop:
      %i = phi i32 [ 0, %entry ], [ %next, %loop ]
      %pa = getelementptr float, ptr %a, i32 %i
      %pb = getelementptr float, ptr %b, i32 %i
      %po = getelementptr float, ptr %out, i32 %i
      %x = load float, ptr %pa
      %y = load float, ptr %pb
      %s = fadd float %x, %y
      store float %s, ptr %po
      %next = add i32 %i, 1
      %done = icmp eq i32 %next, %n
      br i1 %done, label %exit, label %loop
    exit:
      ret void
    })");

  const int n = 1 << 20;
  std::vector<float> a(n), b(n), out(n);
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (int i = 0; i < n; ++i) a[i] = dist(rng), b[i] = dist(rng);

  Buffer ba("llvm", n, dtypes::float32), bb("llvm", n, dtypes::float32), bo("llvm", n, dtypes::float32);
  ba.allocate().copyin(std::span<const float>(a));
  bb.allocate().copyin(std::span<const float>(b));
  bo.allocate();
  const Allocation args[] = {bo.allocation(), ba.allocation(), bb.allocation()};
  const std::int32_t vals[] = {n};
  double seconds = *(*add)(args, vals, LaunchParams{.wait = true});
  bo.copyout(std::span<float>(out));

  int wrong = 0;
  for (int i = 0; i < n; ++i) wrong += out[i] != a[i] + b[i];

  // The same launch through the device's hardware command queue: out = out + b, ordered on the
  // device's timeline, then a synchronize.
  auto& hcq = dynamic_cast<cpu::CpuHCQDevice&>(dev);
  auto& program = dynamic_cast<cpu::CpuProgram&>(*add);
  const Allocation again[] = {bo.allocation(), bo.allocation(), bb.allocation()};
  {
    // The next timeline value, held until submitted (a throw completes it: the device goes on);
    // kernargs are allocated in the same locked section.
    auto reservation = hcq.reserve_timeline_value();
    Kernargs kernargs = hcq.alloc_kernargs(3, 1);
    fill_kernargs(program, kernargs, again, vals);
    hcq.compute_queue()
        .wait(hcq.timeline_signal(), reservation.value() - 1)
        .exec(program, kernargs, {1, 1, 1}, {1, 1, 1})
        .signal(hcq.timeline_signal(), reservation.value())
        .submit(hcq);
    reservation.submitted();
  }
  hcq.synchronize();
  bo.copyout(std::span<float>(out));
  for (int i = 0; i < n; ++i) wrong += out[i] != (a[i] + b[i]) + b[i];

  // Weights from a file: write `out` as a safetensors file, load it back onto the device in one
  // call (a DISK device on the file and copy_from_disk underneath), compare.
  const std::string weights =
      (std::filesystem::temp_directory_path() / ("consumer-" + std::to_string(::getpid()) + ".safetensors")).string();
  const SafetensorsEntry entries[] = {{"out", dtypes::float32, {static_cast<std::uint64_t>(n)},
                                       std::as_bytes(std::span<const float>(out))}};
  write_safetensors(weights, entries);
  std::vector<LoadedTensor> loaded = load_safetensors(weights, dev.name());
  std::vector<float> back(n);
  loaded.at(0).buffer.copyout(std::span<float>(back));
  wrong += back != out;
  std::remove(weights.c_str());
  std::printf("consumer: %d floats added on %s in %.3f ms, %d wrong; backends in this build:", n,
              dev.name().c_str(), seconds * 1e3, wrong);
  for (const auto& name : Device.backends()) std::printf(" %s", name.c_str());
  std::printf("\n");
  return wrong == 0 ? 0 : 1;
}
