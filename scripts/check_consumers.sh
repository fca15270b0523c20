#!/usr/bin/env bash
# Builds the tiny consumer projects in tests/consumers/ out of tree, each the way a user
# takes ferry, runs their programs, and prints one line per consumer:
#   meson_subproject  ferry as a Meson subproject (subprojects/ferry -> the checkout),
#                     dependency('ferry') / dependency('ferry-cuda') from its overrides
#   pkgconfig         Meson + pkg-config (ferry.pc, ferry-cuda.pc) after `meson install`
#                     into a temporary prefix
#   cmake             CMake find_package(ferry CONFIG ... OPTIONAL_COMPONENTS cuda) against
#                     the same install, targets ferry::ferry and ferry::cuda
#   install_only      that install compiled nothing (tests, benchmarks and examples off:
#                     no compile command, no object file) and installed the headers,
#                     ferry.pc (with -std=c++20) and the CMake package
#   cxx17             a program including ferry/ferry.hpp with -std=c++17 stops with one
#                     error line, which names C++20 (pkgconfig and cmake above set no
#                     standard themselves: ferry.pc and ferry::ferry carry C++20)
#   options           every combination of -Dtests, -Dbenchmarks, -Dexamples configures,
#                     and so does a build without the CUDA toolkit (-Dtoolkit_dir=<empty>)
#   warnings          tests/consumers/warnings/warnings.cpp (every public header, the typical
#                     pipelines instantiated) compiles against the install with -I and
#                     -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Werror, by $CXX and by
#                     clang++ where it is on PATH (its -Wconversion includes -Wsign-conversion)
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

# cxx_name CXX: what the compiler CXX is, clang++ or g++ (c++ is one of them), from the
# macros it predefines (clang's include __GNUC__ too); CXX itself when neither.
cxx_name() {
  local m
  m=$($1 -dM -E -x c++ /dev/null 2>/dev/null)  # $1 unquoted: CXX may be "ccache g++"
  if grep -q '__clang__' <<<"$m"; then
    echo clang++
  elif grep -q '__GNUC__' <<<"$m"; then
    echo g++
  else
    echo "$1"
  fi
}

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

# Installing without building: the install above must have compiled nothing.
consumer_install_only() {
  local b=$tmp/build-ferry n objs missing=""
  [ $install_ok = 1 ] || { echo "FAIL install_only: ferry did not install (see above)"; return 1; }
  n=$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))))' "$b/compile_commands.json" 2>/dev/null || echo "?")
  objs=$(find "$b" -name '*.o' | wc -l)
  if [ "$n" != 0 ] || [ "$objs" != 0 ]; then
    echo "FAIL install_only: -Dtests=false -Dbenchmarks=false -Dexamples=false still compiles ($n compile commands, $objs objects)"
    return 1
  fi
  for f in include/ferry/ferry.hpp ferry.pc ferryConfig.cmake ferryConfigVersion.cmake; do
    [ -n "$(find "$prefix" -path "*$f" | head -n 1)" ] || missing+=" $f"
  done
  [ -z "$missing" ] || { echo "FAIL install_only: not installed:$missing"; return 1; }
  grep -q -- '-std=c++20' "$(find "$prefix" -name ferry.pc | head -n 1)" ||
    { echo "FAIL install_only: ferry.pc's Cflags carry no -std=c++20"; return 1; }
  echo "PASS install_only: meson setup -Dtests=false -Dbenchmarks=false -Dexamples=false + meson install: 0 compile commands; headers, ferry.pc (-std=c++20), CMake package"
}

# An older standard: one error line, and it says C++20.
consumer_cxx17() {
  local inc out errors
  [ $install_ok = 1 ] || { echo "FAIL cxx17: ferry did not install (see above)"; return 1; }
  inc=$(dirname "$(dirname "$(find "$prefix" -path '*include/ferry/ferry.hpp' | head -n 1)")")
  printf '#include "ferry/ferry.hpp"\nint main() { return 0; }\n' > "$tmp/cxx17.cpp"
  if out=$(${CXX:-c++} -std=c++17 -I"$inc" -fsyntax-only "$tmp/cxx17.cpp" 2>&1); then
    echo "FAIL cxx17: ferry/ferry.hpp compiled with -std=c++17"
    return 1
  fi
  errors=$(grep -cE ': (fatal )?error:' <<<"$out")
  if [ "$errors" != 1 ] || ! grep -qE ': error:.*C\+\+20' <<<"$out"; then
    echo "FAIL cxx17: expected one error line naming C++20, got $errors:"
    head -n 10 <<<"$out" | sed 's/^/    /'
    return 1
  fi
  echo "PASS cxx17: -std=c++17 gives one error: $(grep -E ': error:' <<<"$out" | sed 's/^.*error: //')"
}

# Every combination of the three build options configures (configure only: seconds each).
consumer_options() {
  local t b e bad=""
  for t in true false; do for b in true false; do for e in true false; do
    if ! meson setup "$tmp/opts-$t-$b-$e" "$src" -Dtests=$t -Dbenchmarks=$b -Dexamples=$e \
         >"$tmp/opts-$t-$b-$e.log" 2>&1; then
      bad+=" tests=$t,benchmarks=$b,examples=$e"
      tail -n 5 "$tmp/opts-$t-$b-$e.log" | sed 's/^/    /'
    fi
    rm -rf "$tmp/opts-$t-$b-$e"
  done; done; done
  # A machine without the CUDA toolkit (a folder with none of it, no nvcc): the CPU layer.
  if ! meson setup "$tmp/opts-notoolkit" "$src" -Dcuda=disabled -Dtoolkit_dir="$tmp/no-toolkit" \
       >"$tmp/opts-notoolkit.log" 2>&1; then
    bad+=" no CUDA toolkit"
    tail -n 5 "$tmp/opts-notoolkit.log" | sed 's/^/    /'
  fi
  rm -rf "$tmp/opts-notoolkit"
  [ -z "$bad" ] || { echo "FAIL options: these do not configure:$bad"; return 1; }
  echo "PASS options: all 8 combinations of -Dtests, -Dbenchmarks, -Dexamples configure, and one without the CUDA toolkit"
}

# ferry's headers warn nowhere a user's strict flags reach them: included with -I (as a
# user's own code, not -isystem) and instantiated. -fsyntax-only instantiates every
# template used (the same warnings as -O2 -c, measured, at a quarter of its 55 CPU-s).
# The libraries behind the optional headers are -isystem, where found: the CUDA runtime
# API (FERRY_WITH_CUDART), Thrust and OpenBLAS (the host trainer), MPI. Compiled by $CXX
# (c++ by default), then by clang++ too where it is on PATH and $CXX is not clang: clang's
# -Wconversion includes -Wsign-conversion, g++'s does not.
consumer_warnings() {
  local inc out n t0=$SECONDS cuda=/usr/local/cuda/include with="" f cxx ran=""
  local flags=(-std=c++20 -fsyntax-only -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Werror)
  local cxxs=("${CXX:-c++}")
  [ $install_ok = 1 ] || { echo "FAIL warnings: ferry did not install (see above)"; return 1; }
  inc=$(dirname "$(dirname "$(find "$prefix" -path '*include/ferry/ferry.hpp' | head -n 1)")")
  if [ -f "$cuda/cuda_runtime_api.h" ]; then flags+=(-isystem "$cuda" -DFERRY_WITH_CUDART=1); with+=" cudart"; fi
  if [ -d "$cuda/cccl" ]; then
    flags+=(-isystem "$cuda/cccl" -DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP); with+=" thrust"
  fi
  if command -v mpicxx >/dev/null; then
    for f in $(mpicxx --showme:compile 2>/dev/null); do
      if [[ $f == -I* ]]; then flags+=(-isystem "${f#-I}"); else flags+=("$f"); fi
    done
    flags+=(-DOMPI_SKIP_MPICXX=1); with+=" mpi"
  fi
  if [ "$(cxx_name "${cxxs[0]}")" != clang++ ] && command -v clang++ >/dev/null; then cxxs+=(clang++); fi
  for cxx in "${cxxs[@]}"; do
    # $cxx unquoted, as $CXX may carry words of its own (ccache g++)
    if ! out=$($cxx "${flags[@]}" -I"$inc" "$consumers/warnings/warnings.cpp" 2>&1); then
      n=$(grep -cE ': (warning|error):' <<<"$out")
      echo "FAIL warnings: $(cxx_name "$cxx"): $n warnings/errors under ${flags[*]:2:6}:"
      grep -E ': (warning|error):' <<<"$out" | head -n 15 | sed 's/^/    /'
      return 1
    fi
    ran+="${ran:+ and }$(cxx_name "$cxx")"
  done
  echo "PASS warnings: every public header, typical pipelines instantiated (with:${with:- none}): no warning from $ran under -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Werror, $((SECONDS - t0)) s"
}

consumer_sub
record $?
if install_ferry; then install_ok=1; fi
consumer_pkgconfig
record $?
consumer_cmake
record $?
consumer_install_only
record $?
consumer_cxx17
record $?
consumer_options
record $?
consumer_warnings
record $?
echo "consumers: $passed passed, $failed failed"
[ "$failed" = 0 ]
