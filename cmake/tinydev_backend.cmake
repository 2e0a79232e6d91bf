# tinydev_add_backend: a backend is a folder whose CMakeLists.txt calls this once (docs/architecture.md,
# "Adding a backend"). It checks the name and sources, makes the static library tinydev_<name>
# (exported as tinydev::<name>), and registers the backend, so that the generated table
# (src/builtin_backends.cpp.in) opens it as Device["<NAME>"] and the conformance suite runs on it.
#
#   tinydev_add_backend(NAME <TYPE>                 # the device type: uppercase letters and digits
#                       SOURCES <files...>          # one defines open_<type>_device (lowercase)
#                       [DEPENDS <targets...>]      # linked PUBLIC (e.g. tinydev_cpu)
#                       [PRIVATE_DEPENDS <targets...>]
#                       [SUFFIX ordinal|path]       # how names read after ':' (default: ordinal)
#                       [COUNT <function>]          # unsigned tinydev::<function>() noexcept: how many
#                                                   # devices this machine has, without opening one
#                       [HCQ_DEVICE <C++ type> HCQ_HEADER <header>]  # an HCQ backend's device class
#                       [UNSUPPORTED_TESTS "<conformance test name>" "<reason>" ...])
#
# The factory the sources must define, in namespace tinydev:
#   std::unique_ptr<Compiled> open_<type>_device(const std::string& canonical_name);
# It throws DeviceUnavailable (saying what to install or set) when the backend cannot work here.
#
# HCQ_DEVICE names the HCQCompiled class of an HCQ backend's devices (e.g. tinydev::cpu::CpuHCQDevice)
# and HCQ_HEADER the header declaring it: the HCQ subset of the conformance suite runs on it as that
# type. The class must satisfy tinydev::HCQDevice (tinydev/hcq_concepts.hpp).
#
# UNSUPPORTED_TESTS lists conformance tests this backend cannot pass although its declared
# capabilities say it should, each with the reason; the suite reports them as skipped.

function(tinydev_add_backend)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "NAME;SUFFIX;HCQ_DEVICE;HCQ_HEADER;COUNT" "SOURCES;DEPENDS;PRIVATE_DEPENDS;UNSUPPORTED_TESTS")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "tinydev_add_backend: unknown arguments '${arg_UNPARSED_ARGUMENTS}' (in ${CMAKE_CURRENT_LIST_FILE})")
  endif()
  if(NOT arg_NAME MATCHES "^[A-Z][A-Z0-9]*$")
    message(FATAL_ERROR "tinydev_add_backend: NAME '${arg_NAME}' must be uppercase letters and digits, starting "
                        "with a letter, as device names are canonicalized (e.g. NAME MYDEV) (in ${CMAKE_CURRENT_LIST_FILE})")
  endif()
  string(LENGTH "${arg_NAME}" length)
  if(length GREATER 32)
    message(FATAL_ERROR "tinydev_add_backend: NAME '${arg_NAME}' is ${length} characters; a device type has at most 32")
  endif()
  # The names of tinydev's own targets (tinydev_core, tinydev_cpu, ...) are taken.
  if(arg_NAME MATCHES "^(CORE|CPU|ORC|CLI|BENCH|TEST|TESTS|TEST_MAIN)$")
    message(FATAL_ERROR "tinydev_add_backend: NAME ${arg_NAME} is reserved: tinydev_${arg_NAME} names one of tinydev's "
                        "own targets; choose another device type (in ${CMAKE_CURRENT_LIST_FILE})")
  endif()
  get_property(names GLOBAL PROPERTY TINYDEV_BACKEND_NAMES)
  if(arg_NAME IN_LIST names)
    message(FATAL_ERROR "tinydev_add_backend: a backend named ${arg_NAME} exists already (in ${CMAKE_CURRENT_LIST_FILE})")
  endif()
  if(NOT arg_SUFFIX)
    set(arg_SUFFIX ordinal)
  elseif(NOT arg_SUFFIX MATCHES "^(ordinal|path)$")
    message(FATAL_ERROR "tinydev_add_backend(${arg_NAME}): SUFFIX is '${arg_SUFFIX}', expected ordinal or path")
  endif()
  if(NOT arg_SOURCES)
    message(FATAL_ERROR "tinydev_add_backend(${arg_NAME}): no SOURCES given")
  endif()
  list(LENGTH arg_UNSUPPORTED_TESTS n)
  math(EXPR odd "${n} % 2")
  if(odd)
    message(FATAL_ERROR "tinydev_add_backend(${arg_NAME}): UNSUPPORTED_TESTS takes pairs of test name and reason, "
                        "got ${n} strings")
  endif()

  if(arg_HCQ_DEVICE AND NOT arg_HCQ_HEADER OR arg_HCQ_HEADER AND NOT arg_HCQ_DEVICE)
    message(FATAL_ERROR "tinydev_add_backend(${arg_NAME}): HCQ_DEVICE and HCQ_HEADER go together")
  endif()

  string(TOLOWER ${arg_NAME} lname)
  # The factory must be there: a missing one would otherwise be a link error in every consumer.
  set(found FALSE)
  foreach(src IN LISTS arg_SOURCES)
    get_filename_component(path ${src} ABSOLUTE)
    if(NOT EXISTS ${path})
      message(FATAL_ERROR "tinydev_add_backend(${arg_NAME}): source ${src} does not exist")
    endif()
    file(STRINGS ${path} hits REGEX "open_${lname}_device[ \t]*\\(")
    if(hits)
      set(found TRUE)
    endif()
  endforeach()
  if(NOT found)
    message(FATAL_ERROR "tinydev_add_backend(${arg_NAME}): no source defines the factory; add to one of them\n"
                        "  namespace tinydev {\n"
                        "  std::unique_ptr<Compiled> open_${lname}_device(const std::string& canonical_name);\n"
                        "  }")
  endif()

  set(target tinydev_${lname})
  if(TARGET ${target})
    message(FATAL_ERROR "tinydev_add_backend(${arg_NAME}): a target named ${target} exists already")
  endif()
  # The backend registers itself: a generated function naming its factory, which the core reaches
  # through a weak reference and the target's link options force into every program that links it
  # (Note [Backend registration] in src/registry.cpp).
  set(entry ${CMAKE_CURRENT_BINARY_DIR}/tinydev_backend_${lname}_entry.cpp)
  set(count_decl "")
  set(count_ref "nullptr")
  if(arg_COUNT)
    if(NOT arg_COUNT MATCHES "^[A-Za-z_][A-Za-z0-9_]*$")
      message(FATAL_ERROR "tinydev_add_backend(${arg_NAME}): COUNT '${arg_COUNT}' is not a function name")
    endif()
    set(count_decl "unsigned ${arg_COUNT}() noexcept;")
    set(count_ref "&tinydev::${arg_COUNT}")
  endif()
  file(CONFIGURE OUTPUT ${entry} CONTENT [=[
// Generated by tinydev_add_backend: the registry's entry for @arg_NAME@ (Note [Backend registration]).
#include <memory>
#include <string>

#include "tinydev/registry.hpp"

namespace tinydev {
class Compiled;
std::unique_ptr<Compiled> open_@lname@_device(const std::string& canonical_name);
@count_decl@
}  // namespace tinydev

extern "C" const tinydev::BackendEntry* tinydev_backend_@lname@() {
  static constexpr tinydev::BackendEntry entry{"@arg_NAME@", &tinydev::open_@lname@_device,
                                               tinydev::DeviceSuffix::@arg_SUFFIX@, @count_ref@};
  return &entry;
}
]=] @ONLY)
  add_library(${target} STATIC ${arg_SOURCES} ${entry})
  # The backend's folder is on the include path of tinydev's own tests and tools (HCQ_HEADER and
  # the backend's own headers); installed consumers get only include/.
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}>)
  target_compile_options(${target} PRIVATE -Wall -Wextra)
  target_link_libraries(${target} PUBLIC tinydev_core ${arg_DEPENDS} PRIVATE ${arg_PRIVATE_DEPENDS})
  target_link_options(${target} INTERFACE "LINKER:--undefined=tinydev_backend_${lname}")
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${lname})
  tinydev_library_defaults(${target})
  set_property(GLOBAL APPEND PROPERTY TINYDEV_BACKEND_NAMES ${arg_NAME})
  set_property(GLOBAL PROPERTY TINYDEV_BACKEND_SUFFIX_${arg_NAME} ${arg_SUFFIX})
  set_property(GLOBAL PROPERTY TINYDEV_BACKEND_UNSUPPORTED_${arg_NAME} "${arg_UNSUPPORTED_TESTS}")
  set_property(GLOBAL PROPERTY TINYDEV_BACKEND_HCQ_DEVICE_${arg_NAME} "${arg_HCQ_DEVICE}")
  set_property(GLOBAL PROPERTY TINYDEV_BACKEND_HCQ_HEADER_${arg_NAME} "${arg_HCQ_HEADER}")
  tinydev_export_target(${target} COMPONENT ${lname})
endfunction()

# The compile settings of every library target of tinydev: every symbol hidden, the API too unless
# TINYDEV_EXPORT_API (include/tinydev/export.hpp), so that a plugin linking tinydev statically
# exports none of it.
function(tinydev_library_defaults target)
  set_target_properties(${target} PROPERTIES CXX_VISIBILITY_PRESET hidden C_VISIBILITY_PRESET hidden
                                             VISIBILITY_INLINES_HIDDEN ON)
  target_compile_definitions(${target} PRIVATE TINYDEV_BUILDING_LIBRARY $<$<BOOL:${TINYDEV_EXPORT_API}>:TINYDEV_EXPORT_API>)
endfunction()

# Installs and exports a library target with tinydev's, in the export set of COMPONENT: a backend's
# lowercase name (find_package(tinydev COMPONENTS clang)), or core for what every backend needs.
# LINK names what a hand-written link line needs for it (pkg-config's tinydev-<component>.pc).
function(tinydev_export_target target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "COMPONENT" "")
  if(NOT arg_COMPONENT)
    message(FATAL_ERROR "tinydev_export_target(${target}): say which COMPONENT it belongs to")
  endif()
  get_property(components GLOBAL PROPERTY TINYDEV_COMPONENTS)
  if(NOT arg_COMPONENT IN_LIST components)
    set_property(GLOBAL APPEND PROPERTY TINYDEV_COMPONENTS ${arg_COMPONENT})
  endif()
  set_property(GLOBAL APPEND PROPERTY TINYDEV_COMPONENT_TARGETS_${arg_COMPONENT} ${target})
  set_property(GLOBAL APPEND PROPERTY TINYDEV_EXPORTED_TARGETS ${target})
endfunction()
