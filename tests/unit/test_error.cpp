// Structured errors (tinydev/error.hpp): a code per kind, one-line what(), device and kernel.
#include <catch2/catch.hpp>

#include <string>

#include "support.hpp"
#include "tinydev/tinydev.hpp"

using namespace tinydev;
using namespace tinydev::testing;

namespace {

template <class E>
ErrorCode code_of() {
  try {
    throw E("message " + std::to_string(fresh_seed()));
  } catch (const Error& e) {
    return e.code();
  }
}

}  // namespace

TEST_CASE("errors: each kind has its code and every one is caught as Error and std::runtime_error", "[errors]") {
  CHECK(code_of<Error>() == ErrorCode::failed);
  CHECK(code_of<InvalidArgument>() == ErrorCode::invalid_argument);
  CHECK(code_of<DeviceUnavailable>() == ErrorCode::unavailable);
  CHECK(code_of<OutOfMemory>() == ErrorCode::out_of_memory);
  CHECK(code_of<DeviceFault>() == ErrorCode::device_fault);
  CHECK(code_of<ForkedDevice>() == ErrorCode::forked);
  CHECK(code_of<IoError>() == ErrorCode::io);
  CHECK(code_of<Timeout>() == ErrorCode::timeout);
  CHECK(CompileError("x", "log").code() == ErrorCode::compile);
  CHECK(to_string(ErrorCode::invalid_argument) == "invalid_argument");
  CHECK(to_string(ErrorCode::timeout) == "timeout");
  CHECK_THROWS_AS(throw Timeout("late"), std::runtime_error);
}

TEST_CASE("errors: what() is one line and a compile error's log stays whole in log()", "[errors]") {
  const std::string tag = std::to_string(fresh_seed());
  const Error e("no usable devices:\n  CUDA: not in this build\n  LLVM: " + tag + "\nset TINYDEV_DEVICE");
  CHECK(std::string(e.what()) == "no usable devices: CUDA: not in this build; LLVM: " + tag + "; set TINYDEV_DEVICE");
  const std::string log = "\n  kernel.c:3:5: error: use of undeclared identifier 'x" + tag + "'\n    3 | x;\n      | ^\n1 error generated.\n";
  const CompileError c("clang-19 failed compiling the kernel (exit 1)", log);
  const std::string what = c.what();
  CHECK(what.find('\n') == std::string::npos);
  CHECK(what == "clang-19 failed compiling the kernel (exit 1): kernel.c:3:5: error: use of undeclared identifier 'x" + tag + "'");
  CHECK(c.log() == log);
}

TEST_CASE("errors: add_context records the device and kernel once and says what the message did not", "[errors]") {
  const std::string kernel = "k" + std::to_string(fresh_seed() % 1000);
  Error plain("the launch failed");
  plain.add_context("LLVM:2", kernel);
  CHECK(plain.device() == "LLVM:2");
  CHECK(plain.kernel() == kernel);
  CHECK(std::string(plain.what()) == "LLVM:2: kernel '" + kernel + "': the launch failed");
  plain.add_context("CLANG", "other");  // the first context wins: the innermost knows best
  CHECK(plain.device() == "LLVM:2");
  CHECK(std::string(plain.what()) == "LLVM:2: kernel '" + kernel + "': the launch failed");

  InvalidArgument said("LLVM: could not load kernel '" + kernel + "': no such function");
  said.add_context("LLVM", kernel);
  CHECK(std::string(said.what()) == "LLVM: could not load kernel '" + kernel + "': no such function");
  CHECK(said.kernel() == kernel);
  Error nothing("x");
  nothing.add_context("", "");
  CHECK(nothing.device().empty());
  CHECK(std::string(nothing.what()) == "x");
}

TEST_CASE("errors: a device that cannot open names itself in the error", "[errors]") {
  const std::string type = "NOPEN" + std::to_string(fresh_seed() % 10000);
  Device.register_backend(type, [](const std::string&) -> std::unique_ptr<Compiled> {
    throw DeviceUnavailable("no driver here: install one");
  });
  try {
    Device[type + ":3"];
    FAIL("expected DeviceUnavailable");
  } catch (const DeviceUnavailable& e) {
    CHECK(e.code() == ErrorCode::unavailable);
    CHECK(e.device() == type + ":3");
    CHECK(std::string(e.what()) == type + ":3: no driver here: install one");
  }
}
