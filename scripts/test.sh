#!/usr/bin/env bash
# ferry's tests: set up and build, then
#   1. the test suite (CPU suite; the GPU suite runs on a GPU machine and skips elsewhere),
#      with every CUDA target compiled when nvcc is present;
#   2. the CPU suite again under ASan+UBSan;
#   3. the threaded tests under TSan;
#   4. each libFuzzer harness for a short run over its seed corpus (clang);
#   5. three tiny consumer projects built against ferry (Meson subproject, pkg-config, CMake);
# and a closing line "N passed, N failed, N skipped" over all of them.
# Exits non-zero when anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
build=${FERRY_BUILD:-build}
logs=()
status=0

run_suite() {  # build-dir [meson test args...]
  local dir=$1; shift
  meson test -C "$dir" --print-errorlogs --num-processes 2 "$@" || status=1
  logs+=("$dir/meson-logs/testlog.json")
}

echo "== tests ($build)"
run_suite "$build"

echo "== ASan+UBSan"
if [ ! -f build-asan/build.ninja ]; then
  meson setup build-asan -Dcuda=disabled -Dbenchmarks=false -Dexamples=false \
    -Db_sanitize=address,undefined -Dbuildtype=debugoptimized >/dev/null || status=1
fi
ninja -C build-asan && run_suite build-asan --suite cpu || status=1

echo "== TSan (threaded tests)"
if [ ! -f build-tsan/build.ninja ]; then
  meson setup build-tsan -Dcuda=disabled -Dbenchmarks=false -Dexamples=false \
    -Db_sanitize=thread -Dbuildtype=debugoptimized -Dareas=core,memory,sources,collective,train,observe,cuda >/dev/null || status=1
fi
# libgomp is not instrumented: one OpenMP thread under TSan (see docs/architecture.md).
ninja -C build-tsan && OMP_NUM_THREADS=1 TSAN_OPTIONS=halt_on_error=1 run_suite build-tsan --suite cpu || status=1

if command -v clang++ >/dev/null && [ -f tests/fuzz/meson.build ]; then
  echo "== fuzzers (short runs)"
  if [ ! -f build-fuzz/build.ninja ]; then
    CXX=clang++ meson setup build-fuzz -Dcuda=disabled -Dbenchmarks=false -Dexamples=false \
      -Dfuzzers=true -Dareas=fuzz >/dev/null || status=1
  fi
  ninja -C build-fuzz && run_suite build-fuzz --suite fuzz || status=1
fi

echo "== consumers (Meson subproject, pkg-config, CMake find_package)"
consumers_log=$(mktemp)
bash scripts/check_consumers.sh 2>&1 | tee "$consumers_log"
consumers=$(tail -n 1 "$consumers_log")
rm -f "$consumers_log"

python3 scripts/summarize.py --extra "$consumers" "${logs[@]}" || status=1
exit $status
