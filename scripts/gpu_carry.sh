#!/usr/bin/env bash
# Fills .carry/ (git-ignored) with what the GPU machines lack and the GPU run needs:
# doctest's header, zlib's headers and library, and the Fashion-MNIST files. Run it here,
# then hand .carry to the device tool's `carry` and run scripts/gpu_run.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry/include/doctest .carry/lib .carry/fashion-mnist
cp /usr/include/doctest/doctest.h .carry/include/doctest/
cp /usr/include/zlib.h /usr/include/zconf.h .carry/include/
cp -L /usr/lib/x86_64-linux-gnu/libz.so .carry/lib/libz.so
cp /usr/share/datasets/fashion-mnist/*.gz .carry/fashion-mnist/
du -sh .carry
