#!/usr/bin/env bash
# ferry's main job: set up, build, and train the MLP on Fashion-MNIST through the whole
# pipeline (from_files -> shuffle -> map -> batch -> prefetch -> distribute), on every GPU
# when there are any, on CPU replicas otherwise. Extra arguments go to the program.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
build=${FERRY_BUILD:-build}
exe=$build/examples/04_train_fashion_mnist/train_fashion_mnist
if [ -x "$exe" ]; then
  exec "$exe" "$@"
fi
# Until the trainer is built, the best example there is.
exec "$build/examples/01_pipeline/01_pipeline" "$@"
