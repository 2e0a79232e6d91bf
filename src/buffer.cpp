#include "tinydev/buffer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#include "tinydev/counters.hpp"
#include "tinydev/device.hpp"
#include "tinydev/error.hpp"
#include "tinydev/registry.hpp"

namespace tinydev {

namespace {
// count * itemsize, or InvalidArgument naming the numbers when it does not fit in 64 bits.
// `what` names the buffer in the message ("a view"), followed by " on `device`" when one is given:
// formatted only when the check fails, as buffers are made on hot paths.
std::size_t checked_bytes(std::size_t count, DType dtype, std::string_view what, std::string_view device = {}) {
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(count, std::size_t{dtype.itemsize}, &bytes))
    throw InvalidArgument(fmt::format("{}{}{} of {} x {} ({} bytes each) overflows 64 bits: ask for fewer elements",
                                      what, device.empty() ? "" : " on ", device, count, dtype.name,
                                      dtype.itemsize));
  return bytes;
}
}  // namespace

// Note [Buffer allocation]
// A base and its views share one State chain: two threads may allocate two views of one
// unallocated base, or copy() from one unallocated view of an allocated base, at once (distinct
// Buffers, which buffer.hpp allows). So the allocation is published once, under the base's mutex,
// before `allocated` is set with release: a reader that sees the flag sees the allocation and the
// allocator, and nothing changes either afterwards. Reads take no lock. The allocator is called
// outside that mutex (an allocation that runs out of memory frees the cache, which may wait for a
// device's queued work and its submit mutex, held meanwhile by a thread that may be waiting for
// this mutex): two threads may both allocate a base, and the one that publishes second gives its
// memory back.
// Every base's memory is marked owned (Allocator::adopt) while the buffer holds it, whether the
// buffer allocated it or adopted it: a second Buffer adopting it, or a plain free of it, would free
// memory this buffer still uses, and is refused.
struct Buffer::State {
  std::string device;
  std::size_t size = 0;
  DType dtype;
  BufferOptions options;
  std::size_t offset = 0;
  std::shared_ptr<State> base;  // null for a base buffer
  Allocation buf{};               // valid once `allocated`; written once
  std::shared_ptr<Allocator> allocator;  // keeps the allocator alive while we hold memory; set with buf
  std::atomic<bool> allocated{false};
  std::mutex allocate_mutex;  // a base's guards the publication of it and of its views
  std::int64_t lb_refcount = 0;
  // What the allocator handed the memory out as (an adopted allocation may be larger than nbytes):
  // the size and options it is freed with.
  std::size_t alloc_bytes = 0;
  BufferOptions alloc_options;

  std::size_t nbytes() const noexcept { return size * dtype.itemsize; }  // checked at construction
  bool counts_memory() const noexcept { return !device.starts_with("DISK"); }
  // The allocation, or nullptr while unallocated (Note [Buffer allocation]).
  const Allocation* allocation_if_any() const noexcept {
    return allocated.load(std::memory_order_acquire) ? &buf : nullptr;
  }

  ~State() {
    if (!allocated.load(std::memory_order_acquire) || base) return;
    if (counts_memory()) GlobalCounters::mem_used -= static_cast<std::int64_t>(nbytes());
    try {
      allocator->release_adopted(buf, alloc_bytes, alloc_options);
    } catch (const std::exception& e) {
      try {
        debug_log(1, device, "freeing a {}-byte buffer on {} failed: {}", nbytes(), device, e.what());
      } catch (...) {  // the log's own settings may be invalid: a destructor must not throw
      }
    }
  }

  // Allocates (adopting `opaque` if given). When already allocated: nothing if `ensure`, else
  // InvalidArgument (the seed's assert).
  void allocate(std::optional<Allocation> opaque, bool ensure) {
    if (allocated.load(std::memory_order_acquire)) {
      if (ensure) return;
      throw_already_allocated();
    }
    std::shared_ptr<Allocator> alloc = Device[device].shared_allocator();
    if (base) {
      base->allocate(std::nullopt, /*ensure=*/true);
      if (!alloc->supports_offset())
        throw InvalidArgument(fmt::format(
            "{} cannot make views (no offset function), so this {}-byte view at offset {} "
            "cannot be allocated",
            device, nbytes(), offset));
      const Allocation view = alloc->offset(base->buf, nbytes(), offset);
      std::lock_guard lock(base->allocate_mutex);
      if (allocated.load(std::memory_order_relaxed)) {
        if (ensure) return;  // another thread made the same view
        throw_already_allocated();
      }
      publish(view, std::move(alloc));
      return;
    }
    Allocation mine{};
    std::size_t bytes = nbytes();
    BufferOptions with = options;
    if (opaque) {
      if (opaque->size != 0 && opaque->size < nbytes())
        throw InvalidArgument(fmt::format(
            "cannot adopt an allocation of {} bytes for a buffer of {} bytes on {}: adopt one at "
            "least as large",
            opaque->size, nbytes(), device));
      // The buffer frees what it adopts, so it must be a live allocation of this device's
      // allocator that nobody owns yet (Note [Buffer allocation]).
      std::optional<Allocator::LiveInfo> info = alloc->live_info(*opaque);
      if (info && info->size < nbytes())
        throw InvalidArgument(fmt::format(
            "cannot adopt an allocation of {} bytes for a buffer of {} bytes on {}: adopt one at "
            "least as large",
            info->size, nbytes(), device));
      try {
        info = alloc->adopt(*opaque);
      } catch (const InvalidArgument& e) {
        throw InvalidArgument(fmt::format("cannot adopt on {}: {}", device, e.what()));
      }
      // The size the allocator knows, not the caller's (0, or any number at least nbytes).
      mine = Allocation{opaque->va_addr, info->size, opaque->backend};
      bytes = info->size;
      with = info->options;
    } else {
      if (nbytes() == 0)
        throw InvalidArgument(fmt::format(
            "can't allocate a 0-byte buffer on {}: allocate at least one element", device));
      mine = alloc->alloc(nbytes(), options);
      try {
        alloc->adopt(mine);  // owned by this buffer (Note [Buffer allocation])
      } catch (...) {
        alloc->free(mine, nbytes(), options);
        throw;
      }
    }
    {
      std::lock_guard lock(allocate_mutex);
      if (!allocated.load(std::memory_order_relaxed)) {
        alloc_bytes = bytes;
        alloc_options = with;
        if (counts_memory()) GlobalCounters::mem_used += static_cast<std::int64_t>(nbytes());
        publish(mine, alloc);
        return;
      }
    }
    // Another thread allocated this buffer meanwhile: ours goes back. (Adoption happens at
    // construction only, before any other thread has the buffer: never here.)
    alloc->release_adopted(mine, bytes, with);
    if (!ensure) throw_already_allocated();
  }

 private:
  // Under the base's allocate_mutex: the allocation, then the flag.
  void publish(Allocation a, std::shared_ptr<Allocator> alloc) {
    buf = a;
    allocator = std::move(alloc);
    allocated.store(true, std::memory_order_release);
  }
  [[noreturn]] void throw_already_allocated() const {
    throw InvalidArgument(fmt::format(
        "can't allocate already allocated buffer ({} bytes on {}): use ensure_allocated()", nbytes(),
        device));
  }
};

Buffer::Buffer(std::string_view device, std::size_t size, DType dtype, BufferOptions options)
    : Buffer(device, size, dtype, Params{.options = options}) {}

Buffer::Buffer(std::string_view device, std::size_t size, DType dtype, Params params)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.device = canonicalize(device);
  checked_bytes(size, dtype, "a buffer", s.device);
  s.size = size;
  s.dtype = dtype;
  s.options = params.options;
  // Checked before adopting: a bad initial value must leave the caller's allocation theirs.
  if (!params.initial_value.empty() && params.initial_value.size() != s.nbytes())
    throw InvalidArgument(fmt::format(
        "initial value has {} bytes but the buffer ({} x {}) has {}: pass exactly nbytes()",
        params.initial_value.size(), size, dtype.name, s.nbytes()));
  if (params.adopt) s.allocate(params.adopt, /*ensure=*/false);
  if (!params.initial_value.empty()) {
    s.allocate(std::nullopt, /*ensure=*/true);
    s.allocator->copyin(s.buf, params.initial_value);
  }
  if (params.preallocate) s.allocate(std::nullopt, /*ensure=*/true);
}

const std::string& Buffer::device() const noexcept { return state_->device; }
std::size_t Buffer::size() const noexcept { return state_->size; }
DType Buffer::dtype() const noexcept { return state_->dtype; }
const BufferOptions& Buffer::options() const noexcept {
  return state_->base ? state_->base->options : state_->options;
}
std::size_t Buffer::offset() const noexcept { return state_->offset; }
bool Buffer::is_view() const noexcept { return state_->base != nullptr; }
Buffer Buffer::base() const { return state_->base ? Buffer(state_->base) : *this; }
bool Buffer::is_allocated() const noexcept { return state_->allocation_if_any() != nullptr; }

Buffer& Buffer::allocate() {
  state_->allocate(std::nullopt, /*ensure=*/false);
  return *this;
}

Buffer& Buffer::ensure_allocated() {
  state_->allocate(std::nullopt, /*ensure=*/true);
  return *this;
}

const Allocation& Buffer::allocation() const {
  const Allocation* a = state_->allocation_if_any();
  if (!a)
    throw InvalidArgument(fmt::format("buffer of {} bytes on {} is not allocated: call allocate()",
                                      nbytes(), device()));
  return *a;
}

Buffer& Buffer::copyin(std::span<const std::byte> src) {
  if (src.size() != nbytes())
    throw InvalidArgument(fmt::format("size mismatch: copyin of {} bytes into a buffer of {} x {} "
                                      "({} bytes): pass exactly nbytes() bytes",
                                      src.size(), size(), dtype().name, nbytes()));
  const Allocation* a = state_->allocation_if_any();
  if (!a)
    throw InvalidArgument(fmt::format(
        "can't copyin to unallocated buffer ({} bytes on {}): call allocate() first", nbytes(),
        device()));
  state_->allocator->copyin(*a, src);
  return *this;
}

std::span<std::byte> Buffer::copyout(std::span<std::byte> dest) const {
  if (dest.size() != nbytes())
    throw InvalidArgument(fmt::format("size mismatch: copyout of a buffer of {} x {} ({} bytes) "
                                      "into {} bytes: pass exactly nbytes() bytes",
                                      size(), dtype().name, nbytes(), dest.size()));
  const Allocation* a = state_->allocation_if_any();
  if (!a)
    throw InvalidArgument(fmt::format(
        "can't copyout unallocated buffer ({} bytes on {}): allocate and fill it first", nbytes(),
        device()));
  state_->allocator->copyout(dest, *a);
  return dest;
}

HostBytes Buffer::as_buffer(bool allow_zero_copy, bool force_zero_copy) const {
  const Allocation* a = state_->allocation_if_any();
  if (force_zero_copy && !a)
    throw InvalidArgument(fmt::format(
        "force zero copy was passed for a buffer of {} bytes on {} that is not allocated: allocate and "
        "fill it first",
        nbytes(), device()));
  if ((allow_zero_copy || force_zero_copy) && a) {
    // An adopted allocation may be larger than the buffer: the window is the buffer's bytes only.
    if (auto window = state_->allocator->as_buffer(*a)) return HostBytes(window->first(std::min(window->size(), nbytes())));
  }
  if (force_zero_copy)
    throw InvalidArgument(fmt::format(
        "force zero copy was passed, but copy is required: {} memory is not host-visible", device()));
  std::vector<std::byte> out(nbytes());
  copyout(out);
  return HostBytes(std::move(out));
}

Buffer Buffer::view(std::size_t size, DType dtype, std::size_t offset) const {
  if (offset >= nbytes())
    throw InvalidArgument(fmt::format(
        "view offset {} is out of range: offset must be less than nbytes ({}) of the buffer",
        offset, nbytes()));
  const std::size_t view_bytes = checked_bytes(size, dtype, "a view");
  if (view_bytes > nbytes() - offset)
    throw InvalidArgument(fmt::format(
        "view of {} x {} ({} bytes) at offset {} runs past the end of a {}-byte buffer", size,
        dtype.name, view_bytes, offset, nbytes()));
  auto v = std::make_shared<State>();
  v->device = state_->device;
  v->size = size;
  v->dtype = dtype;
  v->options = options();
  v->base = state_->base ? state_->base : state_;
  v->offset = state_->offset + offset;
  return Buffer(std::move(v));
}

std::int64_t Buffer::lb_refcount() const noexcept {
  return (state_->base ? state_->base : state_)->lb_refcount;
}
void Buffer::ref(std::int64_t count) noexcept {
  (state_->base ? state_->base : state_)->lb_refcount += count;
}

std::string Buffer::repr() const {
  // The seed prints a buffer's options unless they are None, and a view's are always None (a
  // view uses its base's). Here the default options stand for None; the flags set are named.
  std::string options_text;
  const BufferOptions& o = is_view() ? BufferOptions{} : options();
  for (const auto& [set, name] : {std::pair{o.uncached, "uncached"}, std::pair{o.cpu_access, "cpu_access"},
                                  std::pair{o.host, "host"}, std::pair{o.nolru, "nolru"}}) {
    if (!set) continue;
    options_text += options_text.empty() ? " options:" : ",";
    options_text += name;
  }
  return fmt::format("<buf real:{} device:{} size:{} dtype:{}{}{}>", is_allocated(), device(), size(),
                     dtype().name, is_view() ? fmt::format(" offset:{}", offset()) : "", options_text);
}

std::string_view to_string(CopyPath path) noexcept {
  switch (path) {
    case CopyPath::copy_from_disk: return "copy_from_disk";
    case CopyPath::as_buffer: return "as_buffer";
    case CopyPath::transfer: return "transfer";
    case CopyPath::copyin: return "copyin";
  }
  return "?";
}

namespace {
std::string_view device_type(std::string_view canonical) { return canonical.substr(0, canonical.find(':')); }
}  // namespace

// The seed's BufferCopy.copy and BufferXfer.copy, in one place. The 4 KiB floor is the seed's:
// below it, a round of the staging ring costs more than a read through the mapping.
CopyPath copy(const Buffer& dest, const Buffer& src) {
  if (dest.nbytes() != src.nbytes() || dest.dtype() != src.dtype())
    throw InvalidArgument(fmt::format("copy into {} x {} on {} from {} x {} on {}: the sizes and dtypes must match; "
                                      "make the destination a buffer (or view) of the source's shape",
                                      dest.size(), dest.dtype().name, dest.device(), src.size(), src.dtype().name,
                                      src.device()));
  Buffer source = src;
  if (!source.is_allocated() && source.is_view() && source.base().is_allocated()) source.ensure_allocated();
  if (!source.is_allocated())
    throw InvalidArgument(fmt::format("copy from an unallocated buffer of {} bytes on {}: allocate and fill it first",
                                      src.nbytes(), src.device()));
  Buffer target = dest;  // a handle on the same memory
  target.ensure_allocated();
  const std::size_t n = dest.nbytes();
  if (n == 0) return CopyPath::copyin;
  Allocator& from = Device[src.device()].allocator();
  Allocator& to = Device[dest.device()].allocator();
  const Allocation& s = src.allocation();
  const Allocation& d = dest.allocation();
  CopyPath path = CopyPath::copyin;
  FileReader* reader = from.file_reader();
  if (reader && to.supports_copy_from_disk() && n >= 4096) {
    path = CopyPath::copy_from_disk;
    debug_log(2, "buffer", "copy {} -> {}: {} bytes by copy_from_disk ({})", src.device(), dest.device(), n,
              reader->describe_reads());
    to.copy_from_disk(d, *reader, s, n);
  } else if (auto window = reader && !to.file_reader() ? to.as_buffer(d) : std::nullopt) {
    path = CopyPath::as_buffer;
    debug_log(2, "buffer", "copy {} -> {}: {} bytes read into its host memory ({})", src.device(), dest.device(), n,
              reader->describe_reads());
    reader->read_into(window->data(), s, n);
  } else if (device_type(src.device()) == device_type(dest.device()) && to.supports_transfer()) {
    path = CopyPath::transfer;
    debug_log(2, "buffer", "copy {} -> {}: {} bytes by transfer", src.device(), dest.device(), n);
    to.transfer(d, s, n, Device[src.device()], Device[dest.device()]);
  } else if (reader) {
    // Through the reader, not the mapping: a file truncated meanwhile is an IoError, not SIGBUS.
    debug_log(2, "buffer", "copy {} -> {}: {} bytes read into host memory ({}), then copyin", src.device(),
              dest.device(), n, reader->describe_reads());
    std::vector<std::byte> bytes(n);
    reader->read_into(bytes.data(), s, n);
    target.copyin(bytes);
  } else {
    HostBytes bytes = src.as_buffer(/*allow_zero_copy=*/true);
    debug_log(2, "buffer", "copy {} -> {}: {} bytes through host memory ({}), then copyin", src.device(),
              dest.device(), n, bytes.is_zero_copy() ? "zero copy" : "a copy");
    target.copyin(bytes.bytes());
  }
  return path;
}

}  // namespace tinydev
