// src/cpu/host.hpp (installed as <tinydev/cpu/host.hpp>): what the CPU backends know about the
// host they run on, detected once without LLVM (the LLVM backend asks LLVM for its own view).
//
// Thread safety: the functions may be called concurrently; detection runs once.
#pragma once

#include <map>
#include <string>

namespace tinydev::cpu {

struct HostTarget {
  std::string triple;    // "x86_64-pc-linux-gnu", from the compiler that built tinydev
  std::string cpu;       // /proc/cpuinfo's model name ("unknown" when it has none)
  std::string features;  // "+avx2,+fma,...": /proc/cpuinfo's flags, sorted
};
const HostTarget& host_target();

// The CPU devices' properties (target, cpu, features) for `tinydev devices`.
std::map<std::string, std::string> host_properties(const HostTarget& target = host_target());

}  // namespace tinydev::cpu
