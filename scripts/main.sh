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
# `ninja -t query`, not `-t targets | grep -q`: under pipefail, grep's early exit made
# ninja die of SIGPIPE and the test fail at random (46 of 300 runs).
if ninja -C "$build" -t query "$target" >/dev/null 2>&1; then
  ninja -C "$build" -j "$(bash scripts/jobs.sh)" "$target"
fi
if [ ! -x "$exe" ]; then
  # The trainer needs CLI11, and OpenBLAS and Thrust (the CUDA toolkit's, or Debian's) on
  # the host path, or CUDA: setup.sh installs all but CUDA, so this means the build left
  # it out.
  echo "main.sh: $exe was not built; see the 'ferry' summary printed by 'meson setup $build'" \
       "(openblas, CLI11, CCCL, cuda) and the build log; after installing what was missing," \
       "run 'meson setup --reconfigure $build'" >&2
  exit 1
fi
exec "$exe" "$@"
