// libFuzzer target: device names. canonicalize never crashes, throws only InvalidArgument, is
// idempotent, and every accepted name is short printable text.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tinydev/error.hpp"
#include "tinydev/registry.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string name(reinterpret_cast<const char*>(data), size);
  std::string once;
  try {
    once = tinydev::canonicalize(name);
  } catch (const tinydev::InvalidArgument& e) {
    // Messages quote at most about 100 characters of the name, whatever its length.
    if (std::string(e.what()).size() > 600) std::abort();
    return 0;
  }
  if (tinydev::has_control_characters(once) || once.size() > name.size()) std::abort();
  if (tinydev::canonicalize(once) != once) std::abort();  // idempotent
  return 0;
}
