// tinydev/dtype.hpp: the scalar element types a Buffer can hold.
//
// A DType is a small immutable value (name, size in bytes, struct-format letter) compared by
// identity of its fields. All values here are constants: thread-safe to use from anywhere.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

struct DType {
  std::string_view name;  // tinygrad's name: "float", "half", "__bf16", "int", ...
  std::uint8_t itemsize;  // bytes per element
  char fmt;               // Python struct-format letter ('\0' where struct has none, as bfloat16)
  std::uint8_t priority;  // tinygrad's promotion priority, kept for frameworks that need it

  friend constexpr bool operator==(const DType& a, const DType& b) noexcept {
    return a.itemsize == b.itemsize && a.fmt == b.fmt && a.name == b.name;
  }
};

namespace dtypes {
constexpr DType bool_{"bool", 1, '?', 0};
constexpr DType int8{"char", 1, 'b', 1};
constexpr DType uint8{"unsigned char", 1, 'B', 2};
constexpr DType int16{"short", 2, 'h', 3};
constexpr DType uint16{"unsigned short", 2, 'H', 4};
constexpr DType int32{"int", 4, 'i', 5};
constexpr DType uint32{"unsigned int", 4, 'I', 6};
constexpr DType int64{"long", 8, 'q', 7};
constexpr DType uint64{"unsigned long", 8, 'Q', 8};
constexpr DType float16{"half", 2, 'e', 9};
constexpr DType bfloat16{"__bf16", 2, '\0', 10};
constexpr DType float32{"float", 4, 'f', 11};
constexpr DType float64{"double", 8, 'd', 12};

// Every dtype above, in promotion-priority order.
std::span<const DType> all() noexcept;
}  // namespace dtypes

// Looks a dtype up by tinygrad's name or its common alias ("float32", "bfloat16", "half", ...).
// Throws InvalidArgument listing the known names.
DType dtype_from_name(std::string_view name);

}  // namespace tinydev

TINYDEV_API_END
