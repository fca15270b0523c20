#!/usr/bin/env bash
# ferry's tests: set up and build, then
#   1. the test suite (CPU suite; the GPU suite runs on a GPU machine and skips elsewhere),
#      with every CUDA target compiled when nvcc is present;
#   2. the CPU suite again under ASan+UBSan;
#   3. the threaded tests under TSan;
#   4. each libFuzzer harness for a short run over its seed corpus (clang);
#   5. the consumer checks: three tiny projects built against ferry (Meson subproject,
#      pkg-config, CMake), an install that compiles nothing, C++20 carried, every
#      combination of the build options configuring;
#   6. the API reference (scripts/api_docs.sh): Doxygen with no warning, so no undocumented
#      public entity, and every stage header's Threads / Errors / Memory / Checkpoints;
# then how long each part took, and a closing line "N passed, N failed, N skipped" over
# all of them. Exits non-zero when anything failed.
#
# Compile time is most of the cost (docs/testing.md): the sanitizer builds compile at -Og
# with line tables only (-g1: enough for the sanitizers' stack traces), and ninja runs
# one job per core as memory allows (scripts/jobs.sh; FERRY_JOBS overrides). A fresh
# 2-core machine with a cold ccache takes 29 to 34 minutes with nothing else running, up
# to 38 with other builds beside it (44 to 46 on a slower VM; docs/testing.md, measured).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup.sh --configure-only || exit 1
setup_s=$((SECONDS - start))
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
build=${FERRY_BUILD:-build}
jobs=$(bash scripts/jobs.sh)
logs=()
status=0
parts=()  # "name|build seconds|test seconds"

fmt() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
# part NAME BUILD_S TEST_S: records and prints one part's times.
part() {
  parts+=("$1|$2|$3")
  echo "== $1 took $(fmt $(($2 + $3))) (build $(fmt "$2"), tests $(fmt "$3"))"
}
# build_dir DIR: ninja in DIR; on failure its test log is recorded as missing.
build_dir() {
  rm -f "$1/meson-logs/testlog.json"
  ninja -C "$1" -j "$jobs" && return 0
  status=1
  logs+=("$1/meson-logs/testlog.json")
  return 1
}
run_suite() {  # build-dir [meson test args...]
  local dir=$1; shift
  meson test -C "$dir" --no-rebuild --print-errorlogs --num-processes 2 "$@" || status=1
  logs+=("$dir/meson-logs/testlog.json")
}
# setup_or_configure DIR ARGS...: meson setup DIR with ARGS, or, when DIR exists, the same
# options applied to it (an older DIR built at -O2 -g is brought to today's levels).
# Meson's output goes to a log, shown when it fails (its ERROR line is on stdout).
setup_or_configure() {
  local dir=$1; shift
  local log
  log=$(mktemp)
  if [ -f "$dir/build.ninja" ]; then
    meson configure "$dir" "$@" >"$log" 2>&1 || { status=1; tail -n 20 "$log"; }
  else
    meson setup "$dir" "$@" >"$log" 2>&1 || { status=1; tail -n 20 "$log"; }
  fi
  rm -f "$log"
}
part "setup" "$setup_s" 0  # packages (when missing) and configuring $build
echo "== ninja runs $jobs jobs"

echo "== tests ($build)"
t0=$SECONDS
build_dir "$build" && ok=1 || ok=0
t1=$SECONDS
[ $ok = 1 ] && run_suite "$build"
part "main suite" $((t1 - t0)) $((SECONDS - t1))

# Sanitizer builds: -Og -g1 (test_map.cpp under ASan+UBSan: 540 CPU-s at -O2 -g, 66 at -Og
# -g1), the CPU suite only, no CUDA, benchmarks or examples.
san_opts=(-Dcuda=disabled -Dbenchmarks=false -Dexamples=false -Doptimization=g -Ddebug=false -Dcpp_args=-g1)

echo "== ASan+UBSan"
t0=$SECONDS
setup_or_configure build-asan "${san_opts[@]}" -Db_sanitize=address,undefined
build_dir build-asan && ok=1 || ok=0
t1=$SECONDS
# Sanitized tests run several times slower than the main suite's: twice each test's timeout
# (sources_from_files took 108-121 s of its 120 under TSan on the 2-core VM).
[ $ok = 1 ] && run_suite build-asan --suite cpu --timeout-multiplier 2
part "ASan+UBSan" $((t1 - t0)) $((SECONDS - t1))

echo "== TSan (threaded tests)"
t0=$SECONDS
setup_or_configure build-tsan "${san_opts[@]}" -Db_sanitize=thread \
  -Dareas=core,memory,sources,collective,train,observe,cuda
build_dir build-tsan && ok=1 || ok=0
t1=$SECONDS
# libgomp is not instrumented: one OpenMP thread under TSan (see docs/architecture.md).
[ $ok = 1 ] && OMP_NUM_THREADS=1 TSAN_OPTIONS=halt_on_error=1 run_suite build-tsan --suite cpu --timeout-multiplier 2
part "TSan" $((t1 - t0)) $((SECONDS - t1))

if command -v clang++ >/dev/null && [ -f tests/fuzz/meson.build ]; then
  echo "== fuzzers (short runs)"
  t0=$SECONDS
  [ -f build-fuzz/build.ninja ] || CXX=clang++ setup_or_configure build-fuzz -Dcuda=disabled -Dbenchmarks=false \
    -Dexamples=false -Dfuzzers=true -Dareas=fuzz
  build_dir build-fuzz && ok=1 || ok=0
  t1=$SECONDS
  [ $ok = 1 ] && run_suite build-fuzz --suite fuzz
  part "fuzzers" $((t1 - t0)) $((SECONDS - t1))
fi

# extra_check NAME SCRIPT: runs a check that is not a Meson test, records its time, and
# keeps its last line ("...: N passed, N failed") for the closing count in $extra_result.
extra_check() {
  local t0=$SECONDS log
  log=$(mktemp)
  bash "$2" 2>&1 | tee "$log"
  extra_result=$(tail -n 1 "$log")
  rm -f "$log"
  part "$1" 0 $((SECONDS - t0))
}
echo "== consumers (Meson subproject, pkg-config, CMake find_package; install-only, C++20, options, warnings)"
extra_check "consumers" scripts/check_consumers.sh
consumers=$extra_result
echo "== API reference (Doxygen: no warnings, no undocumented public entity; stage header blocks)"
extra_check "API docs" scripts/api_docs.sh
api=$extra_result

echo "== time per part (wall; ninja -j $jobs on $(nproc) cores)"
for p in "${parts[@]}"; do
  IFS='|' read -r name b t <<<"$p"
  printf '  %-12s %8s  (build %s, tests %s)\n' "$name" "$(fmt $((b + t)))" "$(fmt "$b")" "$(fmt "$t")"
done
printf '  %-12s %8s\n' "total" "$(fmt $((SECONDS - start)))"

python3 scripts/summarize.py --extra "$consumers" --extra "$api" "${logs[@]}" || status=1
exit $status
