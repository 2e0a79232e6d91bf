#include "host.hpp"

#include <fmt/format.h>

#include <algorithm>
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

}  // namespace

const HostTarget& host_target() {
  static const HostTarget target = [] {
    std::ifstream file("/proc/cpuinfo");
    std::stringstream content;
    content << file.rdbuf();
    const std::string cpuinfo = content.str();
    HostTarget t;
    t.triple = kTriple;
    t.cpu = cpuinfo_field(cpuinfo, "model name");
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
