#!/usr/bin/env bash
# Installs the Debian packages flashback needs to build, test and benchmark, if any is missing.
# Everything comes from apt-get; nothing else is downloaded. Safe to run again.
set -euo pipefail

packages=(
  build-essential cmake               # compiler, CMake/CTest
  libgtest-dev libgmock-dev           # GoogleTest (tests)
  libbenchmark-dev libopenblas-dev    # Google Benchmark, the materialized BLAS baseline (bench/)
  libcli11-dev nlohmann-json3-dev     # the flashback program's flags and safetensors headers
  clang libclang-rt-14-dev libomp-dev # libFuzzer, sanitizer runtimes, OpenMP for clang (fuzz/)
  valgrind time                       # memcheck run, /usr/bin/time -v for peak memory
  pkg-config                          # the package test's pkg-config consumer
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
