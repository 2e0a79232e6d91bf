#include "support.hpp"

#include <clocale>
#include <cctype>
#include <cstdlib>

#include <locale.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

using tinydev::canonicalize;
using tinydev::InvalidArgument;

TEST_CASE("canonicalize: the contract's cases", "[registry]") {
  CHECK(canonicalize("cuda") == "CUDA");
  CHECK(canonicalize("cuda:0") == "CUDA");
  CHECK(canonicalize("cuda:1") == "CUDA:1");
  CHECK(canonicalize("CUDA:10") == "CUDA:10");
  CHECK(canonicalize("disk:/dev/shm/x") == "DISK:/dev/shm/x");
  CHECK(canonicalize("disk:000.txt") == "DISK:000.txt");
  CHECK(canonicalize("gpu:00") == "GPU:00");
}

TEST_CASE("canonicalize: more cases", "[registry]") {
  CHECK(canonicalize("llvm") == "LLVM");
  CHECK(canonicalize("Clang") == "CLANG");
  CHECK(canonicalize("LLVM:0") == "LLVM");
  CHECK(canonicalize("cuda:2") == "CUDA:2");
  CHECK(canonicalize("cuda:20") == "CUDA:20");
  CHECK(canonicalize("disk:/tmp/Mixed:Case") == "DISK:/tmp/Mixed:Case");
  CHECK(canonicalize("disk:/tmp/a:0") == "DISK:/tmp/a");  // one trailing ":0" goes
  CHECK(canonicalize("disk:/tmp/a:0:0") == "DISK:/tmp/a");  // every trailing ":0" (Note [Trailing :0])
  CHECK(canonicalize("npy:x") == "NPY:x");
  CHECK(canonicalize("my_dev2:3") == "MY_DEV2:3");
  CHECK(canonicalize(canonicalize("cuda:1")) == "CUDA:1");  // idempotent
}

TEST_CASE("canonicalize: malformed names are InvalidArgument", "[registry]") {
  CHECK_THROWS_AS(canonicalize(""), InvalidArgument);
  CHECK_THROWS_AS(canonicalize(":1"), InvalidArgument);
  CHECK_THROWS_AS(canonicalize("cuda:"), InvalidArgument);
  CHECK_THROWS_AS(canonicalize("cu da"), InvalidArgument);
  CHECK_THROWS_AS(canonicalize("1cuda"), InvalidArgument);
  CHECK_THROWS_AS(canonicalize("cu-da:1"), InvalidArgument);
  CHECK_THROWS_WITH(canonicalize("cuda:"), Catch::Contains("nothing after ':'"));
  CHECK_THROWS_WITH(canonicalize(""), Catch::Contains("empty device name"));
}

// Note [ASCII device types]: what a name means does not follow the thread's locale. The two
// 8-bit locales are compiled into a temporary folder with localedef (LOCPATH), as few machines
// have them installed; the test skips, saying why, where localedef or its sources are missing.
TEST_CASE("canonicalize: a name means the same under Turkish and Latin-1 locales", "[registry]") {
  tinydev::testing::TempDir dir;
  for (const auto& [source, charmap] : {std::pair{"tr_TR", "ISO-8859-9"}, std::pair{"de_DE", "ISO-8859-1"}}) {
    const std::string name = std::string(source) + "." + charmap;
    const std::string command = std::string("localedef -i ") + source + " -f " + charmap + " " +
                                (dir.path / name).string() + " >/dev/null 2>&1";
    if (std::system(command.c_str()) != 0) {
      tinydev::testing::skip("localedef could not compile " + name + " (no localedef, or no locale sources in /usr/share/i18n)");
      return;
    }
  }
  REQUIRE(::setenv("LOCPATH", dir.path.c_str(), 1) == 0);
  locale_t turkish{}, latin1{};
  {
#if defined(__SANITIZE_ADDRESS__)
    // glibc 2.36's newlocale keeps the list it splits LOCPATH into (41 bytes a call, never freed):
    // its leak, not tinydev's, which LeakSanitizer would report at exit.
    __lsan::ScopedDisabler glibc_keeps_locpath;
#endif
    turkish = ::newlocale(LC_ALL_MASK, "tr_TR.ISO-8859-9", locale_t{});
    latin1 = ::newlocale(LC_ALL_MASK, "de_DE.ISO-8859-1", locale_t{});
  }
  ::unsetenv("LOCPATH");
  REQUIRE(turkish != locale_t{});
  REQUIRE(latin1 != locale_t{});
  struct Restore {
    locale_t turkish, latin1;
    ~Restore() {
      ::uselocale(LC_GLOBAL_LOCALE);
      ::freelocale(turkish);
      ::freelocale(latin1);
    }
  } restore{turkish, latin1};

  ::uselocale(turkish);
  REQUIRE(std::toupper('i') != 'I');  // the locale is in force: its dotted capital I
  CHECK(canonicalize("disk:/tmp/weights") == "DISK:/tmp/weights");
  CHECK(canonicalize("nil:1") == "NIL:1");
  CHECK(canonicalize("Disk:/x") == canonicalize("DISK:/x"));

  ::uselocale(latin1);
  REQUIRE(std::isalpha(0xE9));  // the locale is in force: e-acute is a letter
  CHECK_THROWS_AS(canonicalize("cud\xE9"), InvalidArgument);
  CHECK_THROWS_AS(canonicalize("\xE9:1"), InvalidArgument);
  CHECK(canonicalize("llvm") == "LLVM");
}
