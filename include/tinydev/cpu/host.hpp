// include/tinydev/cpu/host.hpp: what the CPU backends know about the
// host they run on, detected once without LLVM (the LLVM backend asks LLVM for its own view).
//
// Thread safety: the functions may be called concurrently; detection runs once.
#pragma once

#include <map>
#include <string>
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::cpu {

struct HostTarget {
  std::string triple;    // "x86_64-pc-linux-gnu", from the compiler that built tinydev
  std::string cpu;       // the CPU's brand string (cpuid), else /proc/cpuinfo's model name, else "unknown"
  std::string features;  // "+avx2,+fma,...": /proc/cpuinfo's flags, sorted (for display)
  // What tells this CPU's code generation apart, read from the hardware itself (x86-64: cpuid's
  // vendor, family/model/stepping and feature words, and the OS-enabled register state; AArch64:
  // the hwcaps and MIDR), so a cache key built on it never hands `-march=native` code to another
  // CPU even where /proc/cpuinfo cannot be read.
  std::string fingerprint;
};
const HostTarget& host_target();

// The CPU devices' properties (target, cpu, features) for `tinydev devices`.
std::map<std::string, std::string> host_properties(const HostTarget& target = host_target());

}  // namespace tinydev::cpu

TINYDEV_API_END
