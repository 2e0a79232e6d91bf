// tinydev/safetensors.hpp: safetensors files (https://github.com/huggingface/safetensors): a strict
// header reader, and loading a whole file into Buffers on a device in one pass (docs/disk.md).
//
// A file is an 8-byte little-endian header length N, N bytes of JSON naming each tensor's dtype,
// shape and [begin, end) byte range in the data section that follows, and the data section. Every
// part is checked before it is used: the header is hostile until proven otherwise (a bad one is
// InvalidArgument saying what is wrong, never a crash, a hang, or an allocation of a size the
// file claims).
//
// Thread safety: the functions are reentrant; loads of different files may run concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tinydev/buffer.hpp"
#include "tinydev/dtype.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

struct SafetensorsTensor {
  std::string name;
  DType dtype;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0, end = 0;  // byte range in the data section
  std::uint64_t nbytes() const noexcept { return end - begin; }
  std::uint64_t numel() const noexcept { return nbytes() / dtype.itemsize; }
};

struct SafetensorsHeader {
  std::uint64_t header_bytes = 0;  // N, the JSON's length
  std::uint64_t data_offset = 0;   // 8 + N: where the data section starts in the file
  std::vector<SafetensorsTensor> tensors;       // in file order (by begin)
  std::map<std::string, std::string> metadata;  // the "__metadata__" strings
};

// The header limit of the format's reference reader (100 MB): a longer one is refused unread.
inline constexpr std::uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Parses and checks the header of a file of `file_size` bytes whose first bytes are `file_start`
// (the length and the N bytes of JSON, or more). The checks, those of the format's reference
// reader: N fits in the file and in the limit; the JSON is well formed, at most three levels deep,
// with no duplicate keys; each tensor has exactly dtype (one tinydev has), shape (non-negative
// integers) and data_offsets ([begin, end]); shape x itemsize is end - begin without overflow;
// the ranges, in file order, cover the data section with no overlap and no gap, and end exactly at
// the end of the file. InvalidArgument naming `what` (a path) and the problem otherwise.
SafetensorsHeader parse_safetensors_header(std::span<const std::byte> file_start, std::uint64_t file_size,
                                           std::string_view what = "safetensors header");

// Reads and checks the header of the file at `path` (IoError when it cannot be read).
SafetensorsHeader read_safetensors_header(const std::string& path);

// The safetensors name of a dtype ("F32") and back; InvalidArgument for dtypes the format or
// tinydev lacks.
std::string_view safetensors_dtype_name(DType dtype);
DType dtype_from_safetensors(std::string_view name);

// Writes `tensors` (name, dtype, shape, bytes) as a safetensors file, in the order given, with
// `metadata`; the bytes of each must be shape x itemsize. For tests, tools and examples.
struct SafetensorsEntry {
  std::string name;
  DType dtype;
  std::vector<std::uint64_t> shape;
  std::span<const std::byte> bytes;
};
void write_safetensors(const std::string& path, std::span<const SafetensorsEntry> tensors,
                       const std::map<std::string, std::string>& metadata = {});

struct LoadedTensor {
  std::string name;
  std::vector<std::uint64_t> shape;
  Buffer buffer;  // on the device; an empty tensor's is not allocated (there is nothing to hold)
};

struct LoadProgress {
  std::uint64_t bytes_done = 0, bytes_total = 0;
  std::size_t tensors_done = 0, tensors_total = 0;
  std::string_view tensor;  // the tensor being loaded
};
using LoadProgressCallback = std::function<void(const LoadProgress&)>;

// Loads every tensor of the safetensors file at `path` onto `device`, in one pass over the file
// in file order, through a DISK device on the file and tinydev::copy (copy_from_disk where the
// device has it). `progress` is called as bytes land (every 32 MiB at most, and after each
// tensor) on the calling thread. Returns once every byte is on the device (synchronized). On an
// error, buffers loaded so far are freed and nothing else changes.
std::vector<LoadedTensor> load_safetensors(const std::string& path, std::string_view device,
                                           const LoadProgressCallback& progress = {});

}  // namespace tinydev

TINYDEV_API_END
