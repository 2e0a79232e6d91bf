// tinydev/error.hpp: the exception hierarchy every layer throws.
//
// Every error a caller can provoke is a tinydev::Error subclass whose message says what was asked,
// what was found and what to do about it. Errors are values: copyable, thread-agnostic, and an
// error never leaves another buffer, cache entry or device in a changed state.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

// Base of every tinydev exception: catch this to catch them all.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bad name, size, offset, value or call sequence from the caller (the seed's asserts).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A backend that this build has but that cannot be opened here (no driver, no clang, ...).
class DeviceUnavailable : public Error {
 public:
  using Error::Error;
};

// An allocation failed even after the allocator's cache was dropped and the allocation retried.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// A kernel failed to compile. `log()` is the compiler's own diagnostic output, verbatim.
class CompileError : public Error {
 public:
  CompileError(const std::string& message, std::string log)
      : Error(log.empty() ? message : message + "\n" + log), log_(std::move(log)) {}
  const std::string& log() const noexcept { return log_; }

 private:
  std::string log_;
};

// A device (or stream) whose queue failed earlier: the message names the first failure. Sticky
// until Compiled::recover() (docs/serving.md).
class DeviceFault : public Error {
 public:
  using Error::Error;
};

// A device opened before fork() used in the forked child (docs/serving.md, Fork).
class ForkedDevice : public Error {
 public:
  using Error::Error;
};

// A read or write of a file failed: the operating system's error (named in the message), or a file
// shorter than the range asked of it (DISK devices, safetensors files).
class IoError : public Error {
 public:
  using Error::Error;
};

// A wait on the device or a signal ran past its deadline.
class Timeout : public Error {
 public:
  using Error::Error;
};

// `text` as it may appear inside an error message: control characters and NUL escaped (\n, \x01),
// at most `max_chars` characters of it kept, and a longer text cut with "... (N bytes)" so that a
// hostile 1 MiB name never makes a 1 MiB message. Pure function; thread-safe.
std::string quote_for_message(std::string_view text, std::size_t max_chars = 100);

// Whether `text` holds NUL or another ASCII control character (0x00-0x1f, 0x7f).
bool has_control_characters(std::string_view text) noexcept;

}  // namespace tinydev

TINYDEV_API_END
