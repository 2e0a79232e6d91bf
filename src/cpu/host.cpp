#include "host.hpp"

#include <fmt/format.h>

#if defined(__x86_64__)
#include <cpuid.h>
#elif defined(__aarch64__)
#include <sys/auxv.h>
#endif

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

namespace tinydev::cpu {

namespace {

#if defined(__x86_64__)
constexpr const char* kTriple = "x86_64-pc-linux-gnu";
constexpr std::string_view kFlagsField = "flags";
#elif defined(__aarch64__)
constexpr const char* kTriple = "aarch64-unknown-linux-gnu";
constexpr std::string_view kFlagsField = "Features";
#else
#error "the CPU backends support x86-64 and AArch64 hosts"
#endif

// The value of the first "name : value" line of /proc/cpuinfo whose name is `field`.
std::string cpuinfo_field(const std::string& cpuinfo, std::string_view field) {
  std::istringstream in(cpuinfo);
  for (std::string line; std::getline(in, line);) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    while (!name.empty() && (name.back() == ' ' || name.back() == '\t')) name.pop_back();
    if (name != field) continue;
    std::string value = line.substr(colon + 1);
    value.erase(0, value.find_first_not_of(' '));
    return value;
  }
  return "";
}

#if defined(__x86_64__)
// Leaves 0, 1 (without EBX, which holds the APIC id of whichever core runs this), 7.0 and 7.1,
// 0x80000001, XCR0 when the OS enabled XSAVE, and the brand string.
std::string cpu_fingerprint(std::string& brand) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  std::string out;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return "";
  const unsigned max_leaf = a;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  out += fmt::format("{} max:{:x}", vendor, max_leaf);
  __get_cpuid(1, &a, &b, &c, &d);
  out += fmt::format(" 1:{:08x},{:08x},{:08x}", a, c, d);
  const bool osxsave = (c >> 27) & 1;
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    out += fmt::format(" 7.0:{:08x},{:08x},{:08x}", b, c, d);
    __cpuid_count(7, 1, a, b, c, d);
    out += fmt::format(" 7.1:{:08x},{:08x},{:08x},{:08x}", a, b, c, d);
  }
  if (__get_cpuid(0x80000001, &a, &b, &c, &d)) out += fmt::format(" e1:{:08x},{:08x}", c, d);
  if (osxsave) {
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    out += fmt::format(" xcr0:{:08x}{:08x}", hi, lo);
  }
  char text[49] = {};
  unsigned regs[12] = {};
  if (__get_cpuid(0x80000000, &a, &b, &c, &d) && a >= 0x80000004) {
    for (unsigned leaf = 0; leaf < 3; ++leaf)
      __get_cpuid(0x80000002 + leaf, &regs[leaf * 4], &regs[leaf * 4 + 1], &regs[leaf * 4 + 2], &regs[leaf * 4 + 3]);
    std::memcpy(text, regs, 48);
    brand = text;
    brand.erase(0, brand.find_first_not_of(' '));
  }
  return out + " " + brand;
}
#elif defined(__aarch64__)
std::string cpu_fingerprint(std::string&) {
  std::ifstream midr("/sys/devices/system/cpu/cpu0/regs/identification/midr_el1");
  std::string id;
  midr >> id;
  return fmt::format("hwcap:{:x} hwcap2:{:x} midr:{}", getauxval(AT_HWCAP), getauxval(AT_HWCAP2), id);
}
#endif

}  // namespace

const HostTarget& host_target() {
  static const HostTarget target = [] {
    std::ifstream file("/proc/cpuinfo");
    std::stringstream content;
    content << file.rdbuf();
    const std::string cpuinfo = content.str();
    HostTarget t;
    t.triple = kTriple;
    std::string brand;
    t.fingerprint = cpu_fingerprint(brand);
    t.cpu = brand.empty() ? cpuinfo_field(cpuinfo, "model name") : brand;
    if (t.cpu.empty()) t.cpu = cpuinfo_field(cpuinfo, "CPU part");
    if (t.cpu.empty()) t.cpu = "unknown";
    std::vector<std::string> flags;
    std::istringstream words(cpuinfo_field(cpuinfo, kFlagsField));
    for (std::string w; words >> w;) flags.push_back("+" + w);
    std::sort(flags.begin(), flags.end());
    t.features = fmt::format("{}", fmt::join(flags, ","));
    return t;
  }();
  return target;
}

std::map<std::string, std::string> host_properties(const HostTarget& t) {
  int enabled = 0;
  for (char c : t.features) enabled += c == '+';
  return {{"target", t.triple}, {"cpu", t.cpu}, {"cpu features", fmt::format("{} enabled", enabled)}};
}

}  // namespace tinydev::cpu
