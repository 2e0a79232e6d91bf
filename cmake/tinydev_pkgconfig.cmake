# pkg-config files for hand-written link lines (docs/embedding.md): tinydev-core.pc, one
# tinydev-<backend>.pc per backend (carrying the forced-undefined symbol that registers it, Note
# [Backend registration]) and tinydev.pc for every backend of the build. tinydev's libraries are
# static archives, so `pkg-config --libs --static tinydev` is the whole link line:
#
#   g++ -std=c++20 main.cpp $(pkg-config --cflags --libs --static tinydev-clang)
#
# Included from the top-level CMakeLists.txt after the backends and TINYDEV_COMPONENTS are known.
# A backend adds what its archive needs beyond the core with
#   set_property(GLOBAL APPEND PROPERTY TINYDEV_PKGCONFIG_LIBS_PRIVATE_<component> <flags>)
#   set_property(GLOBAL APPEND PROPERTY TINYDEV_PKGCONFIG_REQUIRES_PRIVATE_<component> <package>)
set(pc_dir ${PROJECT_BINARY_DIR}/pkgconfig)
# The prefix relative to the .pc file's folder (lib/pkgconfig, or lib/x86_64-linux-gnu/pkgconfig),
# so that an installed tree can move.
string(REGEX REPLACE "[^/]+" ".." pc_up "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
string(CONCAT pc_header "prefix=\${pcfiledir}/${pc_up}\nexec_prefix=\${prefix}\nlibdir=\${prefix}/${CMAKE_INSTALL_LIBDIR}\n"
              "includedir=\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}\n\n")
set(all_requires "")
foreach(component IN LISTS TINYDEV_COMPONENTS)
  get_property(targets GLOBAL PROPERTY TINYDEV_COMPONENT_TARGETS_${component})
  list(REVERSE targets)  # dependents first: tinydev_llvm before tinydev_orc, tinydev_cpu before tinydev_core
  set(libs "-L\${libdir}")
  if(NOT component STREQUAL "core")
    string(APPEND libs " -Wl,--undefined=tinydev_backend_${component}")
  endif()
  foreach(target IN LISTS targets)
    get_target_property(output ${target} OUTPUT_NAME)
    if(NOT output)
      set(output ${target})
    endif()
    string(APPEND libs " -l${output}")
  endforeach()
  get_property(private_libs GLOBAL PROPERTY TINYDEV_PKGCONFIG_LIBS_PRIVATE_${component})
  get_property(private_requires GLOBAL PROPERTY TINYDEV_PKGCONFIG_REQUIRES_PRIVATE_${component})
  list(JOIN private_libs " " private_libs)
  list(JOIN private_requires ", " private_requires)
  if(component STREQUAL "core")
    set(requires "fmt")
    set(description "tinydev's core (layers 1-5), no backend")
    set(cflags "Cflags: -I\${includedir}\n")
  else()
    set(requires "tinydev-core = ${PROJECT_VERSION}")
    string(TOUPPER ${component} upper)
    set(description "tinydev's ${upper} backend, registered in any program that links it")
    set(cflags "")
    list(APPEND all_requires "tinydev-${component} = ${PROJECT_VERSION}")
  endif()
  file(WRITE ${pc_dir}/tinydev-${component}.pc
    "${pc_header}Name: tinydev-${component}\nDescription: ${description}\nVersion: ${PROJECT_VERSION}\n"
    "Requires: ${requires}\nRequires.private: ${private_requires}\n${cflags}Libs: ${libs}\n"
    "Libs.private: ${private_libs}\n")
endforeach()
list(JOIN all_requires ", " all_requires)
list(JOIN TINYDEV_BACKEND_NAMES ", " backend_list)
file(WRITE ${pc_dir}/tinydev.pc
  "${pc_header}Name: tinydev\nDescription: ${PROJECT_DESCRIPTION}: every backend of this build (${backend_list})\n"
  "Version: ${PROJECT_VERSION}\nRequires: ${all_requires}, tinydev-core = ${PROJECT_VERSION}\n")
foreach(component IN LISTS TINYDEV_COMPONENTS ITEMS "")
  if(component)
    install(FILES ${pc_dir}/tinydev-${component}.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
  endif()
endforeach()
install(FILES ${pc_dir}/tinydev.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
