#!/usr/bin/env bash
# Builds the tiny consumer projects in tests/consumers/ out of tree, each the way a user
# takes ferry, runs their programs, and prints one line per consumer:
#   meson_subproject  ferry as a Meson subproject (subprojects/ferry -> the checkout),
#                     dependency('ferry') / dependency('ferry-cuda') from its overrides
#   pkgconfig         Meson + pkg-config (ferry.pc, ferry-cuda.pc) after `meson install`
#                     into a temporary prefix
#   cmake             CMake find_package(ferry CONFIG ... OPTIONAL_COMPONENTS cuda) against
#                     the same install, targets ferry::ferry and ferry::cuda
# The CUDA programs are g++ targets (no nvcc needed); they are built where the CUDA toolkit
# is installed and run anywhere (without a driver they report no device and still pass).
# Last line: "consumers: N passed, N failed". Exits non-zero when one failed.
#
# Environment: FERRY_SRC   the ferry tree to use (default: this checkout)
#              KEEP_TMP=1  keep the temporary directory (its path is printed) for the logs
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "${FERRY_SRC:-$here}" && pwd)
consumers=$here/tests/consumers
tmp=$(mktemp -d "${TMPDIR:-/tmp}/ferry-consumers-XXXXXX")
if [ "${KEEP_TMP:-0}" = 1 ]; then echo "consumers: logs in $tmp"; else trap 'rm -rf "$tmp"' EXIT; fi
passed=0
failed=0

# step NAME LOG CMD...: runs CMD with its output in LOG; on failure prints the log's tail.
step() {
  local name=$1 log=$2
  shift 2
  if "$@" >>"$log" 2>&1; then return 0; fi
  echo "FAIL $name: '$*' failed; last lines of $log:"
  tail -n 15 "$log" | sed 's/^/    /'
  return 1
}

# run_programs NAME BUILD_DIR: runs app (and app_cuda when it was built), one result line.
run_programs() {
  local name=$1 dir=$2 out="" line prog
  for prog in app app_cuda; do
    [ -x "$dir/$prog" ] || { [ $prog = app ] && { echo "FAIL $name: $dir/app was not built"; return 1; }; continue; }
    if ! line=$(cd "$dir" && timeout 60 "./$prog" 2>&1); then
      echo "FAIL $name: $prog: $line"
      return 1
    fi
    out+="${out:+; }$prog: $line"
  done
  echo "PASS $name: $out"
}

record() { if [ "$1" = 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi; }

# 1. Meson subproject: a copy of the consumer with the checkout linked into subprojects/.
consumer_sub() {
  local c=$tmp/meson_subproject log=$tmp/meson_subproject.log
  cp -r "$consumers/meson_subproject" "$c" && mkdir -p "$c/subprojects" && ln -s "$src" "$c/subprojects/ferry"
  step meson_subproject "$log" meson setup "$tmp/build-sub" "$c" --force-fallback-for=ferry -Dbuildtype=release &&
    step meson_subproject "$log" ninja -C "$tmp/build-sub" &&
    run_programs meson_subproject "$tmp/build-sub"
}

# 2. and 3. need ferry installed into a temporary prefix (headers, ferry.pc, ferryConfig.cmake).
prefix=$tmp/prefix
install_ok=0
install_log=$tmp/install.log
install_ferry() {
  step install "$install_log" meson setup "$tmp/build-ferry" "$src" --prefix "$prefix" \
      -Dcuda=disabled -Dtests=false -Dbenchmarks=false -Dexamples=false &&
    step install "$install_log" meson install -C "$tmp/build-ferry"
}

consumer_pkgconfig() {
  local log=$tmp/pkgconfig.log pcdir
  [ $install_ok = 1 ] || { echo "FAIL pkgconfig: ferry did not install (see above)"; return 1; }
  pcdir=$(dirname "$(find "$prefix" -name ferry.pc | head -n 1)")
  [ -f "$pcdir/ferry.pc" ] || { echo "FAIL pkgconfig: no ferry.pc under $prefix"; return 1; }
  step pkgconfig "$log" meson setup "$tmp/build-pc" "$consumers/pkgconfig" -Dpkg_config_path="$pcdir" \
      -Dbuildtype=release &&
    step pkgconfig "$log" ninja -C "$tmp/build-pc" &&
    run_programs pkgconfig "$tmp/build-pc"
}

consumer_cmake() {
  local log=$tmp/cmake.log gen=()
  [ $install_ok = 1 ] || { echo "FAIL cmake: ferry did not install (see above)"; return 1; }
  command -v ninja >/dev/null && gen=(-G Ninja)
  step cmake "$log" cmake -S "$consumers/cmake" -B "$tmp/build-cmake" "${gen[@]}" \
      -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release &&
    step cmake "$log" cmake --build "$tmp/build-cmake" &&
    run_programs cmake "$tmp/build-cmake"
}

consumer_sub
record $?
if install_ferry; then install_ok=1; fi
consumer_pkgconfig
record $?
consumer_cmake
record $?
echo "consumers: $passed passed, $failed failed"
[ "$failed" = 0 ]
