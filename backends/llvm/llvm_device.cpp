// The LLVM backend: LLVM IR text in, host object code out (what the compile cache stores), loaded
// by the shared ORC object runtime. The only file of this backend that sees LLVM's headers.
#include <fmt/format.h>
#include <llvm/Analysis/CGSCCPassManager.h>
#include <llvm/Analysis/LoopAnalysisManager.h>
#include <llvm/Config/llvm-config.h>
#include <llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/LegacyPassManager.h>
#include <llvm/IR/Module.h>
#include <llvm/IR/Verifier.h>
#include <llvm/IRReader/IRReader.h>
#include <llvm/Passes/PassBuilder.h>
#include <llvm/Support/MemoryBuffer.h>
#include <llvm/Support/SourceMgr.h>
#include <llvm/Support/raw_ostream.h>
#include <llvm/Target/TargetMachine.h>
#include <xxhash.h>

#include "cpu_runtime.hpp"
#include "tinydev/device.hpp"
#include "tinydev/error.hpp"

namespace tinydev {

namespace {

class LLVMCompiler final : public Compiler {
 public:
  LLVMCompiler() : Compiler("compile_llvm") {
    const cpu::HostTarget& t = cpu::host_target();
    // Everything that changes the object code: LLVM's version, the target, the host's CPU and
    // features, the optimization level.
    identity_ = fmt::format("llvm {} {} {} features:{:016x} O2/codegen-O3 pic", LLVM_VERSION_STRING,
                            t.triple, t.cpu, XXH3_64bits(t.features.data(), t.features.size()));
  }

  std::string identity() const override { return identity_; }

  Blob compile(std::string_view source) override {
    llvm::LLVMContext context;
    llvm::SMDiagnostic diagnostic;
    auto buffer = llvm::MemoryBuffer::getMemBuffer(
        llvm::StringRef(source.data(), source.size()), "kernel.ll", /*RequiresNullTerminator=*/false);
    std::unique_ptr<llvm::Module> module = llvm::parseIR(buffer->getMemBufferRef(), diagnostic, context);
    if (!module) {
      std::string log;
      llvm::raw_string_ostream os(log);
      diagnostic.print("kernel.ll", os, /*ShowColors=*/false);
      throw CompileError("LLVM could not parse the kernel's IR", os.str());
    }
    {
      std::string log;
      llvm::raw_string_ostream os(log);
      if (llvm::verifyModule(*module, &os))
        throw CompileError("the kernel's LLVM IR is invalid (verifier)", os.str());
    }
    const cpu::HostTarget& t = cpu::host_target();
    auto builder = llvm::orc::JITTargetMachineBuilder(llvm::Triple(t.triple));
    llvm::SubtargetFeatures features(t.features);
    builder.setCPU(t.cpu).addFeatures(features.getFeatures());
    builder.setCodeGenOptLevel(llvm::CodeGenOptLevel::Aggressive);
    builder.setRelocationModel(llvm::Reloc::PIC_);
    builder.setCodeModel(llvm::CodeModel::Small);
    auto machine = builder.createTargetMachine();
    if (!machine)
      throw CompileError("LLVM cannot create a target machine for this host",
                         llvm::toString(machine.takeError()));
    llvm::TargetMachine& tm = **machine;
    module->setTargetTriple(t.triple);
    module->setDataLayout(tm.createDataLayout());

    {
      llvm::LoopAnalysisManager lam;
      llvm::FunctionAnalysisManager fam;
      llvm::CGSCCAnalysisManager cgam;
      llvm::ModuleAnalysisManager mam;
      llvm::PassBuilder passes(&tm);
      passes.registerModuleAnalyses(mam);
      passes.registerCGSCCAnalyses(cgam);
      passes.registerFunctionAnalyses(fam);
      passes.registerLoopAnalyses(lam);
      passes.crossRegisterProxies(lam, fam, cgam, mam);
      llvm::ModulePassManager mpm = passes.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O2);
      mpm.run(*module, mam);
    }

    llvm::SmallVector<char, 0> object;
    llvm::raw_svector_ostream os(object);
    llvm::legacy::PassManager codegen;
    if (tm.addPassesToEmitFile(codegen, os, nullptr, llvm::CodeGenFileType::ObjectFile))
      throw CompileError("LLVM cannot emit object files for this host", "");
    codegen.run(*module);
    const auto* begin = reinterpret_cast<const std::byte*>(object.data());
    return Blob(begin, begin + object.size());
  }

 private:
  std::string identity_;
};

class LLVMDevice final : public Compiled {
 public:
  explicit LLVMDevice(const std::string& name)
      : Compiled(name, MallocAllocator::shared(), std::make_unique<LLVMCompiler>(),
                 std::make_unique<cpu::ObjectRuntime>(name), SourceLanguage::LLVMIR) {}

  std::map<std::string, std::string> properties() const override {
    auto props = Compiled::properties();
    props.merge(cpu::host_properties());
    props["compiler"] = fmt::format("LLVM {} in process (ORC JIT loader)", LLVM_VERSION_STRING);
    return props;
  }
};

}  // namespace

std::unique_ptr<Compiled> open_llvm_device(const std::string& canonical_name) {
  return std::make_unique<LLVMDevice>(canonical_name);
}

}  // namespace tinydev
