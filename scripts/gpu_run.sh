#!/usr/bin/env bash
# On a lent GPU machine (no apt there): build with nvcc, run the GPU test suite
# (compute-sanitizer cases included) and the GPU benchmarks, and keep every output under
# $OUT (or ./gpu-out). Needs .carry/ from scripts/gpu_carry.sh. Prints a short table last.
# A device call is limited to 600 s: run `tests` and `bench` as two calls on the warm
# machine (the build directory stays); `cpu` runs the CPU suite there too.
#
#   device run, carry [".carry"]:  bash scripts/gpu_run.sh tests|bench|cpu|all
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
# OpenBLAS from .carry (the image has none outside numpy, whose copy is renamed).
if [ -f .carry/openblas.tar.xz ] && ! ldconfig -p 2>/dev/null | grep -q libopenblas; then
  mkdir -p .carry/openblas && tar -C .carry/openblas -xJf .carry/openblas.tar.xz
  export CPATH=$PWD/.carry/openblas/include${CPATH:+:$CPATH}
  export LIBRARY_PATH=$PWD/.carry/openblas/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$PWD/.carry/openblas/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# NCCL: the toolkit's, or the pip package's (nvidia-nccl-cu13) with a libnccl.so link.
if [ ! -e /usr/local/cuda/lib64/libnccl.so ]; then
  nd=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null || true)
  if [ -n "$nd" ] && [ -f "$nd/include/nccl.h" ]; then
    mkdir -p .carry/nccl-lib && ln -sf "$nd"/lib/libnccl.so.* .carry/nccl-lib/ &&
      ln -sf "$(ls "$nd"/lib/libnccl.so.* | head -1)" .carry/nccl-lib/libnccl.so
    export CPATH=$nd/include${CPATH:+:$CPATH}
    export LIBRARY_PATH=$PWD/.carry/nccl-lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$PWD/.carry/nccl-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
fi
meson=(meson)
command -v meson >/dev/null || meson=(python3 -m mesonbuild.mesonmain)

{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nvcc --version | tail -1
  git rev-parse --short HEAD 2>/dev/null || true
  ls /usr/local/cuda/lib64/ 2>/dev/null | grep -E "nccl|cublas" | head -4; echo "LIBRARY_PATH=${LIBRARY_PATH:-}"
} > "$out/device.txt" 2>&1
cat "$out/device.txt"

log "configure and build ($bdir)"
if [ ! -f "$bdir"/build.ninja ]; then
  bash scripts/meson_setup.sh "$bdir" -Dcuda=enabled -Dgpu_arch=90 -Dfuzzers=false > "$out/configure.log" 2>&1 ||
    { tail -40 "$out/configure.log"; exit 1; }
fi
ninja -C "$bdir" > "$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }

status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  log "GPU test suite"
  "${meson[@]}" test -C "$bdir" --list --suite gpu > "$out/gpu_tests.txt" 2>&1
  for t in distribute_gpu train_gpu collective_nccl; do  # a GPU test the build left out is a failure here
    grep -q "$t" "$out/gpu_tests.txt" || { log "MISSING from this build: $t"; status=1; }
  done
  "${meson[@]}" test -C "$bdir" --suite gpu --print-errorlogs --num-processes 1 > "$out/test_gpu.log" 2>&1 || status=1
  grep -E "^ *[0-9]+/[0-9]+ " "$out/test_gpu.log" | tee -a "$out/summary.txt"
  # A GPU test that skips on a GPU machine is a failure, except a compute-sanitizer run
  # where the machine refuses the sanitizer (gVisor): said here, and in the note.
  if grep -E "^ *[0-9]+/[0-9]+ .* SKIP" "$out/test_gpu.log" | grep -vqE "_(memcheck|racecheck) "; then
    log "some GPU tests skipped on a GPU machine"; status=1
  fi
  if grep -qE "^ *[0-9]+/[0-9]+ .*_(memcheck|racecheck) .* SKIP" "$out/test_gpu.log"; then
    log "compute-sanitizer refused here: $(grep -m1 "SKIP: compute-sanitizer" "$out/test_gpu.log")"
  fi
fi
if [ "$what" = cpu ] || [ "$what" = all ]; then
  log "CPU suite on this machine"
  "${meson[@]}" test -C "$bdir" --suite cpu --num-processes 4 > "$out/test_cpu.log" 2>&1 || status=1
  grep -E "^(Ok|Fail|Skipped|Timeout):" "$out/test_cpu.log" | tee -a "$out/summary.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  log "GPU benchmarks (scripts/bench.py: JSON under benchmarks/results, copied to \$OUT)"
  before=$(ls benchmarks/results/*.json 2>/dev/null | sort)
  # One benchmark at a time, the archive rewritten after each: a call cut off at its time
  # limit still brings back what finished. At most 8 files come back: the results go as
  # one archive.
  for b in distribute_gpu collective_nccl train_fed_gpu train_fashion_mnist_gpu_vs_pytorch; do
    python3 scripts/bench.py --build "$bdir" --no-build --only "$b" >> "$out/bench.log" 2>&1 || status=1
    comm -13 <(echo "$before") <(ls benchmarks/results/*.json | sort) | tar -czf "$out/results.tgz" -T - 2>/dev/null
  done
  grep -E "^(pass|fail|skip)|ratio|h2d_|hidden_copy|busbw|time to" "$out/bench.log" | tail -20 | tee -a "$out/summary.txt"
  tar -czf "$out/figures.tgz" benchmarks/results/figures 2>/dev/null
fi
# At most 8 files come back from a device call: the logs go as one archive.
(cd "$out" && ls *.log gpu_tests.txt 2>/dev/null | tar -czf logs.tgz -T - && ls *.log gpu_tests.txt 2>/dev/null | xargs rm -f)
log "status $status"
exit $status
