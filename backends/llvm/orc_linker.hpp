// backends/llvm/orc_linker.hpp (installed as <tinydev/cpu/orc_linker.hpp>): ORC's JITLink as the
// CPU object runtime's general linker (Note [Two object loaders] in include/tinydev/cpu/elf_loader.hpp): it
// links any object LLVM can, on any host, for what the fast ELF loader declines. Part of the
// tinydev_orc target, which the LLVM backend and (in builds with LLVM) the CLANG backend link.
// Includes no LLVM header.
//
// Thread safety: link() may be called concurrently.
#pragma once

#include <memory>
#include <string>

#include "object_runtime.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev::cpu {

// A linker with its own LLJIT instance, for device `device_name` (named in errors). Each link gets
// its own JITDylib, removed when the returned owner goes. Throws DeviceUnavailable when LLVM cannot
// target this host.
std::shared_ptr<ObjectLinker> make_orc_linker(std::string device_name);

// Initializes LLVM's native target, asm printer and parser, once per process (the LLVM compiler
// needs them too).
void initialize_llvm_native_target();

}  // namespace tinydev::cpu

TINYDEV_API_END
