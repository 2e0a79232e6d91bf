#include "object_runtime.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <mutex>

#include "cpu_blob.hpp"
#include "elf_loader.hpp"
#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/error.hpp"

extern "C" {
float tinydev_extendhfsf2(_Float16);
_Float16 tinydev_truncsfhf2(float);
_Float16 tinydev_truncdfhf2(double);
_Float16 tinydev_truncsfbf2(float);
_Float16 tinydev_truncdfbf2(double);
std::uint16_t tinydev_f2h_ieee(float);
float tinydev_h2f_ieee(std::uint16_t);
}

namespace tinydev::cpu {

namespace {

// The conversion helpers compiled kernels call (cpu_helpers.cpp), by their compiler-rt names.
const std::array<std::pair<const char*, void*>, 7> kHelpers = {{
    {"__extendhfsf2", reinterpret_cast<void*>(&tinydev_extendhfsf2)},
    {"__truncsfhf2", reinterpret_cast<void*>(&tinydev_truncsfhf2)},
    {"__truncdfhf2", reinterpret_cast<void*>(&tinydev_truncdfhf2)},
    {"__truncsfbf2", reinterpret_cast<void*>(&tinydev_truncsfbf2)},
    {"__truncdfbf2", reinterpret_cast<void*>(&tinydev_truncdfbf2)},
    {"__gnu_f2h_ieee", reinterpret_cast<void*>(&tinydev_f2h_ieee)},
    {"__gnu_h2f_ieee", reinterpret_cast<void*>(&tinydev_h2f_ieee)},
}};

// Kernels call libm; make sure it is in the process for the symbol search.
void load_libm() {
  static std::once_flag once;
  std::call_once(once, [] { ::dlopen("libm.so.6", RTLD_NOW | RTLD_GLOBAL); });
}

}  // namespace

std::span<const std::pair<const char*, void*>> kernel_helpers() noexcept { return kHelpers; }

void* resolve_external(std::string_view name) {
  for (const auto& [helper, address] : kHelpers)
    if (name == helper) return address;
  return ::dlsym(RTLD_DEFAULT, std::string(name).c_str());
}

ObjectRuntime::ObjectRuntime(std::string device_name, CallOrdering* ordering, std::shared_ptr<ObjectLinker> linker)
    : device_(std::move(device_name)), ordering_(ordering), linker_(std::move(linker)) {
  load_libm();
#if !defined(__x86_64__)
  if (!linker_)
    throw DeviceUnavailable(fmt::format("{}: this host has no fast object loader (x86-64 only) and this program has "
                                        "no ORC linker, which would load objects here: link the LLVM backend too "
                                        "(tinydev::llvm; a build with -DTINYDEV_WITH_LLVM=ON)",
                                        device_));
#endif
}

std::string ObjectRuntime::describe() const {
  return linker_ ? fmt::format("fast ELF loader, then {}", linker_->describe())
                 : std::string("fast ELF loader only (no ORC linker: the program links no LLVM backend)");
}

std::shared_ptr<Program> ObjectRuntime::load(std::string_view kernel_name, std::span<const std::byte> wrapped) {
  const UnwrappedBlob unwrapped = unwrap_object(wrapped);
  const std::span<const std::byte> blob = unwrapped.object;
  check_loadable(kernel_name, blob);
  std::vector<std::string> defined = elf_functions(blob).value_or(std::vector<std::string>{});
  if (defined.empty())
    throw InvalidArgument(fmt::format("{}: the blob for kernel '{}' ({} bytes) is an object file that "
                                      "defines no function: pass what compile() returned",
                                      device_, quote_for_message(kernel_name), blob.size()));
  if (std::find(defined.begin(), defined.end(), kernel_name) == defined.end())
    throw InvalidArgument(fmt::format("{}: kernel '{}' is not in the compiled object, which defines "
                                      "{}: check the kernel name",
                                      device_, quote_for_message(kernel_name),
                                      quote_for_message(fmt::format("{}", fmt::join(defined, ", ")), 400)));
#if defined(__x86_64__)
  // The fast path (Note [Two object loaders] in elf_loader.hpp); the linker below when it declines.
  ElfLoadResult fast = load_elf_x86_64(blob, kernel_name, &resolve_external);
  if (!fast.error.empty())
    throw InvalidArgument(fmt::format("{}: could not load kernel '{}': {}", device_, quote_for_message(kernel_name),
                                      fast.error));
  if (fast.object) {
    void* fn = fast.object->entry;
    return make_cpu_program(std::string(kernel_name), device_,
                                        std::shared_ptr<void>(std::move(fast.object)), fn,
                                        unwrapped.signature_of(kernel_name), ordering_);
  }
  if (!linker_)
    throw InvalidArgument(fmt::format("{}: could not load kernel '{}': the fast ELF loader declined the object ({}) "
                                      "and this program has no general linker (it links no LLVM backend): compile the "
                                      "kernel without it, or link the LLVM backend too (tinydev::llvm; a build "
                                      "with -DTINYDEV_WITH_LLVM=ON)",
                                      device_, quote_for_message(kernel_name), fast.declined));
  debug_log(2, device_, "the fast loader declined '{}' ({}); loading with {}", kernel_name,
            fast.declined, linker_->describe());
#endif
  return link(kernel_name, unwrapped);
}

std::shared_ptr<Program> ObjectRuntime::load_with_linker(std::string_view kernel_name,
                                                         std::span<const std::byte> wrapped) {
  const UnwrappedBlob unwrapped = unwrap_object(wrapped);
  check_loadable(kernel_name, unwrapped.object);
  if (!linker_)
    throw InvalidArgument(fmt::format("{}: cannot link kernel '{}': this runtime has no general linker", device_,
                                      quote_for_message(kernel_name)));
  return link(kernel_name, unwrapped);
}

void ObjectRuntime::check_loadable(std::string_view kernel_name, std::span<const std::byte> object) const {
  if (std::string why = check_elf_object(object, host_elf_machine()); !why.empty())
    throw InvalidArgument(fmt::format(
        "{}: the blob for kernel '{}' ({} bytes) is not a loadable object: {}; pass what this device's "
        "compile() returned",
        device_, quote_for_message(kernel_name), object.size(), why));
}

std::shared_ptr<Program> ObjectRuntime::link(std::string_view kernel_name, const UnwrappedBlob& unwrapped) {
  ObjectLinker::Linked linked;
  try {
    linked = linker_->link(kernel_name, unwrapped.object);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("{}: could not load kernel '{}': {}", device_, quote_for_message(kernel_name),
                                      e.what()));
  }
  return make_cpu_program(std::string(kernel_name), device_, std::move(linked.owner), linked.function,
                                      unwrapped.signature_of(kernel_name), ordering_);
}

}  // namespace tinydev::cpu
