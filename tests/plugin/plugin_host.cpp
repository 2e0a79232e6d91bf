// The plugin test's host: loads tinydev_plugin_a and tinydev_plugin_b, two shared libraries that
// each link tinydev statically, runs kernels through both (from two threads at once, too), and
// exits through exit(), which runs both copies' exit handlers and static destructors.
//
//   plugin_host linked              the plugins are linked to this program (plugin_host_linked)
//   plugin_host global A.so B.so    dlopen(RTLD_NOW | RTLD_GLOBAL)
//   plugin_host local A.so B.so     dlopen(RTLD_NOW | RTLD_LOCAL)
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

using RunFn = int (*)(int, char*, std::size_t);
using RegistryFn = const void* (*)();

#ifdef PLUGIN_HOST_LINKED
extern "C" int plugin_a_run(int, char*, std::size_t);
extern "C" const void* plugin_a_registry();
extern "C" int plugin_b_run(int, char*, std::size_t);
extern "C" const void* plugin_b_registry();
#endif

namespace {

struct Plugin {
  RunFn run = nullptr;
  RegistryFn registry = nullptr;
};

Plugin open_plugin(const char* path, int mode) {
  void* handle = dlopen(path, mode);
  if (!handle) {
    std::fprintf(stderr, "plugin_host: dlopen %s: %s\n", path, dlerror());
    std::exit(3);
  }
  Plugin p;
  p.run = reinterpret_cast<RunFn>(dlsym(handle, "tinydev_plugin_run"));
  p.registry = reinterpret_cast<RegistryFn>(dlsym(handle, "tinydev_plugin_registry"));
  if (!p.run || !p.registry) {
    std::fprintf(stderr, "plugin_host: %s lacks the plugin entry points\n", path);
    std::exit(3);
  }
  return p;
}

int run(const Plugin& p, int rounds) {
  char report[512] = {};
  int wrong = p.run(rounds, report, sizeof report);
  std::printf("  %s -> %d wrong\n", report, wrong);
  return wrong < 0 ? 1000000 : wrong;  // an exception counts as a failure, never as a negative
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: plugin_host linked | global A.so B.so | local A.so B.so\n");
    return 2;
  }
  const std::string how = argv[1];
  Plugin a, b;
#ifdef PLUGIN_HOST_LINKED
  if (how != "linked") return 2;
  a = {&plugin_a_run, &plugin_a_registry};
  b = {&plugin_b_run, &plugin_b_registry};
#else
  if (argc != 4 || (how != "global" && how != "local")) return 2;
  const int mode = RTLD_NOW | (how == "global" ? RTLD_GLOBAL : RTLD_LOCAL);
  a = open_plugin(argv[2], mode);
  b = open_plugin(argv[3], mode);
#endif
  std::printf("plugin_host (%s): registries %p and %p\n", how.c_str(), a.registry(), b.registry());
  if (a.registry() == b.registry()) {
    std::fprintf(stderr, "plugin_host: the two plugins share one device registry\n");
    return 1;
  }
  int wrong = run(a, 2) + run(b, 2);
  // Both copies at once, from two threads: their devices and worker threads are separate.
  int wa = 0, wb = 0;
  std::thread ta([&] { wa = run(a, 3); });
  std::thread tb([&] { wb = run(b, 3); });
  ta.join();
  tb.join();
  wrong += wa + wb;
  if (wrong != 0) {
    std::fprintf(stderr, "plugin_host: %d wrong results or errors\n", wrong);
    return 1;
  }
  std::printf("plugin_host (%s): both plugins ran their kernels; exiting\n", how.c_str());
  std::fflush(stdout);
  std::exit(0);  // exit handlers and static destructors of both copies run here
}
