// libFuzzer target: the settings parser. Input lines "NAME=value" become one environment; parsing
// it never crashes and fails only with InvalidArgument. Byte counts are fuzzed alongside.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>

#include "tinydev/config.hpp"
#include "tinydev/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  std::map<std::string, std::string, std::less<>> values;
  const auto known = tinydev::known_variables();
  while (!text.empty()) {
    const std::size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    const std::size_t eq = line.find('=');
    std::string name(line.substr(0, eq));
    // A short name picks a known variable by number, so values reach every parser.
    if (name.size() == 1) name = known[static_cast<unsigned char>(name[0]) % known.size()];
    values[name] = eq == std::string_view::npos ? std::string() : std::string(line.substr(eq + 1));
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  try {
    const tinydev::Settings s = tinydev::detail::parse_settings(values);
    if (tinydev::has_control_characters(s.cache_dir) || tinydev::has_control_characters(s.profile)) std::abort();
    if (s.debug < 0 || s.debug > 7 || s.compile_timeout_s < 1) std::abort();
  } catch (const tinydev::InvalidArgument&) {
  }
  for (const auto& [name, value] : values) {
    try {
      tinydev::parse_byte_count(value, "X");
    } catch (const tinydev::InvalidArgument&) {
    }
    (void)tinydev::closest_known_variable(name);
  }
  return 0;
}
