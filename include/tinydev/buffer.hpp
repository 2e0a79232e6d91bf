// tinydev/buffer.hpp: Buffer, a typed range of device memory with lazy allocation and views.
//
// A Buffer is a reference-counted handle, as in the seed: copies of a Buffer refer to the same
// memory. A view (`view(size, dtype, offset)`) refers to a range of its base and keeps the base
// alive; a view of a view is rooted at the base. The memory goes back to the device's allocator
// when the last handle to the base goes.
//
// Thread safety: distinct Buffers may be used from different threads. Allocation is serialized
// per base: ensure_allocated() of one Buffer, or of views of one base, from several threads at
// once allocates once (allocate() then throws for all but one, as it would one after another).
// copyin/copyout/as_buffer of an allocated Buffer may run concurrently (they are plain copies of
// device memory).
//
// Ownership: a base Buffer owns its memory, allocated or adopted; while it holds it, the
// allocator refuses a plain free of that allocation and a second adoption of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tinydev/dtype.hpp"
#include "tinydev/memory.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

// Bytes from Buffer::as_buffer: either a zero-copy window on host-visible device memory, or an
// owned copy. A zero-copy window is only valid while the Buffer is alive (the seed's "use after
// free" warning).
class HostBytes {
 public:
  explicit HostBytes(std::span<std::byte> borrowed) : view_(borrowed) {}
  explicit HostBytes(std::vector<std::byte> owned) : owned_(std::move(owned)), view_(owned_) {}
  HostBytes(HostBytes&& other) noexcept
      : owned_(std::move(other.owned_)), view_(other.is_zero_copy() ? other.view_ : owned_) {}
  HostBytes(const HostBytes&) = delete;
  HostBytes& operator=(const HostBytes&) = delete;

  std::span<std::byte> bytes() const noexcept { return view_; }
  std::byte* data() const noexcept { return view_.data(); }
  std::size_t size() const noexcept { return view_.size(); }
  bool is_zero_copy() const noexcept { return owned_.empty() && !view_.empty(); }
  template <class T>
  std::span<T> as() const noexcept {
    return {reinterpret_cast<T*>(view_.data()), view_.size() / sizeof(T)};
  }

 private:
  std::vector<std::byte> owned_;
  std::span<std::byte> view_;
};

class Buffer {
 public:
  struct Params {
    BufferOptions options{};
    // Memory to adopt instead of allocating (freed through the device's allocator at the end): a
    // live allocation of the device's allocator that no Buffer owns, at least nbytes() long. Its
    // size is the one the allocator handed it out with (allocation().size), whatever `size` says.
    std::optional<Allocation> adopt{};
    // Bytes to copy in right away (allocates); must be exactly nbytes().
    std::span<const std::byte> initial_value{};
    bool preallocate = false;
  };

  // A buffer of `size` elements of `dtype` on `device` (any spelling of a device name). Nothing
  // is allocated until allocate()/ensure_allocated() unless `params` asks for it.
  Buffer(std::string_view device, std::size_t size, DType dtype, Params params);
  Buffer(std::string_view device, std::size_t size, DType dtype, BufferOptions options = {});

  const std::string& device() const noexcept;
  std::size_t size() const noexcept;
  DType dtype() const noexcept;
  const BufferOptions& options() const noexcept;
  std::size_t offset() const noexcept;  // bytes from the base's start (0 for a base)
  std::size_t nbytes() const noexcept { return size() * dtype().itemsize; }
  bool is_view() const noexcept;
  Buffer base() const;  // this buffer for a base, else its base

  bool is_allocated() const noexcept;
  // Allocates (a view allocates its base first). InvalidArgument if already allocated.
  Buffer& allocate();
  Buffer& ensure_allocated();
  // The allocation; InvalidArgument when unallocated.
  const Allocation& allocation() const;

  // Copies exactly nbytes() bytes in / out. InvalidArgument on size mismatch or when unallocated.
  Buffer& copyin(std::span<const std::byte> src);
  std::span<std::byte> copyout(std::span<std::byte> dest) const;
  template <class T>
  Buffer& copyin(std::span<const T> src) { return copyin(std::as_bytes(src)); }
  template <class T>
  std::span<T> copyout(std::span<T> dest) const {
    copyout(std::as_writable_bytes(dest));
    return dest;
  }

  // The contents on the host. Zero-copy where allowed and possible; force_zero_copy makes a
  // required copy an InvalidArgument instead.
  HostBytes as_buffer(bool allow_zero_copy = false, bool force_zero_copy = false) const;

  // A view of `size` elements of `dtype` at byte `offset` of this buffer. InvalidArgument when
  // offset >= nbytes() or the view runs past this buffer's end.
  Buffer view(std::size_t size, DType dtype, std::size_t offset) const;

  // The seed's lazy-buffer reference count, stored on the base. Plain (not atomic) bookkeeping for
  // the framework that owns the buffer: not for concurrent use.
  std::int64_t lb_refcount() const noexcept;
  void ref(std::int64_t count) noexcept;

  // tinydev's form of the seed's __repr__: "<buf real:true device:CPU size:8 dtype:float>", with
  // " offset:N" for a view, and " options:host,nolru" naming the options set on a base buffer
  // (nothing for the default options, nor for a view, whose options are the seed's None).
  std::string repr() const;

 private:
  struct State;
  explicit Buffer(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

// How copy() moved the bytes (the seed's BufferCopy / BufferXfer choice).
enum class CopyPath {
  copy_from_disk,  // a file (DISK) read into the destination's staging ring, or straight into it
  as_buffer,       // a file read into the destination's host-visible memory
  transfer,        // a device-to-device copy between two devices of one backend
  copyin,          // the source's bytes on the host (zero copy where it can; a file read by its reader), copied in
};
std::string_view to_string(CopyPath path) noexcept;

// Copies all of `src` into `dest` (the seed's BufferCopy and BufferXfer), allocating `dest` if it
// is not yet. The path, said at TINYDEV_DEBUG>=2:
//  - from a file (DISK) into a device with copy_from_disk, at least 4 KiB: copy_from_disk;
//  - from a file into host-visible memory: the file read straight into it (as_buffer);
//  - between two devices of one backend that transfers (the HCQ devices): transfer;
//  - else the source's bytes through the host (zero-copy where it can; a file's through its reader,
//    never its mapping) and a copyin.
// Sizes and dtypes must match and `src` must be allocated, or be a view of an allocated buffer
// (InvalidArgument before a byte moves).
// Returns once `src` may be changed again; `dest` is complete for the work queued after it on
// dest's device, and for its copyout. Safe to call concurrently for distinct destinations.
CopyPath copy(const Buffer& dest, const Buffer& src);

}  // namespace tinydev

TINYDEV_API_END
