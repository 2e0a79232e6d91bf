#include "tinydev/safetensors.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

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

namespace {

// Note [Header reading by events]
// The header is read as a stream of JSON events (nlohmann's SAX interface), straight into
// SafetensorsTensors: nothing but the tensors themselves is built, so a 100 MB hostile header
// costs memory in proportion to the tensors it names, not a document tree several times its
// size, and every rule (field names, a shape of at most kMaxRank sizes, two offsets) is checked
// as its token arrives.
class HeaderReader {
 public:
  HeaderReader(std::string_view what, std::uint64_t data_bytes, SafetensorsHeader& out)
      : what_(what), data_bytes_(data_bytes), out_(out) {}

  bool null() { return scalar("null"); }
  bool boolean(bool) { return scalar("a boolean"); }
  bool number_integer(std::int64_t) { return scalar("a negative integer"); }
  bool number_unsigned(std::uint64_t v) {
    if (where_ == Where::shape) {
      if (tensor_.shape.size() == kMaxRank) fail("shape has more than {} sizes", kMaxRank);
      tensor_.shape.push_back(v);
      return true;
    }
    if (where_ == Where::offsets) {
      if (offsets_ == 2) fail("data_offsets is not [begin, end]");
      (offsets_++ == 0 ? tensor_.begin : tensor_.end) = v;
      return true;
    }
    return scalar("a number");
  }
  bool number_float(double, const std::string&) { return scalar("a fraction"); }
  bool binary(nlohmann::json::binary_t&) { return scalar("binary data"); }
  bool string(std::string& v) {
    if (where_ == Where::metadata) {
      if (!out_.metadata.emplace(key_, v).second)
        throw InvalidArgument(fmt::format("{}: the key {} appears twice in one object", what_, quote_for_message(key_)));
      return true;
    }
    if (where_ == Where::tensor && key_ == "dtype") {
      try {
        tensor_.dtype = dtype_from_safetensors(v);
      } catch (const InvalidArgument& e) {
        fail("{}", e.what());
      }
      return true;
    }
    return scalar("a string");
  }
  bool start_object(std::size_t) {
    switch (where_) {
      case Where::top: where_ = Where::root; return true;
      case Where::root:
        if (key_ == "__metadata__") {
          if (seen_metadata_)
            throw InvalidArgument(fmt::format("{}: the key __metadata__ appears twice in one object", what_));
          seen_metadata_ = true;
          where_ = Where::metadata;
          return true;
        }
        if (key_.empty()) throw InvalidArgument(fmt::format("{}: a tensor has an empty name", what_));
        tensor_ = SafetensorsTensor{};
        tensor_.name = key_;
        fields_ = 0;
        where_ = Where::tensor;
        return true;
      default: return scalar("an object");
    }
  }
  bool key(std::string& k) {
    if (where_ == Where::tensor) {
      const unsigned field = k == "dtype" ? 1u : k == "shape" ? 2u : k == "data_offsets" ? 4u : 0u;
      if (!field) fail("has an unknown field {} (expected dtype, shape, data_offsets)", quote_for_message(k));
      if (fields_ & field) fail("the key {} appears twice in one object", k);
      fields_ |= field;
    }
    key_ = std::move(k);
    return true;
  }
  bool end_object() {
    switch (where_) {
      case Where::root: where_ = Where::done; return true;
      case Where::metadata: where_ = Where::root; return true;
      case Where::tensor: finish_tensor(); where_ = Where::root; return true;
      default: return true;
    }
  }
  bool start_array(std::size_t) {
    if (where_ == Where::tensor && key_ == "shape") {
      where_ = Where::shape;
      return true;
    }
    if (where_ == Where::tensor && key_ == "data_offsets") {
      where_ = Where::offsets;
      offsets_ = 0;
      return true;
    }
    return scalar("an array");
  }
  bool end_array() {
    if (where_ == Where::offsets && offsets_ != 2) fail("data_offsets is not [begin, end]");
    where_ = Where::tensor;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("{}: the header is not valid JSON: {}", what_, e.what()));
  }

 private:
  enum class Where { top, root, metadata, tensor, shape, offsets, done };

  template <class... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) const {
    throw InvalidArgument(fmt::format("{}: tensor {}: {}", what_, quote_for_message(tensor_.name),
                                      fmt::format(format, std::forward<Args>(args)...)));
  }
  // A value where it does not belong, said for where it is.
  bool scalar(std::string_view kind) {
    switch (where_) {
      case Where::top: throw InvalidArgument(fmt::format("{}: the header is not a JSON object", what_));
      case Where::root:
        if (key_ == "__metadata__") throw InvalidArgument(fmt::format("{}: __metadata__ is not an object of strings", what_));
        throw InvalidArgument(fmt::format("{}: tensor {} is not an object (it is {})", what_, quote_for_message(key_), kind));
      case Where::metadata:
        throw InvalidArgument(fmt::format("{}: __metadata__ {} is not a string", what_, quote_for_message(key_)));
      case Where::shape: fail("shape holds {}, not a non-negative integer", kind);
      case Where::offsets: fail("data_offsets holds {}, not a non-negative integer", kind);
      case Where::tensor:
        if (key_ == "dtype") fail("dtype is not a string");
        if (key_ == "shape") fail("shape is not an array of at most {} sizes", kMaxRank);
        fail("data_offsets is not [begin, end]");
      case Where::done: break;
    }
    throw InvalidArgument(fmt::format("{}: the header has {} after its end", what_, kind));
  }
  void finish_tensor() {
    if (fields_ != 7) fail("lacks one of dtype, shape and data_offsets");
    SafetensorsTensor& t = tensor_;
    std::uint64_t numel = 1, nbytes = 0;
    for (std::uint64_t d : t.shape)
      if (__builtin_mul_overflow(numel, d, &numel)) fail("the shape's element count overflows 64 bits");
    if (__builtin_mul_overflow(numel, std::uint64_t{t.dtype.itemsize}, &nbytes)) fail("its byte size overflows 64 bits");
    if (t.end < t.begin || t.end > data_bytes_)
      fail("data_offsets [{}, {}] is not a range inside the {}-byte data section", t.begin, t.end, data_bytes_);
    if (t.end - t.begin != nbytes)
      fail("shape x {} is {} bytes, but data_offsets [{}, {}] hold {}", safetensors_dtype_name(t.dtype), nbytes, t.begin,
           t.end, t.end - t.begin);
    out_.tensors.push_back(std::move(t));
  }

  std::string_view what_;
  std::uint64_t data_bytes_;
  SafetensorsHeader& out_;
  Where where_ = Where::top;
  std::string key_;
  SafetensorsTensor tensor_;
  unsigned fields_ = 0, offsets_ = 0;
  bool seen_metadata_ = false;
};

}  // namespace

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

  const std::uint64_t data_bytes = file_size - out.data_offset;
  HeaderReader reader(what, data_bytes, out);
  try {
    nlohmann::json::sax_parse(json.begin(), json.end(), &reader);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("{}: the header is not valid JSON: {}", what, e.what()));
  }
  // Duplicate names (a JSON object keeps one of them, hiding a tensor), found without a second
  // copy of every name: sort pointers to them.
  std::vector<const std::string*> names;
  names.reserve(out.tensors.size());
  for (const SafetensorsTensor& t : out.tensors) names.push_back(&t.name);
  std::sort(names.begin(), names.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
  for (std::size_t i = 1; i < names.size(); ++i)
    if (*names[i] == *names[i - 1])
      throw InvalidArgument(fmt::format("{}: the key {} appears twice in one object", what, quote_for_message(*names[i])));
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
    if (t.name.empty() || t.name == "__metadata__")
      throw InvalidArgument(fmt::format("write_safetensors: a tensor may not be named {}", quote_for_message(t.name)));
    std::uint64_t numel = 1, nbytes = 0;
    bool overflow = false;
    for (std::uint64_t d : t.shape) overflow |= __builtin_mul_overflow(numel, d, &numel);
    overflow |= __builtin_mul_overflow(numel, std::uint64_t{t.dtype.itemsize}, &nbytes);
    if (overflow || nbytes != t.bytes.size())
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
  // A relative path gets "./": "shm:x" would otherwise name shared memory, not the file read above.
  const std::string disk_name = "DISK:" + (path.starts_with('/') ? path : "./" + path);
  std::string canonical;
  try {
    canonical = canonicalize(disk_name);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("load_safetensors: {} cannot be a device name: {}", quote_for_message(path),
                                      e.what()));
  }
  if (canonical != disk_name)
    throw InvalidArgument(fmt::format("load_safetensors: {} ends in \":0\", which device names drop: rename the file",
                                      quote_for_message(path)));
  Compiled& dest = Device[device];
  if (dest.allocator().file_reader())
    throw InvalidArgument(fmt::format("load_safetensors: cannot load onto {}: every tensor would be written at the "
                                      "start of that one file; load onto a compute device (LLVM, CLANG, CUDA, NULL)",
                                      dest.name()));
  // The whole file as one DISK buffer; each tensor a view of it at its absolute offset.
  Buffer file(disk_name, static_cast<std::size_t>(header.data_offset + (header.tensors.empty() ? 0 : header.tensors.back().end)),
              dtypes::uint8);
  if (file.nbytes() > 0) {
    file.allocate();
    // Note [One file for header and data]: the header was read through a descriptor of its own,
    // the data is read through the DISK device's, which a buffer still open on the path may have
    // opened before the file was replaced. The header as the DISK device reads it must be the one
    // checked, or the tensors would be another file's bytes under this file's layout.
    std::vector<std::byte> head(static_cast<std::size_t>(header.data_offset));
    file.view(head.size(), dtypes::uint8, 0).ensure_allocated().copyout(head);
    std::optional<SafetensorsHeader> seen;
    try {
      seen = parse_safetensors_header(head, file.nbytes(), path);
    } catch (const Error&) {
    }
    const auto same_layout = [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
      return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.begin == b.begin && a.end == b.end;
    };
    if (!seen || seen->data_offset != header.data_offset ||
        !std::ranges::equal(seen->tensors, header.tensors, same_layout))
      throw IoError(fmt::format("load_safetensors: {} changed while it was being loaded (replaced or rewritten: the "
                                "DISK device, opened on it earlier by a buffer still alive, reads another header); "
                                "drop the DISK buffers on it and load again",
                                quote_for_message(path)));
  }
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
        try {
          if (off == 0 && n == t.nbytes()) {
            copy(buffer, file.view(static_cast<std::size_t>(t.numel()), t.dtype,
                                   static_cast<std::size_t>(header.data_offset + t.begin)));
          } else {
            copy(buffer.view(static_cast<std::size_t>(n), dtypes::uint8, static_cast<std::size_t>(off)),
                 file.view(static_cast<std::size_t>(n), dtypes::uint8,
                           static_cast<std::size_t>(header.data_offset + t.begin + off)));
          }
        } catch (const IoError& e) {
          // The DISK device names the file and the bytes; a user loading a model wants the tensor.
          throw IoError(fmt::format("load_safetensors: tensor '{}' of {} (file bytes {} to {}) could not be read: {}",
                                    quote_for_message(t.name), quote_for_message(path), header.data_offset + t.begin,
                                    header.data_offset + t.end, e.what()));
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
