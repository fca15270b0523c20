#!/usr/bin/env bash
# One call on a lent GPU machine (no apt there): build with nvcc, run the GPU test suite
# (compute-sanitizer cases included) and the GPU benchmarks, and keep every output under
# $OUT (or ./gpu-out). Needs .carry/ from scripts/gpu_carry.sh. Prints a short table last.
#
#   device run, carry [".carry"]:  bash scripts/gpu_run.sh [tests|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
bdir=${FERRY_GPU_BUILD:-build-gpu}
out=${OUT:-gpu-out}
mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }

export PATH=/usr/local/cuda/bin:$PATH
# zlib and doctest from .carry when the machine has none; Fashion-MNIST where the tests look.
if [ ! -f /usr/include/zlib.h ]; then
  export CPATH=$PWD/.carry/include${CPATH:+:$CPATH} LIBRARY_PATH=$PWD/.carry/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$PWD/.carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if [ -d .carry/fashion-mnist ] && [ ! -d /usr/share/datasets/fashion-mnist ]; then
  mkdir -p /usr/share/datasets && ln -s "$PWD/.carry/fashion-mnist" /usr/share/datasets/fashion-mnist
fi
export FERRY_FASHION_MNIST=/usr/share/datasets/fashion-mnist
meson=(meson)
command -v meson >/dev/null || meson=(python3 -m mesonbuild.mesonmain)

{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nvcc --version | tail -1
  git rev-parse --short HEAD 2>/dev/null || true
} > "$out/device.txt" 2>&1
cat "$out/device.txt"

log "configure and build ($bdir)"
if [ ! -f "$bdir"/build.ninja ]; then
  "${meson[@]}" setup "$bdir" -Dcuda=enabled -Dgpu_arch=90 -Dfuzzers=false > "$out/configure.log" 2>&1 ||
    { tail -40 "$out/configure.log"; exit 1; }
fi
ninja -C "$bdir" > "$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }

status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  log "GPU test suite"
  "${meson[@]}" test -C "$bdir" --suite gpu --print-errorlogs --num-processes 1 > "$out/test_gpu.log" 2>&1 || status=1
  grep -E "^ *[0-9]+/[0-9]+ " "$out/test_gpu.log" | tee -a "$out/summary.txt"
  log "CPU suite on this machine"
  "${meson[@]}" test -C "$bdir" --suite cpu --num-processes 4 > "$out/test_cpu.log" 2>&1 || status=1
  grep -E "^(Ok|Fail|Skipped|Timeout):" "$out/test_cpu.log" | tee -a "$out/summary.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  log "GPU benchmarks (scripts/bench.py: JSON under benchmarks/results, copied to \$OUT)"
  before=$(ls benchmarks/results/*.json 2>/dev/null | sort)
  python3 scripts/bench.py --build "$bdir" --no-build \
    --only distribute_gpu,collective_nccl,train_fed_gpu,train_fashion_mnist_gpu_vs_pytorch > "$out/bench.log" 2>&1 || status=1
  grep -E "^(pass|fail|skip)|ratio|h2d_|hidden_copy|busbw|time to" "$out/bench.log" | tail -20 | tee -a "$out/summary.txt"
  # At most 8 files come back: the new results go as one archive.
  comm -13 <(echo "$before") <(ls benchmarks/results/*.json | sort) | tar -czf "$out/results.tgz" -T - 2>/dev/null
  tar -czf "$out/figures.tgz" benchmarks/results/figures 2>/dev/null
fi
log "status $status"
exit $status
