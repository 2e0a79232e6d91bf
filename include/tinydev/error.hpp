// tinydev/error.hpp: the exception hierarchy every layer throws.
//
// Every error a caller can provoke is a tinydev::Error subclass whose message says what was asked,
// what was found and what to do about it. Errors are values: copyable, thread-agnostic, and an
// error never leaves another buffer, cache entry or device in a changed state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

// What kind of failure an Error is, for mapping to a status code (an HTTP status, a gRPC code)
// without parsing messages. Each Error subclass has one; a plain Error is `failed`.
enum class ErrorCode : std::uint8_t {
  failed,            // Error itself: a failure of no more specific kind
  invalid_argument,  // InvalidArgument: the caller's request is wrong; retrying it will not help
  unavailable,       // DeviceUnavailable: this machine cannot open the backend (no driver, no clang)
  out_of_memory,     // OutOfMemory
  compile,           // CompileError: the kernel did not compile
  device_fault,      // DeviceFault: the device's queue failed earlier; recover() it
  forked,            // ForkedDevice: a device opened before fork() used in the child
  io,                // IoError: reading or writing a file failed
  timeout,           // Timeout: a wait ran past its deadline; the work may still finish
};
std::string_view to_string(ErrorCode code) noexcept;  // "invalid_argument", "timeout", ...

// Base of every tinydev exception: catch this to catch them all.
//
// what() is one line: the message with its line breaks folded into "; ". code() says the kind,
// device() and kernel() where the failure happened when known ("" otherwise): Compiled::load_kernel,
// Device[] and CPU kernel calls fill them in for errors passing through them, and say them in
// what() when the message did not already.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, ErrorCode code = ErrorCode::failed);
  const char* what() const noexcept override { return what_.c_str(); }
  ErrorCode code() const noexcept { return code_; }
  const std::string& device() const noexcept { return device_; }
  const std::string& kernel() const noexcept { return kernel_; }
  // Records where the error happened if not recorded yet (empty arguments are ignored), and puts
  // what the message does not say yet in front of what(): "LLVM: kernel 'add': ...".
  void add_context(std::string_view device, std::string_view kernel = {});

 private:
  std::string what_;
  std::string device_, kernel_;
  ErrorCode code_;
};

// A bad name, size, offset, value or call sequence from the caller (the seed's asserts).
class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& message) : Error(message, ErrorCode::invalid_argument) {}
};

// A backend that this build has but that cannot be opened here (no driver, no clang, ...).
class DeviceUnavailable : public Error {
 public:
  explicit DeviceUnavailable(const std::string& message) : Error(message, ErrorCode::unavailable) {}
};

// An allocation failed even after the allocator's cache was dropped and the allocation retried.
class OutOfMemory : public Error {
 public:
  explicit OutOfMemory(const std::string& message) : Error(message, ErrorCode::out_of_memory) {}
};

// A kernel failed to compile. what() is one line: the message and the first line of the
// compiler's diagnostics; `log()` is the compiler's whole output, verbatim.
class CompileError : public Error {
 public:
  CompileError(const std::string& message, std::string log);
  const std::string& log() const noexcept { return log_; }

 private:
  std::string log_;
};

// A device (or stream) whose queue failed earlier: the message names the first failure. Sticky
// until Compiled::recover() (docs/serving.md).
class DeviceFault : public Error {
 public:
  explicit DeviceFault(const std::string& message) : Error(message, ErrorCode::device_fault) {}
};

// A device opened before fork() used in the forked child (docs/serving.md, Fork).
class ForkedDevice : public Error {
 public:
  explicit ForkedDevice(const std::string& message) : Error(message, ErrorCode::forked) {}
};

// A read or write of a file failed: the operating system's error (named in the message), or a file
// shorter than the range asked of it (DISK devices, safetensors files).
class IoError : public Error {
 public:
  explicit IoError(const std::string& message) : Error(message, ErrorCode::io) {}
};

// A wait on the device or a signal ran past its deadline.
class Timeout : public Error {
 public:
  explicit Timeout(const std::string& message) : Error(message, ErrorCode::timeout) {}
};

// `text` as it may appear inside an error message: control characters and NUL escaped (\n, \x01),
// at most `max_chars` characters of it kept, and a longer text cut with "... (N bytes)" so that a
// hostile 1 MiB name never makes a 1 MiB message. Pure function; thread-safe.
std::string quote_for_message(std::string_view text, std::size_t max_chars = 100);

// Whether `text` holds NUL or another ASCII control character (0x00-0x1f, 0x7f).
bool has_control_characters(std::string_view text) noexcept;

}  // namespace tinydev

TINYDEV_API_END
