#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for ferry and builds it: installs the Debian packages
# ferry needs (when missing), puts nvcc on PATH when the CUDA toolkit is there, configures
# and builds ./build (or $FERRY_BUILD). Safe to run again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(meson ninja-build pkg-config g++ clang libclang-rt-14-dev doctest-dev zlib1g-dev libisal-dev
          libopenblas-dev libopenmpi-dev openmpi-bin dataset-fashion-mnist python3-torch
          python3-numpy python3-matplotlib cmake ccache)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
build=${FERRY_BUILD:-build}
if [ ! -f "$build/build.ninja" ]; then
  bash scripts/meson_setup.sh "$build" -Dcuda=auto
fi
ninja -C "$build"
