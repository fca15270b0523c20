#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for ferry and builds it: installs the Debian packages
# ferry needs (when missing), puts nvcc on PATH when the CUDA toolkit is there, configures
# and builds ./build (or $FERRY_BUILD). Safe to run again: it only does what is missing.
#   bash scripts/setup.sh                    packages, configure, build everything
#   bash scripts/setup.sh --configure-only   packages and configure (main.sh then builds
#                                            one program, test.sh times the build itself)
#   bash scripts/setup.sh --packages-only    the Debian packages alone
#   bash scripts/setup.sh --images           the packages and the image data (no build):
#                                            scripts/make_image_corpus.py writes data/images/
#                                            (photographs and Fashion-MNIST as WebDataset tar
#                                            shards, ~450 MB, about a minute on 2 cores) for the
#                                            images benchmark and the image example
# FERRY_IMAGES=1 makes the image data in any mode too (after the packages; kept when there).
# ninja runs $(bash scripts/jobs.sh) jobs (cores and memory; FERRY_JOBS overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
case $mode in
  all | --configure-only | --packages-only | --images) ;;
  *) echo "usage: $0 [--configure-only | --packages-only | --images]" >&2; exit 2 ;;
esac

packages=(meson ninja-build pkg-config g++ clang libclang-rt-14-dev doctest-dev zlib1g-dev libisal-dev
          libopenblas-dev libopenmpi-dev openmpi-bin dataset-fashion-mnist python3-torch
          python3-numpy python3-matplotlib cmake ccache libcli11-dev doxygen
          wamerican wfrench wngerman wspanish witalian wportuguese wdutch  # variable-length data: word lists
          libjpeg62-turbo-dev mate-backgrounds  # images: libjpeg-turbo; photographs (bench_jpeg_crop, image data)
          libspng-dev python3-pil python3-torchvision  # images: libspng (PNG); Pillow (image data); torchvision baseline
          locales)  # tests: localedef builds a comma-decimal locale (trace JSON under any LC_NUMERIC)
# Thrust for the trainer's host backend: the CUDA toolkit's CCCL, or Debian's without one.
[ -d /usr/local/cuda/include/cccl ] || packages+=(libthrust-dev)
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
if [ "$mode" = --images ] || [ "${FERRY_IMAGES:-0}" = 1 ]; then
  /usr/bin/python3 scripts/make_image_corpus.py
fi
case $mode in --packages-only | --images) exit 0 ;; esac

[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
build=${FERRY_BUILD:-build}
if [ ! -f "$build/build.ninja" ]; then
  bash scripts/meson_setup.sh "$build" -Dcuda=auto
fi
[ "$mode" = --configure-only ] && exit 0
ninja -C "$build" -j "$(bash scripts/jobs.sh)"
