// tests/fatal_signal_probe.cpp: a process that dies the ways a bad kernel kills a server, for
// tests/fatal_signal_test.cmake. `probe DEVICE MODE`:
//   segv  a queued kernel writes through a bad address (on the device's compute worker)
//   fpe   a direct call divides an integer by zero (on the calling thread)
//   hang  a queued kernel never returns; the timeout is printed and main returns: the process
//         must still exit cleanly (exit code 0) with the kernel running.
#include <cstdio>
#include <cstring>
#include <string>

#include "cpu_hcq.hpp"
#include "tinydev/tinydev.hpp"

using namespace tinydev;

namespace {
std::string source(Compiled& dev, const char* ir, const char* c) {
  return dev.source_language() == SourceLanguage::LLVMIR ? ir : c;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DEVICE segv|fpe|hang\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[2];
  auto& dev = dynamic_cast<cpu::CpuHCQDevice&>(Device[argv[1]]);
  if (mode == "segv") {
    auto program = std::dynamic_pointer_cast<cpu::CpuProgram>(dev.load_kernel(
        "write_one", source(dev, "define void @write_one(ptr %p) {\n  store volatile i32 1, ptr %p\n  ret void\n}\n",
                            "void write_one(volatile int* p) { *p = 1; }\n")));
    const Allocation bad[] = {Allocation{0x10, 4, nullptr}};
    Kernargs k = dev.alloc_kernargs(1, 0);
    fill_kernargs(*program, k, bad, {});
    auto r = dev.reserve_timeline_value();
    dev.compute_queue().wait(dev.timeline_signal(), r.value() - 1).exec(*program, k, {1, 1, 1}, {1, 1, 1})
        .signal(dev.timeline_signal(), r.value()).submit(dev);
    r.submitted();
    dev.synchronize();
    std::puts("the kernel did not fault");
    return 1;
  }
  if (mode == "fpe") {
    auto program = dev.load_kernel(
        "divide", source(dev,
                         "define void @divide(ptr %out, i32 %a, i32 %b) {\n  %q = sdiv i32 %a, %b\n"
                         "  store volatile i32 %q, ptr %out\n  ret void\n}\n",
                         "void divide(volatile int* out, int a, int b) { *out = a / b; }\n"));
    Buffer out(dev.name(), 1, dtypes::int32);
    out.allocate();
    const Allocation args[] = {out.allocation()};
    const std::int32_t values[] = {7, 0};
    (*program)(args, values);
    std::puts("the kernel did not fault");
    return 1;
  }
  if (mode == "hang") {
    auto program = std::dynamic_pointer_cast<cpu::CpuProgram>(dev.load_kernel(
        "spin_forever", source(dev,
                               "define void @spin_forever(ptr %flag) {\nentry:\n  br label %loop\nloop:\n"
                               "  %v = load volatile i32, ptr %flag\n  %z = icmp eq i32 %v, 12345\n"
                               "  br i1 %z, label %done, label %loop\ndone:\n  ret void\n}\n",
                               "void spin_forever(volatile int* flag) { while (flag[0] != 12345) {} }\n")));
    Buffer flag(dev.name(), 1, dtypes::int32);
    const std::int32_t zero = 0;
    flag.allocate().copyin(std::span<const std::int32_t>(&zero, 1));
    const Allocation args[] = {flag.allocation()};
    Kernargs k = dev.alloc_kernargs(1, 0);
    fill_kernargs(*program, k, args, {});
    auto r = dev.reserve_timeline_value();
    const std::uint64_t v = r.value();
    dev.compute_queue().wait(dev.timeline_signal(), v - 1).exec(*program, k, {1, 1, 1}, {1, 1, 1})
        .signal(dev.timeline_signal(), v).submit(dev);
    r.submitted();
    try {
      dev.wait_timeline(v, std::chrono::milliseconds(200));
    } catch (const Timeout& e) {
      std::printf("timeout: %s\n", e.what());
    }
    return 0;  // the buffer, the program and the device go with the kernel still running
  }
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
