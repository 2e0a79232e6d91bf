#include "support.hpp"

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
