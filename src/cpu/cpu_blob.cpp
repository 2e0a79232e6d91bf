#include "cpu_blob.hpp"

#include <fmt/format.h>

#include <cctype>
#include <cstring>

#include "tinydev/error.hpp"

namespace tinydev::cpu {

namespace {
constexpr char kMagic[8] = {'T', 'D', 'V', 'C', 'P', 'U', '0', '1'};

void put16(Blob& out, std::uint32_t v) {
  out.push_back(static_cast<std::byte>(v & 0xff));
  out.push_back(static_cast<std::byte>((v >> 8) & 0xff));
}
}  // namespace

Blob wrap_object(std::span<const std::byte> object, const std::vector<KernelInfo>& kernels) {
  Blob out;
  out.reserve(object.size() + 64);
  for (char c : kMagic) out.push_back(static_cast<std::byte>(c));
  const std::uint32_t count = static_cast<std::uint32_t>(kernels.size());
  put16(out, count & 0xffff);
  put16(out, count >> 16);
  for (const KernelInfo& k : kernels) {
    put16(out, static_cast<std::uint32_t>(k.name.size()));
    for (char c : k.name) out.push_back(static_cast<std::byte>(c));
    put16(out, k.signature.num_buffers);
    put16(out, k.signature.num_values);
  }
  // A u16 count of zero bytes, then those bytes, so the object starts 8-byte aligned in the blob
  // (its ELF structures are read in place).
  const std::uint32_t padding = static_cast<std::uint32_t>((8 - (out.size() + 2) % 8) % 8);
  put16(out, padding);
  out.insert(out.end(), padding, std::byte{0});
  out.insert(out.end(), object.begin(), object.end());
  return out;
}

std::optional<KernelSignature> UnwrappedBlob::signature_of(std::string_view name) const {
  for (const KernelInfo& k : kernels)
    if (k.name == name) return k.signature;
  return std::nullopt;
}

UnwrappedBlob unwrap_object(std::span<const std::byte> blob) {
  if (blob.size() < 12 || std::memcmp(blob.data(), kMagic, 8) != 0) return UnwrappedBlob{blob, {}};
  const auto* p = reinterpret_cast<const unsigned char*>(blob.data());
  std::size_t at = 8;
  auto need = [&](std::size_t n) {
    if (blob.size() - at < n) throw InvalidArgument("a CPU kernel blob's signature header is truncated: recompile it");
  };
  auto get16 = [&] {
    need(2);
    const std::uint32_t v = p[at] | (p[at + 1] << 8);
    at += 2;
    return v;
  };
  const std::uint32_t count = get16() | (get16() << 16);
  UnwrappedBlob out;
  for (std::uint32_t i = 0; i < count; ++i) {
    const std::uint32_t len = get16();
    need(len);
    KernelInfo k;
    k.name.assign(reinterpret_cast<const char*>(p + at), len);
    at += len;
    k.signature.num_buffers = get16();
    k.signature.num_values = get16();
    out.kernels.push_back(std::move(k));
  }
  const std::uint32_t padding = get16();
  need(padding);
  if (padding >= 8) throw InvalidArgument("a CPU kernel blob's signature header is malformed: recompile it");
  at += padding;
  out.object = blob.subspan(at);
  return out;
}

std::vector<KernelInfo> c_signatures(std::string_view src) {
  std::vector<KernelInfo> out;
  int depth = 0;
  for (std::size_t i = 0; i < src.size(); ++i) {
    const char c = src[i];
    if (c == '{') ++depth;
    else if (c == '}') --depth;
    if (depth != 0 || c != '(') continue;
    // An identifier right before '(' at top level, preceded by `void`, followed by `) {`.
    std::size_t end = i;
    while (end > 0 && std::isspace(static_cast<unsigned char>(src[end - 1]))) --end;
    std::size_t begin = end;
    while (begin > 0 && (std::isalnum(static_cast<unsigned char>(src[begin - 1])) || src[begin - 1] == '_')) --begin;
    if (begin == end) continue;
    std::string_view name = src.substr(begin, end - begin);
    std::size_t line = src.rfind('\n', begin);
    line = line == std::string_view::npos ? 0 : line + 1;
    // The return type must be exactly `void` (not `void*`), on the line of the name.
    std::string_view before = src.substr(line, begin - line);
    while (!before.empty() && std::isspace(static_cast<unsigned char>(before.back()))) before.remove_suffix(1);
    if (!before.ends_with("void") || before.find("static") != std::string_view::npos) continue;
    std::size_t close = src.find(')', i);
    if (close == std::string_view::npos) break;
    std::size_t after = close + 1;
    while (after < src.size() && std::isspace(static_cast<unsigned char>(src[after]))) ++after;
    if (after >= src.size() || src[after] != '{') continue;
    std::string_view params = src.substr(i + 1, close - i - 1);
    KernelSignature sig;
    bool readable = params.find('(') == std::string_view::npos && params.find("...") == std::string_view::npos;
    std::size_t start = 0;
    while (readable && start <= params.size()) {
      std::size_t comma = params.find(',', start);
      std::string_view param = params.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
      std::size_t a = param.find_first_not_of(" \t\n");
      std::string_view trimmed = a == std::string_view::npos ? std::string_view() : param.substr(a);
      if (!(trimmed.empty() || trimmed == "void")) {
        if (param.find('*') != std::string_view::npos) {
          if (sig.num_values) readable = false;  // a buffer after a value: not the kernel ABI
          ++sig.num_buffers;
        } else if (param.find("float") != std::string_view::npos || param.find("double") != std::string_view::npos ||
                   param.find("long") != std::string_view::npos || param.find("_Float16") != std::string_view::npos ||
                   param.find("__bf16") != std::string_view::npos) {
          readable = false;  // not an int32 value: not the kernel ABI
        } else {
          ++sig.num_values;
        }
      }
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    if (readable) out.push_back(KernelInfo{std::string(name), sig});
  }
  return out;
}

}  // namespace tinydev::cpu
