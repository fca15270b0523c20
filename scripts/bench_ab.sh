#!/usr/bin/env bash
# A/B of two builds' benchmarks, run alternately (old, new, old, ...) so that both see the
# same machine: bench_overhead at 4 Mi and 16 Mi elements, then bench_sweep,
# bench_fmnist_pipeline and `bench_read 256 1024`. Raw outputs go to OUT as
# <bench>-<old|new>-<round>.txt. Build each side with
#   bash scripts/meson_setup.sh build-ab -Dcuda=disabled --buildtype=release \
#        -Dareas=overhead,sweep,train,read -Dtests=false -Dexamples=false && ninja -C build-ab
#   bash scripts/bench_ab.sh OLD_BUILD NEW_BUILD OUT [overhead rounds (5)] [other rounds (5)]
set -u
[ $# -ge 3 ] || { echo "usage: $0 OLD_BUILD NEW_BUILD OUT [overhead_rounds] [other_rounds]" >&2; exit 2; }
old=$1 new=$2 out=$3 r1=${4:-5} r2=${5:-5}
mkdir -p "$out"
for round in $(seq 1 "$r1"); do
  for side in old new; do
    b=$old
    [ $side = new ] && b=$new
    "$b/benchmarks/overhead/bench_overhead" 4194304 5 > "$out/overhead4-$side-$round.txt" 2>&1
    "$b/benchmarks/overhead/bench_overhead" 16777216 5 > "$out/overhead16-$side-$round.txt" 2>&1
  done
done
for round in $(seq 1 "$r2"); do
  for side in old new; do
    b=$old
    [ $side = new ] && b=$new
    "$b/benchmarks/sweep/bench_sweep" > "$out/sweep-$side-$round.txt" 2>&1
    "$b/benchmarks/train/bench_fmnist_pipeline" > "$out/fmnist-$side-$round.txt" 2>&1
    "$b/benchmarks/read/bench_read" 256 1024 > "$out/read-$side-$round.txt" 2>&1
  done
done
echo done
