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
# --bin: the GPU programs built here (./build, or $FERRY_BUILD), in the build tree's layout,
# and the libraries they link that the GPU image lacks, for scripts/gpu_check.sh.
if [ "${1:-}" = --bin ]; then
  build=${FERRY_BUILD:-build}
  rm -rf .carry/build
  for t in tests/cuda/test_distribute_gpu tests/collective/test_nccl_communicator tests/train/test_train_gpu \
           benchmarks/distribute/bench_distribute_gpu benchmarks/distribute/bench_distribute_varlen_gpu \
           tests/cuda/test_augment_gpu benchmarks/image/bench_augment_gpu \
           tests/cuda/test_cache_on_device_gpu benchmarks/distribute/bench_cache_on_device_gpu \
           benchmarks/collective/bench_nccl_allreduce \
           benchmarks/train/bench_train_fed_gpu benchmarks/train/bench_train_fashion_mnist \
           benchmarks/train/bench_fmnist_pipeline \
           examples/04_train_fashion_mnist/train_fashion_mnist examples/12_image_classification/12_image_classification; do
    [ -x "$build/$t" ] || { echo "gpu_carry.sh: $build/$t is not built" >&2; exit 1; }
    mkdir -p ".carry/build/$(dirname "$t")" && cp "$build/$t" ".carry/build/$t"
  done
  cp -L /lib/x86_64-linux-gnu/libz.so.1 /usr/local/cuda/lib64/libcudart.so.13 .carry/lib/
  for l in libisal.so.2 libjpeg.so.62 libspng.so.0; do  # optional: where the build used them
    if [ -e /lib/x86_64-linux-gnu/$l ]; then cp -L /lib/x86_64-linux-gnu/$l .carry/lib/; fi
  done
fi
du -sh .carry
