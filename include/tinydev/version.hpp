// tinydev/version.hpp: the library's version (kept equal to project(VERSION) in CMakeLists.txt).
#pragma once

#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {
inline constexpr int kVersionMajor = 0;
inline constexpr int kVersionMinor = 1;
inline constexpr int kVersionPatch = 0;
inline constexpr const char* kVersionString = "0.1.0";
}  // namespace tinydev

TINYDEV_API_END
