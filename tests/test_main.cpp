// The test runner: Catch2's, plus skips that reach ctest (Catch2 v2 has no SKIP) and the
// conformance suite's --backend option.
//
// Note [Skips reach ctest]
// A test (or one backend's run of it) that cannot run here calls testing::skip(reason), which
// prints "SKIPPED: <reason>". A run in which every test case that ran only skipped, and none
// failed, exits with kSkipExitCode, which CMake registers as the tests' SKIP_RETURN_CODE: ctest
// lists the test as skipped in its summary instead of counting it as passed. ctest runs one test
// case per process, so this is exact there; a whole-binary run exits 0 when anything ran.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "support.hpp"

namespace tinydev::testing {

namespace {
struct SkipState {
  std::string current_test;
  bool current_skipped = false, current_ran = false;
  int cases_ran = 0, cases_skipped = 0;
  int skips = 0;  // skip() calls in the whole run
  std::string backend;  // --backend
};
SkipState& state() {
  static SkipState s;
  return s;
}
}  // namespace

void skip(const std::string& reason) {
  std::printf("SKIPPED: %s: %s\n", state().current_test.c_str(), reason.c_str());
  std::fflush(stdout);
  state().current_skipped = true;
  ++state().skips;
}
int skip_count() { return state().skips; }
void note_ran() { state().current_ran = true; }
const std::string& current_test_name() { return state().current_test; }
const std::string& selected_backend() { return state().backend; }

struct SkipListener : Catch::TestEventListenerBase {
  using TestEventListenerBase::TestEventListenerBase;
  void testCaseStarting(const Catch::TestCaseInfo& info) override {
    state().current_test = info.name;
    state().current_skipped = state().current_ran = false;
  }
  void testCaseEnded(const Catch::TestCaseStats&) override {
    // A test that skipped and ran nothing else counts as skipped; partial skips count as run.
    if (state().current_skipped && !state().current_ran) ++state().cases_skipped;
    else ++state().cases_ran;
  }
};

}  // namespace tinydev::testing

using tinydev::testing::SkipListener;
CATCH_REGISTER_LISTENER(SkipListener)

int main(int argc, char* argv[]) {
  Catch::Session session;
  using namespace Catch::clara;
  std::vector<std::string> environment;
  auto cli = session.cli() |
             Opt(tinydev::testing::state().backend, "TYPE")["--backend"](
                 "run the conformance suite on this backend only (LLVM, CLANG, NULL, ...)") |
             Opt(environment, "NAME=VALUE")["--env"](
                 "set this environment variable before any test runs (ctest properties cannot hold two: their "
                 "';' splits the list)");
  session.cli(cli);
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  for (const std::string& entry : environment) {
    const std::size_t eq = entry.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::fprintf(stderr, "--env %s: expected NAME=VALUE\n", entry.c_str());
      return 2;
    }
    ::setenv(entry.substr(0, eq).c_str(), entry.substr(eq + 1).c_str(), 1);  // single-threaded still
  }
  // Catch returns the number of failed assertions: any number (4 included) is a failure, never a skip.
  if (session.run() != 0) return 1;
  const auto& s = tinydev::testing::state();
  if (s.cases_ran == 0 && s.cases_skipped > 0) return tinydev::testing::kSkipExitCode;
  return 0;
}

// ctest splits test names at ';' (a CMake list) and Catch's command line at ',', so a name with
// either runs as a test that matches nothing. Both binaries link this file, so this checks both.
TEST_CASE("tests: no test name contains a comma or a semicolon", "[meta]") {
  for (const Catch::TestCase& test : Catch::getRegistryHub().getTestCaseRegistry().getAllTests()) {
    INFO(test.name);
    CHECK(test.name.find_first_of(",;") == std::string::npos);
  }
}
