#include "tinydev/error.hpp"

#include <fmt/format.h>

namespace tinydev {

namespace {

// The message on one line: each line break, with the indentation after it, becomes "; ".
std::string one_line(std::string_view message) {
  std::string out;
  out.reserve(message.size());
  for (std::size_t i = 0; i < message.size(); ++i) {
    if (message[i] != '\n' && message[i] != '\r') {
      out.push_back(message[i]);
      continue;
    }
    while (i + 1 < message.size() && (message[i + 1] == ' ' || message[i + 1] == '\t' || message[i + 1] == '\n' ||
                                      message[i + 1] == '\r'))
      ++i;
    while (!out.empty() && out.back() == ' ') out.pop_back();
    if (i + 1 < message.size() && !out.empty()) out += out.back() == ':' ? " " : "; ";
  }
  return out;
}

// The first line of a compiler's diagnostics worth showing, at most 200 characters of it.
std::string first_diagnostic(std::string_view log) {
  std::size_t start = 0;
  while (start < log.size()) {
    std::size_t end = log.find('\n', start);
    if (end == std::string_view::npos) end = log.size();
    std::string_view line = log.substr(start, end - start);
    while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
    if (!line.empty()) return quote_for_message(line, 200);
    start = end + 1;
  }
  return {};
}

}  // namespace

std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::failed: return "failed";
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::unavailable: return "unavailable";
    case ErrorCode::out_of_memory: return "out_of_memory";
    case ErrorCode::compile: return "compile";
    case ErrorCode::device_fault: return "device_fault";
    case ErrorCode::forked: return "forked";
    case ErrorCode::io: return "io";
    case ErrorCode::timeout: return "timeout";
  }
  return "failed";
}

Error::Error(const std::string& message, ErrorCode code)
    : std::runtime_error(message), what_(one_line(message)), code_(code) {}

void Error::add_context(std::string_view device, std::string_view kernel) {
  std::string prefix;
  if (!device.empty() && device_.empty()) {
    device_ = device;
    // Only a message that starts "<device>:" counts as naming it ("LLVM could not ..." names the
    // compiler, and "LLVM" is in "LLVM:3: ..." too).
    if (!what_.starts_with(device_ + ":")) prefix += device_ + ": ";
  }
  if (!kernel.empty() && kernel_.empty()) {
    kernel_ = kernel;
    if (what_.find("'" + kernel_ + "'") == std::string::npos)
      prefix += fmt::format("kernel '{}': ", quote_for_message(kernel_, 60));
  }
  what_ = prefix + what_;
}

CompileError::CompileError(const std::string& message, std::string log)
    : Error(log.empty() ? message : fmt::format("{}: {}", message, first_diagnostic(log)), ErrorCode::compile),
      log_(std::move(log)) {}

std::string quote_for_message(std::string_view text, std::size_t max_chars) {
  std::string out;
  out.reserve(std::min(text.size(), max_chars) + 24);
  std::size_t i = 0;
  for (; i < text.size() && out.size() < max_chars; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    switch (c) {
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      case '\\': out += "\\\\"; break;
      default:
        if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
        else out.push_back(static_cast<char>(c));
    }
  }
  if (i < text.size()) out += fmt::format("... ({} bytes)", text.size());
  return out;
}

bool has_control_characters(std::string_view text) noexcept {
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f) return true;
  }
  return false;
}

}  // namespace tinydev
