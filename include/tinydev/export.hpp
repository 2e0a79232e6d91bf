// tinydev/export.hpp: the visibility of tinydev's API (docs/embedding.md, "Plugins").
//
// Every public header brackets its declarations in TINYDEV_API_BEGIN / TINYDEV_API_END. While
// tinydev itself is compiled they make the API hidden, like everything else in the library
// (-fvisibility=hidden), so the archives define every symbol hidden; a linker gives a symbol the
// most constraining visibility of its definitions and references, so a shared library or plugin
// that links tinydev statically exports nothing of it, and never binds to another copy's symbols,
// whatever its own flags and however it is loaded (Note [Copies in one process] in
// src/registry.cpp). In consumers the macros give default visibility: a consumer's classes may
// derive from tinydev's without visibility warnings, and its own settings decide the rest.
//
// A build configured with -DTINYDEV_EXPORT_API=ON defines the API with default visibility
// instead: for a shared library that bundles tinydev and re-exports its API to its own users (only
// one library in a process should do so).
#pragma once

#if defined(TINYDEV_BUILDING_LIBRARY) && !defined(TINYDEV_EXPORT_API)
#define TINYDEV_API_BEGIN _Pragma("GCC visibility push(hidden)")
#else
#define TINYDEV_API_BEGIN _Pragma("GCC visibility push(default)")
#endif
#define TINYDEV_API_END _Pragma("GCC visibility pop")

// Format strings in the header-only HCQ templates. fmt checks a format string at compile time
// wherever its arguments do not depend on a template parameter, and the first check in a
// translation unit instantiates fmt's parser: about 0.1 s of every consumer's compile. So the
// strings are checked while tinydev builds (every header is parsed by its own sources) and taken
// at run time in consumers' translation units, which cannot change them.
#if defined(TINYDEV_BUILDING_LIBRARY)
#define TINYDEV_FMT(s) s
#else
#define TINYDEV_FMT(s) fmt::runtime(s)
#endif
