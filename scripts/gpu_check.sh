#!/usr/bin/env bash
# On a lent GPU machine: the GPU suite, the GPU benchmarks and the main job, from binaries
# built on the development machine (`scripts/gpu_carry.sh --bin` puts them, with the
# libraries the GPU image lacks, under .carry/), so the lease's minutes go to running, not
# to building. Each step has its own time limit and the whole run a deadline
# (FERRY_GPU_DEADLINE seconds, default 380): a hang costs one step, not the call. Logs and
# the benchmark results (bench.py's JSON) come back under $OUT; a short table is printed last.
#
#   device run, carry [".carry"]:  bash scripts/gpu_check.sh [step ...]
#   steps: tests example example_nographs bench_distribute bench_varlen bench_augment bench_cache bench_fed bench_fed_nographs bench_pipeline bench_nccl
#          main main_nographs bench_torch memcheck racecheck train_memcheck augment_memcheck cache_memcheck
#          example12 images12 main_cache bench_cache_big
#   (the trainer runs CUDA graphs by default; the *_nographs steps pass --graphs 0)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-$root/gpu-out}
mkdir -p "$out/logs"
start_marker=$(mktemp) # results newer than this are this run's
B=$root/.carry/build
deadline=${FERRY_GPU_DEADLINE:-380}
steps=("$@")
((${#steps[@]})) || steps=(tests example example_nographs bench_distribute bench_varlen bench_augment bench_cache bench_fed bench_fed_nographs bench_pipeline bench_nccl
                            main main_nographs bench_torch memcheck racecheck train_memcheck augment_memcheck cache_memcheck
                            example12 images12 main_cache bench_cache_big)
summary=$out/summary.txt
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }

# Libraries: the device's CUDA first, then what travelled (zlib, ISA-L, OpenBLAS, gfortran).
ob=$(mktemp -d) && tar -C "$ob" -xJf .carry/openblas.tar.xz  # outside the tree: it must not travel back
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$root/.carry/lib:$ob/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=/usr/local/cuda/bin:$PATH
# NCCL or cuBLAS missing from the toolkit: the pip packages' copies (nvidia-nccl-cu13, ...).
missing=$(for f in "$B"/*/*/* "$B"/*/*; do [ -f "$f" ] && [ -x "$f" ] && ldd "$f" 2>/dev/null; done | awk '/not found/{print $1}' | sort -u)
if [ -n "$missing" ]; then
  nv=$(python3 -c "import nvidia, os; print(list(nvidia.__path__)[0])" 2>/dev/null)
  for lib in $missing; do
    d=$(find ${nv:+"$nv"} /usr/local/cuda*/ /usr/lib -name "$lib" 2>/dev/null | head -1)
    [ -n "$d" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$d")
  done
  export LD_LIBRARY_PATH
fi
# The data where the programs look by default.
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  mkdir -p /usr/share/datasets && ln -s "$root/.carry/fashion-mnist" /usr/share/datasets/fashion-mnist
fi
export FERRY_FASHION_MNIST=/usr/share/datasets/fashion-mnist FERRY_TEST_DATA=$root/tests/data

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max,clocks.max.sm --format=csv,noheader
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -1)"
  echo "python3: $(command -v python3) torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1 | tail -1)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) x $(nproc)"
  echo "kernel: $(uname -r)"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  for f in "$B"/tests/cuda/test_distribute_gpu "$B"/benchmarks/train/bench_train_fed_gpu; do ldd "$f" | grep -E "cuda|nccl|cublas|not found"; done
} > "$out/device.txt" 2>&1
cat "$out/device.txt"

status=0
# step NAME LIMIT CMD...: runs CMD with its log under $OUT/logs, unless the deadline is near.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS))
  if ((left < 20)); then say "$(printf '%-26s %s' "$name" "not run: deadline")"; status=1; return; fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS log=$out/logs/$name.log n=1
  while [ -e "$log" ]; do n=$((n + 1)); log=$out/logs/$name.$n.log; done  # a step run again keeps each log
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  local verdict=ok
  ((rc == 77)) && verdict=SKIP
  ((rc == 124 || rc == 137)) && verdict="TIMEOUT(${limit}s)"
  ((rc != 0 && rc != 77 && rc != 124 && rc != 137)) && verdict="FAIL(rc=$rc)"
  [ "$verdict" = ok ] || status=1
  say "$(printf '%-26s %-14s %4ds  %s' "$name" "$verdict" $((SECONDS - t0)) "$(grep -E '^\[doctest\] (test cases|assertions)|_ratio:|_ratio_steady_w[0-9]*:|_speedup:|^test_accuracy|^images_per_s|ERROR SUMMARY|ferry / pytorch|^graphs:' "$log" | tr '\n' ' ' | cut -c1-150)")"
}
# bench NAME LIMIT CMD...: through bench.py's runner, so the result is kept as its JSON.
bench() {
  local name=$1 limit=$2; shift 2
  step "bench_$name" "$limit" python3 - "$name" "$limit" "$@" <<'EOF'
import sys
sys.path.insert(0, "scripts")
import bench
name, limit, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
b = {"name": name, "cmd": cmd, "suite": ["ferry:gpu"], "timeout": limit - 5}
r = bench.run_one(b, ".carry/build", False, {})
print("kept:", bench.save(r, bench.machine(), __import__("datetime").datetime.now(
    __import__("datetime").timezone.utc).strftime("%Y-%m-%dT%H%M%S")))
sys.exit(r["returncode"])
EOF
}

for s in "${steps[@]}"; do
  case $s in
    tests)
      step test_distribute_gpu 120 "$B/tests/cuda/test_distribute_gpu"
      step test_nccl_communicator 60 "$B/tests/collective/test_nccl_communicator"
      step test_train_gpu 120 "$B/tests/train/test_train_gpu"
      step test_augment_gpu 60 "$B/tests/cuda/test_augment_gpu"
      step test_cache_on_device_gpu 60 "$B/tests/cuda/test_cache_on_device_gpu" ;;
    example) step example_04_gpu 90 python3 examples/04_train_fashion_mnist/check_output.py \
               "$B/examples/04_train_fashion_mnist/train_fashion_mnist" gpu ;;
    example_nographs) step example_04_gpu_nographs 90 python3 examples/04_train_fashion_mnist/check_output.py \
                        "$B/examples/04_train_fashion_mnist/train_fashion_mnist" gpu -- --graphs 0 ;;
    bench_distribute) bench distribute_gpu 90 "$B/benchmarks/distribute/bench_distribute_gpu" ;;
    bench_varlen) bench distribute_varlen_gpu 90 "$B/benchmarks/distribute/bench_distribute_varlen_gpu" ;;  # padded, ragged
    bench_augment) bench augment_gpu 60 "$B/benchmarks/image/bench_augment_gpu" ;;  # the kernel over a D2D copy
    bench_cache) bench cache_on_device_gpu 90 "$B/benchmarks/distribute/bench_cache_on_device_gpu" ;;  # device_cache_step_ratio
    bench_cache_big) bench cache_on_device_gpu_600k 120 "$B/benchmarks/distribute/bench_cache_on_device_gpu" 600000 ;;  # 1.9 GB
    bench_fed) bench train_fed_gpu 150 "$B/benchmarks/train/bench_train_fed_gpu" ;;
    bench_fed_nographs) bench train_fed_gpu_nographs 120 "$B/benchmarks/train/bench_train_fed_gpu" --graphs 0 ;;
    bench_pipeline) bench fmnist_pipeline 60 "$B/benchmarks/train/bench_fmnist_pipeline" ;;  # the host's feed rate
    bench_nccl) bench collective_nccl 90 "$B/benchmarks/collective/bench_nccl_allreduce" ;;
    main) step main_job_gpu 90 "$B/examples/04_train_fashion_mnist/train_fashion_mnist" --device gpu ;;
    main_cache) step main_job_gpu_cache_on_device 90 "$B/examples/04_train_fashion_mnist/train_fashion_mnist" --device gpu \
                  --cache-on-device ;;
    main_nographs) step main_job_gpu_nographs 90 "$B/examples/04_train_fashion_mnist/train_fashion_mnist" --device gpu \
                     --graphs 0 ;;
    bench_torch) bench train_fashion_mnist_gpu_vs_pytorch 200 python3 "$root/benchmarks/train/time_to_accuracy.py" \
                   "$B/benchmarks/train/bench_train_fashion_mnist" --device gpu ;;
    memcheck|racecheck) step "distribute_gpu_$s" 80 sh tests/cuda/sanitize.sh "$s" \
                          "$B/tests/cuda/test_distribute_gpu" '--test-case-exclude=*overlap*,*hot path*' ;;
    train_memcheck) step train_gpu_memcheck 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
                      "$B/tests/train/test_train_gpu" ;;  # the trainer's kernels, graphs included
    augment_memcheck) step augment_gpu_memcheck 90 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
                        "$B/tests/cuda/test_augment_gpu" ;;
    cache_memcheck) step cache_on_device_gpu_memcheck 120 compute-sanitizer --tool memcheck --report-api-errors no \
                      --error-exitcode 1 "$B/tests/cuda/test_cache_on_device_gpu" ;;  # the gather, plan and pack kernels
    example12) step example_12_gpu 120 python3 examples/12_image_classification/check_output.py \
                 "$B/examples/12_image_classification/12_image_classification" -- --device gpu ;;
    images12)  # images/s fed to the GPU through the whole image path: the 70,000 JPEGs written here
      step make_fmnist_jpeg 120 "${FERRY_PY:-python3}" scripts/make_image_corpus.py --out /tmp/ferry-images --only fmnist
      step example_12_gpu_full 150 "$B/examples/12_image_classification/12_image_classification" --device gpu \
        --epochs 3 --data /tmp/ferry-images/fmnist-jpeg
      step example_12_cpu_full 150 "$B/examples/12_image_classification/12_image_classification" --device cpu \
        --epochs 1 --data /tmp/ferry-images/fmnist-jpeg ;;
    *) say "unknown step $s"; status=1 ;;
  esac
done

# At most 8 files come back: the logs and the kept results go as archives.
tar -czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
find benchmarks/results -name '*.json' -newer "$start_marker" | tar -czf "$out/results.tgz" -T - 2>/dev/null
say "status $status ($SECONDS s)"
exit $status
