#include <fmt/format.h>

#include "tinydev/compile.hpp"
#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/error.hpp"

namespace tinydev {

std::string_view to_string(SourceLanguage language) noexcept {
  switch (language) {
    case SourceLanguage::None: return "none";
    case SourceLanguage::LLVMIR: return "LLVM IR";
    case SourceLanguage::C: return "C";
    case SourceLanguage::CUDA: return "CUDA C++";
  }
  return "unknown";
}

Blob Compiler::compile(std::string_view) {
  throw InvalidArgument("this device has no compiler: it runs no kernels");
}

Blob Compiler::compile_cached(std::string_view source) {
  const Settings& cfg = settings();
  const bool use_cache = cache_key_.has_value() && !cfg.disable_compiler_cache;
  std::string ident;
  if (use_cache) {
    ident = identity();
    if (auto hit = DiskCache::global().get(*cache_key_, ident, source)) return std::move(*hit);
  }
  if (cfg.assert_compile)
    throw CompileError(
        "tried to compile with TINYDEV_ASSERT_COMPILE set (no cache entry for this source; unset it or warm "
        "the cache); log() holds the source, which begins",
        std::string(source));
  debug_log(4, "compiler", "compiling with {}:\n{}", cache_key_.value_or("uncached compiler"), source);
  Blob blob = compile(source);
  if (use_cache) DiskCache::global().put(*cache_key_, ident, source, blob);
  return blob;
}

}  // namespace tinydev
