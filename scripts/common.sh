# Shared by scripts/demo and scripts/test: the Debian packages tinydev needs, installed when
# missing (as root), or the exact apt-get line to run (otherwise). Sourced, not run.
set -euo pipefail

TINYDEV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TINYDEV_PACKAGES=(
  cmake ninja-build g++ pkg-config ccache
  llvm-19-dev libzstd-dev clang-19 libclang-rt-19-dev
  libfmt-dev libxxhash-dev catch2 nlohmann-json3-dev liburing-dev libfuse3-dev locales
)

tinydev_ensure_packages() {
  local missing=()
  for pkg in "${TINYDEV_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$pkg")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local line="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "tinydev needs these Debian packages: ${missing[*]}" >&2
    echo "run as root:  $line" >&2
    exit 1
  fi
  echo "==> installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# ccache keeps rebuilds of the two presets cheap; use it when it is there.
tinydev_cmake_launcher() {
  if command -v ccache >/dev/null 2>&1; then
    echo "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache"
  fi
}

tinydev_jobs() { nproc 2>/dev/null || echo 2; }
