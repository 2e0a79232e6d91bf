// The LLVM backend: LLVM IR text in, host object code out (what the compile cache stores), loaded
// by the CPU object runtime (the fast ELF loader on x86-64, ORC's JITLink for the rest). With
// orc_linker.cpp the only files that see LLVM's headers.
#include <fmt/format.h>

#include <algorithm>
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
#include <llvm/TargetParser/Host.h>
#include <xxhash.h>

#include "cpu_blob.hpp"
#include "cpu_hcq.hpp"
#include "host.hpp"
#include "object_runtime.hpp"
#include "orc_linker.hpp"
#include "tinydev/device.hpp"
#include "tinydev/error.hpp"

namespace tinydev {

namespace {

// The host as LLVM sees it (the CPU name and feature names LLVM's code generator takes), which
// differs from /proc/cpuinfo's spelling in cpu::host_target().
const cpu::HostTarget& llvm_host_target() {
  static const cpu::HostTarget target = [] {
    cpu::initialize_llvm_native_target();
    cpu::HostTarget t;
    t.triple = llvm::sys::getProcessTriple();
    t.cpu = std::string(llvm::sys::getHostCPUName());
    std::string features;
    for (const auto& [name, enabled] : llvm::sys::getHostCPUFeatures()) {
      if (!features.empty()) features += ',';
      features += (enabled ? "+" : "-") + name.str();
    }
    t.features = features;
    return t;
  }();
  return target;
}

class LLVMCompiler final : public Compiler {
 public:
  LLVMCompiler() : Compiler("compile_llvm") {
    const cpu::HostTarget& t = llvm_host_target();
    // Everything that changes the object code: LLVM's version, the target, the host's CPU and
    // features, the optimization level.
    identity_ = fmt::format("llvm {} {} {} features:{:016x} O2+vec(clang -O2 tuning)/codegen-O2 pic blob:TDVCPU01a", LLVM_VERSION_STRING,
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
    // The kernels' signatures, read before optimization can change parameter lists.
    std::vector<cpu::KernelInfo> kernels;
    for (const llvm::Function& f : *module) {
      if (f.isDeclaration() || f.hasLocalLinkage()) continue;
      cpu::KernelInfo k{f.getName().str(), {}};
      bool readable = true;
      for (const llvm::Argument& a : f.args()) {
        if (a.getType()->isPointerTy()) {
          if (k.signature.num_values) readable = false;  // buffers come first in the kernel ABI
          ++k.signature.num_buffers;
        } else if (a.getType()->isIntegerTy(32)) {
          ++k.signature.num_values;
        } else {
          readable = false;
        }
      }
      if (readable) kernels.push_back(std::move(k));
    }
    const cpu::HostTarget& t = llvm_host_target();
    auto builder = llvm::orc::JITTargetMachineBuilder(llvm::Triple(t.triple));
    llvm::SubtargetFeatures features(t.features);
    builder.setCPU(t.cpu).addFeatures(features.getFeatures());
    // clang -O2's code generator level (Note [clang's -O2 pipeline]): the same IR gives the same
    // machine code through this device as through `clang -O2 -march=native`.
    builder.setCodeGenOptLevel(llvm::CodeGenOptLevel::Default);
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
      // Note [clang's -O2 pipeline]: llvm::PipelineTuningOptions leaves loop and SLP
      // vectorization, interleaving and unrolling off; clang -O2 turns all four on (as does
      // tinygrad's LLVM backend). Without them a generator-style matmul runs 3x slower, and a
      // reduction whose float ops allow reassociation sums in another order than clang's code
      // does, so the same IR gives other results (the corpus's reassoc dot product shows it).
      llvm::PipelineTuningOptions tuning;
      tuning.LoopVectorization = true;
      tuning.SLPVectorization = true;
      tuning.LoopInterleaving = true;
      tuning.LoopUnrolling = true;
      llvm::PassBuilder passes(&tm, tuning);
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
    return cpu::wrap_object(std::as_bytes(std::span(object.data(), object.size())), kernels);
  }

 private:
  std::string identity_;
};

class LLVMDevice final : public cpu::CpuHCQDevice {
 public:
  explicit LLVMDevice(const std::string& name)
      : CpuHCQDevice(name, std::make_unique<LLVMCompiler>(), SourceLanguage::LLVMIR,
                     [](const std::string& device, cpu::CallOrdering* ordering) {
                       return std::make_unique<cpu::ObjectRuntime>(device, ordering, cpu::make_orc_linker(device));
                     }) {}

  std::map<std::string, std::string> properties() const override {
    auto props = CpuHCQDevice::properties();
    props.insert_or_assign("target", llvm_host_target().triple);
    props.insert_or_assign("cpu", llvm_host_target().cpu);
    const std::string& features = llvm_host_target().features;
    props.insert_or_assign("cpu features",
                           fmt::format("{} enabled", std::count(features.begin(), features.end(), '+')));
    props["compiler"] = fmt::format("LLVM {} in process", LLVM_VERSION_STRING);
    return props;
  }
};

}  // namespace

std::unique_ptr<Compiled> open_llvm_device(const std::string& canonical_name) {
  return std::make_unique<LLVMDevice>(canonical_name);
}

}  // namespace tinydev
