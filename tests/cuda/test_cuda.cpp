// The CUDA backend. The compiler tests need NVRTC only, so they run in CI on machines without a
// GPU; the "cuda gpu:" tests skip, saying why, where no GPU opens. This binary links the CUDA
// backend alone (no LLVM) and registers it itself.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <functional>
#include <iterator>
#include <mutex>
#include <optional>
#include <thread>

#include "cuda_compiler.hpp"
#include "cuda_hcq.hpp"
#include "demo_kernels.hpp"
#include "support.hpp"

namespace tinydev {
std::unique_ptr<Compiled> open_cuda_device(const std::string& canonical_name);
}

using namespace tinydev;
using namespace tinydev::testing;

namespace {

// This program links tinydev_cuda and no aggregate: linking the backend's target registers it.
void register_cuda() {
  static const bool registered = [] {
    const auto types = Device.backends();
    return types == std::vector<std::string>{"CUDA"};
  }();
  REQUIRE(registered);
}

// The first GPU, or nullptr after skip() saying why none opens here.
Compiled* gpu() {
  register_cuda();
  try {
    return &Device["CUDA"];
  } catch (const DeviceUnavailable& e) {
    skip(std::string("no CUDA device opens here: ") + e.what());
    return nullptr;
  }
}

std::uint16_t elf_machine(const Blob& blob) {
  std::uint16_t machine = 0;
  if (blob.size() >= 20) std::memcpy(&machine, blob.data() + 18, 2);
  return machine;
}

std::string as_text(const Blob& blob) { return std::string(reinterpret_cast<const char*>(blob.data()), blob.size()); }

// Kernels shaped like tinygrad's CUDA renderer output: extern "C", __launch_bounds__, restrict
// pointers, half and bf16 through the toolkit's headers, shared memory and barriers.
const char* kRendererStyle = R"(#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void __launch_bounds__(256) E_4096_4(half* __restrict__ data0, const float* __restrict__ data1) {
  int gidx0 = blockIdx.x; int lidx0 = threadIdx.x;
  int alu0 = (gidx0 * 256 + lidx0);
  float val0 = *(data1 + alu0);
  *(data0 + alu0) = __float2half(val0 * 2.0f);
}
extern "C" __global__ void __launch_bounds__(32) r_64_32(float* __restrict__ data0, const __nv_bfloat16* __restrict__ data1) {
  __shared__ float temp0[32];
  int gidx0 = blockIdx.x; int lidx0 = threadIdx.x;
  float acc0 = 0.0f;
  for (int ridx0 = 0; ridx0 < 8; ridx0++) acc0 += __bfloat162float(*(data1 + (gidx0 * 256 + lidx0 * 8 + ridx0)));
  temp0[lidx0] = acc0;
  __syncthreads();
  if (lidx0 == 0) {
    float acc1 = 0.0f;
    for (int i = 0; i < 32; i++) acc1 += temp0[i];
    *(data0 + gidx0) = acc1;
  }
}
extern "C" __global__ void __launch_bounds__(256) r_16_16_16(float* __restrict__ c, const float* __restrict__ a, const float* __restrict__ b, int n) {
  __shared__ float as[16][16]; __shared__ float bs[16][16];
  int row = blockIdx.y * 16 + threadIdx.y, col = blockIdx.x * 16 + threadIdx.x;
  float acc = 0.0f;
  for (int t = 0; t < n; t += 16) {
    as[threadIdx.y][threadIdx.x] = a[row * n + t + threadIdx.x];
    bs[threadIdx.y][threadIdx.x] = b[(t + threadIdx.y) * n + col];
    __syncthreads();
    for (int k = 0; k < 16; k++) acc += as[threadIdx.y][k] * bs[k][threadIdx.x];
    __syncthreads();
  }
  c[row * n + col] = acc;
}
)";

// Whether NVRTC 12 can be opened here (then the backend must choose it for a 12.x driver or a GPU
// older than compute capability 7.5).
bool nvrtc_12_opens() {
  for (const char* name : {"libnvrtc.so.12", "/usr/local/cuda/lib64/libnvrtc.so.12"})
    if (void* handle = ::dlopen(name, RTLD_NOW | RTLD_LOCAL)) {
      ::dlclose(handle);
      return true;
    }
  return false;
}

}  // namespace

TEST_CASE("cuda compiler: CUDA C++ compiles to CUBIN for sm_80 and sm_90 without a GPU", "[cuda]") {
  const std::string src = kernels::add_f32(SourceLanguage::CUDA, "add_" + std::to_string(fresh_seed() % 100000));
  cuda::CudaCompiler c80("sm_80", false), c90("sm_90", false);
  const Blob b80 = c80.compile(src), b90 = c90.compile(src);
  for (const Blob* b : {&b80, &b90}) {
    REQUIRE(b->size() > 64);
    CHECK(std::memcmp(b->data(), "\x7f" "ELF", 4) == 0);
    CHECK(elf_machine(*b) == 190);  // EM_CUDA
  }
  CHECK(b80 != b90);
  CHECK(c80.identity() != c90.identity());
  CHECK_THAT(c90.identity(), Catch::Contains("nvrtc " + c90.nvrtc_version()) && Catch::Contains("sm_90"));
  CHECK(c90.options().front() == "--gpu-architecture=sm_90");
}

TEST_CASE("cuda compiler: PTX mode emits PTX for the virtual architecture and caches apart from CUBIN", "[cuda]") {
  const std::string name = "ptx_" + std::to_string(fresh_seed() % 100000);
  cuda::CudaCompiler ptx("sm_90", true), cubin("sm_90", false);
  const std::string text = as_text(ptx.compile(kernels::add_f32(SourceLanguage::CUDA, name)));
  CHECK_THAT(text, Catch::Contains(".version") && Catch::Contains(".target sm_90") && Catch::Contains(name));
  CHECK(ptx.options().front() == "--gpu-architecture=compute_90");
  CHECK(ptx.identity() != cubin.identity());
  CHECK(ptx.cache_key() != cubin.cache_key());
}

TEST_CASE("cuda compiler: invalid source is a CompileError carrying NVRTC's log", "[cuda]") {
  const std::string missing = "undefined_function_" + std::to_string(fresh_seed() % 1000000);
  cuda::CudaCompiler c("sm_90", false);
  try {
    c.compile("extern \"C\" __global__ void k(float* o) { o[0] = " + missing + "(); }\n");
    FAIL("expected a CompileError");
  } catch (const CompileError& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("NVRTC could not compile the kernel for sm_90"));
    CHECK_THAT(e.log(), Catch::Contains(missing) && Catch::Contains("error"));
  }
}

TEST_CASE("cuda compiler: an architecture NVRTC does not compile for is a CompileError saying which NVRTC to use", "[cuda]") {
  const std::string src = kernels::add_f32(SourceLanguage::CUDA, "old_" + std::to_string(fresh_seed() % 100000));
  CHECK(cuda::CudaCompiler("sm_90", false).unsupported_reason().empty());
  // Compute capability 3.0: neither NVRTC 12 nor 13 compiles for it; 99.0: no NVRTC yet.
  const bool nvrtc_13 = cuda::CudaCompiler("sm_90", false).nvrtc_version().rfind("12.", 0) != 0;
  const std::pair<const char*, const char*> cases[] = {
      {"sm_30", nvrtc_13 ? "CUDA 13 dropped GPUs older than compute capability 7.5" : "older than any this NVRTC"},
      {"sm_990", "this GPU is newer than this NVRTC"},
      {"sm_91", "does not list it among its architectures"}};
  for (const auto& [arch, why] : cases) {
    INFO(arch);
    cuda::CudaCompiler c(arch, false);
    CHECK_THAT(c.unsupported_reason(), Catch::Contains(std::string("cannot compile for ") + arch) &&
                                           Catch::Contains(why) && Catch::Contains("TINYDEV_CUDA_NVRTC"));
    const auto before = DiskCache::global().stats();
    CHECK_THROWS_AS(c.compile_cached(src), CompileError);
    CHECK_THROWS_WITH(c.compile(src), Catch::Contains(std::string("cannot compile for ") + arch));
    CHECK(DiskCache::global().stats().writes == before.writes);  // nothing cached for it
  }
}

// Run by the TINYDEV_CUDA_NVRTC test below in a fresh process (NVRTC is loaded once per process).
TEST_CASE("cuda compiler: NVRTC setting probe", "[.][probe][cuda-nvrtc-probe]") {
  const std::string missing = "/nonexistent/libnvrtc_" + std::to_string(fresh_seed() % 1000000) + ".so";
  {
    ScopedOverride nvrtc("TINYDEV_CUDA_NVRTC", missing);
    CHECK_THROWS_AS(cuda::CudaCompiler("sm_90", false), DeviceUnavailable);
    CHECK_THROWS_WITH(cuda::CudaCompiler("sm_90", false),
                      Catch::Contains("TINYDEV_CUDA_NVRTC='" + missing + "' cannot be opened") &&
                          Catch::Contains("unset it"));
  }
  // Until a load succeeds each use reads the setting again: the toolkit's own library now loads.
  const char* real = std::getenv("TINYDEV_TEST_REAL_NVRTC");
  REQUIRE(real != nullptr);
  ScopedOverride nvrtc("TINYDEV_CUDA_NVRTC", real);
  cuda::CudaCompiler c("sm_90", false);
  CHECK(c.nvrtc_library() == real);
  CHECK(c.compile(kernels::add_f32(SourceLanguage::CUDA, "probe")).size() > 64);
}

TEST_CASE("cuda compiler: TINYDEV_CUDA_NVRTC picks the NVRTC library and a wrong path is DeviceUnavailable naming it", "[cuda]") {
  // The library this process loaded (the default choice), handed to the child.
  const std::string real = cuda::CudaCompiler("sm_90", false).nvrtc_library();
  REQUIRE_FALSE(real.empty());
  CHECK(run_probe("[cuda-nvrtc-probe]", {{"TINYDEV_TEST_REAL_NVRTC", real}}) == 0);
}

// Run by the test below in a fresh process (NVRTC is loaded once per process).
TEST_CASE("cuda compiler: old NVRTC probe", "[.][probe][cuda-nvrtc-old-probe]") {
  ScopedOverride nvrtc("TINYDEV_CUDA_NVRTC", TINYDEV_TEST_FAKE_NVRTC_11);
  CHECK_THROWS_AS(cuda::CudaCompiler("sm_90", false), DeviceUnavailable);
  CHECK_THROWS_WITH(cuda::CudaCompiler("sm_90", false),
                    Catch::Contains(TINYDEV_TEST_FAKE_NVRTC_11) && Catch::Contains("it is NVRTC 11.8") &&
                        Catch::Contains("CUDA 12's or 13's NVRTC") && Catch::Contains("TINYDEV_CUDA_NVRTC"));
}

TEST_CASE("cuda fake: an NVRTC older than 12 is DeviceUnavailable saying which NVRTC tinydev needs", "[cuda][fake]") {
  CHECK(run_probe("[cuda-nvrtc-old-probe]", {}) == 0);
}

TEST_CASE("cuda compiler: a kernel's quoted include is not read from the working directory", "[cuda]") {
  // A header planted in the working directory (a folder such as /tmp that others may write).
  const std::string header = "tinydev_planted_" + std::to_string(fresh_seed() % 1000000) + ".h";
  TempDir dir;
  {
    std::ofstream out(dir.path / header);
    out << "#define PLANTED_VALUE 42\n";
  }
  const std::filesystem::path was = std::filesystem::current_path();
  std::filesystem::current_path(dir.path);
  struct Back {
    std::filesystem::path to;
    ~Back() { std::filesystem::current_path(to); }
  } back{was};
  cuda::CudaCompiler c("sm_90", false);
  CHECK(std::find(c.options().begin(), c.options().end(), "--no-source-include") != c.options().end());
  const std::string src = "#include \"" + header + "\"\nextern \"C\" __global__ void planted(int* o) { o[0] = PLANTED_VALUE; }\n";
  try {
    c.compile(src);
    FAIL("the planted header was included");
  } catch (const CompileError& e) {
    CHECK_THAT(e.log(), Catch::Contains(header));
  }
  // The cache key names the compiler's files: the library NVRTC was loaded from is found.
  CHECK_THAT(c.identity(), Catch::Contains(" files:") && !Catch::Contains("files:-"));
}

TEST_CASE("cuda: the queue kernels' PTX assembles for sm_75 and sm_90 (ptxas)", "[cuda]") {
  // Every device loads this PTX at open; a GPU is the only other place a mistake in it would show.
  std::string ptxas;
  for (const char* candidate : {"/usr/local/cuda/bin/ptxas", "/opt/cuda/bin/ptxas"})
    if (::access(candidate, X_OK) == 0) {
      ptxas = candidate;
      break;
    }
  if (ptxas.empty()) {
    skip("no ptxas (the CUDA toolkit's PTX assembler) in /usr/local/cuda/bin or /opt/cuda/bin");
    return;
  }
  TempDir dir;
  const std::string source = dir.str() + "/queue.ptx";
  std::ofstream(source) << cuda::queue_kernels_ptx();
  for (const char* arch : {"sm_75", "sm_90"}) {
    INFO(arch);
    const std::string command = fmt::format("'{}' -arch={} '{}' -o '{}/queue_{}.cubin' 2>&1", ptxas, arch, source,
                                            dir.str(), arch);
    CHECK(std::system(command.c_str()) == 0);
    std::ifstream cubin(dir.str() + "/queue_" + arch + ".cubin", std::ios::binary);
    const std::string image((std::istreambuf_iterator<char>(cubin)), std::istreambuf_iterator<char>());
    for (const char* kernel : {"tinydev_timestamp", "tinydev_signal", "tinydev_wait"})
      CHECK_THAT(image, Catch::Contains(kernel));
  }
}

TEST_CASE("cuda compiler: a malformed architecture is InvalidArgument saying what to pass", "[cuda]") {
  for (const char* arch : {"sm90", "sm_9", "compute_90", "sm_90;rm -rf", "", "sm_1000"}) {
    INFO(arch);
    CHECK_THROWS_WITH(cuda::CudaCompiler(arch, false), Catch::Contains("is not a GPU architecture"));
  }
  CHECK(cuda::arch_for(9, 0) == "sm_90");
  CHECK_NOTHROW(cuda::CudaCompiler("sm_100a", false));
}

TEST_CASE("cuda compiler: compile_cached hits the disk cache from another process", "[cuda]") {
  TempDir dir;
  ScopedOverride folder("TINYDEV_CACHE_DIR", dir.str());
  cuda::CudaCompiler c("sm_90", false);
  const std::string src = kernels::add_f32(SourceLanguage::CUDA, "cached_" + std::to_string(fresh_seed() % 1000000));
  const auto before = DiskCache::global().stats();
  const Blob cold = c.compile_cached(src);
  CHECK(DiskCache::global().stats().writes == before.writes + 1);
  // A forked child with its memory layer dropped must read the entry from disk, compiling nothing.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int code = 1;
    try {
      DiskCache::global().drop_memory_layer();
      ScopedOverride strict("TINYDEV_ASSERT_COMPILE", "1");
      code = c.compile_cached(src) == cold && DiskCache::global().stats().disk_hits >= 1 ? 0 : 1;
    } catch (...) {
      code = 2;
    }
    ::_exit(code);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

// Run by the patched-toolkit test below with TINYDEV_CUDA_NVRTC set to a copy of NVRTC in a
// toolkit folder of the test's own (TEST_PATCHED_TOOLKIT: lib64/ and include/), whose files it
// changes as patching a toolkit in place would (Note [NVRTC includes]).
TEST_CASE("cuda compiler: patched toolkit probe", "[.][probe][cuda-patched-toolkit-probe]") {
  const char* folder = std::getenv("TEST_PATCHED_TOOLKIT");
  REQUIRE(folder != nullptr);
  const std::filesystem::path toolkit = std::filesystem::canonical(folder);
  const std::string src = kernels::add_f32(SourceLanguage::CUDA, "patched_" + std::to_string(fresh_seed() % 1000000));
  cuda::CudaCompiler original("sm_90", false);
  REQUIRE(std::filesystem::canonical(original.nvrtc_library()).string().find(toolkit.string()) == 0);
  // The toolkit's own headers come first.
  REQUIRE(original.options().at(2) == "-I" + (toolkit / "include").string());
  const auto writes = [] { return DiskCache::global().stats().writes; };
  const std::uint64_t before = writes();
  const Blob cold = original.compile_cached(src);
  CHECK(writes() == before + 1);
  // NVRTC compiled with the builtins beside the copy it was opened from (Note [NVRTC builtins]),
  // not those of the toolkit in the loader's cache.
  std::string builtins;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (const std::size_t at = line.find('/'); at != std::string::npos && line.find("/libnvrtc-builtins.so.") != std::string::npos)
      builtins = line.substr(at);
  CHECK(builtins.find(toolkit.string() + "/lib64/") == 0);
  CHECK(cuda::CudaCompiler("sm_90", false).compile_cached(src) == cold);  // unchanged: a hit
  CHECK(writes() == before + 1);
  // Each change a patch in place makes gives new keys, so the kernel compiles afresh.
  std::string previous = original.identity();
  const auto later = [](const std::filesystem::path& file) {
    std::filesystem::last_write_time(file, std::filesystem::last_write_time(file) + std::chrono::seconds(7));
  };
  const std::vector<std::pair<std::string, std::function<void()>>> patches{
      {"a newer cuda_fp16.hpp", [&] { later(toolkit / "include" / "cuda_fp16.hpp"); }},
      {"a longer cuda_bf16.h", [&] { std::ofstream(toolkit / "include" / "cuda_bf16.h", std::ios::app) << "\n"; }},
      {"cuda_bf16.hpp removed", [&] { std::filesystem::remove(toolkit / "include" / "cuda_bf16.hpp"); }},
      {"a newer NVRTC library", [&] { later(original.nvrtc_library()); }}};
  for (const auto& [what, patch] : patches) {
    INFO(what);
    patch();
    cuda::CudaCompiler patched("sm_90", false);
    CHECK(patched.identity() != previous);  // in every entry's key, beside the family (cache_key)
    const std::uint64_t at = writes();
    CHECK(patched.compile_cached(src) == cold);  // the same NVRTC: the same code, compiled again
    CHECK(writes() == at + 1);
    previous = patched.identity();
  }
}

TEST_CASE("cuda compiler: a toolkit patched in place - NVRTC or its half-precision headers changed - compiles afresh", "[cuda]") {
  cuda::CudaCompiler c("sm_90", false);
  // The NVRTC this process loaded, as a file, and its toolkit's headers.
  std::string library;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (const std::size_t at = line.find('/'); at != std::string::npos && line.find("/libnvrtc.so.") != std::string::npos)
      library = line.substr(at);
  REQUIRE_FALSE(library.empty());
  const std::filesystem::path headers = c.options().size() > 2 ? c.options().at(2).substr(2) : "";
  // The headers whose fingerprints the cache key holds (Note [NVRTC includes]).
  static constexpr const char* kHalfPrecisionHeaders[] = {"cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp"};
  for (const char* header : kHalfPrecisionHeaders)
    if (!std::filesystem::is_regular_file(headers / header)) {
      skip(fmt::format("NVRTC's toolkit here has no {} to copy ({})", header, headers.string()));
      return;
    }
  TempDir toolkit, cache;
  std::filesystem::create_directories(toolkit.path / "lib64");
  std::filesystem::create_directories(toolkit.path / "include");
  const std::filesystem::path copy = toolkit.path / "lib64" / std::filesystem::path(library).filename();
  std::filesystem::copy_file(library, copy);
  // NVRTC's builtins library, which tinydev loads from beside the copy (Note [NVRTC builtins]).
  for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(library).parent_path()))
    if (entry.path().filename().string().starts_with("libnvrtc-builtins.so"))
      std::filesystem::copy(entry.path(), toolkit.path / "lib64" / entry.path().filename(),
                            std::filesystem::copy_options::copy_symlinks);
  for (const char* header : kHalfPrecisionHeaders)
    std::filesystem::copy_file(headers / header, toolkit.path / "include" / header);
  CHECK(run_probe("[cuda-patched-toolkit-probe]", {{"TINYDEV_CUDA_NVRTC", copy.string()},
                                                    {"TEST_PATCHED_TOOLKIT", toolkit.str()},
                                                    {"TINYDEV_CACHE_DIR", cache.str()}}) == 0);
}

TEST_CASE("cuda compiler: kernels in the style of tinygrad's CUDA renderer compile (half and bf16 and shared memory)", "[cuda]") {
  cuda::CudaCompiler c("sm_90", false);
  const Blob blob = c.compile(kRendererStyle);
  const std::string text = as_text(blob);
  for (const char* kernel : {"E_4096_4", "r_64_32", "r_16_16_16"}) CHECK_THAT(text, Catch::Contains(kernel));
}

TEST_CASE("cuda: without a usable driver opening is DeviceUnavailable saying which and the default device moves on", "[cuda]") {
  register_cuda();
  try {
    Device["CUDA"];
    skip("a CUDA driver and GPU are present: the no-driver paths cannot be shown here");
    return;
  } catch (const DeviceUnavailable& e) {
    INFO(e.what());
    const std::string what = e.what();
    CHECK((what.find("libcuda.so.1 cannot be opened") != std::string::npos ||
           what.find("did not initialize") != std::string::npos));
  }
  {
    ScopedOverride path("TINYDEV_CUDA_DRIVER", "/nonexistent/libcuda.so.1");
    CHECK_THROWS_WITH(Device["CUDA:2"], Catch::Contains("TINYDEV_CUDA_DRIVER='/nonexistent/libcuda.so.1' cannot be opened"));
  }
  {
    // A library that is not a driver: the first missing function is named.
    ScopedOverride path("TINYDEV_CUDA_DRIVER", "libm.so.6");
    CHECK_THROWS_WITH(Device["CUDA:2"], Catch::Contains("libm.so.6 has no cuInit") && Catch::Contains("update the NVIDIA driver"));
  }
  ScopedOverride unset("TINYDEV_DEVICE", std::nullopt);
  CHECK_THROWS_WITH(Device.default_device(), Catch::Contains("CUDA"));
}

namespace {

// Runs `add` (kernels::add_f32) on `n` random floats from `seed` over a grid of 256-thread blocks
// and waits for it: the kernel's time, and how many sums differ from the CPU's.
struct GridAdd {
  std::optional<double> seconds;
  std::size_t wrong = 0;
};
GridAdd add_on_grid(Compiled& dev, Program& add, std::size_t n, std::uint64_t seed) {
  auto a = random_floats(n, seed), b = random_floats(n, seed + 1);
  Buffer ba(dev.name(), n, dtypes::float32), bb(dev.name(), n, dtypes::float32), bo(dev.name(), n, dtypes::float32);
  ba.allocate().copyin(std::span<const float>(a));
  bb.allocate().copyin(std::span<const float>(b));
  bo.allocate();
  const Allocation bufs[] = {bo.allocation(), ba.allocation(), bb.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  GridAdd run;
  run.seconds = add(bufs, vals, LaunchParams{.global = {static_cast<std::uint32_t>((n + 255) / 256), 1, 1},
                                             .local = {256, 1, 1},
                                             .wait = true});
  std::vector<float> out(n);
  bo.copyout(std::span<float>(out));
  for (std::size_t i = 0; i < n; ++i) run.wrong += out[i] != a[i] + b[i];
  return run;
}

}  // namespace

TEST_CASE("cuda gpu: add on random data matches the CPU reference with grids and one thread", "[cuda][gpu]") {
  Compiled* dev = gpu();
  if (!dev) return;
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const GridAdd run = add_on_grid(*dev, *add, (1u << 20) + 7, seed);
  REQUIRE(run.seconds.has_value());
  CHECK(*run.seconds > 0.0);
  CHECK(run.wrong == 0);
  // One thread (the default launch) walks the whole range too.
  const std::size_t m = 4096;
  auto c = random_floats(m, seed + 2), d = random_floats(m, seed + 3);
  Buffer bc(dev->name(), m, dtypes::float32), bd(dev->name(), m, dtypes::float32), be(dev->name(), m, dtypes::float32);
  bc.allocate().copyin(std::span<const float>(c));
  bd.allocate().copyin(std::span<const float>(d));
  be.allocate();
  const Allocation small_bufs[] = {be.allocation(), bc.allocation(), bd.allocation()};
  const std::int32_t small[] = {static_cast<std::int32_t>(m)};
  (*add)(small_bufs, small);
  dev->synchronize();
  std::vector<float> small_out(m);
  be.copyout(std::span<float>(small_out));
  for (std::size_t i = 0; i < m; ++i) REQUIRE(small_out[i] == c[i] + d[i]);
}

// Run by the PTX test below with TINYDEV_CUDA_PTX=1: the device's compiler emits PTX for the
// GPU's virtual architecture, which the driver JIT-compiles when the kernel is loaded.
TEST_CASE("cuda gpu: PTX device probe", "[.][probe][cuda-ptx-probe]") {
  Compiled* dev = gpu();
  REQUIRE(dev != nullptr);
  auto& compiler = dynamic_cast<cuda::CudaCompiler&>(dev->compiler());
  REQUIRE(compiler.ptx());
  CHECK(compiler.options().front() == "--gpu-architecture=compute_" + compiler.arch().substr(3));
  const std::string src = kernels::add_f32(SourceLanguage::CUDA);
  const std::string text = as_text(dev->compiler().compile_cached(src));
  CHECK_THAT(text, Catch::Contains(".version") && Catch::Contains(".entry add"));
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  auto add = dev->load_kernel("add", src);
  CHECK(add_on_grid(*dev, *add, 100003, seed).wrong == 0);
}

TEST_CASE("cuda gpu: with TINYDEV_CUDA_PTX=1 the device compiles to PTX that the driver JIT-compiles at load and it computes the sums", "[cuda][gpu]") {
  if (!gpu()) return;
  CHECK(run_probe("[cuda-ptx-probe]", {{"TINYDEV_CUDA_PTX", "1"}}) == 0);
}

TEST_CASE("cuda gpu: bad blobs and missing kernels and zero grids are clear errors and the device keeps working", "[cuda][gpu]") {
  Compiled* dev = gpu();
  if (!dev) return;
  CHECK_THROWS_WITH(dev->runtime().load("add", Blob(100, std::byte{7})), Catch::Contains("neither CUBIN"));
  const Blob blob = dev->compiler().compile_cached(kernels::add_f32(SourceLanguage::CUDA));
  CHECK_THROWS_WITH(dev->runtime().load("nope", blob), Catch::Contains("'nope' is not in the compiled module"));
  auto add = dev->runtime().load("add", blob);
  Buffer o(dev->name(), 4, dtypes::float32);
  o.allocate();
  const Allocation bufs[] = {o.allocation(), o.allocation(), o.allocation()};
  const std::int32_t vals[] = {4};
  CHECK_THROWS_WITH((*add)(bufs, vals, LaunchParams{.global = {0, 1, 1}}), Catch::Contains("zero"));
  if (dev->capabilities().checks_signatures) {  // the driver reports parameter layouts (CUDA 12.4 and later)
    CHECK(add->signature() == KernelSignature{3, 1, /*grid_index=*/false});
    CHECK_THROWS_WITH((*add)(std::span(bufs, 2), vals), Catch::Contains("takes 3 buffers and 1 values, got 2 and 1"));
  } else {
    WARN("the driver has no cuFuncGetParamInfo: kernel signatures are not checked");
  }
  CHECK_NOTHROW((*add)(bufs, vals, LaunchParams{.wait = true}));
}

TEST_CASE("cuda gpu: an allocation larger than the GPU is OutOfMemory and the device keeps working", "[cuda][gpu]") {
  Compiled* dev = gpu();
  if (!dev) return;
  CHECK_THROWS_AS(dev->allocator().alloc(std::size_t{1} << 50), OutOfMemory);
  const auto data = random_bytes(1 << 16, fresh_seed());
  Buffer b(dev->name(), data.size(), dtypes::uint8);
  b.allocate().copyin(data);
  std::vector<std::byte> back(data.size());
  b.copyout(back);
  CHECK(back == data);
}

TEST_CASE("cuda gpu: a graph's copy node of more than 2 GiB copies every byte range it spans", "[cuda][gpu][cuda-2gib-copy]") {
  auto* dev = dynamic_cast<cuda::CudaHCQDevice*>(gpu());
  if (!dev) return;
  // Past 2^31 - 1 bytes a memcpy node's pitch is not given (Note [CUDA graph replay], copy_params):
  // only a real driver can say whether it takes that. The fake runs it too, with 6 GiB (a probe
  // below), which checks the test itself.
  if (dev->total_memory() < (std::uint64_t{5} << 30))
    return skip(fmt::format("two buffers of over 2 GiB do not fit this GPU's {} bytes (the fake driver's 256 MiB "
                            "unless FAKE_CUDA_MEMORY says more)",
                            dev->total_memory()));
  // Free memory too: on a GPU another process (or this one's cache) holds, the test would only
  // report OutOfMemory. The cache is what the allocator gives back first, so it counts as free.
  const std::uint64_t usable = dev->free_memory() + dev->allocator().stats().bytes_cached;
  if (usable < (std::uint64_t{9} << 29))
    return skip(fmt::format("two buffers of over 2 GiB do not fit the {} bytes free on this GPU (of {})", usable,
                            dev->total_memory()));
  const std::size_t chunk = std::size_t{1} << 20;
  // The three ranges below, apart: the first, one across the 2 GiB mark, and the last.
  const std::size_t size = (std::size_t{2} << 30) + 2 * chunk + 4096 + 16 * (fresh_seed() % 256);
  Buffer src(dev->name(), size, dtypes::uint8), dst(dev->name(), size, dtypes::uint8);
  src.allocate();
  dst.allocate();
  // Random bytes at the start, across the 2 GiB mark and at the end; other noise in dst there.
  const std::size_t offsets[] = {0, (std::size_t{2} << 30) - chunk / 2, size - chunk};
  std::vector<std::vector<std::byte>> wanted;
  for (const std::size_t offset : offsets) {
    wanted.push_back(random_bytes(chunk, fresh_seed()));
    src.view(chunk, dtypes::uint8, offset).allocate().copyin(wanted.back());
    dst.view(chunk, dtypes::uint8, offset).allocate().copyin(random_bytes(chunk, fresh_seed()));
  }
  auto graph = dev->create_graph({GraphCopy{GraphBuffer::in(0), GraphBuffer::in(1), size}});
  graph->replay(std::vector<Allocation>{dst.allocation(), src.allocation()}, {}, /*wait=*/true);
  for (std::size_t i = 0; i < std::size(offsets); ++i) {
    INFO("the range at " << offsets[i]);
    std::vector<std::byte> back(chunk);
    dst.view(chunk, dtypes::uint8, offsets[i]).allocate().copyout(back);
    CHECK(back == wanted[i]);
  }
}

// Note [CUDA cache bound]: a CUDA allocator's cache is bounded by the GPU's memory, not by the host
// memory default (1/16 of it, at most 2 GiB), which freed a buffer past it at once: the next
// allocation of its size was a cuMemAlloc (and the free a cuMemFree, which may synchronize the
// device). Tagged for a probe as well: the fake driver runs it with a GPU of 8 GiB, where the buffer
// is past the host's bound.
TEST_CASE("cuda gpu: a freed buffer larger than the host's cache bound stays cached for the next allocation of its size",
          "[cuda][gpu][cuda-cache-bound]") {
  auto* dev = dynamic_cast<cuda::CudaHCQDevice*>(gpu());
  if (!dev) return;
  const std::uint64_t memory = dev->total_memory();
  Allocator& allocator = dev->allocator();
  REQUIRE(memory > 0);
  CHECK(allocator.stats().max_bytes == memory);
  {
    ScopedOverride bound("TINYDEV_LRU_MAX_BYTES", "64M");  // the setting still decides
    CHECK(allocator.stats().max_bytes == std::uint64_t{64} << 20);
  }
  // Past the host's bound where the GPU has room for it twice; else (the fake's 256 MiB) a quarter
  // of the GPU, which checks only the bookkeeping.
  const std::uint64_t host_bound = default_host_cache_bound();
  std::size_t size = host_bound + (std::size_t{1} << 20) + 4096 * (fresh_seed() % 256);
  if (size > memory / 2) size = memory / 4 + 4096 * (fresh_seed() % 256);
  INFO("a buffer of " << size << " bytes, the host's bound " << host_bound << ", the GPU's memory " << memory);
  const auto data = random_bytes(1 << 16, fresh_seed());
  const AllocatorStats before = allocator.stats();
  {
    Buffer b(dev->name(), size, dtypes::uint8);
    b.allocate();
    b.view(data.size(), dtypes::uint8, size - data.size()).allocate().copyin(data);  // used, at its far end
    dev->synchronize();
  }
  const AllocatorStats cached = allocator.stats();
  CHECK(cached.evictions == before.evictions);
  CHECK(cached.bytes_cached == before.bytes_cached + size);
  Buffer again(dev->name(), size, dtypes::uint8);
  again.allocate();
  CHECK(allocator.stats().hits == cached.hits + 1);
  CHECK(allocator.stats().misses == cached.misses);
  // The memory is the same: its far end still holds the bytes written before.
  std::vector<std::byte> back(data.size());
  again.view(data.size(), dtypes::uint8, size - data.size()).allocate().copyout(back);
  CHECK(back == data);
}

// ---- against the fake driver (tests/cuda/fake_driver): the paths a GPU rarely shows ---------------

namespace {

// The fake driver's settings (FAKE_CUDA_FAIL and the others), for a scope.
using FakeEnv = ScopedEnvironmentVariable;

// Collects the messages of `levels` (warnings unless told) logged in its scope; the log sink is
// reset when it goes.
struct Warnings {
  std::vector<std::string> messages;
  std::mutex mutex;
  explicit Warnings(std::vector<LogLevel> levels = {LogLevel::warning}) {
    set_log_sink([this, levels = std::move(levels)](LogLevel level, std::string_view, std::string_view message) {
      std::lock_guard lock(mutex);
      if (std::ranges::find(levels, level) != levels.end()) messages.emplace_back(message);
    });
  }
  ~Warnings() { set_log_sink(nullptr); }
  Warnings(const Warnings&) = delete;
  Warnings& operator=(const Warnings&) = delete;
};

// What opening `name` throws as an E (an injected failure in the caller's scope), or nullopt after
// skip() when the device was open already; anything else it throws goes on.
template <class E>
std::optional<std::string> open_error(const std::string& name) {
  try {
    Device[name];
  } catch (const E& e) {
    return std::string(e.what());
  }
  skip(name + " was opened before this test (run it alone, as ctest does)");
  return std::nullopt;
}

// The first fake GPU, or nullptr after skip() when the driver in use is not the fake.
Compiled* fake_gpu() {
  Compiled* dev = gpu();
  if (dev && dev->properties().at("gpu").find("tinydev fake GPU") == std::string::npos) {
    skip("these tests need the fake driver (TINYDEV_CUDA_DRIVER=libtinydev_fake_cuda.so), not a real GPU");
    return nullptr;
  }
  return dev;
}

}  // namespace

TEST_CASE("cuda fake: properties name the GPU and its compute capability and the compiler targets it", "[cuda][fake]") {
  Compiled* dev = fake_gpu();
  if (!dev) return;
  const auto props = dev->properties();
  CHECK(props.at("compute capability") == "9.0");
  CHECK(props.at("64-bit stream memory operations") == "yes");
  CHECK_THAT(props.at("compiler"), Catch::Contains("CUBIN for sm_90"));
  CHECK(dev->source_language() == SourceLanguage::CUDA);
  const DeviceCapabilities caps = dev->capabilities();
  CHECK(caps.runs_kernels);
  CHECK(caps.caches_compiles);
  CHECK_FALSE(caps.host_visible_memory);
}

TEST_CASE("cuda fake: Device.available lists every GPU the driver counts by ordinal", "[cuda][fake]") {
  Compiled* dev = fake_gpu();
  if (!dev) return;
  const char* configured = std::getenv("FAKE_CUDA_DEVICES");
  const unsigned gpus = configured ? static_cast<unsigned>(std::stoul(configured)) : 2;  // the fake's default
  std::vector<std::string> expected;
  for (unsigned i = 0; i < gpus; ++i) expected.push_back(i == 0 ? "CUDA" : "CUDA:" + std::to_string(i));
  CHECK(Device.available() == expected);
}

TEST_CASE("cuda fake: on a GPU of 6 GiB a graph's copy node of more than 2 GiB copies every byte range it spans", "[cuda][fake]") {
  if (!fake_gpu()) return;
  // Gigabytes through the fake's memmove: on a busy machine (or under a sanitizer) longer than the
  // default 30 s a wait lasts, which this test is not about.
  CHECK(run_probe("[cuda-2gib-copy]", {{"FAKE_CUDA_MEMORY", std::to_string(std::uint64_t{6} << 30)},
                                       {"TINYDEV_WAIT_TIMEOUT_MS", "300000"}}) == 0);
}

TEST_CASE("cuda fake: on a GPU of 8 GiB a freed buffer larger than the host's cache bound stays cached", "[cuda][fake]") {
  if (!fake_gpu()) return;
  CHECK(run_probe("[cuda-cache-bound]", {{"FAKE_CUDA_MEMORY", std::to_string(std::uint64_t{8} << 30)}}) == 0);
}

TEST_CASE("cuda fake: out of device memory frees the LRU cache and retries once", "[cuda][fake]") {
  Compiled* dev = fake_gpu();
  if (!dev) return;
  // The fake GPU has 256 MiB (FAKE_CUDA_MEMORY unset). Three 64 MiB allocations freed into the
  // cache still hold their memory; a 128 MiB one then fits only once the cache is given back.
  constexpr std::size_t k64 = 64u << 20;
  Allocator& lru = dev->allocator();  // stats() needs no cast to LRUAllocator
  const auto before = lru.stats();
  std::vector<Allocation> held;
  for (int i = 0; i < 3; ++i) held.push_back(dev->allocator().alloc(k64));
  for (const Allocation& a : held) dev->allocator().free(a, k64);
  const Allocation big = dev->allocator().alloc(2 * k64);
  CHECK(lru.stats().oom_retries == before.oom_retries + 1);
  // Nothing fits a request past the whole GPU, even with the cache empty: OutOfMemory.
  CHECK_THROWS_AS(dev->allocator().alloc(std::size_t{1} << 30), OutOfMemory);
  const auto data = random_bytes(1 << 12, fresh_seed());
  dev->allocator().copyin(big, data);
  std::vector<std::byte> back(data.size());
  dev->allocator().copyout(back, big);
  CHECK(back == data);
  dev->allocator().free(big, 2 * k64);
}

TEST_CASE("cuda fake: a launch the driver refuses is an Error naming the driver's error and the device keeps working", "[cuda][fake]") {
  Compiled* dev = fake_gpu();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = 1000;
  auto a = random_floats(n, fresh_seed());
  Buffer ba(dev->name(), n, dtypes::float32), bo(dev->name(), n, dtypes::float32);
  ba.allocate().copyin(std::span<const float>(a));
  bo.allocate();
  const Allocation bufs[] = {bo.allocation(), ba.allocation(), ba.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  {
    // Too many resources requested: the launch never happened, the context is fine.
    FakeEnv fail("FAKE_CUDA_FAIL", "cuLaunchKernel=701");
    CHECK_THROWS_WITH((*add)(bufs, vals), Catch::Contains("launching 'add' failed") &&
                                              Catch::Contains("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"));
  }
  (*add)(bufs, vals);
  std::vector<float> out(n);
  bo.copyout(std::span<float>(out));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(out[i] == a[i] + a[i]);
}

TEST_CASE("cuda fake: a module the driver rejects is InvalidArgument with the driver's reason", "[cuda][fake]") {
  Compiled* dev = fake_gpu();
  if (!dev) return;
  const Blob blob = dev->compiler().compile_cached(kernels::add_f32(SourceLanguage::CUDA));
  {
    FakeEnv fail("FAKE_CUDA_FAIL", "cuModuleLoadData=200");
    CHECK_THROWS_WITH(dev->runtime().load("add", blob),
                      Catch::Contains("could not load the module") && Catch::Contains("CUDA_ERROR_INVALID_IMAGE"));
  }
  CHECK(dev->runtime().load("add", blob)->name() == "add");
}

TEST_CASE("cuda fake: two GPUs are two devices with their own memory and an ordinal past them is DeviceUnavailable", "[cuda][fake]") {
  Compiled* dev = fake_gpu();
  if (!dev) return;
  Compiled& second = Device["cuda:1"];
  CHECK(&second != dev);
  CHECK(second.name() == "CUDA:1");
  const auto data = random_bytes(4096, fresh_seed());
  Buffer one(dev->name(), data.size(), dtypes::uint8), two(second.name(), data.size(), dtypes::uint8);
  one.allocate().copyin(data);
  two.allocate().copyin(one.as_buffer(true).bytes());
  std::vector<std::byte> back(data.size());
  two.copyout(back);
  CHECK(back == data);
  CHECK_THROWS_WITH(Device["CUDA:5"], Catch::Contains("this machine has 2 CUDA devices (CUDA to CUDA:1)"));
}

TEST_CASE("cuda fake: cuInit failing is DeviceUnavailable saying there is no GPU", "[cuda][fake]") {
  register_cuda();
  FakeEnv fail("FAKE_CUDA_FAIL", "cuInit=100");
  try {
    Device["CUDA:1"];
    skip("the driver was loaded before this test (run it alone, as ctest does)");
  } catch (const DeviceUnavailable& e) {
    const std::string what = e.what();
    if (what.find("TINYDEV_CUDA_DRIVER") != std::string::npos || what.find("libcuda.so.1") != std::string::npos)
      return skip("the fake driver is not in use: " + what);
    CHECK_THAT(what, Catch::Contains("did not initialize") && Catch::Contains("CUDA_ERROR_NO_DEVICE") &&
                         Catch::Contains("no NVIDIA GPU"));
  }
}

TEST_CASE("cuda fake: a GPU another process holds in exclusive compute mode is DeviceUnavailable saying so - and opens once it is free", "[cuda][fake]") {
  if (!fake_gpu()) return;
  {
    FakeEnv fail("FAKE_CUDA_FAIL", "cuDevicePrimaryCtxRetain=46");  // CUDA_ERROR_DEVICE_UNAVAILABLE
    const auto error = open_error<DeviceUnavailable>("CUDA:1");
    if (!error) return;
    CHECK_THAT(*error, Catch::Contains("CUDA:1") && Catch::Contains("CUDA_ERROR_DEVICE_UNAVAILABLE") &&
                           Catch::Contains("exclusive-process"));
  }
  // A failed open is tried again (the seed's registry caches only what opened).
  const auto data = random_bytes(4096, fresh_seed());
  Buffer b("CUDA:1", data.size(), dtypes::uint8);
  b.allocate().copyin(data);
  std::vector<std::byte> back(data.size());
  b.copyout(back);
  CHECK(back == data);
}

// ---- HCQ on the fake driver: streams, stream memory operations, failures, peers ----------------

namespace {

cuda::CudaHCQDevice* fake_hcq(const char* name = "CUDA") {
  if (!fake_gpu()) return nullptr;
  auto* dev = dynamic_cast<cuda::CudaHCQDevice*>(&Device[name]);
  REQUIRE(dev);
  return dev;
}

// A function the fake driver exports for tests, looked up in the library the backend loaded.
template <class Fn>
Fn* fake_function(const char* symbol) {
  void* fake = ::dlopen(std::getenv("TINYDEV_CUDA_DRIVER"), RTLD_NOW | RTLD_NOLOAD);
  REQUIRE(fake);
  auto* fn = reinterpret_cast<Fn*>(::dlsym(fake, symbol));
  ::dlclose(fake);  // the backend keeps the library loaded
  REQUIRE(fn);
  return fn;
}

// What the fake driver says about peer access from device `from` to `to`.
bool fake_peer_enabled(int from, int to) { return fake_function<int(int, int)>("fake_cuda_peer_enabled")(from, to) != 0; }
// How often the fake driver's `function` was called.
long fake_calls(const char* function) { return fake_function<long(const char*)>("fake_cuda_calls")(function); }

// Copies `data` into `b` through the staging ring even where a direct copy would do.
void hcq_copyin_forced(cuda::CudaHCQDevice& dev, Buffer& b, const std::vector<float>& data) {
  auto& allocator = dynamic_cast<HCQAllocator<cuda::CudaHCQDevice>&>(dev.allocator());
  allocator.set_force_staging(true);
  struct Unforce {  // also when the copyin throws: later tests share the device
    HCQAllocator<cuda::CudaHCQDevice>& allocator;
    ~Unforce() { allocator.set_force_staging(false); }
  } unforce{allocator};
  b.copyin(std::span<const float>(data));
}

void check_transfer(cuda::CudaHCQDevice& a, cuda::CudaHCQDevice& b) {
  const auto data = random_bytes((3u << 20) + 5, fresh_seed());
  Buffer src(a.name(), data.size(), dtypes::uint8), dst(b.name(), data.size(), dtypes::uint8);
  src.allocate().copyin(data);
  dst.allocate();
  HCQAllocator<cuda::CudaHCQDevice>::transfer(dst.allocation(), src.allocation(), data.size(), a, b);
  std::vector<std::byte> back(data.size());
  dst.copyout(back);
  CHECK(back == data);
}

}  // namespace

TEST_CASE("cuda fake: launches with the wrong counts are InvalidArgument before the driver sees them - direct - queued and graph nodes", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  REQUIRE(dev->capabilities().checks_signatures);
  CHECK_THAT(dev->properties().at("kernel signatures"), Catch::Contains("checked at launch"));
  auto add = std::dynamic_pointer_cast<cuda::CudaProgram>(dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA)));
  REQUIRE(add);
  // From the driver's parameter layout; a GPU kernel takes no grid index.
  REQUIRE(add->signature() == KernelSignature{3, 1, /*grid_index=*/false});
  const std::size_t n = 777;
  const auto x = random_floats(n, fresh_seed()), y = random_floats(n, fresh_seed());
  Buffer a(dev->name(), n, dtypes::float32), b(dev->name(), n, dtypes::float32), o(dev->name(), n, dtypes::float32);
  a.allocate().copyin(std::span<const float>(x));
  b.allocate().copyin(std::span<const float>(y));
  o.allocate();
  const Allocation bufs[] = {o.allocation(), a.allocation(), b.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n), 5};
  const long launches = fake_calls("cuLaunchKernel");
  // Direct calls.
  CHECK_THROWS_WITH((*add)(std::span(bufs, 2), std::span(vals, 1)),
                    Catch::Contains("add on CUDA: the kernel takes 3 buffers and 1 values, got 2 and 1"));
  CHECK_THROWS_AS((*add)(bufs, {}), InvalidArgument);
  CHECK_THROWS_WITH((*add)(bufs, vals, LaunchParams{.global = {4, 1, 1}}), Catch::Contains("got 3 and 2"));
  // Queued execs: neither fill_kernargs nor exec takes them, and nothing is queued.
  CHECK_THROWS_WITH(fill_kernargs(*add, dev->alloc_kernargs(3, 2), bufs, vals), Catch::Contains("takes 3 buffers"));
  auto q = dev->compute_queue();
  CHECK_THROWS_WITH(q.exec(*add, dev->alloc_kernargs(3, 0), {1, 1, 1}, {1, 1, 1}), Catch::Contains("got 3 and 0"));
  CHECK(q.size() == 0);
  // Graph nodes, checked when the graph is made.
  CHECK_THROWS_WITH(dev->create_graph({GraphKernel{add, {GraphBuffer::in(0), GraphBuffer::in(1)}, {GraphValue::of(1)}}}),
                    Catch::Contains("takes 3 buffers and 1 values, the node gives 2 and 1"));
  CHECK(fake_calls("cuLaunchKernel") == launches);  // nothing reached the driver
  // The right counts run, on a grid too (no index appended), queued and in a graph as well.
  (*add)(bufs, std::span(vals, 1), LaunchParams{.global = {4, 1, 1}, .local = {256, 1, 1}});
  Kernargs args = dev->alloc_kernargs(3, 1);
  fill_kernargs(*add, args, bufs, std::span(vals, 1));
  q.exec(*add, args, {4, 1, 1}, {256, 1, 1}).submit(*dev);
  auto graph = dev->create_graph({GraphKernel{add, {GraphBuffer::in(0), GraphBuffer::in(1), GraphBuffer::in(2)},
                                              {GraphValue::var(0)}, LaunchParams{.global = {4, 1, 1}}}});
  graph->replay(bufs, std::span(vals, 1));
  std::vector<float> out(n);
  o.copyout(std::span<float>(out));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(out[i] == x[i] + y[i]);
  // A parameter list the packed arguments cannot express is refused at load.
  const std::string odd = "extern \"C\" __global__ void odd(int n, float* p) { if (n > 0) p[0] = 1.0f; }\n";
  CHECK_THROWS_WITH(dev->load_kernel("odd", odd),
                    Catch::Contains("kernel 'odd' has parameters tinydev cannot pass (4 bytes at 0, 8 bytes at 8)") &&
                        Catch::Contains("buffers first"));
  // A driver that cannot tell leaves the counts to the caller.
  {
    FakeEnv fail("FAKE_CUDA_FAIL", "cuFuncGetParamInfo=801");
    auto unchecked = dev->runtime().load("add", dev->compiler().compile_cached(kernels::add_f32(SourceLanguage::CUDA)));
    CHECK_FALSE(unchecked->signature().has_value());
    (*unchecked)(bufs, std::span(vals, 1), LaunchParams{.wait = true});
  }
}

// Set in the exit probe's forked child just before it exits. The child holds the parent's memory
// but none of its threads: whatever a fake stream's thread held on its stack at the fork (the work
// item it was running) is reachable from nowhere LeakSanitizer scans in the child, which reports it
// as leaked (and warns that "running thread ... was not suspended": the parent's threads are still
// in the child's copy of the sanitizer's thread registry). LeakSanitizer asks this function at exit;
// the parent's own exit is still checked.
static volatile int g_in_forked_exit_probe_child = 0;
extern "C" int __lsan_is_turned_off() { return g_in_forked_exit_probe_child; }

// Run by the exit test below, in a process of its own: uses both fake GPUs, leaves work queued,
// and exits through exit() (a forked child first exits through it too).
TEST_CASE("cuda fake: exit probe", "[.][probe][cuda-exit-probe]") {
  // The profile's exit writer is registered first, so it runs after the CUDA exit handler and
  // reads the devices' signals then (Note [CUDA at exit]).
  { ProfileRange before("before the GPUs open"); }
  auto* a = fake_hcq("CUDA");
  auto* b = fake_hcq("CUDA:1");
  REQUIRE(a);
  REQUIRE(b);
  // A forked child inherits the exit handler but not the devices: it exits through exit() too,
  // and must neither crash nor wait for the parent's work (60 s, then SIGALRM fails the test).
  const auto fork_a_child_that_exits = [] {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      ::alarm(60);
      g_in_forked_exit_probe_child = 1;
      std::exit(0);
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    INFO("a child killed by signal 14 (SIGALRM) hung for a minute in exit()");
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 0);
  };
  // Under AddressSanitizer the child forks while the devices are idle: GCC 12's libasan takes no
  // locks around fork(), so a fake stream's thread inside the ASan allocator at the fork (running
  // queued work) would leave its lock held, and the child's first malloc would wait forever.
  // Elsewhere the child forks with work queued on both GPUs and a stream.
#if defined(__SANITIZE_ADDRESS__)
  a->synchronize();
  b->synchronize();
  fork_a_child_that_exits();
#endif
  const std::size_t n = 4096;
  const auto x = random_floats(n, fresh_seed());
  for (auto* dev : {a, b}) {
    auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
    static std::vector<Buffer> alive_at_exit;  // destroyed after the exit handler released the contexts
    alive_at_exit.reserve(4);  // no reallocation: their allocations stay where the kernels use them
    alive_at_exit.emplace_back(dev->name(), n, dtypes::float32);
    alive_at_exit.emplace_back(dev->name(), n, dtypes::float32);
    Buffer* in = &alive_at_exit[alive_at_exit.size() - 2];
    Buffer* out = &alive_at_exit.back();
    in->allocate().copyin(std::span<const float>(x));
    out->allocate();
    const Allocation bufs[] = {out->allocation(), in->allocation(), in->allocation()};
    const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
    for (int i = 0; i < 50; ++i) (*add)(bufs, vals);  // direct calls, not waited for
  }
  {
    // A stream's lane, with work left on it at exit.
    static std::shared_ptr<Stream> stream = a->create_stream();
    auto add = a->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
    static Buffer in(a->name(), n, dtypes::float32), out(a->name(), n, dtypes::float32);
    in.allocate();
    out.allocate();
    stream->copyin(in, std::as_bytes(std::span(x)));
    const Buffer args[] = {out, in, in};
    const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
    for (int i = 0; i < 20; ++i) stream->launch(add, args, vals);
  }
  static Buffer moved_at_exit(b->name(), n, dtypes::float32);  // destroyed after the contexts are released
  moved_at_exit.allocate();
  Buffer src(a->name(), n, dtypes::float32);
  src.allocate().copyin(std::span<const float>(x));
  HCQAllocator<cuda::CudaHCQDevice>::transfer(moved_at_exit.allocation(), src.allocation(), n * 4, *a, *b);
#if !defined(__SANITIZE_ADDRESS__)
  fork_a_child_that_exits();
#endif
}

// Run by the version test below with FAKE_CUDA_DRIVER_VERSION=12040 and
// CUDA_DEVICE_MAX_CONNECTIONS=1: the first open warns that NVRTC 13's output needs a newer driver
// and that one hardware queue can deadlock the queues' cross waits.
TEST_CASE("cuda fake: version probe", "[.][probe][cuda-version-probe]") {
  std::vector<std::string> warnings;
  {
    Warnings logged;
    REQUIRE(fake_hcq());
    warnings = logged.messages;
  }
  bool warned_version = false, warned_connections = false;
  for (const std::string& w : warnings) {
    warned_version |= w.find("compiles for CUDA 13 drivers, and this driver is 12.4") != std::string::npos;
    warned_connections |= w.find("CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream on one hardware queue") !=
                          std::string::npos;
  }
  const bool nvrtc_12_here = nvrtc_12_opens();
  // With a 12.x driver NVRTC 12 is chosen wherever it can be opened; the warning is for NVRTC 13.
  if (nvrtc_12_here) CHECK_THAT(cuda::CudaCompiler("sm_90", false).nvrtc_version(), Catch::StartsWith("12."));
  CHECK(warned_version == !nvrtc_12_here);
  CHECK(warned_connections);
}

TEST_CASE("cuda fake: NVRTC newer than the driver and CUDA_DEVICE_MAX_CONNECTIONS=1 are warnings at the first open", "[cuda][fake]") {
  if (!fake_gpu()) return;
  CHECK(run_probe("[cuda-version-probe]", {{"FAKE_CUDA_DRIVER_VERSION", "12040"}, {"CUDA_DEVICE_MAX_CONNECTIONS", "1"}}) ==
        0);
}

// Run by the 12.0 driver test below, with TINYDEV_CUDA_DRIVER naming the fake built as a CUDA 12.0
// driver (no cuEventElapsedTime_v2, no cuFuncGetParamInfo): the device opens, a timed direct call
// is timed through the older symbol, and kernel signatures are the caller's.
TEST_CASE("cuda fake: 12.0 driver probe", "[.][probe][cuda-12.0-probe]") {
  auto* dev = fake_hcq();
  REQUIRE(dev);
  CHECK_THAT(dev->properties().at("driver"), Catch::StartsWith("12.0 ("));
  CHECK_FALSE(dev->capabilities().checks_signatures);
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  CHECK_FALSE(add->signature().has_value());
  const std::size_t n = 1000 + fresh_seed() % 1000;
  const auto x = random_floats(n, fresh_seed()), y = random_floats(n, fresh_seed());
  Buffer a(dev->name(), n, dtypes::float32), b(dev->name(), n, dtypes::float32), o(dev->name(), n, dtypes::float32);
  a.allocate().copyin(std::span<const float>(x));
  b.allocate().copyin(std::span<const float>(y));
  const Allocation bufs[] = {o.allocate().allocation(), a.allocation(), b.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  const long timed_before = fake_calls("cuEventElapsedTime");
  const std::optional<double> seconds = (*add)(bufs, vals, LaunchParams{.global = {static_cast<unsigned>((n + 255) / 256), 1, 1},
                                                                        .local = {256, 1, 1},
                                                                        .wait = true});
  REQUIRE(seconds.has_value());
  CHECK(*seconds >= 0.0);
  CHECK(fake_calls("cuEventElapsedTime") == timed_before + 1);
  std::vector<float> out(n);
  o.copyout(std::span<float>(out));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(out[i] == x[i] + y[i]);
}

TEST_CASE("cuda fake: a CUDA 12.0 driver (no cuEventElapsedTime_v2 or cuFuncGetParamInfo) opens and times calls", "[cuda][fake]") {
  if (!fake_gpu()) return;
  CHECK(run_probe("[cuda-12.0-probe]", {{"TINYDEV_CUDA_DRIVER", TINYDEV_TEST_FAKE_CUDA_12_0}}) == 0);
}

// Run by the compile-only test below in a fresh process (the driver is initialized once per process).
TEST_CASE("cuda fake: compile-only probe", "[.][probe][cuda-compile-only-probe]") {
  cuda::CudaCompiler compiler("sm_90", false);
  CHECK(compiler.compile(kernels::add_f32(SourceLanguage::CUDA, "compile_only")).size() > 64);
  // The driver was asked its version only: a fork now would leave the child a usable CUDA.
  CHECK(fake_calls("cuDriverGetVersion") >= 1);
  CHECK(fake_calls("cuInit") == 0);
  auto* dev = fake_hcq();
  REQUIRE(dev);
  CHECK(fake_calls("cuInit") == 1);
}

TEST_CASE("cuda fake: a compiler made before any device does not initialize the driver", "[cuda][fake]") {
  if (!fake_gpu()) return;
  CHECK(run_probe("[cuda-compile-only-probe]", {}) == 0);
}

// Run by the time-limit test below with FAKE_CUDA_NO_MEMOPS=1 and FAKE_CUDA_KERNEL_TIME_LIMIT=1.
TEST_CASE("cuda fake: kernel time limit probe", "[.][probe][cuda-time-limit-probe]") {
  std::vector<std::string> warnings;
  Compiled* dev = nullptr;
  {
    Warnings logged;
    dev = fake_gpu();
    warnings = logged.messages;
  }
  REQUIRE(dev != nullptr);
  bool warned = false;
  for (const std::string& w : warnings) warned |= w.find("queue waits run as spinning kernels") != std::string::npos;
  CHECK(warned);
  CHECK_THAT(dev->properties().at("64-bit stream memory operations"), Catch::Contains("kernel time limit"));
}

TEST_CASE("cuda fake: a GPU without memory operations and with a kernel time limit is warned about at open", "[cuda][fake]") {
  if (!fake_gpu()) return;
  CHECK(run_probe("[cuda-time-limit-probe]", {{"FAKE_CUDA_NO_MEMOPS", "1"}, {"FAKE_CUDA_KERNEL_TIME_LIMIT", "1"}}) == 0);
}

// Run by the old-GPU test below with FAKE_CUDA_COMPUTE_CAPABILITY=70 (a V100).
TEST_CASE("cuda fake: old GPU probe", "[.][probe][cuda-old-gpu-probe]") {
  Compiled* dev = fake_gpu();
  REQUIRE(dev != nullptr);
  const auto props = dev->properties();
  CHECK(props.at("compute capability") == "7.0");
  auto& compiler = dynamic_cast<cuda::CudaCompiler&>(dev->compiler());
  CHECK(compiler.arch() == "sm_70");
  const std::string src = kernels::add_f32(SourceLanguage::CUDA, "old_gpu");
  if (nvrtc_12_opens()) {
    // NVRTC 12 is there, so it is chosen for this GPU: it compiles for it.
    CHECK_THAT(compiler.nvrtc_version(), Catch::StartsWith("12."));
    CHECK(compiler.unsupported_reason().empty());
    CHECK(compiler.compile(src).size() > 64);
  } else {
    CHECK_THAT(props.at("compiler"), Catch::StartsWith("none: NVRTC") && Catch::Contains("cannot compile for sm_70"));
    CHECK_THROWS_WITH(dev->compiler().compile_cached(src),
                      Catch::Contains("CUDA 13 dropped GPUs older than compute capability 7.5"));
    // The device itself still works: memory, copies, and kernels compiled elsewhere.
    std::vector<float> host = random_floats(1024, fresh_seed());
    Buffer b(dev->name(), host.size(), dtypes::float32);
    b.allocate();
    b.copyin(std::as_bytes(std::span(host)));
    std::vector<float> back(host.size());
    b.copyout(std::as_writable_bytes(std::span(back)));
    CHECK(back == host);
  }
}

TEST_CASE("cuda fake: a GPU older than NVRTC 13 supports gets NVRTC 12 or a compiler saying why it has none", "[cuda][fake]") {
  if (!fake_gpu()) return;
  CHECK(run_probe("[cuda-old-gpu-probe]", {{"FAKE_CUDA_COMPUTE_CAPABILITY", "70"}}) == 0);
}

TEST_CASE("cuda fake: a process that used two GPUs while profiling exits cleanly - and so does its forked child", "[cuda][fake]") {
  if (!fake_gpu()) return;
  TempDir dir;
  const std::string trace = dir.str() + "/exit.json";
  const int status = run_probe("[cuda-exit-probe]", {{"TINYDEV_PROFILE", trace}});
  INFO("a negative status is a crash at exit, minus the signal number");
  REQUIRE(status == 0);
  std::ifstream in(trace);
  const std::string profile((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK_THAT(profile, Catch::Contains("\"CUDA\"") && Catch::Contains("\"CUDA:1\"") && Catch::Contains("add"));
}

TEST_CASE("cuda fake: a kernel's illegal address is sticky - the device says so on every later call", "[cuda][fake]") {
  FakeEnv fail("FAKE_CUDA_FAIL", "run:add=700");  // the kernel faults when it runs, as on a GPU
  auto* dev = fake_hcq();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  Buffer a(dev->name(), 64, dtypes::float32), o(dev->name(), 64, dtypes::float32);
  a.allocate();
  o.allocate();
  auto& cache = dynamic_cast<LRUAllocator&>(dev->allocator());
  std::vector<Allocation> cached;
  for (std::size_t i = 1; i <= 3; ++i) cached.push_back(cache.alloc(i << 12));
  const Allocation kept = cache.alloc(1 << 12), pinned = cache.alloc(1 << 12, BufferOptions{.host = true});
  for (std::size_t i = 1; i <= 3; ++i) cache.free(cached[i - 1], i << 12);  // into the cache
  cache.free(pinned, 1 << 12, BufferOptions{.host = true});
  const Allocation bufs[] = {o.allocation(), a.allocation(), a.allocation()};
  const std::int32_t vals[] = {64};
  // The fault happens on the GPU's time: the launch's own submit may already see it, else the
  // synchronize does.
  CHECK_THROWS_WITH(((*add)(bufs, vals), dev->synchronize()), Catch::Contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
  CHECK_THROWS_WITH((*add)(bufs, vals), Catch::Contains("failed earlier") && Catch::Contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
  CHECK_THROWS_WITH(Buffer(dev->name(), 1 << 20, dtypes::uint8).allocate(), Catch::Contains("failed earlier"));
  CHECK_THROWS_WITH(dev->compute_queue().signal(dev->alloc_signal(), 1).submit(*dev), Catch::Contains("failed earlier"));
  // Frees and unloads: the driver refuses them with the sticky error (the context keeps its memory
  // until exit); nobody freeing is told, and the cache still empties whole.
  const long frees = fake_calls("cuMemFree"), host_frees = fake_calls("cuMemFreeHost");
  CHECK_NOTHROW(cache.free_cache());
  CHECK(cache.stats().entries_cached == 0);
  CHECK(fake_calls("cuMemFree") == frees + 3);  // each was tried
  CHECK(fake_calls("cuMemFreeHost") == host_frees + 1);
  CHECK_NOTHROW(cache.free(kept, 1 << 12));
  CHECK_NOTHROW(cache.free_cache());
  // The other GPU is a separate context and keeps working.
  auto* other = fake_hcq("CUDA:1");
  Signal s = other->alloc_signal(0);
  other->compute_queue().signal(s, 3).submit(*other);
  s.wait(3, std::chrono::seconds(5));
}

TEST_CASE("cuda fake: transfer between GPUs enables peer access once both ways and copies", "[cuda][fake]") {
  auto* a = fake_hcq("CUDA");
  if (!a) return;
  auto* b = fake_hcq("CUDA:1");
  check_transfer(*a, *b);
  CHECK(fake_peer_enabled(0, 1));
  CHECK(fake_peer_enabled(1, 0));
  check_transfer(*b, *a);  // enabled already: no second enable (the fake would refuse it)
}

TEST_CASE("cuda fake: a GPU whose stream memory operations fail at open runs its queues on one-thread kernels and says why", "[cuda][fake]") {
  auto* a = fake_hcq("CUDA");
  if (!a) return;
  // Note [Probing stream memory operations]: the fake's attribute says yes; the calls fail.
  {
    FakeEnv fail("FAKE_CUDA_FAIL", "cuStreamBatchMemOp=700");  // sticky: the open fails
    const auto error = open_error<Error>("CUDA:1");
    if (!error) return;
    CHECK_THAT(*error, Catch::Contains("CUDA:1") && Catch::Contains("probing stream memory operations") &&
                           Catch::Contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
  }
  Warnings warnings;
  {
    FakeEnv fail("FAKE_CUDA_FAIL", "cuStreamBatchMemOp=801");  // CUDA_ERROR_NOT_SUPPORTED: refused
    Device["CUDA:1"];
  }
  auto* b = fake_hcq("CUDA:1");
  REQUIRE(b);
  REQUIRE(warnings.messages.size() == 1);
  CHECK_THAT(warnings.messages[0], Catch::Contains("reports 64-bit stream memory operations") &&
                                       Catch::Contains("CUDA_ERROR_NOT_SUPPORTED") && Catch::Contains("one-thread kernels"));
  const auto props = b->properties();
  CHECK_THAT(props.at("64-bit stream memory operations"),
             Catch::StartsWith("no (the GPU reports them, but at open a 64-bit write (cuStreamBatchMemOp) was refused") &&
                 Catch::Contains("CUDA_ERROR_NOT_SUPPORTED") && Catch::Contains("one-thread kernels"));
  CHECK_THAT(props.at("queues"), Catch::Contains("signals by one-thread kernels"));
  CHECK(a->properties().at("64-bit stream memory operations") == "yes");  // the other GPU's probe passed
  // Its queues work without memory operations: a kernel, copies both ways, transfers both ways
  // (each GPU waiting for the other's timeline its own way), a stream.
  const long memops = fake_calls("cuStreamBatchMemOp");
  auto add = b->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = 1000 + fresh_seed() % 1000;
  const auto x = random_floats(n, fresh_seed()), y = random_floats(n, fresh_seed());
  Buffer bx(b->name(), n, dtypes::float32), by(b->name(), n, dtypes::float32), sum(b->name(), n, dtypes::float32);
  bx.allocate().copyin(std::span<const float>(x));
  by.allocate().copyin(std::span<const float>(y));
  sum.allocate();
  const Allocation bufs[] = {sum.allocation(), bx.allocation(), by.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  auto program = std::dynamic_pointer_cast<cuda::CudaProgram>(add);
  REQUIRE(program);
  Kernargs args = b->alloc_kernargs(3, 1);
  fill_kernargs(*program, args, bufs, vals);
  {
    auto r = b->reserve_timeline_value();
    b->compute_queue()
        .wait(b->timeline_signal(), r.value() - 1)
        .exec(*program, args, {(static_cast<std::uint32_t>(n) + 255) / 256, 1, 1}, {256, 1, 1})
        .signal(b->timeline_signal(), r.value())
        .submit(*b);
    r.submitted();
  }
  std::vector<float> back(n);
  sum.copyout(std::span<float>(back));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(back[i] == x[i] + y[i]);
  // A stream's lane takes its GPU's answer: every copy queued, signalled by kernels too.
  auto stream = b->create_stream(StreamOptions{.run_inline_when_idle = false});
  const auto z = random_floats(n, fresh_seed());
  stream->copyin(bx, std::as_bytes(std::span(z)));
  stream->launch(add, std::vector<Buffer>{sum, bx, by}, vals,
                 LaunchParams{.global = {(static_cast<std::uint32_t>(n) + 255) / 256, 1, 1}, .local = {256, 1, 1}});
  stream->copyout(std::as_writable_bytes(std::span(back)), sum);
  stream->synchronize();
  for (std::size_t i = 0; i < n; ++i) REQUIRE(back[i] == z[i] + y[i]);
  CHECK(fake_calls("cuStreamBatchMemOp") == memops);  // none on CUDA:1, and CUDA was idle
  check_transfer(*a, *b);
  check_transfer(*b, *a);
}

TEST_CASE("cuda fake: transfer between GPUs without peer access is staged through the destination's ring - no host waits - ordered on both GPUs", "[cuda][fake]") {
  FakeEnv no_peer("FAKE_CUDA_NO_PEER", "1");
  auto* a = fake_hcq("CUDA");
  if (!a) return;
  auto* b = fake_hcq("CUDA:1");
  const long driver_staged = fake_calls("cuMemcpyAsync (staged between GPUs)");
  check_transfer(*a, *b);  // 3 MiB + 5 bytes: two chunks through the default 2 MiB slots
  check_transfer(*b, *a);
  CHECK_FALSE(fake_peer_enabled(0, 1));
  CHECK_FALSE(fake_peer_enabled(1, 0));

  // A ring of four 64 KiB slots on the destination: 17 chunks refill each slot four times, each
  // refill waiting on the source GPU for the destination's copy out of it.
  auto& ring = dynamic_cast<HCQAllocator<cuda::CudaHCQDevice>&>(b->allocator());
  auto* const hold = fake_function<void(int)>("fake_cuda_hold_copies_to_host");
  std::promise<void> checked;
  // Whatever fails below, the fake lets go (at the latest 3 s on: a transfer that waited on the
  // host for its own held copies would otherwise hang) and the ring gets its shape back.
  struct Cleanup {
    void (*hold)(int);
    HCQAllocator<cuda::CudaHCQDevice>& ring;
    std::size_t slot, slots;
    std::future<void> releaser;
    ~Cleanup() {
      hold(0);
      if (releaser.valid()) releaser.wait();
      try {
        ring.set_staging_shape(slot, slots);
      } catch (const std::exception&) {
      }
    }
  } cleanup{hold, ring, ring.staging_batch_size(), ring.staging_batch_count(), {}};
  ring.set_staging_shape(64u << 10, 4);
  const auto data = random_bytes((1u << 20) + 5, fresh_seed()), before = random_bytes(data.size(), fresh_seed()),
             after = random_bytes(data.size(), fresh_seed());
  Buffer src(a->name(), data.size(), dtypes::uint8), dst(b->name(), data.size(), dtypes::uint8);
  src.allocate().copyin(data);
  dst.allocate().copyin(before);  // the destination's earlier work, through the same slots
  const long held_before = fake_calls("held copy to host");
  hold(1);                        // the source GPU's copies into pinned memory stall
  cleanup.releaser = std::async(std::launch::async, [hold, done = checked.get_future()] {
    if (done.wait_for(std::chrono::seconds(3)) == std::future_status::timeout) hold(0);
  });
  const auto start = std::chrono::steady_clock::now();
  HCQAllocator<cuda::CudaHCQDevice>::transfer(dst.allocation(), src.allocation(), data.size(), *a, *b);
  const auto took = std::chrono::steady_clock::now() - start;
  src.copyin(after);  // the source's later work: queued behind the transfer's reads of `src`
  // Nothing of it could run yet, and the destination's queue holds its copies.
  CHECK(b->timeline_slot()->value.load() < b->timeline_value() - 1);
  // The source's copy engine stalls at the first fill: on a busy machine its thread may get there
  // only now, after the transfer returned (a CI run let go of the hold before it did).
  for (const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
       fake_calls("held copy to host") == held_before && std::chrono::steady_clock::now() < deadline;)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  checked.set_value();
  hold(0);
  CHECK(took < std::chrono::seconds(2));
  std::vector<std::byte> back(data.size());
  dst.copyout(back);
  CHECK(back == data);
  src.copyout(back);
  CHECK(back == after);
  CHECK(fake_calls("held copy to host") > held_before);
  // The driver staged none of it: no cuMemcpyAsync between the GPUs.
  CHECK(fake_calls("cuMemcpyAsync (staged between GPUs)") == driver_staged);
}

TEST_CASE("cuda fake: a stream's transfer to a GPU without peer access is staged and ordered by its event", "[cuda][fake]") {
  FakeEnv no_peer("FAKE_CUDA_NO_PEER", "1");
  auto* a = fake_hcq("CUDA");
  if (!a) return;
  auto* b = fake_hcq("CUDA:1");
  const auto data = random_bytes((5u << 20) + 3, fresh_seed()), before = random_bytes(data.size(), fresh_seed());
  Buffer src(a->name(), data.size(), dtypes::uint8), dst(b->name(), data.size(), dtypes::uint8);
  src.allocate();
  dst.allocate().copyin(before);
  const long driver_staged = fake_calls("cuMemcpyAsync (staged between GPUs)");
  auto stream = a->create_stream();
  stream->copyin(src, data);
  Event moved = stream->transfer(dst, src);
  moved.wait();
  std::vector<std::byte> back(data.size());
  dst.copyout(back);
  CHECK(back == data);
  CHECK(fake_calls("cuMemcpyAsync (staged between GPUs)") == driver_staged);
  stream->synchronize();
}

TEST_CASE("cuda fake: without 64-bit stream memory operations signals and waits run as one-thread kernels", "[cuda][fake]") {
  FakeEnv no_memops("FAKE_CUDA_NO_MEMOPS", "1");  // read when the device opens
  auto* dev = fake_hcq();
  if (!dev) return;
  CHECK(dev->properties().at("64-bit stream memory operations") == "no (signals and waits run as one-thread kernels)");
  const long memops_before = fake_calls("cuStreamBatchMemOp") + fake_calls("cuStreamWaitValue64") +
                             fake_calls("cuStreamWriteValue64");
  const long kernels_before = fake_calls("cuLaunchKernel");
  Signal gate = dev->alloc_signal(0), done = dev->alloc_signal(0);
  dev->compute_queue().wait(gate, 2).signal(done, 5).submit(*dev);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(done.value() == 0);
  gate.set(2);  // a value the host sets, which no event could stand for
  done.wait(5, std::chrono::seconds(5));
  CHECK(fake_calls("cuLaunchKernel") - kernels_before >= 2);
  // Cross waits between the two streams, each wait submitted before the signal it waits for, all
  // resolved on the GPU side by the kernels.
  Signal ping = dev->alloc_signal(0), pong = dev->alloc_signal(0);
  const std::uint64_t rounds = 20;
  for (std::uint64_t r = 1; r <= rounds; ++r) {
    dev->compute_queue().wait(pong, r).signal(ping, r).submit(*dev);
    dev->copy_queue().signal(pong, r).wait(ping, r).submit(*dev);
  }
  ping.wait(rounds, std::chrono::seconds(10));
  CHECK(ping.value() == rounds);
  CHECK(fake_calls("cuStreamBatchMemOp") + fake_calls("cuStreamWaitValue64") + fake_calls("cuStreamWriteValue64") ==
        memops_before);
  const auto data = random_bytes((2u << 20) + 7, fresh_seed());
  Buffer b(dev->name(), data.size(), dtypes::uint8);
  b.allocate().copyin(data);
  std::vector<std::byte> back(data.size());
  b.copyout(back);
  CHECK(back == data);
}

TEST_CASE("cuda fake: a producer far ahead of the GPU blocks at about 1000 operations in flight", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  Signal gate = dev->alloc_signal(0);
  submit_ordered(*dev, [&](auto& q) { q.wait(gate, 1); });  // the GPU stalls here
  std::atomic<int> submitted{0};
  std::thread producer([&] {
    for (int i = 0; i < 1500; ++i) {
      submit_ordered(*dev, [](auto&) {});
      submitted.fetch_add(1);
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int while_stalled = submitted.load();
  CHECK(while_stalled >= 900);
  CHECK(while_stalled <= 1001);
  gate.set(1);
  producer.join();
  dev->synchronize();
  CHECK(submitted.load() == 1500);
}

TEST_CASE("cuda fake: a copy that gives up at the queue-depth bound fails the value it took - later waits fail at once instead of stopping at a hole", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  const auto data = random_floats(1000, fresh_seed());
  Buffer b(dev->name(), data.size(), dtypes::float32);
  b.allocate();
  Signal gate = dev->alloc_signal(0);
  submit_ordered(*dev, [&](auto& q) { q.wait(gate, 1); });  // the GPU stalls here
  for (int i = 0; i < 999; ++i) submit_ordered(*dev, [](auto&) {});  // 1000 values in flight: the bound
  {
    // A staged copyin takes its timeline value, then its submit waits for the GPU to drain.
    ScopedOverride timeout("TINYDEV_WAIT_TIMEOUT_MS", "300");
    CHECK_THROWS_AS(hcq_copyin_forced(*dev, b, data), Timeout);
  }
  gate.set(1);
  // That value failed: a synchronize says so at once, not after TINYDEV_WAIT_TIMEOUT_MS (30 s).
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(dev->synchronize(), Catch::Contains("gave up"));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  dev->recover();
  hcq_copyin_forced(*dev, b, data);
  std::vector<float> back(data.size());
  b.copyout(std::span<float>(back));
  CHECK(back == data);
}

TEST_CASE("cuda fake: a timed direct call at the queue-depth bound gives up after one timeout - its value fails", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const auto x = random_floats(256, fresh_seed());
  Buffer a(dev->name(), x.size(), dtypes::float32), o(dev->name(), x.size(), dtypes::float32);
  a.allocate().copyin(std::span<const float>(x));
  o.allocate();
  const Allocation bufs[] = {o.allocation(), a.allocation(), a.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(x.size())};
  Signal gate = dev->alloc_signal(0);
  submit_ordered(*dev, [&](auto& q) { q.wait(gate, 1); });  // the GPU stalls here
  for (int i = 0; i < 998; ++i) submit_ordered(*dev, [](auto&) {});
  {
    // The 1000th value in flight, signalled from the copy stream: the call first orders the
    // compute stream after it, a submit that waits at the bound.
    auto r = dev->reserve_timeline_value();
    dev->copy_queue().wait(dev->timeline_signal(), r.value() - 1).signal(dev->timeline_signal(), r.value()).submit(*dev);
    r.submitted();
  }
  {
    ScopedOverride timeout("TINYDEV_WAIT_TIMEOUT_MS", "2000");
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_AS((*add)(bufs, vals, LaunchParams{.global = {1, 1, 1}, .local = {256, 1, 1}, .wait = true}), Timeout);
    // One wait at the bound, not a second one for the signal after it (4 s), with room for a busy
    // machine.
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::milliseconds(3800));
  }
  gate.set(1);
  CHECK_THROWS_WITH(dev->synchronize(), Catch::Contains("gave up"));
  dev->recover();
  (*add)(bufs, vals, LaunchParams{.global = {1, 1, 1}, .local = {256, 1, 1}, .wait = true});
  std::vector<float> got(x.size());
  o.copyout(std::span<float>(got));
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(got[i] == x[i] + x[i]);
}

TEST_CASE("cuda fake: a 100-kernel CUDA graph replays as eager and patches only the nodes whose inputs changed", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = 300;
  const auto x = random_floats(n, fresh_seed()), y = random_floats(n, fresh_seed());
  Buffer a(dev->name(), n, dtypes::float32), b(dev->name(), n, dtypes::float32), acc(dev->name(), n, dtypes::float32);
  a.allocate().copyin(std::span<const float>(x));
  b.allocate().copyin(std::span<const float>(y));
  acc.allocate();
  // acc = in0 + in1, then 99 times acc = acc + in1, then a copy of acc into input 2.
  const GraphValue count = GraphValue::var(0);
  std::vector<GraphNode> nodes{GraphKernel{add, {GraphBuffer::of(acc.allocation()), GraphBuffer::in(0), GraphBuffer::in(1)},
                                           {count}, LaunchParams{.global = {2, 1, 1}, .local = {128, 1, 1}}}};
  for (int i = 0; i < 99; ++i)
    nodes.push_back(GraphKernel{add, {GraphBuffer::of(acc.allocation()), GraphBuffer::of(acc.allocation()), GraphBuffer::in(1)},
                                {count}, LaunchParams{.global = {2, 1, 1}, .local = {128, 1, 1}}});
  nodes.push_back(GraphCopy{GraphBuffer::in(2), GraphBuffer::of(acc.allocation()), n * sizeof(float)});
  auto graph = dev->create_graph(std::move(nodes));
  Buffer out(dev->name(), n, dtypes::float32);
  out.allocate();
  const auto expect = [&](const std::vector<float>& p, const std::vector<float>& q) {
    std::vector<float> want(n), got(n);
    for (std::size_t i = 0; i < n; ++i) {
      want[i] = p[i] + q[i];
      for (int k = 0; k < 99; ++k) want[i] += q[i];
    }
    out.copyout(std::span<float>(got));
    for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == want[i]);
  };
  const std::int32_t vars[] = {static_cast<std::int32_t>(n)};
  graph->replay(std::vector<Allocation>{a.allocation(), b.allocation(), out.allocation()}, vars, true);
  expect(x, y);
  const long launches = fake_calls("cuGraphLaunch"), kernel_patches = fake_calls("cuGraphExecKernelNodeSetParams");
  const long copy_patches = fake_calls("cuGraphExecMemcpyNodeSetParams");
  // The same inputs again: no node is patched.
  graph->replay(std::vector<Allocation>{a.allocation(), b.allocation(), out.allocation()}, vars);
  dev->synchronize();
  CHECK(fake_calls("cuGraphLaunch") == launches + 1);
  CHECK(fake_calls("cuGraphExecKernelNodeSetParams") == kernel_patches);
  // Input 0 changed: only the first kernel reads it.
  const auto z = random_floats(n, fresh_seed());
  Buffer c(dev->name(), n, dtypes::float32);
  c.allocate().copyin(std::span<const float>(z));
  graph->replay(std::vector<Allocation>{c.allocation(), b.allocation(), out.allocation()}, vars);
  expect(z, y);
  CHECK(fake_calls("cuGraphExecKernelNodeSetParams") == kernel_patches + 1);
  // Input 1 changed: all 100 kernels read it; the copy node is untouched.
  graph->replay(std::vector<Allocation>{c.allocation(), a.allocation(), out.allocation()}, vars);
  expect(z, x);
  CHECK(fake_calls("cuGraphExecKernelNodeSetParams") == kernel_patches + 101);
  CHECK(fake_calls("cuGraphExecMemcpyNodeSetParams") == copy_patches);
  // Input 2 changed: the copy node is patched.
  Buffer out2(dev->name(), n, dtypes::float32);
  out2.allocate();
  graph->replay(std::vector<Allocation>{c.allocation(), a.allocation(), out2.allocation()}, vars);
  dev->synchronize();
  CHECK(fake_calls("cuGraphExecMemcpyNodeSetParams") == copy_patches + 1);
  std::vector<float> first(n), second(n);
  out.copyout(std::span<float>(first));
  out2.copyout(std::span<float>(second));
  CHECK(first == second);
}

TEST_CASE("cuda fake: a graph replayed with input sets that come back keeps an instance for each and patches nothing - new inputs are patched in - at most 4 instances", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = 256, kernels_in_graph = 10;
  const std::int32_t count[] = {static_cast<std::int32_t>(n)};
  // Each kernel: in1 = in0 + in0 (the last one's result stays).
  std::vector<GraphNode> nodes;
  for (std::size_t i = 0; i < kernels_in_graph; ++i)
    nodes.push_back(GraphKernel{add, {GraphBuffer::in(1), GraphBuffer::in(0), GraphBuffer::in(0)}, {GraphValue::var(0)}});
  auto graph = dev->create_graph(std::move(nodes));
  struct Set {
    Buffer in, out;
  };
  const auto make_set = [&] {
    Set set{Buffer(dev->name(), n, dtypes::float32), Buffer(dev->name(), n, dtypes::float32)};
    set.in.allocate();
    set.out.allocate();
    return set;
  };
  // Fresh data each replay, checked against the host's sum.
  const auto replay = [&](Set& set) {
    const auto x = random_floats(n, fresh_seed());
    set.in.copyin(std::span<const float>(x));
    graph->replay(std::vector<Allocation>{set.in.allocation(), set.out.allocation()}, count);
    std::vector<float> got(n);
    set.out.copyout(std::span<float>(got));
    for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == x[i] + x[i]);
  };
  const auto instantiated = [] { return fake_calls("cuGraphInstantiateWithFlags"); };
  const auto patches = [] { return fake_calls("cuGraphExecKernelNodeSetParams"); };
  const long built = instantiated();
  std::vector<Set> sets;
  for (int i = 0; i < 6; ++i) sets.push_back(make_set());
  replay(sets[0]);  // built, instance 1
  replay(sets[1]);  // new inputs: patched into instance 1
  CHECK(instantiated() == built + 1);
  replay(sets[0]);  // seen again: instance 2
  CHECK(instantiated() == built + 2);
  replay(sets[1]);  // instance 1 still holds set 1
  // Alternating from now on: no patch, no instantiation, and every result right.
  const long patched = patches();
  for (int round = 0; round < 10; ++round) {
    replay(sets[0]);
    replay(sets[1]);
  }
  CHECK(patches() == patched);
  CHECK(instantiated() == built + 2);
  // A stream of buffers never seen before (all kept alive, or the LRU cache would hand the same
  // memory back): each patched in (every kernel reads them), none instantiated.
  std::vector<Set> fresh;
  for (int i = 0; i < 12; ++i) replay(fresh.emplace_back(make_set()));
  CHECK(patches() == patched + 12 * static_cast<long>(kernels_in_graph));
  CHECK(instantiated() == built + 2);
  // Six sets coming back in turn: never more than 4 instances, and still every result right.
  for (int round = 0; round < 4; ++round)
    for (Set& set : sets) replay(set);
  CHECK(instantiated() == built + 4);
}

TEST_CASE("cuda fake: a graph whose copy moves to memory the driver cannot patch in gets an instance of a graph built for it - and empty copies and kernels without parameters run", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  auto nop = dev->load_kernel("nop", std::string("extern \"C\" __global__ void nop() {}\n"));
  REQUIRE(nop->signature() == KernelSignature{0, 0, false});
  (*nop)({}, {}, LaunchParams{.wait = true});  // no argument buffer at all
  const std::size_t n = 512;
  const std::int32_t count[] = {static_cast<std::int32_t>(n)};
  // in0 = in1 (a copy), an empty copy, nop, in2 = in0 + in0.
  const auto make_graph = [&] {
    return dev->create_graph(
        {GraphKernel{nop, {}, {}}, GraphCopy{GraphBuffer::in(0), GraphBuffer::in(1), n * 4},
         GraphCopy{GraphBuffer::in(0), GraphBuffer::in(1), 0},
         GraphKernel{add, {GraphBuffer::in(2), GraphBuffer::in(0), GraphBuffer::in(0)}, {GraphValue::var(0)}}});
  };
  auto graph = make_graph();
  Buffer mid(dev->name(), n, dtypes::float32), out(dev->name(), n, dtypes::float32);
  Buffer device_src(dev->name(), n, dtypes::float32), pinned_src(dev->name(), n, dtypes::float32, BufferOptions{.host = true});
  Buffer other_pinned_src(dev->name(), n, dtypes::float32, BufferOptions{.host = true});
  mid.allocate();
  out.allocate();
  device_src.allocate();
  pinned_src.allocate();
  other_pinned_src.allocate();
  const auto replay_from = [&](Buffer& src) {
    const auto x = random_floats(n, fresh_seed());
    src.copyin(std::span<const float>(x));
    const Allocation inputs[] = {mid.allocation(), src.allocation(), out.allocation()};
    graph->replay(inputs, count);
    std::vector<float> got(n);
    out.copyout(std::span<float>(got));
    for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == x[i] + x[i]);
  };
  const long built = fake_calls("cuGraphInstantiateWithFlags");
  // Graphs and executable graphs made and not destroyed.
  const auto graphs_alive = [] { return fake_calls("cuGraphCreate") - fake_calls("cuGraphDestroy"); };
  const auto execs_alive = [] {
    return fake_calls("cuGraphInstantiateWithFlags") - fake_calls("cuGraphExecDestroy");
  };
  const long alive_before = graphs_alive(), execs_before = execs_alive();
  replay_from(device_src);
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == built + 1);
  // Device memory to pinned host memory: the driver refuses the copy node's patch, and an
  // instance of a graph built for these inputs replaces the one that refused.
  replay_from(pinned_src);
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == built + 2);
  CHECK(graphs_alive() == alive_before + 1);  // the first graph, which no instance uses now, went
  CHECK(execs_alive() == execs_before + 1);  // and the executable graph that refused
  replay_from(pinned_src);  // the same inputs: nothing patched, nothing built
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == built + 2);
  // Inputs seen again (Note [CUDA graph instances]): an instance of their own, instantiated from
  // the newest graph (pinned), whose patch the driver refuses as well: replaced by an instance of
  // a graph built for them, while the pinned inputs keep theirs.
  replay_from(device_src);
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == built + 4);
  replay_from(device_src);
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == built + 4);
  // Both kinds coming back in turn: each has its instance, nothing is patched or built again
  // (dropping every instance at a refused patch built twice at every change of kind).
  const long patches = fake_calls("cuGraphExecMemcpyNodeSetParams");
  for (int round = 0; round < 3; ++round) {
    replay_from(pinned_src);
    replay_from(device_src);
  }
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == built + 4);
  CHECK(fake_calls("cuGraphExecMemcpyNodeSetParams") == patches);
  CHECK(graphs_alive() == alive_before + 2);
  CHECK(execs_alive() == execs_before + 2);
  // Pinned memory not seen before: patched into the least recently launched instance, the pinned
  // one, through the handles of the graph it came from (not the newest, built for device memory,
  // whose handles the driver would not know in it: a refusal and another build).
  replay_from(other_pinned_src);
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == built + 4);
  CHECK(fake_calls("cuGraphExecMemcpyNodeSetParams") == patches + 1);
  graph.reset();
  CHECK(graphs_alive() == alive_before);
  CHECK(execs_alive() == execs_before);

  // An instantiation the driver refuses is an Error that leaves the graph working: at the first
  // build (no instance yet: the next replay, of inputs not seen before, builds again), and where
  // inputs seen again would get an instance of their own and then replace the one that refused a
  // patch (that one stays, describing no inputs, until a replay patches it).
  graph = make_graph();
  const auto refused_instantiation = [&](Buffer& src) {
    const FakeEnv fail("FAKE_CUDA_FAIL", "cuGraphInstantiateWithFlags=2");
    CHECK_THROWS_WITH(replay_from(src), Catch::Contains("cuGraphInstantiate") && Catch::Contains("CUDA_ERROR_OUT_OF_MEMORY"));
  };
  refused_instantiation(device_src);  // one refused call
  replay_from(pinned_src);
  refused_instantiation(device_src);  // two: the extra instance, then the replacement
  for (int round = 0; round < 3; ++round) {
    replay_from(pinned_src);
    replay_from(device_src);
  }
  const long settled = fake_calls("cuGraphInstantiateWithFlags");
  replay_from(pinned_src);
  replay_from(device_src);
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == settled);
  graph.reset();
  CHECK(graphs_alive() == alive_before);
  CHECK(execs_alive() == execs_before + 3);  // fake_cuda_calls counts the three refused calls too
}

TEST_CASE("cuda fake: graph nodes that write nothing another reads have no dependency - and inputs that alias build the dependencies that then hold", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  const auto edges = fake_function<long()>("fake_cuda_graph_edges");
  const long built_before = fake_calls("cuGraphInstantiateWithFlags");
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = 300;
  const GraphValue count = GraphValue::of(static_cast<std::int32_t>(n));
  Buffer p(dev->name(), n, dtypes::float32), q(dev->name(), n, dtypes::float32), r(dev->name(), n, dtypes::float32);
  p.allocate();
  q.allocate();
  r.allocate();
  using B = GraphBuffer;
  // p = x + y and q = y + x read the same inputs and write different buffers; r = p + q; out = r.
  const auto nodes = [&](std::vector<std::size_t> writes) {
    return std::vector<GraphNode>{GraphKernel{add, {B::of(p.allocation()), B::in(0), B::in(1)}, {count}, {}, writes},
                                  GraphKernel{add, {B::of(q.allocation()), B::in(1), B::in(0)}, {count}, {}, writes},
                                  GraphKernel{add, {B::of(r.allocation()), B::of(p.allocation()), B::of(q.allocation())},
                                              {count}, {}, writes},
                                  GraphCopy{B::in(2), B::of(r.allocation()), n * 4}};
  };
  auto declared = dev->create_graph(nodes({0}));
  auto undeclared = dev->create_graph(nodes({}));  // every buffer may be written: the readers of x and y chain
  CHECK_THROWS_WITH(dev->create_graph({GraphKernel{add, {B::in(0), B::in(1), B::in(2)}, {count}, {}, {3}}}),
                    Catch::Contains("writes buffer 3, but it takes 3 buffers"));
  Buffer x(dev->name(), n, dtypes::float32), y(dev->name(), n, dtypes::float32), out(dev->name(), n, dtypes::float32);
  x.allocate();
  y.allocate();
  out.allocate();
  const auto run = [&](Graph& g, Buffer& dest) {
    const auto xs = random_floats(n, fresh_seed()), ys = random_floats(n, fresh_seed());
    x.copyin(std::span<const float>(xs));
    y.copyin(std::span<const float>(ys));
    const Allocation inputs[] = {x.allocation(), y.allocation(), dest.allocation()};
    g.replay(inputs);
    std::vector<float> got(n);
    dest.copyout(std::span<float>(got));
    for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == (xs[i] + ys[i]) + (ys[i] + xs[i]));
  };
  run(*declared, out);
  CHECK(edges() == 3);  // r after p and q, the copy after r: p and q may run at once
  run(*undeclared, out);
  CHECK(edges() == 4);  // and q after p
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == built_before + 2);
  run(*declared, out);  // the same inputs: nothing built
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == built_before + 2);
  // The copy now writes x, which p and q read: built again, the copy after them too.
  run(*declared, x);
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == built_before + 3);
  CHECK(edges() == 5);
  run(*declared, x);  // the same overlaps: patched, not built
  CHECK(fake_calls("cuGraphInstantiateWithFlags") == built_before + 3);
  // Write after read: the copy into x waits for the kernel that reads x (the fake would run it first).
  auto war = dev->create_graph({GraphKernel{add, {B::in(2), B::in(0), B::in(1)}, {count}, {}, {0}},
                                GraphCopy{B::in(0), B::in(1), n * 4}});
  const auto xs = random_floats(n, fresh_seed()), ys = random_floats(n, fresh_seed());
  x.copyin(std::span<const float>(xs));
  y.copyin(std::span<const float>(ys));
  const Allocation inputs[] = {x.allocation(), y.allocation(), out.allocation()};
  war->replay(inputs);
  CHECK(edges() == 1);
  std::vector<float> sum(n), moved(n);
  out.copyout(std::span<float>(sum));
  x.copyout(std::span<float>(moved));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(sum[i] == xs[i] + ys[i]);
  CHECK(moved == ys);
}

TEST_CASE("cuda fake: pinned host buffers are copied by the host - not by a synchronous host-to-host cuMemcpyAsync - and as_buffer maps them", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = (1u << 20) + 3;  // past one staging slot
  const auto x = random_floats(n, fresh_seed());
  Buffer pinned(dev->name(), n, dtypes::float32, BufferOptions{.host = true}), device(dev->name(), n, dtypes::float32);
  pinned.allocate();
  device.allocate();
  auto& allocator = dynamic_cast<cuda::CudaAllocator&>(dev->allocator());
  CHECK(allocator.host_visible(pinned.allocation()));
  CHECK_FALSE(allocator.host_visible(device.allocation()));
  dev->synchronize();
  const long copies = fake_calls("cuMemcpyAsync");
  pinned.copyin(std::span<const float>(x));  // idle device: memcpy
  std::vector<float> back(n);
  pinned.copyout(std::span<float>(back));
  CHECK(back == x);
  CHECK(fake_calls("cuMemcpyAsync") == copies);
  const auto mapped = allocator.as_buffer(pinned.allocation());
  REQUIRE(mapped.has_value());
  CHECK(std::memcmp(mapped->data(), x.data(), n * 4) == 0);
  CHECK_FALSE(allocator.as_buffer(device.allocation()).has_value());
  // Queued work reads the pinned buffer: a copyin now goes through the ring, after that work.
  const Allocation bufs[] = {device.allocation(), pinned.allocation(), pinned.allocation()};
  const std::int32_t count[] = {static_cast<std::int32_t>(n)};
  (*add)(bufs, count);
  const auto y = random_floats(n, fresh_seed());
  pinned.copyin(std::span<const float>(y));
  CHECK(fake_calls("cuMemcpyAsync") > copies);
  std::vector<float> sum(n);
  device.copyout(std::span<float>(sum));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(sum[i] == x[i] + x[i]);  // the kernel saw x, not y
  pinned.copyout(std::span<float>(back));
  CHECK(back == y);
}

TEST_CASE("cuda gpu: streams run requests on lanes of their own - events order them - graphs and transfers run on them", "[cuda][gpu]") {
  Compiled* dev = gpu();
  if (!dev) return;
  Compiled* other = nullptr;  // a second GPU for the transfer, where there is one
  try {
    other = &Device["CUDA:1"];
  } catch (const DeviceUnavailable&) {
  }
  REQUIRE(dev->capabilities().streams);
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = 5000;
  const std::int32_t count[] = {static_cast<std::int32_t>(n)};
  const LaunchParams grid{.global = {20, 1, 1}, .local = {256, 1, 1}};
  const auto buffer = [&] {
    Buffer b(dev->name(), n, dtypes::float32);
    b.allocate();
    return b;
  };
  auto s1 = dev->create_stream(), s2 = dev->create_stream();
  CHECK(s1->name() != s2->name());
  CHECK_THAT(s1->name(), Catch::StartsWith("CUDA stream "));
  CHECK(&s1->device() == dev);
  // One request per stream: copyin, add, copyout.
  for (auto* s : {s1.get(), s2.get()}) {
    const auto x = random_floats(n, fresh_seed()), y = random_floats(n, fresh_seed());
    Buffer a = buffer(), b = buffer(), o = buffer();
    s->copyin(a, std::as_bytes(std::span(x)));
    s->copyin(b, std::as_bytes(std::span(y)));
    const Buffer args[] = {o, a, b};
    s->launch(add, args, count, grid);
    std::vector<float> got(n);
    s->copyout(std::as_writable_bytes(std::span(got)), o).wait();
    for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == x[i] + y[i]);
  }
  // s2 waits for s1's event on the GPU: z = (x + x) + (x + x).
  const auto x = random_floats(n, fresh_seed());
  Buffer bx = buffer(), by = buffer(), bz = buffer();
  s1->copyin(bx, std::as_bytes(std::span(x)));
  const Buffer first[] = {by, bx, bx};
  s1->launch(add, first, count, grid);
  s2->wait(s1->record());
  const Buffer second[] = {bz, by, by};
  s2->launch(add, second, count, grid);
  std::vector<float> z(n);
  s2->copyout(std::as_writable_bytes(std::span(z)), bz).wait();
  for (std::size_t i = 0; i < n; ++i) REQUIRE(z[i] == (x[i] + x[i]) + (x[i] + x[i]));
  // A graph made by a stream replays on it (and only on it).
  auto graph = s1->create_graph({GraphKernel{add, {GraphBuffer::in(0), GraphBuffer::in(1), GraphBuffer::in(1)},
                                             {GraphValue::var(0)}, grid, {0}}});
  const Buffer graph_inputs[] = {bz, bx};
  s1->replay(*graph, graph_inputs, count);
  CHECK_THROWS_WITH(s2->replay(*graph, graph_inputs, count), Catch::Contains("replays on the stream that made it"));
  s1->copyout(std::as_writable_bytes(std::span(z)), bz).wait();
  for (std::size_t i = 0; i < n; ++i) REQUIRE(z[i] == x[i] + x[i]);
  // A transfer on the same GPU and, where there is one, to another GPU, ordered by its event.
  Buffer near = buffer();
  s2->transfer(near, bz).wait();
  std::vector<float> moved(n);
  near.copyout(std::span<float>(moved));
  CHECK(moved == z);
  if (other) {
    Buffer far(other->name(), n, dtypes::float32);
    far.allocate();
    s1->transfer(far, bz).wait();
    far.copyout(std::span<float>(moved));
    CHECK(moved == z);
    const Buffer foreign[] = {far, bx, bx};
    CHECK_THROWS_WITH(s1->launch(add, foreign, count, grid), Catch::Contains("a stream of CUDA uses CUDA's buffers"));
  }
  // Bad input: counts, unallocated buffers.
  if (dev->capabilities().checks_signatures) {
    const Buffer two[] = {bz, bx};
    CHECK_THROWS_WITH(s1->launch(add, two, count, grid), Catch::Contains("takes 3 buffers and 1 values, got 2 and 1"));
  }
  Buffer unallocated(dev->name(), n, dtypes::float32);
  CHECK_THROWS_WITH(s1->copyin(unallocated, std::as_bytes(std::span(x))), Catch::Contains("allocate it first"));
  s1->synchronize();
  s2->synchronize();
}

TEST_CASE("cuda fake: lanes are reused after their stream is dropped and 64 streams at once is the most", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  for (int i = 0; i < 80; ++i) dev->create_stream();  // each dropped at once: its lane is reused
  std::vector<std::shared_ptr<Stream>> alive;
  for (std::size_t i = 0; i < cuda::CudaHCQDevice::kMaxStreams; ++i) alive.push_back(dev->create_stream());
  CHECK_THROWS_WITH(dev->create_stream(), Catch::Contains("64 streams are alive already"));
  alive.pop_back();
  CHECK_NOTHROW(alive.push_back(dev->create_stream()));
}

namespace {

// Makes `count` streams of `dev` with CUDA_DEVICE_MAX_CONNECTIONS=`queues`, into `streams`, and
// returns the warnings logged while making each; nullopt after skip() when an earlier test of this
// process made lanes (the hardware-queue warning comes once per process; ctest runs each test in
// a process of its own).
std::optional<std::vector<std::vector<std::string>>> warnings_making_streams(
    cuda::CudaHCQDevice& dev, const std::string& queues, int count, std::vector<std::shared_ptr<Stream>>& streams) {
  std::size_t lanes = 0;
  dev.for_each_lane([&](const cuda::CudaHCQDevice&) { ++lanes; });
  if (lanes != 0) {
    skip("lanes were made by an earlier test in this process (the warning comes once per process; ctest runs each "
         "test in a process of its own)");
    return std::nullopt;
  }
  // No kernel is queued while it is set: the fake's stream threads read the environment.
  FakeEnv set("CUDA_DEVICE_MAX_CONNECTIONS", queues);
  std::vector<std::vector<std::string>> each;
  for (int i = 0; i < count; ++i) {
    Warnings logged;
    streams.push_back(dev.create_stream());
    each.push_back(logged.messages);
  }
  return each;
}

// Note [CUDA copyin captures]: three buffers of 24 MiB, fresh random inputs for them, and a stream
// of `dev` waiting for `gate` (shut) before anything it is given: two of these copyins fit the
// stream's 64 MiB, the third does not.
struct ThreeCopyins {
  std::vector<std::vector<float>> inputs;
  std::vector<Buffer> buffers;
  std::shared_ptr<Stream> stream;
  Signal gate;
  explicit ThreeCopyins(cuda::CudaHCQDevice& dev) {
    const std::size_t n = (std::size_t{6} << 20) - fresh_seed() % 1000;
    buffers.reserve(3);
    for (int i = 0; i < 3; ++i) {
      inputs.push_back(random_floats(n, fresh_seed()));
      buffers.emplace_back(dev.name(), n, dtypes::float32).allocate();
    }
    stream = dev.create_stream();
    gate = dev.alloc_signal(0);
    stream->wait(Event(gate, 1, nullptr));
  }
};

}  // namespace

TEST_CASE("cuda fake: the first lane whose streams outnumber the GPU's hardware queues says so once", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  std::vector<std::shared_ptr<Stream>> streams;
  const auto warnings = warnings_making_streams(*dev, "4", 3, streams);
  if (!warnings) return;
  CHECK((*warnings)[0].empty());  // the device's 2 streams and the lane's 2: 4 queues hold them
  REQUIRE((*warnings)[1].size() == 1);  // 6 streams on 4 queues
  CHECK_THAT((*warnings)[1][0], Catch::Contains("6 CUDA streams") && Catch::Contains("4 hardware queues") &&
                                    Catch::Contains("CUDA_DEVICE_MAX_CONNECTIONS=32"));
  CHECK((*warnings)[2].empty());  // 8: said once already
  // The streams work all the same (the fake has no hardware queues to share).
  const std::size_t n = 500 + fresh_seed() % 500;
  const auto x = random_floats(n, fresh_seed());
  Buffer b(dev->name(), n, dtypes::float32);
  b.allocate();
  streams[2]->copyin(b, std::as_bytes(std::span(x)));
  std::vector<float> back(n);
  streams[2]->copyout(std::as_writable_bytes(std::span(back)), b).wait(std::chrono::seconds(10));
  CHECK(back == x);
}

TEST_CASE("cuda fake: a CUDA_DEVICE_MAX_CONNECTIONS the driver would not take counts as its default of 8", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  // Not a number, a number with a tail, out of range, an overflow: each is the driver's 8 queues.
  const std::string hostile[] = {"abc", "4x", "0", "-5", "33", "99999999999999999999", ""};
  const std::string& value = hostile[fresh_seed() % std::size(hostile)];
  INFO("CUDA_DEVICE_MAX_CONNECTIONS='" << value << "'");
  std::vector<std::shared_ptr<Stream>> streams;
  const auto warnings = warnings_making_streams(*dev, value, 4, streams);
  if (!warnings) return;
  for (int i = 0; i < 3; ++i) CHECK((*warnings)[i].empty());  // up to 8 streams on 8 queues
  REQUIRE((*warnings)[3].size() == 1);
  CHECK_THAT((*warnings)[3][0], Catch::Contains("10 CUDA streams") && Catch::Contains("8 hardware queues"));
}

TEST_CASE("cuda fake: a copyin past a stream's 64 MiB that the stream never gets to is a Timeout saying why - and the stream goes on", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  ThreeCopyins three(*dev);
  auto& [inputs, buffers, stream, gate] = three;
  const std::size_t n = inputs[0].size();
  stream->copyin(buffers[0], std::as_bytes(std::span(inputs[0])));
  Event second = stream->copyin(buffers[1], std::as_bytes(std::span(inputs[1])));
  // The gate stays shut: after TINYDEV_WAIT_TIMEOUT_MS (here 300 ms) the third copyin gives up,
  // saying what holds it.
  try {
    ScopedOverride timeout("TINYDEV_WAIT_TIMEOUT_MS", "300");
    stream->copyin(buffers[2], std::as_bytes(std::span(inputs[2])));
    FAIL("a copyin past the limit behind a shut gate returned");
  } catch (const Timeout& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("waited for room in vain") && Catch::Contains("Complete the events"));
  }
  CHECK(stream->fault().empty());
  gate.set(1);
  second.wait(std::chrono::seconds(10));
  stream->copyin(buffers[2], std::as_bytes(std::span(inputs[2])));
  for (int i = 0; i < 3; ++i) {
    std::vector<float> back(n);
    stream->copyout(std::as_writable_bytes(std::span(back)), buffers[i]).wait(std::chrono::seconds(10));
    CHECK(back == inputs[i]);
  }
  dev->free_signal(gate);
}

TEST_CASE("cuda fake: a lane dropped with work running comes back once it finished - its frees wait their full time again", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  Signal gate = dev->alloc_signal(0);
  set_log_sink([](LogLevel, std::string_view, std::string_view) {});  // the drop's warning is expected
  std::string dropped_name;
  Event copied;
  const std::size_t n = 1000 + fresh_seed() % 1000;
  const auto x = random_floats(n, fresh_seed());
  Buffer b(dev->name(), n, dtypes::float32);
  b.allocate();
  {
    auto stream = dev->create_stream(StreamOptions{.drop_timeout = std::chrono::milliseconds(50)});
    dropped_name = stream->name();
    stream->wait(Event(gate, 1, nullptr));
    copied = stream->copyin(b, std::as_bytes(std::span(x)));
  }
  set_log_sink(nullptr);
  const auto lane_named = [&](const std::string& name) {
    const cuda::CudaHCQDevice* found = nullptr;
    dev->for_each_lane([&](const cuda::CudaHCQDevice& lane) {
      if (lane.name() == name) found = &lane;
    });
    REQUIRE(found);
    return found;
  };
  CHECK(lane_named(dropped_name)->has_timed_out());  // the drop's wait gave up
  CHECK(dev->create_stream()->name() != dropped_name);
  gate.set(1);
  copied.wait(std::chrono::seconds(10));
  auto again = dev->create_stream();
  CHECK(again->name() == dropped_name);
  CHECK_FALSE(lane_named(dropped_name)->has_timed_out());
  std::vector<float> back(n);
  again->copyout(std::as_writable_bytes(std::span(back)), b).wait(std::chrono::seconds(10));
  CHECK(back == x);
  dev->free_signal(gate);
}

TEST_CASE("cuda fake: a kernel loaded while a stream waits on the GPU for a host-set signal says the load may wait for it", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  // Note [CUDA lazy loading]: a warning once per GPU, every time at TINYDEV_DEBUG=1 (so this test
  // sees one message per load whichever test warned first in this process).
  ScopedOverride debug("TINYDEV_DEBUG", "1");
  Warnings logged({LogLevel::warning, LogLevel::info});
  const auto said = [&] {  // the messages about loads (TINYDEV_DEBUG=1 logs other things too)
    std::lock_guard lock(logged.mutex);
    std::vector<std::string> loads;
    std::ranges::copy_if(logged.messages, std::back_inserter(loads),
                         [](const std::string& m) { return m.find("is being loaded") != std::string::npos; });
    return loads;
  };
  const auto count = [&] { return said().size(); };
  FakeEnv lazy("CUDA_MODULE_LOADING", "LAZY");
  const std::string src = kernels::add_f32(SourceLanguage::CUDA);
  CHECK(dev->load_kernel("add", src));  // no stream waits: nothing said
  CHECK(count() == 0);
  auto stream = dev->create_stream();
  Signal gate = dev->alloc_signal(0);
  const OpenGateAtExit open_gate{gate};  // before the stream goes, if a check throws
  stream->wait(Event(gate, 1, nullptr));
  const Event held = stream->record();  // submits the wait: the stream now waits on the GPU
  CHECK_FALSE(held.query());
  std::shared_ptr<Program> add = dev->load_kernel("add", src);
  REQUIRE(count() == 1);
  CHECK_THAT(said()[0], Catch::Contains("kernel 'add'") && Catch::Contains(dev->name()) &&
                          Catch::Contains("CUDA_MODULE_LOADING=EAGER"));
  {
    FakeEnv eager("CUDA_MODULE_LOADING", "EAGER");  // loaded with the module: nothing to say
    CHECK(dev->load_kernel("add", src));
    CHECK(count() == 1);
  }
  // The kernel loaded behind the held stream runs (on the device's own queue, waited for there:
  // synchronize() would wait for the stream too) and is right.
  CHECK(add_on_grid(*dev, *add, 1000 + fresh_seed() % 1000, fresh_seed()).wrong == 0);
  gate.set(1);
  held.wait(std::chrono::seconds(10));
  CHECK(dev->load_kernel("add", src));  // the wait passed: nothing said
  CHECK(count() == 1);
  dev->free_signal(gate);
}

namespace {

// Host memory that no copy has written yet: a NaN with a payload no float computation makes.
std::vector<float> sentinel_floats(std::size_t n) {
  return std::vector<float>(n, std::bit_cast<float>(std::uint32_t{0x7fc0beefu}));
}
bool all_sentinel(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float f) { return std::bit_cast<std::uint32_t>(f) == 0x7fc0beefu; });
}

}  // namespace

TEST_CASE("cuda gpu: a stream's copyout behind an event returns at once - in chunks through bounce memory - pinned sources too - in stream order", "[cuda][gpu][gated]") {
  Compiled* dev = gpu();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t big_n = (5u << 20) + 3;  // 20 MiB and 12 bytes: six chunks of the 4 MiB bounce
  const std::size_t n = 1000 + fresh_seed() % 3000;
  const auto big_x = random_floats(big_n, fresh_seed()), x = random_floats(n, fresh_seed()),
             pinned_x = random_floats(n, fresh_seed());
  Buffer big(dev->name(), big_n, dtypes::float32), small(dev->name(), n, dtypes::float32),
      pinned(dev->name(), n, dtypes::float32, BufferOptions{.host = true});
  for (Buffer* buffer : {&big, &small, &pinned}) buffer->allocate();
  big.copyin(std::span<const float>(big_x));
  small.copyin(std::span<const float>(x));
  pinned.copyin(std::span<const float>(pinned_x));
  dev->synchronize();
  auto stream = dev->create_stream();
  auto* hcq = dynamic_cast<cuda::CudaHCQDevice*>(dev);
  REQUIRE(hcq);
  Signal gate = hcq->alloc_signal(0);
  stream->wait(Event(gate, 1, nullptr));
  auto big_back = sentinel_floats(big_n), back = sentinel_floats(n), doubled_back = sentinel_floats(n),
       pinned_back = sentinel_floats(n);
  const auto start = std::chrono::steady_clock::now();
  Event big_done = stream->copyout(std::as_writable_bytes(std::span(big_back)), big);
  Event small_done = stream->copyout(std::as_writable_bytes(std::span(back)), small);
  // Stream order: the kernel runs after the copyout above read `small`, the next copyout after it.
  const Buffer twice[] = {small, small, small};
  const std::int32_t count[] = {static_cast<std::int32_t>(n)};
  stream->launch(add, twice, count, LaunchParams{.global = {static_cast<std::uint32_t>((n + 255) / 256), 1, 1},
                                                 .local = {256, 1, 1}});
  Event doubled_done = stream->copyout(std::as_writable_bytes(std::span(doubled_back)), small);
  Event pinned_done = stream->copyout(std::as_writable_bytes(std::span(pinned_back)), pinned);
  // All of it returned while the gate is shut (not after a timeout), and nothing arrived yet.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(2));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(big_done.query());
  CHECK_FALSE(pinned_done.query());
  CHECK(all_sentinel(big_back));
  CHECK(all_sentinel(back));
  CHECK(all_sentinel(pinned_back));
  gate.set(1);
  pinned_done.wait(std::chrono::seconds(10));
  CHECK(big_done.query());
  CHECK(small_done.query());
  CHECK(doubled_done.query());
  CHECK(big_back == big_x);
  CHECK(back == x);
  for (std::size_t i = 0; i < n; ++i) REQUIRE(doubled_back[i] == x[i] + x[i]);
  CHECK(pinned_back == pinned_x);
  // An idle stream copies out on the caller: the Event is complete when the call returns.
  stream->synchronize();
  auto again = sentinel_floats(big_n);
  CHECK(stream->copyout(std::as_writable_bytes(std::span(again)), big).query());
  CHECK(again == big_x);
  hcq->free_signal(gate);
}

TEST_CASE("cuda gpu: a stream's copyin behind an event reads the caller's bytes and returns at once - more than the lane's ring holds - into pinned buffers too", "[cuda][gpu][gated]") {
  Compiled* dev = gpu();
  if (!dev) return;
  auto* hcq = dynamic_cast<cuda::CudaHCQDevice*>(dev);
  REQUIRE(hcq);
  const std::size_t big_n = (5u << 20) + 3;  // 20 MiB: more than a lane's ring (4 slots of 2 MiB)
  const std::size_t n = 1000 + fresh_seed() % 3000;
  const auto big_x = random_floats(big_n, fresh_seed()), pinned_x = random_floats(n, fresh_seed());
  Buffer big(dev->name(), big_n, dtypes::float32), pinned(dev->name(), n, dtypes::float32, BufferOptions{.host = true});
  big.allocate();
  pinned.allocate();
  auto stream = dev->create_stream();
  Signal gate = hcq->alloc_signal(0);
  stream->wait(Event(gate, 1, nullptr));
  auto big_src = big_x, pinned_src = pinned_x;
  const auto start = std::chrono::steady_clock::now();
  Event big_in = stream->copyin(big, std::as_bytes(std::span(big_src)));
  Event pinned_in = stream->copyin(pinned, std::as_bytes(std::span(pinned_src)));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(2));
  // The bytes were read when the calls returned: what the caller does with its memory now is its own.
  std::fill(big_src.begin(), big_src.end(), 1.5f);
  std::fill(pinned_src.begin(), pinned_src.end(), 2.5f);
  auto big_back = sentinel_floats(big_n), pinned_back = sentinel_floats(n);
  Event big_out = stream->copyout(std::as_writable_bytes(std::span(big_back)), big);
  Event pinned_out = stream->copyout(std::as_writable_bytes(std::span(pinned_back)), pinned);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(big_in.query());
  CHECK_FALSE(pinned_in.query());
  gate.set(1);
  pinned_out.wait(std::chrono::seconds(10));
  CHECK(big_out.query());
  CHECK(big_back == big_x);
  CHECK(pinned_back == pinned_x);
  hcq->free_signal(gate);
}

TEST_CASE("cuda fake: stream copies never make the driver copy into pageable memory or between host memories - and run_inline_when_idle=false queues even an idle one", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  const std::size_t n = 2000 + fresh_seed() % 2000;
  const auto x = random_floats(n, fresh_seed());
  Buffer b(dev->name(), n, dtypes::float32);
  b.allocate();
  b.copyin(std::span<const float>(x));
  dev->synchronize();
  const long synchronous = fake_calls("cuMemcpyAsync (synchronous)"), host_functions = fake_calls("cuLaunchHostFunc");
  auto inline_stream = dev->create_stream(), queued_stream = dev->create_stream(StreamOptions{.run_inline_when_idle = false});
  auto back = sentinel_floats(n);
  CHECK(inline_stream->copyout(std::as_writable_bytes(std::span(back)), b).query());  // through the ring
  CHECK(back == x);
  CHECK(fake_calls("cuLaunchHostFunc") == host_functions);
  back = sentinel_floats(n);
  queued_stream->copyout(std::as_writable_bytes(std::span(back)), b).wait(std::chrono::seconds(10));
  CHECK(back == x);
  CHECK(fake_calls("cuLaunchHostFunc") == host_functions + 1);
  // Copies of a pinned Buffer on a busy stream: host functions, not the driver's host-to-host copy
  // (synchronous: it would block the caller behind the gate for ever).
  Buffer pinned(dev->name(), n, dtypes::float32, BufferOptions{.host = true});
  pinned.allocate();
  Signal gate = dev->alloc_signal(0);
  inline_stream->wait(Event(gate, 1, nullptr));
  inline_stream->copyin(pinned, std::as_bytes(std::span(x)));
  back = sentinel_floats(n);
  Event out = inline_stream->copyout(std::as_writable_bytes(std::span(back)), pinned);
  CHECK(all_sentinel(back));
  gate.set(1);
  out.wait(std::chrono::seconds(10));
  CHECK(back == x);
  CHECK(fake_calls("cuMemcpyAsync (synchronous)") == synchronous);
  dev->free_signal(gate);
}

TEST_CASE("cuda fake: a busy stream holds at most 64 MiB of its callers' copyins - one past it waits until the earliest are copied", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  // Note [CUDA copyin captures]: 3 copyins of 24 MiB behind a gate; the third would make 72 MiB.
  ThreeCopyins three(*dev);
  auto& [inputs, buffers, stream, gate] = three;
  const std::size_t n = inputs[0].size();
  Event first = stream->copyin(buffers[0], std::as_bytes(std::span(inputs[0])));
  stream->copyin(buffers[1], std::as_bytes(std::span(inputs[1])));
  CHECK_FALSE(first.query());
  std::atomic<bool> opened{false};
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    opened.store(true);
    gate.set(1);
  });
  Event third = stream->copyin(buffers[2], std::as_bytes(std::span(inputs[2])));
  // It returned only once the gate opened and the first copyin's bytes were on the GPU.
  CHECK(opened.load());
  CHECK(first.query());
  opener.join();
  third.wait(std::chrono::seconds(10));
  for (int i = 0; i < 3; ++i) {
    auto back = sentinel_floats(n);
    stream->copyout(std::as_writable_bytes(std::span(back)), buffers[i]).wait(std::chrono::seconds(10));
    CHECK(back == inputs[i]);
  }
  // The copied ones are not counted any more: 40 + 20 MiB behind another gate queue without a wait
  // (a wait would be for the gate: Timeout after 30 s).
  Signal gate2 = dev->alloc_signal(0);
  stream->wait(Event(gate2, 1, nullptr));
  const std::size_t n40 = std::size_t{10} << 20, n20 = std::size_t{5} << 20;
  const auto x40 = random_floats(n40, fresh_seed()), x20 = random_floats(n20, fresh_seed());
  Buffer b40(dev->name(), n40, dtypes::float32), b20(dev->name(), n20, dtypes::float32);
  b40.allocate();
  b20.allocate();
  Event in40 = stream->copyin(b40, std::as_bytes(std::span(x40)));
  Event in20 = stream->copyin(b20, std::as_bytes(std::span(x20)));
  CHECK_FALSE(in40.query());
  gate2.set(1);
  in20.wait(std::chrono::seconds(10));
  // One copyin larger than the limit is taken whole when nothing else is held.
  const std::size_t big_n = (std::size_t{17} << 20) + fresh_seed() % 1000;  // 68 MiB
  const auto big_x = random_floats(big_n, fresh_seed());
  Buffer big(dev->name(), big_n, dtypes::float32);
  big.allocate();
  Signal gate3 = dev->alloc_signal(0);
  stream->wait(Event(gate3, 1, nullptr));
  Event big_in = stream->copyin(big, std::as_bytes(std::span(big_x)));
  CHECK_FALSE(big_in.query());
  gate3.set(1);
  auto big_back = sentinel_floats(big_n);
  stream->copyout(std::as_writable_bytes(std::span(big_back)), big).wait(std::chrono::seconds(10));
  CHECK(big_back == big_x);
  std::vector<float> back40(n40), back20(n20);
  b40.copyout(std::span(back40));
  b20.copyout(std::span(back20));
  CHECK(back40 == x40);
  CHECK(back20 == x20);
  dev->free_signal(gate);
  dev->free_signal(gate2);
  dev->free_signal(gate3);
}

TEST_CASE("cuda fake: a stream copyout whose submission fails - or that a later failure of its stream reports failed - writes nothing into the caller's memory and the stream recovers", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  const std::size_t n = (5u << 20) + 3;  // six chunks of the bounce
  const auto x = random_floats(n, fresh_seed());
  Buffer b(dev->name(), n, dtypes::float32);
  b.allocate();
  b.copyin(std::span<const float>(x));
  dev->synchronize();
  auto stream = dev->create_stream();
  for (const char* failing : {"cuMemcpyAsync", "cuLaunchHostFunc"}) {
    INFO(failing);
    Signal gate = dev->alloc_signal(0);
    stream->wait(Event(gate, 1, nullptr));
    auto back = sentinel_floats(n);
    {
      // The second chunk's call fails: the first chunk's copy and host function are queued by then.
      FakeEnv fail("FAKE_CUDA_FAIL", fmt::format("{}@{}=1", failing, fake_calls(failing) + 2));
      CHECK_THROWS_WITH(stream->copyout(std::as_writable_bytes(std::span(back)), b),
                        Catch::Contains(failing) && Catch::Contains("CUDA_ERROR_INVALID_VALUE"));
    }
    CHECK_THAT(stream->fault(), Catch::Contains(failing));
    gate.set(1);  // the queued chunk runs now, and its host function must copy nothing
    CHECK_THAT(stream->recover(std::chrono::seconds(10)), Catch::Contains(failing));
    CHECK(all_sentinel(back));
    // The stream works again, through the same bounce memory (queued: behind a gate still shut).
    Signal gate2 = dev->alloc_signal(0);
    stream->wait(Event(gate2, 1, nullptr));
    Event done = stream->copyout(std::as_writable_bytes(std::span(back)), b);
    CHECK_FALSE(done.query());
    gate2.set(1);
    done.wait(std::chrono::seconds(10));
    CHECK(back == x);
    dev->free_signal(gate);
    dev->free_signal(gate2);
  }
  // A later submission on the stream fails while a copyout waits behind a gate: the copyout's
  // Event reports the failure, so its caller may free the memory; its host function copies nothing.
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  Signal gate = dev->alloc_signal(0);
  stream->wait(Event(gate, 1, nullptr));
  auto back = sentinel_floats(n);
  Event queued = stream->copyout(std::as_writable_bytes(std::span(back)), b);
  {
    FakeEnv fail("FAKE_CUDA_FAIL", "cuLaunchKernel=1");
    const Buffer args[] = {b, b, b};
    const std::int32_t count[] = {static_cast<std::int32_t>(n)};
    CHECK_THROWS_WITH(stream->launch(add, args, count), Catch::Contains("CUDA_ERROR_INVALID_VALUE"));
  }
  CHECK_THROWS_AS(queued.wait(std::chrono::seconds(1)), DeviceFault);
  gate.set(1);
  CHECK_THAT(stream->recover(std::chrono::seconds(10)), Catch::Contains("CUDA_ERROR_INVALID_VALUE"));
  CHECK(all_sentinel(back));
  // The GPU ran past the copyout's value since, but it copied nothing: its Event stays failed.
  CHECK_THROWS_AS(queued.query(), DeviceFault);
  dev->free_signal(gate);
}

TEST_CASE("cuda gpu: 4 clients with a stream each make 200 requests each and every result is right", "[cuda][gpu]") {
  Compiled* dev = gpu();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  std::atomic<int> wrong{0};
  ThreadErrors errors;
  std::vector<std::thread> clients;
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&, c] {
      try {
        auto stream = dev->create_stream();
        const std::size_t n = 256 + 64 * static_cast<std::size_t>(c);
        const std::int32_t count[] = {static_cast<std::int32_t>(n)};
        Buffer a(dev->name(), n, dtypes::float32), b(dev->name(), n, dtypes::float32), o(dev->name(), n, dtypes::float32);
        a.allocate();
        b.allocate();
        o.allocate();
        std::vector<float> got(n);
        for (int r = 0; r < 200; ++r) {
          const auto x = random_floats(n, fresh_seed()), y = random_floats(n, fresh_seed());
          stream->copyin(a, std::as_bytes(std::span(x)));
          stream->copyin(b, std::as_bytes(std::span(y)));
          const Buffer args[] = {o, a, b};
          stream->launch(add, args, count, LaunchParams{.global = {2, 1, 1}, .local = {256, 1, 1}});
          stream->copyout(std::as_writable_bytes(std::span(got)), o).wait();
          for (std::size_t i = 0; i < n; ++i) wrong += got[i] != x[i] + y[i];
        }
      } catch (const std::exception& e) {
        errors.add("client " + std::to_string(c) + ": " + e.what());
      }
    });
  }
  for (auto& t : clients) t.join();
  errors.check_none();
  CHECK(wrong == 0);
}

TEST_CASE("cuda fake: a GPU queue waiting for a signal that failed fails its device with the reason - is let go - and the device recovers", "[cuda][fake]") {
  auto* dev = fake_hcq("CUDA:1");
  if (!dev) return;
  Signal upstream = dev->alloc_signal(0);
  const std::uint64_t wanted = 1 + fresh_seed() % 1000;
  {
    // The HCQ pattern: after the timeline's last value, wait on the GPU for upstream, then signal.
    auto r = dev->reserve_timeline_value();
    dev->compute_queue()
        .wait(dev->timeline_signal(), r.value() - 1)
        .wait(upstream, wanted)
        .signal(dev->timeline_signal(), r.value())
        .submit(*dev);
    r.submitted();
  }
  const std::string cause = "the producer's copy failed " + std::to_string(fresh_seed() % 100000);
  upstream.poison(cause);  // its value will never come
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(dev->synchronize(),
                    Catch::Contains(fmt::format("its queue waits for value {} of a signal that failed", wanted)) &&
                        Catch::Contains(cause));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));  // not TINYDEV_WAIT_TIMEOUT_MS
  CHECK_THAT(dev->fault(), Catch::Contains(cause));
  // The GPU's wait was let go (the failed signal now holds the value it wanted, and stays failed),
  // so the queue drains and recover() goes on as on the CPU.
  CHECK_THAT(dev->recover(std::chrono::seconds(5)), Catch::Contains(cause));
  CHECK(upstream.value() == wanted);
  CHECK_THROWS_WITH(upstream.wait(wanted, std::chrono::milliseconds(10)), Catch::Contains(cause));
  const auto data = random_bytes(4096 + fresh_seed() % 4096, fresh_seed());
  Buffer b(dev->name(), data.size(), dtypes::uint8);
  b.allocate().copyin(data);
  std::vector<std::byte> back(data.size());
  b.copyout(back);
  CHECK(back == data);
  dev->free_signal(upstream);
}

TEST_CASE("cuda fake: a failed signal fails every GPU queue downstream of it on two GPUs before any is let go - none reports success - and both go on", "[cuda][fake]") {
  auto* a = fake_hcq("CUDA");
  if (!a) return;
  auto* b = fake_hcq("CUDA:1");
  // Each round races the watcher letting the queues go against their signals' poisons: a signal
  // written before its poison would complete its waiter here.
  for (int round = 0; round < 25; ++round) {
    INFO("round " << round);
    Signal root = a->alloc_signal(0), middle = a->alloc_signal(0), last = b->alloc_signal(0);
    const std::uint64_t v = 1 + fresh_seed() % 1000;
    a->compute_queue().wait(root, v).signal(middle, v).submit(*a);
    b->copy_queue().wait(middle, v).signal(last, 2 * v).submit(*b);  // another GPU, its copy stream
    const std::string cause = "producer failed in round " + std::to_string(round);
    root.poison(cause);
    CHECK_THROWS_WITH(last.wait(2 * v, std::chrono::seconds(5)), Catch::Contains(cause) && Catch::Contains("poisoned"));
    CHECK_THROWS_WITH(middle.wait(v, std::chrono::seconds(5)), Catch::Contains(cause));
    // Both streams were let go: work queued behind on them runs.
    Signal after_a = a->alloc_signal(0), after_b = b->alloc_signal(0);
    a->compute_queue().signal(after_a, 1).submit(*a);
    b->copy_queue().signal(after_b, 1).submit(*b);
    after_a.wait(1, std::chrono::seconds(5));
    after_b.wait(1, std::chrono::seconds(5));
    // The GPU wrote `last` when let go, and it still reads as failed; the devices are not faulted
    // (these queues were not on their timelines).
    CHECK(last.value() == 2 * v);
    CHECK_THROWS_WITH(last.wait(2 * v, std::chrono::milliseconds(10)), Catch::Contains(cause));
    CHECK(a->fault().empty());
    CHECK(b->fault().empty());
    for (const Signal& s : {root, middle, after_a}) a->free_signal(s);
    for (const Signal& s : {last, after_b}) b->free_signal(s);
  }
}

TEST_CASE("cuda fake: a queue's earlier wait failing after a later one failed poisons what came between before it is let go", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  for (int round = 0; round < 10; ++round) {
    INFO("round " << round);
    Signal first = dev->alloc_signal(0), between = dev->alloc_signal(0), second = dev->alloc_signal(0),
           last = dev->alloc_signal(0);
    dev->compute_queue().wait(first, 1).signal(between, 1).wait(second, 1).signal(last, 1).submit(*dev);
    second.poison("the second producer failed");
    CHECK_THROWS_WITH(last.wait(1, std::chrono::seconds(5)), Catch::Contains("the second producer failed"));
    // Let go past `second`, the queue still waits for `first`; then that fails too.
    std::this_thread::sleep_for(std::chrono::milliseconds(round % 3));
    first.poison("the first producer failed");
    CHECK_THROWS_WITH(between.wait(1, std::chrono::seconds(5)), Catch::Contains("the first producer failed"));
    Signal after = dev->alloc_signal(0);
    dev->compute_queue().signal(after, 1).submit(*dev);
    after.wait(1, std::chrono::seconds(5));  // let go: the stream drained
    CHECK_THROWS_AS(between.wait(1, std::chrono::milliseconds(10)), Error);  // written since, still failed
    for (const Signal& s : {first, between, second, last, after}) dev->free_signal(s);
  }
}

TEST_CASE("cuda fake: a queue behind a failed one on the timeline fails the signals it sets too", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  Signal gate = dev->alloc_signal(0), mine = dev->alloc_signal(0);
  {
    // The first waits on the GPU for `gate`; the second only for the first's timeline value, then
    // signals a signal of the user's.
    auto first = dev->reserve_timeline_value();
    dev->compute_queue()
        .wait(dev->timeline_signal(), first.value() - 1)
        .wait(gate, 1)
        .signal(dev->timeline_signal(), first.value())
        .submit(*dev);
    first.submitted();
    auto second = dev->reserve_timeline_value();
    dev->compute_queue()
        .wait(dev->timeline_signal(), second.value() - 1)
        .signal(mine, 7)
        .signal(dev->timeline_signal(), second.value())
        .submit(*dev);
    second.submitted();
  }
  gate.poison("the gate's producer failed");
  // The first is let go and writes its timeline value; the second then runs, but what it signals
  // is not success: it came after a failure, as on the CPU.
  CHECK_THROWS_WITH(mine.wait(7, std::chrono::seconds(5)), Catch::Contains("the gate's producer failed"));
  CHECK_THAT(dev->recover(std::chrono::seconds(5)), Catch::Contains("the gate's producer failed"));
  CHECK(mine.value() == 7);  // the GPU wrote it, after its poison
  CHECK_THROWS_AS(mine.wait(7, std::chrono::milliseconds(10)), Error);
  dev->free_signal(gate);
  dev->free_signal(mine);
}

TEST_CASE("cuda fake: a queue whose wait failed before it was submitted issues nothing past that wait", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  Signal root = dev->alloc_signal(0), before = dev->alloc_signal(0), after = dev->alloc_signal(0);
  const std::string cause = "failed earlier " + std::to_string(fresh_seed() % 100000);
  root.poison(cause);
  dev->compute_queue().signal(before, 3).wait(root, 1).signal(after, 4).submit(*dev);
  before.wait(3, std::chrono::seconds(5));  // what came before the wait ran
  // (The failed-wait watcher may see the submission while it is issued and poison `after` first,
  // in the same words.)
  CHECK_THROWS_WITH(after.wait(4, std::chrono::seconds(5)),
                    Catch::Contains("its queue waits for value 1 of a signal that failed") && Catch::Contains(cause));
  // The wait never reached the GPU: the stream is not held up, and nothing had to let it go (an
  // issued wait would block the stream, or be let go by writing root's value).
  Signal later = dev->alloc_signal(0);
  dev->compute_queue().signal(later, 1).submit(*dev);
  later.wait(1, std::chrono::seconds(5));
  CHECK(root.value() == 0);
  CHECK(dev->fault().empty());
  for (const Signal& s : {root, before, after, later}) dev->free_signal(s);
}

TEST_CASE("cuda fake: memory a failed device's queued kernel still writes is freed only once its queues drained", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  ScopedOverride no_cache("TINYDEV_LRU", "0");  // frees are real: the fake driver's memory goes
  auto add = std::dynamic_pointer_cast<cuda::CudaProgram>(dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA)));
  REQUIRE(add);
  const std::size_t n = 256 + fresh_seed() % 768;
  const auto x = random_floats(n, fresh_seed());
  Buffer in(dev->name(), n, dtypes::float32);
  in.allocate().copyin(std::span<const float>(x));
  Signal gate = dev->alloc_signal(0), root = dev->alloc_signal(0);
  std::optional<Buffer> out(std::in_place, dev->name(), n, dtypes::float32);
  out->allocate();
  {
    // On the timeline: a wait that will be satisfied late, one that fails, then a kernel writing `out`.
    const Allocation bufs[] = {out->allocation(), in.allocation(), in.allocation()};
    const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
    Kernargs args = dev->alloc_kernargs(3, 1);
    fill_kernargs(*add, args, bufs, vals);
    auto r = dev->reserve_timeline_value();
    dev->compute_queue()
        .wait(dev->timeline_signal(), r.value() - 1)
        .wait(gate, 1)
        .wait(root, 1)
        .exec(*add, args, {4, 1, 1}, {256, 1, 1})
        .signal(dev->timeline_signal(), r.value())
        .submit(*dev);
    r.submitted();
  }
  root.poison("the input never came");
  CHECK_THROWS_AS(dev->synchronize(), DeviceFault);  // failed: the timeline is poisoned
  // The kernel still runs once the gate opens: the free must wait for it, not for the timeline.
  std::atomic<std::int64_t> opened_ns{0};
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    opened_ns = std::chrono::steady_clock::now().time_since_epoch().count();
    gate.set(1);
  });
  out.reset();  // frees the device memory (cuMemFree) the kernel writes
  const std::int64_t freed_ns = std::chrono::steady_clock::now().time_since_epoch().count();
  opener.join();
  CHECK(opened_ns.load() != 0);
  CHECK(freed_ns >= opened_ns.load());
  CHECK_THAT(dev->recover(std::chrono::seconds(5)), Catch::Contains("the input never came"));
  std::vector<float> back(n);
  in.copyout(std::span<float>(back));
  CHECK(back == x);
  dev->free_signal(gate);
  dev->free_signal(root);
}

TEST_CASE("cuda fake: a graph launch the driver refuses is an Error and the device and the graph keep working", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = 64;
  const auto x = random_floats(n, fresh_seed());
  Buffer a(dev->name(), n, dtypes::float32), o(dev->name(), n, dtypes::float32);
  a.allocate().copyin(std::span<const float>(x));
  o.allocate();
  auto graph = dev->create_graph({GraphKernel{add, {GraphBuffer::in(0), GraphBuffer::in(1), GraphBuffer::in(1)},
                                              {GraphValue::of(static_cast<std::int32_t>(n))}}});
  {
    FakeEnv fail("FAKE_CUDA_FAIL", "cuGraphLaunch=1");
    CHECK_THROWS_WITH(graph->replay(std::vector<Allocation>{o.allocation(), a.allocation()}),
                      Catch::Contains("launching a graph of 1 nodes failed") && Catch::Contains("CUDA_ERROR_INVALID_VALUE"));
  }
  graph->replay(std::vector<Allocation>{o.allocation(), a.allocation()}, {}, true);
  std::vector<float> got(n);
  o.copyout(std::span<float>(got));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == x[i] + x[i]);
}

TEST_CASE("cuda fake: a sticky error while a graph is built marks the device failed as a launch's does", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = 64;
  Buffer a(dev->name(), n, dtypes::float32), o(dev->name(), n, dtypes::float32);
  a.allocate().copyin(std::span<const float>(random_floats(n, fresh_seed())));
  o.allocate();
  auto graph = dev->create_graph({GraphKernel{add, {GraphBuffer::in(0), GraphBuffer::in(1), GraphBuffer::in(1)},
                                              {GraphValue::of(static_cast<std::int32_t>(n))}}});
  {
    // The driver reports an earlier kernel's illegal address from the graph's instantiation.
    FakeEnv fail("FAKE_CUDA_FAIL", "cuGraphInstantiateWithFlags=700");
    CHECK_THROWS_WITH(graph->replay(std::vector<Allocation>{o.allocation(), a.allocation()}),
                      Catch::Contains("cuGraphInstantiate of a graph of 1 nodes") &&
                          Catch::Contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
  }
  // The context is unusable: every later call says the device failed, naming the error.
  CHECK_THROWS_WITH(graph->replay(std::vector<Allocation>{o.allocation(), a.allocation()}),
                    Catch::Contains("failed earlier") && Catch::Contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
  CHECK_THROWS_WITH(dev->synchronize(), Catch::Contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
  CHECK_FALSE(dev->fault().empty());
}

TEST_CASE("cuda gpu: renderer-style kernels match the CPU (elementwise to half - bf16 reduction - shared-memory matmul)", "[cuda][gpu]") {
  Compiled* dev = gpu();
  if (!dev) return;
  // On the fake driver the kernels are its host versions (tests/cuda/fake_driver): what runs here
  // is the launches, the half and bf16 buffers and the checks against the CPU's arithmetic.
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const auto load = [&](const char* name) { return dev->load_kernel(name, kRendererStyle); };
  if (dev->capabilities().checks_signatures) {  // the driver's parameter layouts of real CUBIN
    CHECK(load("E_4096_4")->signature() == KernelSignature{2, 0, false});
    CHECK(load("r_64_32")->signature() == KernelSignature{2, 0, false});
    CHECK(load("r_16_16_16")->signature() == KernelSignature{3, 1, false});
  }
  // E_4096_4: data0[i] = half(data1[i] * 2), 16 blocks of 256 threads.
  {
    auto x = random_floats(4096, seed);
    Buffer in(dev->name(), 4096, dtypes::float32), out(dev->name(), 4096, dtypes::float16);
    in.allocate().copyin(std::span<const float>(x));
    out.allocate();
    const Allocation bufs[] = {out.allocation(), in.allocation()};
    (*load("E_4096_4"))(bufs, {}, LaunchParams{.global = {16, 1, 1}, .local = {256, 1, 1}});
    std::vector<std::uint16_t> got(4096);
    out.copyout(std::span<std::uint16_t>(got));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < 4096; ++i) {
      const _Float16 want = static_cast<_Float16>(x[i] * 2.0f);
      std::uint16_t bits;
      std::memcpy(&bits, &want, 2);
      wrong += got[i] != bits;
    }
    CHECK(wrong == 0);
  }
  // r_64_32: data0[g] = the sum of block g's 256 bfloat16 values, in the kernel's order.
  {
    std::vector<std::uint16_t> bf(64 * 256);
    auto x = random_floats(bf.size(), seed + 1);
    for (std::size_t i = 0; i < bf.size(); ++i) {
      std::uint32_t w;
      std::memcpy(&w, &x[i], 4);
      bf[i] = static_cast<std::uint16_t>(w >> 16);  // truncation: any bf16 value will do as input
    }
    Buffer in(dev->name(), bf.size(), dtypes::bfloat16), out(dev->name(), 64, dtypes::float32);
    in.allocate().copyin(std::span<const std::uint16_t>(bf));
    out.allocate();
    const Allocation bufs[] = {out.allocation(), in.allocation()};
    (*load("r_64_32"))(bufs, {}, LaunchParams{.global = {64, 1, 1}, .local = {32, 1, 1}});
    std::vector<float> got(64);
    out.copyout(std::span<float>(got));
    const auto value = [&](std::size_t i) {
      const std::uint32_t w = static_cast<std::uint32_t>(bf[i]) << 16;
      float f;
      std::memcpy(&f, &w, 4);
      return f;
    };
    for (std::size_t g = 0; g < 64; ++g) {
      float partial[32];
      for (std::size_t l = 0; l < 32; ++l) {
        partial[l] = 0.0f;
        for (std::size_t r = 0; r < 8; ++r) partial[l] += value(g * 256 + l * 8 + r);
      }
      float want = 0.0f;
      for (float p : partial) want += p;
      CHECK(got[g] == Approx(want).epsilon(1e-5));
    }
  }
  // r_16_16_16: c = a @ b for 64 x 64 floats, 16 x 16 tiles through shared memory.
  {
    const int n = 64;
    auto a = random_floats(n * n, seed + 2), b = random_floats(n * n, seed + 3);
    Buffer ba(dev->name(), n * n, dtypes::float32), bb(dev->name(), n * n, dtypes::float32),
        bc(dev->name(), n * n, dtypes::float32);
    ba.allocate().copyin(std::span<const float>(a));
    bb.allocate().copyin(std::span<const float>(b));
    bc.allocate();
    const Allocation bufs[] = {bc.allocation(), ba.allocation(), bb.allocation()};
    const std::int32_t vals[] = {n};
    (*load("r_16_16_16"))(bufs, vals, LaunchParams{.global = {n / 16, n / 16, 1}, .local = {16, 16, 1}});
    std::vector<float> got(n * n);
    bc.copyout(std::span<float>(got));
    // Against the exact sum, within what n float multiply-adds may round away (each term is up to
    // 10^4 and they cancel, so a relative bound on the result would not hold); a wrong term is
    // off by far more.
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        double want = 0, magnitude = 0;
        for (int k = 0; k < n; ++k) {
          const double term = static_cast<double>(a[i * n + k]) * b[k * n + j];
          want += term;
          magnitude += std::abs(term);
        }
        INFO("c[" << i << "][" << j << "]");
        REQUIRE(std::abs(got[i * n + j] - want) <= n * std::ldexp(1.0, -24) * magnitude);
      }
  }
}

TEST_CASE("cuda fake: direct calls signal the timeline lazily yet stay ordered with copies - synchronize and frees", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = 4096;
  const auto x = random_floats(n, fresh_seed()), y = random_floats(n, fresh_seed());
  Buffer a(dev->name(), n, dtypes::float32), o(dev->name(), n, dtypes::float32);
  a.allocate().copyin(std::span<const float>(x));
  o.allocate();
  const Allocation bufs[] = {o.allocation(), a.allocation(), a.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  // Hold the compute stream, queue a direct call behind the gate, then overwrite its input through
  // the staging ring (the copy stream): the copy must wait for the call (write after read).
  Signal gate = dev->alloc_signal(0);
  submit_ordered(*dev, [&](auto& q) { q.wait(gate, 1); });
  const long signals_before = fake_calls("cuStreamBatchMemOp");
  (*add)(bufs, vals);
  CHECK(fake_calls("cuStreamBatchMemOp") == signals_before);  // no timeline write of its own
  CHECK_FALSE(dev->idle());
  {
    const GateOpener opener(gate, std::chrono::milliseconds(30));
    hcq_copyin_forced(*dev, a, y);
  }
  std::vector<float> got(n);
  o.copyout(std::span<float>(got));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == x[i] + x[i]);  // the call read the old input
  // A direct call and then a free of its input: the free waits for the call.
  {
    Buffer tmp(dev->name(), n, dtypes::float32);
    tmp.allocate().copyin(std::span<const float>(y));
    const Allocation tmp_bufs[] = {o.allocation(), tmp.allocation(), tmp.allocation()};
    (*add)(tmp_bufs, vals);
  }
  dynamic_cast<LRUAllocator&>(dev->allocator()).free_cache();
  dev->synchronize();
  CHECK(dev->idle());
  o.copyout(std::span<float>(got));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == y[i] + y[i]);
  // Many calls: the timeline is written once per 256 (plus one wait first: the copyout above
  // signalled from the copy stream, which the compute stream's order does not cover).
  const long before_many = fake_calls("cuStreamBatchMemOp");
  for (int i = 0; i < 1024; ++i) (*add)(bufs, vals);
  CHECK(fake_calls("cuStreamBatchMemOp") - before_many == 1 + 4);
  dev->synchronize();
}

TEST_CASE("cuda fake: a refused batch of stream memory operations poisons every signal it held", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  Signal a = dev->alloc_signal(0), b = dev->alloc_signal(0);
  {
    FakeEnv fail("FAKE_CUDA_FAIL", "cuStreamBatchMemOp=1");
    // Both signals go in one batch, issued after the loop: the failure names its first command.
    CHECK_THROWS_WITH(dev->compute_queue().signal(a, 1).signal(b, 2).submit(*dev),
                      Catch::Contains("cuStreamBatchMemOp failed (command 0") &&
                          Catch::Contains("CUDA_ERROR_INVALID_VALUE"));
  }
  CHECK_THROWS_WITH(a.wait(1, std::chrono::seconds(5)), Catch::Contains("poisoned") && Catch::Contains("cuStreamBatchMemOp"));
  CHECK_THROWS_WITH(b.wait(2, std::chrono::seconds(5)), Catch::Contains("poisoned"));
  // Not a sticky error: the device keeps working.
  Signal c = dev->alloc_signal(0);
  dev->compute_queue().signal(c, 3).submit(*dev);
  c.wait(3, std::chrono::seconds(5));
}

namespace {
// Runs `action` while `gate` holds a GPU stream; a watchdog opens the gate after 5 s so a blocked
// action ends. Returns how long the action took.
std::chrono::steady_clock::duration time_while_gated(Signal& gate, const std::function<void()>& action) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock lock(m);
    if (!cv.wait_for(lock, std::chrono::seconds(5), [&] { return done; })) gate.set(1);
  });
  const auto start = std::chrono::steady_clock::now();
  action();
  const auto took = std::chrono::steady_clock::now() - start;
  {
    std::lock_guard lock(m);
    done = true;
  }
  cv.notify_all();
  watchdog.join();
  return took;
}
}  // namespace

TEST_CASE("cuda fake: dropping programs and freeing memory while a GPU stream waits for the host does not wait for that stream", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  ScopedOverride no_cache("TINYDEV_LRU", "0");  // frees are real: cuMemFree and cuMemFreeHost run
  const std::size_t n = 256 + fresh_seed() % 768;
  const auto x = random_floats(n, fresh_seed());
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  const LaunchParams grid{.global = {4, 1, 1}, .local = {256, 1, 1}};
  const bool on_lane = GENERATE(false, true);
  INFO((on_lane ? "a stream's lane waits" : "the device's own queue waits"));
  std::shared_ptr<Stream> stream = on_lane ? dev->create_stream() : nullptr;
  Buffer kept(dev->name(), n, dtypes::float32), scratch(dev->name(), n, dtypes::float32);
  kept.allocate().copyin(std::span<const float>(x));
  scratch.allocate();
  // Holds a GPU stream on a fresh gate, runs `op` (which must reach the driver), then opens it.
  const auto check_not_held = [&](const char* what, const std::function<void()>& op) {
    INFO(what);
    Signal gate = dev->alloc_signal(0);
    if (stream) {
      stream->wait(Event(gate, 1, nullptr));
      stream->copyin(scratch, std::as_bytes(std::span(x)));  // queued behind the wait on the GPU
    } else
      submit_ordered(*dev, [&](auto& q) { q.wait(gate, 1); });
    const long syncs = fake_calls("implicit synchronization");
    CHECK(time_while_gated(gate, op) < std::chrono::seconds(2));
    gate.set(1);
    dev->synchronize();
    if (stream) stream->synchronize();
    CHECK(fake_calls("implicit synchronization") > syncs);  // the driver was asked to free it
    dev->free_signal(gate);
  };
  const auto used_buffer = [&](BufferOptions options) {
    auto b = std::make_shared<Buffer>(dev->name(), n, dtypes::float32, options);
    b->allocate().copyin(std::span<const float>(x));
    return b;
  };
  if (on_lane) {
    // (A free waits for the device's own queues, as the seed's allocators synchronize in _free:
    // only another stream's wait must not hold it.)
    auto device_memory = used_buffer({});
    check_not_held("device memory", [&] { device_memory.reset(); });
    auto pinned = used_buffer(BufferOptions{.host = true});
    check_not_held("pinned host memory", [&] { pinned.reset(); });
  }
  auto unused = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  check_not_held("a program never launched", [&] { unused.reset(); });
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const Allocation bufs[] = {kept.allocation(), kept.allocation(), kept.allocation()};
  (*add)(bufs, vals, LaunchParams{.global = grid.global, .local = grid.local, .wait = true});
  check_not_held("a program launched", [&] { add.reset(); });
  std::vector<float> back(n);
  kept.copyout(std::span<float>(back));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(back[i] == x[i] + x[i]);
}

TEST_CASE("cuda fake: memory freed while a stream waits on the GPU is given back once it passed - an allocation that needs it says so until then", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  // The fake GPU has 256 MiB (FAKE_CUDA_MEMORY unset): two of these do not fit at once.
  const std::size_t big = (150u << 20) + (fresh_seed() % 1024) * 4096;
  Allocator& allocator = dev->allocator();
  Allocation first = allocator.alloc(big, BufferOptions{.nolru = true});
  Signal gate = dev->alloc_signal(0);
  auto stream = dev->create_stream();
  const std::size_t n = 1024;
  const auto x = random_floats(n, fresh_seed());
  Buffer b(dev->name(), n, dtypes::float32);
  b.allocate();
  stream->wait(Event(gate, 1, nullptr));
  Event copied = stream->copyin(b, std::as_bytes(std::span(x)));
  const long syncs = fake_calls("implicit synchronization");
  // Deferred: the stream waits for the gate (a watchdog opens it should the free wait for it).
  CHECK(time_while_gated(gate, [&] { allocator.free(first, big, BufferOptions{.nolru = true}); }) <
        std::chrono::seconds(2));
  CHECK(fake_calls("implicit synchronization") == syncs);
  CHECK(dev->deferred_device_bytes() >= big);
  CHECK_THROWS_WITH(allocator.alloc(big, BufferOptions{.nolru = true}),
                    Catch::Contains(fmt::format("{} bytes freed earlier are not given back", dev->deferred_device_bytes())) &&
                        Catch::Contains("set the signals those streams wait for"));
  gate.set(1);
  copied.wait(std::chrono::seconds(10));
  // The refused allocation gives back what was deferred and tries again.
  Allocation second = allocator.alloc(big, BufferOptions{.nolru = true});
  CHECK(dev->deferred_device_bytes() == 0);
  CHECK(fake_calls("implicit synchronization") > syncs);
  const auto data = random_bytes(1 << 12, fresh_seed());
  allocator.copyin(second, data);
  std::vector<std::byte> back(data.size());
  allocator.copyout(back, second);
  CHECK(back == data);
  allocator.free(second, big, BufferOptions{.nolru = true});
  std::vector<float> got(n);
  b.copyout(std::span<float>(got));
  CHECK(got == x);
  dev->free_signal(gate);
}

TEST_CASE("cuda fake: a copyin after a copyout that timed out with chunks still queued waits for their slots - its bytes are not overwritten", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  auto* const hold = fake_function<void(int)>("fake_cuda_hold_copies_to_host");
  auto& allocator = dynamic_cast<HCQAllocator<cuda::CudaHCQDevice>&>(dev->allocator());
  const std::size_t slot = 64u << 10, slots = 3;
  const std::size_t old_slot = allocator.staging_batch_size(), old_slots = allocator.staging_batch_count();
  allocator.set_staging_shape(slot, slots);
  // Fresh random data: a source spanning every slot of the ring, and what the copyin brings.
  const std::size_t n = slots * slot / sizeof(float);
  const auto x = random_floats(n, fresh_seed()), y = random_floats(slot / sizeof(float), fresh_seed());
  Buffer source(dev->name(), n, dtypes::float32), dest(dev->name(), y.size(), dtypes::float32);
  source.allocate().copyin(std::span<const float>(x));
  dest.allocate();
  dev->synchronize();
  std::thread unhold;
  // Whatever fails below, the fake lets go, the thread ends and the ring gets its shape back.
  struct Cleanup {
    void (*hold)(int);
    std::thread& unhold;
    HCQAllocator<cuda::CudaHCQDevice>& allocator;
    std::size_t slot, slots;
    ~Cleanup() {
      if (unhold.joinable()) unhold.join();
      hold(0);
      try {
        allocator.set_staging_shape(slot, slots);
      } catch (const std::exception&) {
      }
    }
  } cleanup{hold, unhold, allocator, old_slot, old_slots};
  // The copy engine stalls: the copyout queues a chunk into every slot and times out waiting for
  // the first (TINYDEV_WAIT_TIMEOUT_MS, here 500 ms), the chunks still queued.
  hold(1);
  std::vector<float> back(n);
  {
    ScopedOverride timeout("TINYDEV_WAIT_TIMEOUT_MS", "500");
    CHECK_THROWS_AS(source.copyout(std::span<float>(back)), Timeout);
  }
  const long held = fake_calls("held copy to host");
  CHECK(held >= 1);
  // A copyin now must wait for the slot it takes: the stalled chunk queued into it would write
  // the source's bytes over the copyin's once the engine goes on. The fake lets go in 50 ms.
  const auto start = std::chrono::steady_clock::now();
  unhold = std::thread([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    hold(0);
  });
  dest.copyin(std::span<const float>(y));
  CHECK(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(40));
  unhold.join();
  dev->synchronize();
  std::vector<float> landed(y.size());
  dest.copyout(std::span<float>(landed));
  CHECK(landed == y);
  // The device goes on: the source round-trips whole.
  source.copyout(std::span<float>(back));
  CHECK(back == x);
}

TEST_CASE("cuda fake: a GPU wait submitted while a free is inside the driver reaches the GPU only after it - the free is not held", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  auto* const hold = fake_function<void(int)>("fake_cuda_hold_implicit_synchronization");
  Allocator& allocator = dev->allocator();
  const BufferOptions direct{.nolru = true};
  const std::size_t bytes = (1u << 20) + (fresh_seed() % 256) * 4096;
  Allocation memory = allocator.alloc(bytes, direct);
  const std::size_t n = 1024;
  const auto x = random_floats(n, fresh_seed());
  Buffer b(dev->name(), n, dtypes::float32);
  b.allocate();
  auto stream = dev->create_stream();
  Signal gate = dev->alloc_signal(0);
  dev->synchronize();  // no stream waits on the GPU: the free below is made at once
  const long held_before = fake_calls("held implicit synchronization");
  std::atomic<bool> submitting{false};
  std::thread freer, unhold;
  // Whatever fails below, the fake lets go and the threads end before the test does.
  struct Cleanup {
    void (*hold)(int);
    std::atomic<bool>& submitting;
    std::thread& freer;
    std::thread& unhold;
    ~Cleanup() {
      submitting.store(true);
      if (unhold.joinable()) unhold.join();
      hold(0);
      if (freer.joinable()) freer.join();
    }
  } cleanup{hold, submitting, freer, unhold};
  hold(1);
  // The free passes its check for GPU waits and stops in the driver, before it looks at the streams.
  freer = std::thread([&] { allocator.free(memory, bytes, direct); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (fake_calls("held implicit synchronization") == held_before && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(fake_calls("held implicit synchronization") > held_before);
  // The fake lets the free go 100 ms after the wait below is being submitted.
  unhold = std::thread([&] {
    while (!submitting.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    hold(0);
  });
  std::optional<Event> copied;
  // Were the wait issued now, the free would wait for the gate (until the watchdog opens it).
  const auto took = time_while_gated(gate, [&] {
    submitting.store(true);
    stream->wait(Event(gate, 1, nullptr));
    copied = stream->copyin(b, std::as_bytes(std::span(x)));
    freer.join();
  });
  CHECK(took < std::chrono::seconds(2));
  CHECK_FALSE(copied->query());  // the wait was issued, and holds the copy
  gate.set(1);
  copied->wait(std::chrono::seconds(10));
  std::vector<float> got(n);
  b.copyout(std::span<float>(got));
  CHECK(got == x);
  dev->free_signal(gate);
}

// Run by the test below in a process of its own, so its stream's lane has only the bounce memory
// its first copyin makes (64 KiB). Pinned memory freed while the stream waits on the GPU is
// deferred; once the wait passed, a refused cuMemHostAlloc (a stream's larger bounce memory, then
// a pinned buffer) gives the deferred memory back and succeeds on its second try.
TEST_CASE("cuda fake: pinned retry probe", "[.][probe][cuda-pinned-retry-probe]") {
  auto* dev = fake_hcq();
  REQUIRE(dev);
  auto* const limit_pinned = fake_function<void(std::size_t)>("fake_cuda_limit_pinned_bytes");
  auto* const pinned_bytes = fake_function<std::size_t()>("fake_cuda_pinned_bytes");
  Allocator& allocator = dev->allocator();
  const BufferOptions pinned{.host = true, .nolru = true};
  // Larger than the bounce the copyout below needs (at most 512 KiB).
  const std::size_t big = (1u << 20) + (fresh_seed() % 256) * 4096;
  Allocation first = allocator.alloc(big, pinned), second = allocator.alloc(big, pinned);
  const std::size_t n = 256;
  const std::size_t m = (96u << 10) + fresh_seed() % (24u << 10);  // floats: 384-480 KiB, past 64 KiB
  const auto x = random_floats(n, fresh_seed()), y = random_floats(m, fresh_seed());
  Buffer gated(dev->name(), n, dtypes::float32), source(dev->name(), m, dtypes::float32);
  gated.allocate();
  source.allocate().copyin(std::span<const float>(y));
  // Every copy of this stream is queued, through its bounce memory (none staged through a ring).
  auto stream = dev->create_stream(StreamOptions{.run_inline_when_idle = false});
  stream->wait(dev->record());  // its copyout of source reads what the default queue copied in
  const auto defer_while_gated = [&](Allocation& memory) {
    Signal gate = dev->alloc_signal(0);
    stream->wait(Event(gate, 1, nullptr));
    Event copied = stream->copyin(gated, std::as_bytes(std::span(x)));
    const std::size_t held = pinned_bytes();
    CHECK(time_while_gated(gate, [&] { allocator.free(memory, big, pinned); }) < std::chrono::seconds(2));
    CHECK(pinned_bytes() == held);  // deferred, not given back
    limit_pinned(held + 4096);      // until it is, nothing past a page fits
    gate.set(1);
    copied.wait(std::chrono::seconds(10));
    dev->free_signal(gate);
  };

  defer_while_gated(first);
  long tries = fake_calls("cuMemHostAlloc");
  std::vector<float> back(m);
  stream->copyout(std::as_writable_bytes(std::span(back)), source).wait(std::chrono::seconds(10));
  CHECK(fake_calls("cuMemHostAlloc") - tries == 2);  // refused, then made once `first` was given back
  CHECK(back == y);
  limit_pinned(0);

  defer_while_gated(second);
  tries = fake_calls("cuMemHostAlloc");
  const std::size_t before = pinned_bytes();
  Allocation third = allocator.alloc(big, pinned);
  CHECK(fake_calls("cuMemHostAlloc") - tries == 2);
  CHECK(pinned_bytes() == before);  // `second` went, `third` came
  limit_pinned(0);
  const auto data = random_bytes(1 << 12, fresh_seed());
  allocator.copyin(third, data);
  std::vector<std::byte> read(data.size());
  allocator.copyout(read, third);
  CHECK(read == data);
  allocator.free(third, big, pinned);
  std::vector<float> got(n);
  gated.copyout(std::span<float>(got));
  CHECK(got == x);
}

TEST_CASE("cuda fake: pinned memory a stream's wait deferred is given back when cuMemHostAlloc refuses - bounce memory and pinned buffers", "[cuda][fake]") {
  if (!fake_gpu()) return;
  CHECK(run_probe("[cuda-pinned-retry-probe]", {}) == 0);
}

TEST_CASE("cuda fake: a program dropped after a waited call on an idle device is unloaded at once", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  dev->synchronize();
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = 512 + fresh_seed() % 512;
  const auto x = random_floats(n, fresh_seed());
  Buffer b(dev->name(), n, dtypes::float32);
  b.allocate().copyin(std::span<const float>(x));
  const Allocation bufs[] = {b.allocation(), b.allocation(), b.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  CHECK((*add)(bufs, vals, LaunchParams{.global = {4, 1, 1}, .local = {256, 1, 1}, .wait = true}).has_value());
  CHECK(dev->idle());
  // The module goes now (cuModuleUnload, which the fake counts as an implicit synchronization),
  // not whenever later work moves the timeline past the value after the call's.
  const long unloads = fake_calls("cuModuleUnload");
  SECTION("by the thread dropping it") {
    add.reset();
    CHECK(fake_calls("cuModuleUnload") == unloads + 1);
  }
  SECTION("without waiting for a thread that holds the device's submit mutex") {
    // The retired program is reclaimed when it is found idle, possibly on a thread that holds a
    // submit mutex: ~CudaProgram must not take another's.
    std::atomic<bool> held{false}, release{false};
    std::thread holder([&] {
      std::lock_guard lock(dev->submit_mutex());
      held = true;
      for (int i = 0; i < 500 && !release; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    });
    while (!held) std::this_thread::yield();
    const auto start = std::chrono::steady_clock::now();
    add.reset();
    const auto took = std::chrono::steady_clock::now() - start;
    release = true;
    holder.join();
    CHECK(took < std::chrono::seconds(2));
    CHECK(fake_calls("cuModuleUnload") == unloads + 1);
  }
  std::vector<float> back(n);
  b.copyout(std::span<float>(back));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(back[i] == x[i] + x[i]);
}

TEST_CASE("cuda fake: a retired program whose work ran is unloaded later without waiting for a stream held by a signal", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  auto stream = dev->create_stream();
  const std::size_t n = 512 + fresh_seed() % 512;
  const auto x = random_floats(n, fresh_seed());
  Buffer b(dev->name(), n, dtypes::float32), sum(dev->name(), n, dtypes::float32), landed(dev->name(), n, dtypes::float32);
  b.allocate().copyin(std::span<const float>(x));
  sum.allocate();
  landed.allocate();
  // The direct calls read b and write sum; the stream's copyins, unordered with them, write landed.
  const Allocation bufs[] = {sum.allocation(), b.allocation(), b.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  // The first program's last handle goes while a direct call of it may run and a stream is held
  // by a gate: it retires until both are past.
  Signal first_gate = dev->alloc_signal(0);
  stream->wait(dev->record());
  stream->wait(Event(first_gate, 1, nullptr));
  stream->copyin(landed, std::as_bytes(std::span(x)));
  auto first = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  (*first)(bufs, vals, LaunchParams{.global = {4, 1, 1}, .local = {256, 1, 1}});
  first.reset();
  first_gate.set(1);
  stream->synchronize();
  std::vector<float> back(n);
  sum.copyout(std::span<float>(back));  // the device's timeline passes the direct call
  for (std::size_t i = 0; i < n; ++i) REQUIRE(back[i] == x[i] + x[i]);
  // Its work ran, but nothing reclaimed it yet. Now the stream is held again, and another
  // program's retirement reclaims the first: its unload must not wait for the held stream.
  Signal second_gate = dev->alloc_signal(0);
  const auto y = random_floats(n, fresh_seed());
  stream->wait(Event(second_gate, 1, nullptr));
  stream->copyin(landed, std::as_bytes(std::span(y)));
  auto second = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const long before = fake_calls("implicit synchronization");
  CHECK(time_while_gated(second_gate, [&] { second.reset(); }) < std::chrono::seconds(2));
  CHECK(fake_calls("implicit synchronization") == before);  // nothing unloaded under the gate
  second_gate.set(1);
  dev->synchronize();  // both modules go now
  CHECK(fake_calls("implicit synchronization") >= before + 2);
  landed.copyout(std::span<float>(back));
  CHECK(back == y);  // the copyin after the second gate landed
  dev->free_signal(first_gate);
  dev->free_signal(second_gate);
}

TEST_CASE("cuda fake: memory freed after a direct call that has not run is not handed to a stream until the call ran", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  ScopedOverride cache("TINYDEV_LRU", "1");
  auto add = dev->load_kernel("add", kernels::add_f32(SourceLanguage::CUDA));
  const std::size_t n = 2048 + fresh_seed() % 1024;
  const auto x = random_floats(n, fresh_seed());
  Buffer in(dev->name(), n, dtypes::float32);
  in.allocate().copyin(std::span<const float>(x));
  std::optional<Buffer> out(std::in_place, dev->name(), n, dtypes::float32);
  out->allocate();
  const std::uintptr_t freed_at = out->allocation().va_addr;
  // Hold the compute stream without a timeline value of its own, then a direct call writing
  // `out` behind it: no timeline value covers the call yet (Note [Lazy timeline signals]), and
  // the last one taken is reached already.
  dev->synchronize();
  Signal gate = dev->alloc_signal(0);
  dev->compute_queue().wait(gate, 1).submit(*dev);
  const Allocation bufs[] = {out->allocation(), in.allocation(), in.allocation()};
  const std::int32_t vals[] = {static_cast<std::int32_t>(n)};
  (*add)(bufs, vals, LaunchParams{.global = {static_cast<std::uint32_t>((n + 255) / 256), 1, 1}, .local = {256, 1, 1}});
  CHECK(dev->has_lazy_work());
  out.reset();  // into the cache, while the call will still write it
  // A stream's buffer of the same size must not be that memory: the stream is not ordered after
  // the call, so its writes would race with the kernel's.
  auto stream = dev->create_stream();
  Buffer reused(dev->name(), n, dtypes::float32);
  reused.allocate();
  CHECK(reused.allocation().va_addr != freed_at);
  const auto y = random_floats(n, fresh_seed());
  stream->copyin(reused, std::as_bytes(std::span(y)));
  gate.set(1);
  dev->synchronize();
  stream->synchronize();
  std::vector<float> back(n);
  reused.copyout(std::span<float>(back));
  CHECK(back == y);
  // Once the call ran, the memory comes back from the cache.
  Buffer again(dev->name(), n, dtypes::float32);
  again.allocate();
  CHECK(again.allocation().va_addr == freed_at);
  dev->free_signal(gate);
}

TEST_CASE("cuda fake: a staged copyin or copyout whose copy submission fails faults the device naming the driver's error and after recover() the ring and other buffers go on", "[cuda][fake]") {
  auto* dev = fake_hcq();
  if (!dev) return;
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const auto data = random_bytes((5u << 20) + 3, seed);  // three 2 MiB staging slots' worth
  const auto other_data = random_bytes(70000, seed + 1);
  Buffer other(dev->name(), other_data.size(), dtypes::uint8);
  other.allocate().copyin(other_data);
  Buffer b(dev->name(), data.size(), dtypes::uint8);
  b.allocate();
  std::vector<std::byte> back(data.size());
  // The second chunk's copy cannot be queued (the first is queued by then); twice each, so that
  // the ring turns over between failures.
  for (const bool in : {true, false, true, false}) {
    INFO((in ? "copyin" : "copyout"));
    {
      FakeEnv fail("FAKE_CUDA_FAIL", fmt::format("cuMemcpyAsync@{}=1", fake_calls("cuMemcpyAsync") + 2));
      const auto run = [&] {
        if (in) b.copyin(data);
        else b.copyout(back);
      };
      CHECK_THROWS_WITH(run(), Catch::Contains("cuMemcpyAsync") && Catch::Contains("CUDA_ERROR_INVALID_VALUE"));
    }
    // Faulted: every copy says so until recover(), which names what it cleared.
    CHECK_THROWS_AS(other.copyout(std::span(back).first(other_data.size())), DeviceFault);
    CHECK_THAT(dev->recover(std::chrono::seconds(10)), Catch::Contains("cuMemcpyAsync"));
    b.copyin(data);
    std::fill(back.begin(), back.end(), std::byte{0x5a});
    b.copyout(back);
    CHECK(back == data);
  }
  std::vector<std::byte> other_back(other_data.size());
  other.copyout(other_back);
  CHECK(other_back == other_data);
}
