// ORC's JITLink behind the ObjectLinker interface: the only file of tinydev_orc, and with
// llvm_device.cpp the only ones that see LLVM's headers.
#include "orc_linker.hpp"

#include <fmt/format.h>
#include <llvm/Config/llvm-config.h>
#include <llvm/ExecutionEngine/Orc/ExecutionUtils.h>
#include <llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h>
#include <llvm/ExecutionEngine/Orc/LLJIT.h>
#include <llvm/Support/MemoryBuffer.h>
#include <llvm/Support/TargetSelect.h>

#include <atomic>
#include <mutex>

#include "elf_loader.hpp"
#include "tinydev/config.hpp"
#include "tinydev/counters.hpp"
#include "tinydev/error.hpp"

namespace tinydev::cpu {

namespace {

std::string take(llvm::Error err) { return llvm::toString(std::move(err)); }

// ORC reports the root cause of a failed link (e.g. "Symbols not found: [ foo ]") to the session's
// error reporter, and returns only "Failed to materialize symbols" from the lookup. Materialization
// runs on the thread that looks up (LLJIT's default in-place dispatcher), so the reporter stashes
// the cause here for that thread's link() to put in its error.
thread_local std::string t_link_error;

struct Jit {
  std::string device;
  std::unique_ptr<llvm::orc::LLJIT> jit;
  llvm::orc::JITDylib* helpers = nullptr;  // conversion helpers + the process's symbols
  std::atomic<std::uint64_t> counter{0};
};

class OrcLinker final : public ObjectLinker {
 public:
  explicit OrcLinker(std::string device_name) : jit_(std::make_shared<Jit>()) {
    initialize_llvm_native_target();
    jit_->device = std::move(device_name);
    auto jtmb = llvm::orc::JITTargetMachineBuilder::detectHost();
    if (!jtmb)
      throw DeviceUnavailable(fmt::format("{}: LLVM cannot target this host: {}", jit_->device, take(jtmb.takeError())));
    auto jit = llvm::orc::LLJITBuilder().setJITTargetMachineBuilder(std::move(*jtmb)).create();
    if (!jit)
      throw DeviceUnavailable(fmt::format("{}: could not start LLVM's ORC JIT: {}", jit_->device, take(jit.takeError())));
    jit_->jit = std::move(*jit);
    // Link failures are returned to the caller of lookup as errors; don't also print them.
    std::string device = jit_->device;
    jit_->jit->getExecutionSession().setErrorReporter([device](llvm::Error err) {
      std::string what = take(std::move(err));
      debug_log(2, device, "JIT: {}", what);
      t_link_error += (t_link_error.empty() ? "" : "; ") + what;
    });
    auto helpers = jit_->jit->createJITDylib("tinydev_helpers");
    if (!helpers) throw DeviceUnavailable(fmt::format("{}: {}", jit_->device, take(helpers.takeError())));
    jit_->helpers = &*helpers;
    auto& es = jit_->jit->getExecutionSession();
    llvm::orc::SymbolMap symbols;
    for (const auto& [name, address] : kernel_helpers())
      symbols[es.intern(name)] = llvm::orc::ExecutorSymbolDef(llvm::orc::ExecutorAddr::fromPtr(address),
                                                              llvm::JITSymbolFlags::Exported);
    if (llvm::Error err = jit_->helpers->define(llvm::orc::absoluteSymbols(std::move(symbols))))
      throw DeviceUnavailable(fmt::format("{}: {}", jit_->device, take(std::move(err))));
    auto process = llvm::orc::DynamicLibrarySearchGenerator::GetForCurrentProcess(
        jit_->jit->getDataLayout().getGlobalPrefix());
    if (!process) throw DeviceUnavailable(fmt::format("{}: {}", jit_->device, take(process.takeError())));
    jit_->helpers->addGenerator(std::move(*process));
  }

  Linked link(std::string_view function, std::span<const std::byte> checked_object) override {
    // Note [No unwind tables for ORC] in elf_loader.cpp.
    const std::vector<std::byte> blob = without_unwind_tables(checked_object);
    auto& es = jit_->jit->getExecutionSession();
    auto dylib = jit_->jit->createJITDylib(fmt::format("{}_{}", function, jit_->counter.fetch_add(1)));
    if (!dylib) throw Error(fmt::format("{}: {}", jit_->device, take(dylib.takeError())));
    llvm::orc::JITDylib& jd = *dylib;
    jd.addToLinkOrder(*jit_->helpers);
    t_link_error.clear();
    auto fail = [&](std::string what) -> Linked {
      if (!t_link_error.empty()) what = t_link_error + " (" + what + ")";
      t_link_error.clear();
      if (llvm::Error err = es.removeJITDylib(jd)) llvm::consumeError(std::move(err));
      throw InvalidArgument(what);
    };
    auto buffer = llvm::MemoryBuffer::getMemBufferCopy(
        llvm::StringRef(reinterpret_cast<const char*>(blob.data()), blob.size()), fmt::format("{}.o", function));
    if (llvm::Error err = jit_->jit->addObjectFile(jd, std::move(buffer))) return fail(take(std::move(err)));
    auto addr = jit_->jit->lookup(jd, llvm::StringRef(function.data(), function.size()));
    if (!addr) return fail(take(addr.takeError()));
    // Unloading frees the code; other programs (even of the same kernel name) live in other
    // dylibs. The dylib's removal also needs the JIT alive: the deleter holds it.
    std::shared_ptr<Jit> jit = jit_;
    std::shared_ptr<void> owner(&jd, [jit](void* p) {
      auto* dylib = static_cast<llvm::orc::JITDylib*>(p);
      if (llvm::Error err = jit->jit->getExecutionSession().removeJITDylib(*dylib))
        debug_log(1, jit->device, "unloading a kernel on {} failed: {}", jit->device, take(std::move(err)));
    });
    return Linked{std::move(owner), addr->toPtr<void*>()};
  }

  std::string describe() const override { return fmt::format("ORC JITLink (LLVM {})", LLVM_VERSION_STRING); }

 private:
  std::shared_ptr<Jit> jit_;
};

}  // namespace

void initialize_llvm_native_target() {
  static std::once_flag once;
  std::call_once(once, [] {
    llvm::InitializeNativeTarget();
    llvm::InitializeNativeTargetAsmPrinter();
    llvm::InitializeNativeTargetAsmParser();
  });
}

std::shared_ptr<ObjectLinker> make_orc_linker(std::string device_name) {
  return std::make_shared<OrcLinker>(std::move(device_name));
}

}  // namespace tinydev::cpu
