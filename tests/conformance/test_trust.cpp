// Trust boundaries of the CPU backends (docs/reliability.md): a cache entry another user planted
// never runs, the clang subprocess is bounded in time and its output is checked before it is
// cached, and malformed objects are errors saying what is wrong.
#include <elf.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <fstream>
#include <sstream>

#include "conformance.hpp"
#include "cpu_blob.hpp"
#include "demo_kernels.hpp"
#include "elf_loader.hpp"
#include "subprocess.hpp"

using namespace tinydev;
using namespace tinydev::testing;
namespace fs = std::filesystem;

namespace {

std::vector<float> run_add(Program& prg, const std::string& device, const std::vector<float>& a,
                           const std::vector<float>& b) {
  const std::size_t n = a.size();
  Buffer ba(device, n, dtypes::float32), bb(device, n, dtypes::float32), bo(device, n, dtypes::float32);
  ba.allocate().copyin(std::span<const float>(a));
  bb.allocate().copyin(std::span<const float>(b));
  bo.allocate();
  const Allocation bufs[] = {bo.allocation(), ba.allocation(), bb.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  prg(bufs, vals, LaunchParams{.wait = true});
  std::vector<float> out(n);
  bo.copyout(std::span<float>(out));
  return out;
}

// An add kernel that also runs a shell command: what an attacker would plant.
std::string evil_add_ir(const std::string& command) {
  std::string escaped;
  for (char c : command) escaped += c == '"' ? std::string("\\22") : std::string(1, c);
  return "@cmd = private constant [" + std::to_string(command.size() + 1) + " x i8] c\"" + escaped + "\\00\"\n"
         "declare i32 @system(ptr)\n"
         "define void @add(ptr noalias %o, ptr noalias %a, ptr noalias %b, i32 %n) {\n"
         "entry:\n  %r = call i32 @system(ptr @cmd)\n  br label %loop\n"
         "loop:\n  %i = phi i32 [ 0, %entry ], [ %next, %loop ]\n"
         "  %pa = getelementptr float, ptr %a, i32 %i\n  %pb = getelementptr float, ptr %b, i32 %i\n"
         "  %po = getelementptr float, ptr %o, i32 %i\n  %x = load float, ptr %pa\n  %y = load float, ptr %pb\n"
         "  %s = fadd float %x, %y\n  store float %s, ptr %po\n  %next = add i32 %i, 1\n"
         "  %done = icmp eq i32 %next, %n\n  br i1 %done, label %exit, label %loop\n"
         "exit:\n  ret void\n}\n";
}

// A folder holding a fake `clang` (a shell script) for the duration of a test.
struct FakeClang {
  TempDir dir;
  explicit FakeClang(const std::string& compile_body) {
    const std::string path = dir.str() + "/clang";
    std::ofstream(path) << "#!/bin/sh\n"
                           "if [ \"$1\" = \"--version\" ]; then echo 'fake clang version 1.0'; exit 0; fi\n"
                        << compile_body << "\n";
    REQUIRE(::chmod(path.c_str(), 0755) == 0);
  }
};

// Opens a new CLANG ordinal with only `fake` on PATH (each CLANG device finds its clang when it opens).
Compiled& clang_device_with(const FakeClang& fake, const std::string& name) {
  const char* old = std::getenv("PATH");
  const std::string saved = old ? old : "";
  ::setenv("PATH", fake.dir.str().c_str(), 1);
  Compiled* dev = nullptr;
  try {
    dev = &Device[name];
  } catch (...) {
    ::setenv("PATH", saved.c_str(), 1);
    throw;
  }
  ::setenv("PATH", saved.c_str(), 1);
  return *dev;
}

std::size_t entries_in(const std::string& dir) {
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += e.path().extension() == ".tdc";
  return n;
}

}  // namespace

TEST_CASE("trust: a cache entry planted by another user never runs", "[trust]") {
  if (::geteuid() != 0) {
    skip("planting an entry as another user needs root to chown it (running as uid " + std::to_string(::geteuid()) + ")");
    return;
  }
  on_backend_taking(SourceLanguage::LLVMIR, [](Compiled& dev) {
    if (!dev.capabilities().caches_compiles) return skip(dev.name() + " caches no compiles");
    TempDir cache, scratch;
    ScopedOverride folder("TINYDEV_CACHE_DIR", cache.str());
    const std::string marker = scratch.str() + "/planted-code-ran";
    const std::string benign = kernels::add_f32(SourceLanguage::LLVMIR);
    // The attacker knows the key (the source, the compiler's identity) and computes the checksum.
    const Blob evil = dev.compiler().compile(evil_add_ir("touch " + marker));
    DiskCache::global().put(*dev.compiler().cache_key(), dev.compiler().identity(), benign, evil);
    const std::string entry = DiskCache::global().entry_path(*dev.compiler().cache_key(), dev.compiler().identity(), benign);
    REQUIRE(fs::exists(entry));
    REQUIRE(::chown(entry.c_str(), 4242, 4242) == 0);  // the attacker's file
    DiskCache::global().drop_memory_layer();

    const std::uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    auto a = random_floats(1000, seed), b = random_floats(1000, seed + 1);
    {
      auto prg = dev.load_kernel("add", benign);
      auto out = run_add(*prg, dev.name(), a, b);
      for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(out[i] == a[i] + b[i]);
    }
    CHECK_FALSE(fs::exists(marker));
    CHECK(DiskCache::global().stats().rejected_entries >= 1);

    // The witness: the same file, owned by this user, is trusted and its code runs. This is what the
    // ownership check stops (and what this test would see without it).
    const std::string again = DiskCache::global().entry_path(*dev.compiler().cache_key(), dev.compiler().identity(), benign);
    DiskCache::global().put(*dev.compiler().cache_key(), dev.compiler().identity(), benign, evil);
    REQUIRE(::chown(again.c_str(), ::geteuid(), ::getegid()) == 0);
    DiskCache::global().drop_memory_layer();
    {
      auto prg = dev.load_kernel("add", benign);
      run_add(*prg, dev.name(), a, b);
    }
    CHECK(fs::exists(marker));
  });
}

TEST_CASE("trust: a compiler subprocess past its timeout is killed with its children and reaped", "[trust][host]") {
  using namespace std::chrono;
  const auto start = steady_clock::now();
  clang_backend::ProcessResult r =
      clang_backend::run_process({"/bin/sh", "-c", "sleep 30 & sleep 30"}, "", milliseconds(300));
  const double seconds = duration<double>(steady_clock::now() - start).count();
  CHECK(r.timed_out);
  CHECK(seconds < 5.0);
  // No zombie: the child was reaped. No orphan: the whole process group got SIGKILL.
  int status = 0;
  CHECK(::waitpid(r.pid, &status, WNOHANG) == -1);
  // Every process of its group is dead: gone, or a zombie waiting for init (which reaps orphans
  // when it gets to it; some container inits never do).
  bool group_dead = false;
  for (int i = 0; i < 200 && !group_dead; ++i) {
    group_dead = true;
    for (const auto& e : fs::directory_iterator("/proc")) {
      std::ifstream stat(e.path() / "stat");
      std::string line;
      if (!std::getline(stat, line)) continue;
      const std::size_t close = line.rfind(')');
      if (close == std::string::npos) continue;
      char state = 0;
      int ppid = 0, pgrp = 0;
      std::istringstream rest(line.substr(close + 2));
      rest >> state >> ppid >> pgrp;
      if (pgrp == r.pid && state != 'Z') group_dead = false;
    }
    if (!group_dead) ::usleep(5000);
  }
  CHECK(group_dead);
  // A process that floods its output is stopped at kMaxOutputBytes, not collected without end.
  clang_backend::ProcessResult flood = clang_backend::run_process({"/bin/sh", "-c", "exec yes"}, "", std::chrono::seconds(60));
  CHECK(flood.output_overflow);
  CHECK(flood.out.size() <= clang_backend::kMaxOutputBytes);
  // A process that finishes in time is untouched.
  clang_backend::ProcessResult quick = clang_backend::run_process({"/bin/sh", "-c", "cat; echo done >&2"}, "hello", std::chrono::seconds(5));
  CHECK_FALSE(quick.timed_out);
  CHECK(quick.exit_code == 0);
  CHECK(quick.out == "hello");
  CHECK(quick.err == "done\n");
}

TEST_CASE("trust: a clang that hangs is a CompileError after TINYDEV_COMPILE_TIMEOUT and nothing is cached", "[trust]") {
  if (!in_this_run("CLANG")) return;
  TempDir cache;
  ScopedOverride folder("TINYDEV_CACHE_DIR", cache.str());
  FakeClang hangs("exec /bin/sleep 60");
  Compiled& dev = clang_device_with(hangs, "CLANG:61");
  const std::size_t at_open = entries_in(cache.str());  // the fake clang's cached version line (at most)
  CHECK(at_open <= 1);
  ScopedOverride timeout("TINYDEV_COMPILE_TIMEOUT", "1");
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(dev.compiler().compile_cached(kernels::add_f32(SourceLanguage::C)),
                    Catch::Contains("did not finish compiling the kernel within 1 s and was killed") &&
                        Catch::Contains("TINYDEV_COMPILE_TIMEOUT"));
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 10.0);
  CHECK(entries_in(cache.str()) == at_open);
}

// Note [clang's identity, cached]
TEST_CASE("trust: clang's version is asked once per binary and again when the binary changes", "[trust]") {
  if (!in_this_run("CLANG")) return;
  TempDir cache;
  ScopedOverride folder("TINYDEV_CACHE_DIR", cache.str());
  const std::string real = clang_backend::find_on_path("clang-19").empty() ? "clang" : "clang-19";
  const std::string real_path = clang_backend::find_on_path(real);
  if (real_path.empty()) return;
  FakeClang fake("exec " + real_path + " \"$@\"");
  const std::string script = fake.dir.str() + "/clang", asked = fake.dir.str() + "/asked";
  auto write_script = [&](const std::string& version) {
    std::ofstream(script) << "#!/bin/sh\nif [ \"$1\" = \"--version\" ]; then echo x >> " << asked << "; echo '"
                          << version << "'; exit 0; fi\nexec " << real_path << " \"$@\"\n";
  };
  auto times_asked = [&] {
    std::ifstream in(asked);
    return std::count(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>(), '\n');
  };
  write_script("fake clang version 1.0");
  Compiled& first = clang_device_with(fake, "CLANG:57");
  CHECK(times_asked() == 1);
  CHECK_THAT(first.properties().at("compiler"), Catch::Contains("fake clang version 1.0"));
  DiskCache::global().drop_memory_layer();  // the next open reads the answer from disk
  Compiled& second = clang_device_with(fake, "CLANG:58");
  CHECK(times_asked() == 1);
  CHECK(second.compiler().identity() == first.compiler().identity());
  // A replaced binary (another size and mtime) is asked again, and its answer is in the key.
  ::usleep(20000);
  write_script("fake clang version 2.0 (a longer line)");
  Compiled& third = clang_device_with(fake, "CLANG:59");
  CHECK(times_asked() == 2);
  CHECK_THAT(third.compiler().identity(), Catch::Contains("fake clang version 2.0"));
  // With the compile cache disabled, nothing is read from it: clang is asked again.
  {
    ScopedOverride off("TINYDEV_DISABLE_COMPILER_CACHE", "1");
    clang_device_with(fake, "CLANG:60");
    CHECK(times_asked() == 3);
  }
  // The cached answer changes nothing about compiling: a kernel compiles and runs.
  auto prg = second.load_kernel("add", kernels::add_f32(SourceLanguage::C));
  CHECK(prg->signature() == KernelSignature{3, 1});
}

TEST_CASE("trust: a clang that prints garbage is a CompileError quoting it and nothing is cached", "[trust]") {
  if (!in_this_run("CLANG")) return;
  TempDir cache;
  ScopedOverride folder("TINYDEV_CACHE_DIR", cache.str());
  FakeClang garbage("cat >/dev/null; printf 'this is not an object file'; exit 0");
  Compiled& dev = clang_device_with(garbage, "CLANG:62");
  const std::size_t at_open = entries_in(cache.str());  // the fake clang's cached version line (at most)
  CHECK(at_open <= 1);
  const std::string src = kernels::add_f32(SourceLanguage::C);
  CHECK_THROWS_AS(dev.compiler().compile_cached(src), CompileError);
  CHECK_THROWS_WITH(dev.compiler().compile_cached(src),
                    Catch::Contains("did not produce an object file for this host") &&
                        Catch::Contains("began 'this is not an object file'"));
  CHECK(entries_in(cache.str()) == at_open);
  DiskCache::global().drop_memory_layer();
  CHECK_THROWS_AS(dev.load_kernel("add", src), CompileError);  // still not cached: compiled (and refused) again
}

TEST_CASE("trust: a malformed object is an error that says what is wrong on every CPU device", "[trust]") {
  for_each_backend(Needs{.kernels = true, .host_objects = true}, [](Compiled& dev) {
    const Blob wrapped = dev.compiler().compile(kernels::add_f32(dev.source_language()));
    const auto object = cpu::unwrap_object(wrapped).object;
    Blob truncated(object.begin(), object.begin() + static_cast<std::ptrdiff_t>(object.size() * 3 / 4));
    CHECK_THROWS_WITH(dev.runtime().load("add", truncated),
                      Catch::Contains("is not a loadable object") && Catch::Contains("outside"));
    Blob other_machine(object.begin(), object.end());
    other_machine[18] = std::byte{0xb7};  // e_machine = EM_AARCH64 (or x86-64's on AArch64 hosts)
    other_machine[19] = std::byte{0};
    if (cpu::check_elf_object(object, 183).empty()) other_machine[18] = std::byte{62};
    CHECK_THROWS_WITH(dev.runtime().load("add", other_machine), Catch::Contains("this host is machine"));
    // A relocation against the null symbol (JITLink crashes formatting its error for one): the
    // call to getpid of a kernel gets its relocation's symbol set to 0.
    const KernelSource calls_getpid{"declare i32 @getpid()\ndefine void @pid(ptr %o) {\n  %p = call i32 @getpid()\n"
                                    "  store i32 %p, ptr %o\n  ret void\n}\n",
                                    "int getpid(void);\nvoid pid(int* o) { o[0] = getpid(); }\n"};
    const Blob with_call_blob = dev.compiler().compile(calls_getpid.for_device(dev));  // outlives the span
    const auto with_call = cpu::unwrap_object(with_call_blob).object;
    Blob null_symbol(with_call.begin(), with_call.end());
    Elf64_Ehdr header;
    std::memcpy(&header, null_symbol.data(), sizeof header);
    bool patched = false;
    for (std::size_t i = 0; i < header.e_shnum && !patched; ++i) {
      Elf64_Shdr section;
      std::memcpy(&section, null_symbol.data() + header.e_shoff + i * sizeof section, sizeof section);
      if (section.sh_type != SHT_RELA || section.sh_size < sizeof(Elf64_Rela)) continue;
      Elf64_Rela rela;
      std::memcpy(&rela, null_symbol.data() + section.sh_offset, sizeof rela);
      rela.r_info = ELF64_R_INFO(0, ELF64_R_TYPE(rela.r_info));
      std::memcpy(null_symbol.data() + section.sh_offset, &rela, sizeof rela);
      patched = true;
    }
    REQUIRE(patched);
    CHECK_THROWS_WITH(dev.runtime().load("pid", null_symbol),
                      Catch::Contains("is not a loadable object") && Catch::Contains("names the null symbol"));
  });
}
