#include "tinydev/safetensors.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "tinydev/device.hpp"
#include "tinydev/error.hpp"
#include "tinydev/registry.hpp"

namespace tinydev {

namespace {

struct DTypeName {
  std::string_view name;
  DType dtype;
};
constexpr DTypeName kDTypes[] = {
    {"BOOL", dtypes::bool_},   {"U8", dtypes::uint8},     {"I8", dtypes::int8},       {"I16", dtypes::int16},
    {"U16", dtypes::uint16},   {"F16", dtypes::float16},  {"BF16", dtypes::bfloat16}, {"I32", dtypes::int32},
    {"U32", dtypes::uint32},   {"F32", dtypes::float32},  {"F64", dtypes::float64},   {"I64", dtypes::int64},
    {"U64", dtypes::uint64},
};
// Names the format has and tinydev does not (so the error can say which it is).
constexpr std::string_view kFormatOnlyDTypes[] = {"F8_E5M2", "F8_E4M3", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64"};

constexpr int kMaxDepth = 3;       // { "name": { "shape": [ ... ] } }
constexpr std::size_t kMaxRank = 64;

std::uint64_t read_le64(const std::byte* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | static_cast<std::uint8_t>(p[i]);
  return v;
}

// Note [Header depth before parsing]
// The JSON is scanned for its nesting depth before the parser sees it: a valid header is at most
// three levels deep, and refusing "[[[[..." here keeps a hostile header from costing the parser
// memory or stack in proportion to its depth.
void check_depth(std::string_view json, std::string_view what) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '{' || c == '[') {
      if (++depth > kMaxDepth)
        throw InvalidArgument(fmt::format("{}: the header nests deeper than {} levels (at byte {}); a safetensors "
                                          "header is an object of tensor objects",
                                          what, kMaxDepth, 8 + i));
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
}

std::uint64_t as_offset(const nlohmann::json& v, std::string_view what, const std::string& name,
                        std::string_view field) {
  if (!v.is_number_unsigned())
    throw InvalidArgument(fmt::format("{}: tensor {}: {} holds {}, not a non-negative integer", what,
                                      quote_for_message(name), field, quote_for_message(v.dump(), 40)));
  return v.get<std::uint64_t>();
}

}  // namespace

std::string_view safetensors_dtype_name(DType dtype) {
  for (const DTypeName& d : kDTypes)
    if (d.dtype == dtype) return d.name;
  throw InvalidArgument(fmt::format("dtype {} has no safetensors name", dtype.name));
}

DType dtype_from_safetensors(std::string_view name) {
  for (const DTypeName& d : kDTypes)
    if (d.name == name) return d.dtype;
  for (std::string_view n : kFormatOnlyDTypes)
    if (n == name)
      throw InvalidArgument(fmt::format("safetensors dtype {} has no tinydev dtype; convert the file to one of "
                                        "BOOL, U8, I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64",
                                        name));
  throw InvalidArgument(fmt::format("{} is not a safetensors dtype", quote_for_message(name, 40)));
}

SafetensorsHeader parse_safetensors_header(std::span<const std::byte> file_start, std::uint64_t file_size,
                                           std::string_view what) {
  if (file_size < 8 || file_start.size() < 8)
    throw InvalidArgument(fmt::format("{}: {} bytes is too short for a safetensors file (8 bytes of header length "
                                      "come first)",
                                      what, file_size));
  if (file_start.size() > file_size)
    throw InvalidArgument(fmt::format("{}: {} bytes given for a file of {}", what, file_start.size(), file_size));
  SafetensorsHeader out;
  out.header_bytes = read_le64(file_start.data());
  if (out.header_bytes > file_size - 8)
    throw InvalidArgument(fmt::format("{}: the header claims {} bytes, but only {} follow the length: the file is "
                                      "truncated or not a safetensors file",
                                      what, out.header_bytes, file_size - 8));
  if (out.header_bytes > kMaxSafetensorsHeaderBytes)
    throw InvalidArgument(fmt::format("{}: the header claims {} bytes, more than the format's limit of {}", what,
                                      out.header_bytes, kMaxSafetensorsHeaderBytes));
  if (out.header_bytes < 2)
    throw InvalidArgument(fmt::format("{}: the header is {} bytes; it must hold at least {{}}", what, out.header_bytes));
  if (file_start.size() < 8 + out.header_bytes)
    throw InvalidArgument(fmt::format("{}: {} bytes given, but the header ends at byte {}", what, file_start.size(),
                                      8 + out.header_bytes));
  out.data_offset = 8 + out.header_bytes;
  const std::string_view json(reinterpret_cast<const char*>(file_start.data()) + 8, out.header_bytes);
  if (json.front() != '{')
    throw InvalidArgument(fmt::format("{}: the header does not start with '{{' (it starts with {}): not a "
                                      "safetensors file",
                                      what, quote_for_message(json.substr(0, 8))));
  check_depth(json, what);

  // Duplicate keys are refused (a JSON parser would keep the last one, hiding a tensor).
  std::vector<std::set<std::string>> open_objects;
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(
        json.begin(), json.end(),
        [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
          using E = nlohmann::json::parse_event_t;
          if (event == E::object_start) open_objects.emplace_back();
          else if (event == E::object_end) open_objects.pop_back();
          else if (event == E::key && !open_objects.back().insert(parsed.get<std::string>()).second)
            throw InvalidArgument(fmt::format("{}: the key {} appears twice in one object", what,
                                              quote_for_message(parsed.get<std::string>())));
          return true;
        });
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("{}: the header is not valid JSON: {}", what, e.what()));
  }
  if (!root.is_object()) throw InvalidArgument(fmt::format("{}: the header is not a JSON object", what));

  const std::uint64_t data_bytes = file_size - out.data_offset;
  for (const auto& [name, value] : root.items()) {
    if (name == "__metadata__") {
      if (!value.is_object())
        throw InvalidArgument(fmt::format("{}: __metadata__ is not an object of strings", what));
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string())
          throw InvalidArgument(fmt::format("{}: __metadata__ {} is not a string", what, quote_for_message(k)));
        out.metadata.emplace(k, v.get<std::string>());
      }
      continue;
    }
    if (name.empty()) throw InvalidArgument(fmt::format("{}: a tensor has an empty name", what));
    if (!value.is_object())
      throw InvalidArgument(fmt::format("{}: tensor {} is not an object", what, quote_for_message(name)));
    for (const auto& [k, v] : value.items()) {
      (void)v;
      if (k != "dtype" && k != "shape" && k != "data_offsets")
        throw InvalidArgument(fmt::format("{}: tensor {} has an unknown field {} (expected dtype, shape, "
                                          "data_offsets)",
                                          what, quote_for_message(name), quote_for_message(k)));
    }
    if (!value.contains("dtype") || !value.contains("shape") || !value.contains("data_offsets"))
      throw InvalidArgument(fmt::format("{}: tensor {} lacks one of dtype, shape and data_offsets", what,
                                        quote_for_message(name)));
    SafetensorsTensor t;
    t.name = name;
    const nlohmann::json& dtype = value["dtype"];
    if (!dtype.is_string())
      throw InvalidArgument(fmt::format("{}: tensor {}: dtype is not a string", what, quote_for_message(name)));
    try {
      t.dtype = dtype_from_safetensors(dtype.get<std::string>());
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("{}: tensor {}: {}", what, quote_for_message(name), e.what()));
    }
    const nlohmann::json& shape = value["shape"];
    if (!shape.is_array() || shape.size() > kMaxRank)
      throw InvalidArgument(fmt::format("{}: tensor {}: shape is not an array of at most {} sizes", what,
                                        quote_for_message(name), kMaxRank));
    std::uint64_t numel = 1;
    for (const nlohmann::json& dim : shape) {
      t.shape.push_back(as_offset(dim, what, name, "shape"));
      if (__builtin_mul_overflow(numel, t.shape.back(), &numel))
        throw InvalidArgument(fmt::format("{}: tensor {}: the shape's element count overflows 64 bits", what,
                                          quote_for_message(name)));
    }
    const nlohmann::json& offsets = value["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2)
      throw InvalidArgument(fmt::format("{}: tensor {}: data_offsets is not [begin, end]", what,
                                        quote_for_message(name)));
    t.begin = as_offset(offsets[0], what, name, "data_offsets");
    t.end = as_offset(offsets[1], what, name, "data_offsets");
    std::uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, std::uint64_t{t.dtype.itemsize}, &nbytes))
      throw InvalidArgument(fmt::format("{}: tensor {}: its byte size overflows 64 bits", what, quote_for_message(name)));
    if (t.end < t.begin || t.end > data_bytes)
      throw InvalidArgument(fmt::format("{}: tensor {}: data_offsets [{}, {}] is not a range inside the {}-byte data "
                                        "section",
                                        what, quote_for_message(name), t.begin, t.end, data_bytes));
    if (t.end - t.begin != nbytes)
      throw InvalidArgument(fmt::format("{}: tensor {}: shape x {} is {} bytes, but data_offsets [{}, {}] hold {}",
                                        what, quote_for_message(name), safetensors_dtype_name(t.dtype), nbytes,
                                        t.begin, t.end, t.end - t.begin));
    out.tensors.push_back(std::move(t));
  }
  std::stable_sort(out.tensors.begin(), out.tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t covered = 0;
  for (const SafetensorsTensor& t : out.tensors) {
    if (t.begin != covered)
      throw InvalidArgument(fmt::format("{}: tensor {} starts at byte {} of the data section, but the tensors before "
                                        "it end at {}: {}",
                                        what, quote_for_message(t.name), t.begin, covered,
                                        t.begin < covered ? "they overlap" : "there is a gap"));
    covered = t.end;
  }
  if (covered != data_bytes)
    throw InvalidArgument(fmt::format("{}: the tensors cover {} bytes of the {}-byte data section: the file has {} "
                                      "bytes that no tensor names",
                                      what, covered, data_bytes, data_bytes - covered));
  return out;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) throw IoError(fmt::format("cannot open {}: {}", quote_for_message(path), std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    throw InvalidArgument(fmt::format("{} is not a regular file", quote_for_message(path)));
  const auto size = static_cast<std::uint64_t>(st.st_size);
  const auto read_exact = [&](std::byte* dest, std::size_t n, std::uint64_t offset) {
    std::size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd, dest + done, n - done, static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        throw IoError(fmt::format("reading the header of {} failed: {}", quote_for_message(path),
                                  r < 0 ? std::strerror(errno) : "the file ended"));
      done += static_cast<std::size_t>(r);
    }
  };
  std::byte length[8];
  if (size < 8) return parse_safetensors_header({}, size, path);  // the error says why
  read_exact(length, 8, 0);
  const std::uint64_t n = read_le64(length);
  // Checked before a byte is allocated for it.
  if (n > size - 8 || n > kMaxSafetensorsHeaderBytes) return parse_safetensors_header(length, size, path);
  std::vector<std::byte> head(8 + n);
  std::memcpy(head.data(), length, 8);
  read_exact(head.data() + 8, n, 8);
  return parse_safetensors_header(head, size, path);
}

void write_safetensors(const std::string& path, std::span<const SafetensorsEntry> tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const SafetensorsEntry& t : tensors) {
    std::uint64_t numel = 1;
    for (std::uint64_t d : t.shape) numel *= d;
    if (numel * t.dtype.itemsize != t.bytes.size())
      throw InvalidArgument(fmt::format("write_safetensors: tensor {} has {} bytes for a shape of {} x {}",
                                        quote_for_message(t.name), t.bytes.size(), numel, t.dtype.name));
    if (header.contains(t.name))
      throw InvalidArgument(fmt::format("write_safetensors: tensor {} is given twice", quote_for_message(t.name)));
    header[t.name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string json = header.dump();
  json.resize((json.size() + 7) / 8 * 8, ' ');  // the reference writer aligns the data section to 8
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(fmt::format("cannot create {}: {}", quote_for_message(path), std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  const auto write_all = [&](const void* data, std::size_t n) {
    const auto* p = static_cast<const std::byte*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw IoError(fmt::format("writing {} failed: {}", quote_for_message(path), std::strerror(errno)));
      p += w;
      n -= static_cast<std::size_t>(w);
    }
  };
  std::byte length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<std::byte>(json.size() >> (8 * i));
  write_all(length, 8);
  write_all(json.data(), json.size());
  for (const SafetensorsEntry& t : tensors) write_all(t.bytes.data(), t.bytes.size());
}

std::vector<LoadedTensor> load_safetensors(const std::string& path, std::string_view device,
                                           const LoadProgressCallback& progress) {
  const SafetensorsHeader header = read_safetensors_header(path);
  const std::string disk_name = "DISK:" + path;
  if (canonicalize(disk_name) != disk_name)
    throw InvalidArgument(fmt::format("load_safetensors: {} ends in \":0\", which device names drop: rename the file",
                                      quote_for_message(path)));
  Compiled& dest = Device[device];
  // The whole file as one DISK buffer; each tensor a view of it at its absolute offset.
  Buffer file(disk_name, static_cast<std::size_t>(header.data_offset + (header.tensors.empty() ? 0 : header.tensors.back().end)),
              dtypes::uint8);
  if (file.nbytes() > 0) file.allocate();
  LoadProgress p;
  p.tensors_total = header.tensors.size();
  p.bytes_total = header.tensors.empty() ? 0 : header.tensors.back().end;
  if (progress) progress(p);
  constexpr std::uint64_t kPiece = 32u << 20;  // progress granularity
  std::vector<LoadedTensor> out;
  out.reserve(header.tensors.size());
  for (const SafetensorsTensor& t : header.tensors) {
    Buffer buffer(dest.name(), static_cast<std::size_t>(t.numel()), t.dtype);
    p.tensor = t.name;
    if (t.nbytes() > 0) {
      buffer.allocate();
      for (std::uint64_t off = 0; off < t.nbytes(); off += kPiece) {
        const std::uint64_t n = std::min(kPiece, t.nbytes() - off);
        if (off == 0 && n == t.nbytes()) {
          copy(buffer, file.view(static_cast<std::size_t>(t.numel()), t.dtype,
                                 static_cast<std::size_t>(header.data_offset + t.begin)));
        } else {
          copy(buffer.view(static_cast<std::size_t>(n), dtypes::uint8, static_cast<std::size_t>(off)),
               file.view(static_cast<std::size_t>(n), dtypes::uint8,
                         static_cast<std::size_t>(header.data_offset + t.begin + off)));
        }
        p.bytes_done += n;
        if (progress && off + n < t.nbytes()) progress(p);
      }
    }
    ++p.tensors_done;
    if (progress) progress(p);
    out.push_back(LoadedTensor{t.name, t.shape, std::move(buffer)});
  }
  dest.synchronize();
  return out;
}

}  // namespace tinydev
