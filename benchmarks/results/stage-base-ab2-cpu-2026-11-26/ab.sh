#!/usr/bin/env bash
# A/B: old (a845748, /tmp/ab-old/build-ab) against new (/work/main/build-ab), alternating.
set -u
out=${1:-/tmp/t/ab-results}
mkdir -p "$out"
O=/tmp/ab-old/build-ab/benchmarks; N=/work/main/build-ab/benchmarks
for round in 1 2 3 4 5; do
  for side in old new; do
    B=$O; [ $side = new ] && B=$N
    $B/overhead/bench_overhead 4194304 5 > $out/overhead4-$side-$round.txt 2>&1
    $B/overhead/bench_overhead 16777216 5 > $out/overhead16-$side-$round.txt 2>&1
  done
done
for round in 1 2 3; do
  for side in old new; do
    B=$O; [ $side = new ] && B=$N
    $B/sweep/bench_sweep > $out/sweep-$side-$round.txt 2>&1
    $B/train/bench_fmnist_pipeline > $out/fmnist-$side-$round.txt 2>&1
    $B/read/bench_read 256 1024 > $out/read-$side-$round.txt 2>&1
  done
done
echo done
