#!/usr/bin/env bash
# ferry's main job: set up, build, and train the MLP on Fashion-MNIST through the whole
# pipeline (from_files -> shuffle -> map -> batch -> prefetch -> distribute), on every GPU
# when there are any, on CPU replicas otherwise. Extra arguments go to the program.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
build=${FERRY_BUILD:-build}
exe=$build/examples/04_train_fashion_mnist/train_fashion_mnist
if [ ! -x "$exe" ]; then
  # The trainer needs a BLAS (OpenBLAS) and Thrust (CCCL) on the host path, or CUDA:
  # setup.sh installs the first two, so this means the build left it out.
  echo "main.sh: $exe was not built; see the 'ferry' summary printed by 'meson setup $build'" \
       "(openblas and cuda) and the build log" >&2
  exit 1
fi
exec "$exe" "$@"
