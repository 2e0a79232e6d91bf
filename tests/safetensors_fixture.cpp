// Writes the safetensors files the CLI test (cli_load_test.cmake) loads: `good` (random tensors
// of three dtypes, one empty), `truncated` (the same less its last bytes) and `hostile` (a header
// length of 2^63). Usage: tinydev_safetensors_fixture FOLDER
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tinydev/safetensors.hpp"

int main(int argc, char** argv) {
  using namespace tinydev;
  if (argc != 2) {
    std::fprintf(stderr, "usage: tinydev_safetensors_fixture FOLDER\n");
    return 2;
  }
  const std::string folder = argv[1];
  std::mt19937_64 rng(std::random_device{}());
  const auto random_bytes = [&](std::size_t n) {
    std::vector<std::byte> out(n);
    for (std::byte& b : out) b = static_cast<std::byte>(rng());
    return out;
  };
  const auto w = random_bytes(3u << 20), b = random_bytes(64 * 2), e = random_bytes(0);
  const SafetensorsEntry tensors[] = {{"layer.0.weight", dtypes::float32, {768, 1024}, w},
                                      {"layer.0.bias", dtypes::bfloat16, {64}, b},
                                      {"empty", dtypes::int64, {0, 4}, e}};
  write_safetensors(folder + "/good.safetensors", tensors, {{"format", "pt"}});
  std::ifstream in(folder + "/good.safetensors", std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ofstream(folder + "/truncated.safetensors", std::ios::binary).write(bytes.data(), bytes.size() - 1000);
  std::string hostile(8, '\0');
  hostile[7] = '\x80';  // 2^63 bytes of header claimed
  hostile += "{}";
  std::ofstream(folder + "/hostile.safetensors", std::ios::binary) << hostile;
  return 0;
}
