#include "tinydev/dtype.hpp"

#include <fmt/format.h>

#include <array>
#include <string>

#include "tinydev/error.hpp"

namespace tinydev {

namespace {
constexpr std::array<DType, 13> kAll{dtypes::bool_,   dtypes::int8,    dtypes::uint8,
                                     dtypes::int16,   dtypes::uint16,  dtypes::int32,
                                     dtypes::uint32,  dtypes::int64,   dtypes::uint64,
                                     dtypes::float16, dtypes::bfloat16, dtypes::float32,
                                     dtypes::float64};
struct Alias {
  std::string_view alias;
  DType dtype;
};
constexpr std::array<Alias, 13> kAliases{{{"int8", dtypes::int8},
                                          {"uint8", dtypes::uint8},
                                          {"int16", dtypes::int16},
                                          {"uint16", dtypes::uint16},
                                          {"int32", dtypes::int32},
                                          {"uint32", dtypes::uint32},
                                          {"int64", dtypes::int64},
                                          {"uint64", dtypes::uint64},
                                          {"float16", dtypes::float16},
                                          {"bfloat16", dtypes::bfloat16},
                                          {"float32", dtypes::float32},
                                          {"float64", dtypes::float64},
                                          {"bool", dtypes::bool_}}};
}  // namespace

std::span<const DType> dtypes::all() noexcept { return kAll; }

DType dtype_from_name(std::string_view name) {
  for (const DType& d : kAll)
    if (d.name == name) return d;
  for (const Alias& a : kAliases)
    if (a.alias == name) return a.dtype;
  std::string known;
  for (const Alias& a : kAliases) known += fmt::format("{}{}", known.empty() ? "" : ", ", a.alias);
  throw InvalidArgument(fmt::format("unknown dtype '{}': use one of {}", name, known));
}

}  // namespace tinydev
