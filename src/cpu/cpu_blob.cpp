#include "cpu_blob.hpp"

#include <fmt/format.h>

#include <algorithm>
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
  // Each length and count is stored in 16 bits: a kernel that does not fit (a name of 64 KiB)
  // is left out, so its launches are not checked, rather than written wrong.
  auto fits = [](const KernelInfo& k) {
    return k.name.size() <= 0xffff && k.signature.num_buffers <= 0xffff && k.signature.num_values <= 0xffff;
  };
  const auto count = static_cast<std::uint32_t>(std::count_if(kernels.begin(), kernels.end(), fits));
  put16(out, count & 0xffff);
  put16(out, count >> 16);
  for (const KernelInfo& k : kernels) {
    if (!fits(k)) continue;
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

namespace {

// ASCII, whatever the locale (<cctype> follows it): LLVM IR's names and keywords are ASCII.
bool is_ir_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
         c == '$' || c == '-';
}
bool is_ir_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f'; }

// The kernel-ABI reading of one parameter ("ptr noalias noundef %0", "i32 noundef %n"): a buffer,
// an int32 value, or neither.
enum class ParamKind { buffer, value, other };
ParamKind param_kind(std::string_view param) {
  const std::size_t a = param.find_first_not_of(" \t\r\n");
  if (a == std::string_view::npos) return ParamKind::other;
  param.remove_prefix(a);
  // Passed in memory the callee owns a copy of, or a hidden return slot: not the kernel ABI.
  for (std::string_view attribute : {"byval", "byref", "sret", "inalloca", "preallocated"})
    for (std::size_t at = param.find(attribute); at != std::string_view::npos; at = param.find(attribute, at + 1)) {
      const bool starts = at == 0 || !is_ir_name_char(param[at - 1]);
      const std::size_t after = at + attribute.size();
      const bool ends = after == param.size() || !is_ir_name_char(param[after]);
      if (starts && ends) return ParamKind::other;
    }
  std::size_t type_end = 0;
  while (type_end < param.size() && !is_ir_space(param[type_end])) ++type_end;
  const std::string_view type = param.substr(0, type_end);
  if (type == "ptr" || (type.size() > 1 && type.back() == '*')) return ParamKind::buffer;  // typed pointers too
  if (type == "i32") return ParamKind::value;
  return ParamKind::other;
}

}  // namespace

std::vector<KernelInfo> ir_signatures(std::string_view ir) {
  std::vector<KernelInfo> out;
  std::size_t line_start = 0;
  while (line_start < ir.size()) {
    std::size_t line_end = ir.find('\n', line_start);
    if (line_end == std::string_view::npos) line_end = ir.size();
    const std::string_view line = ir.substr(line_start, line_end - line_start);
    line_start = line_end + 1;
    if (!line.starts_with("define ")) continue;
    // define [linkage] [visibility] [dso_local] [cc] [ret attrs] <ret type> @name(<params>) ...
    const std::size_t at = line.find('@');
    if (at == std::string_view::npos) continue;
    const std::string_view head = line.substr(0, at);
    bool local = false;
    for (std::string_view linkage : {" internal ", " private "})
      if (head.find(linkage) != std::string_view::npos) local = true;
    if (local) continue;  // `static` in C: not callable from outside the object
    std::size_t i = at + 1;
    std::string name;
    if (i < line.size() && line[i] == '"') {
      const std::size_t close = line.find('"', i + 1);
      if (close == std::string_view::npos) continue;
      name = std::string(line.substr(i + 1, close - i - 1));
      i = close + 1;
    } else {
      while (i < line.size() && is_ir_name_char(line[i])) name += line[i++];
    }
    if (name.empty() || i >= line.size() || line[i] != '(') continue;
    // The parameter list, split at top-level commas (types nest in (), [], {}, <>).
    std::vector<std::string_view> params;
    int depth = 0;
    std::size_t param_start = i + 1;
    bool closed = false;
    for (std::size_t j = i + 1; j < line.size() && !closed; ++j) {
      const char c = line[j];
      if (c == '(' || c == '[' || c == '{' || c == '<') ++depth;
      else if ((c == ']' || c == '}' || c == '>') && depth > 0) --depth;
      else if (c == ')') {
        if (depth == 0) {
          params.push_back(line.substr(param_start, j - param_start));
          closed = true;
        } else {
          --depth;
        }
      } else if (c == ',' && depth == 0) {
        params.push_back(line.substr(param_start, j - param_start));
        param_start = j + 1;
      }
    }
    if (!closed) continue;
    if (params.size() == 1 && params[0].find_first_not_of(" \t") == std::string_view::npos) params.clear();
    KernelSignature sig;
    bool readable = true;
    for (std::string_view p : params) {
      switch (param_kind(p)) {
        case ParamKind::buffer:
          if (sig.num_values) readable = false;  // a buffer after a value: not the kernel ABI
          ++sig.num_buffers;
          break;
        case ParamKind::value:
          ++sig.num_values;
          break;
        case ParamKind::other:
          readable = false;  // a float, 64-bit or aggregate value, or `...`
          break;
      }
    }
    // The blob header stores each length and count in 16 bits.
    if (readable && name.size() <= 0xffff && sig.num_buffers <= 0xffff && sig.num_values <= 0xffff)
      out.push_back(KernelInfo{std::move(name), sig});
  }
  return out;
}

}  // namespace tinydev::cpu
