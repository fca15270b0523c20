#!/usr/bin/env bash
# ferry's main job: set up, build, and train the MLP on Fashion-MNIST through the whole
# pipeline (from_files -> shuffle -> map -> batch -> prefetch -> distribute), on every GPU
# when there are any, on CPU replicas otherwise. Extra arguments go to the program.
# It builds that one program (ninja's target), not the tests and benchmarks: on a fresh
# 2-core machine with the packages installed and ccache off, its first epoch line comes
# about 42 s after the start (README.md, measured; docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --configure-only
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
build=${FERRY_BUILD:-build}
target=examples/04_train_fashion_mnist/train_fashion_mnist
exe=$build/$target
if ninja -C "$build" -t targets all 2>/dev/null | grep -q "^$target:"; then
  ninja -C "$build" -j "$(bash scripts/jobs.sh)" "$target"
fi
if [ ! -x "$exe" ]; then
  # The trainer needs a BLAS (OpenBLAS) and Thrust (CCCL) on the host path, or CUDA:
  # setup.sh installs the first two, so this means the build left it out.
  echo "main.sh: $exe was not built; see the 'ferry' summary printed by 'meson setup $build'" \
       "(openblas and cuda) and the build log" >&2
  exit 1
fi
exec "$exe" "$@"
