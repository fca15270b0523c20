#!/usr/bin/env bash
# Fills .carry/ (git-ignored) with what the GPU machines lack and the GPU run needs:
# doctest's header, zlib's headers and library, OpenBLAS (the host backend the GPU trainer
# test compares against; xz-packed to stay inside the 64 MiB a call carries) and the
# Fashion-MNIST files. Run it here, then hand .carry to the device tool's `carry` and run
# scripts/gpu_run.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry/include/doctest .carry/lib .carry/fashion-mnist
cp /usr/include/doctest/doctest.h .carry/include/doctest/
cp /usr/include/zlib.h /usr/include/zconf.h .carry/include/
cp -L /usr/lib/x86_64-linux-gnu/libz.so .carry/lib/libz.so
cp /usr/share/datasets/fashion-mnist/*.gz .carry/fashion-mnist/
ob=$(mktemp -d)
mkdir -p "$ob/lib" "$ob/include"
cp -L /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/lib/x86_64-linux-gnu/libgfortran.so.5 \
  /usr/lib/x86_64-linux-gnu/libquadmath.so.0 "$ob/lib/"
ln -s libopenblas.so.0 "$ob/lib/libopenblas.so"
cp /usr/include/x86_64-linux-gnu/openblas-pthread/{cblas.h,openblas_config.h} "$ob/include/"
tar -C "$ob" -cJf .carry/openblas.tar.xz lib include
rm -rf "$ob"
du -sh .carry
