#!/usr/bin/env bash
# Every CUDA object of the build must have its headers recorded by ninja; one with none is
# not rebuilt when a header it includes changes (Meson < 1.4 gives nvcc no -MD/-MF unless
# the build was set up with scripts/meson_setup.sh). Fails naming each such object.
# usage: check_cuda_deps.sh BUILD_DIR
set -euo pipefail
build=$1
mapfile -t objs < <(ninja -C "$build" -t targets all | sed -n 's/^\([^:]*\.cu\.o\): .*/\1/p')
((${#objs[@]})) || { echo "SKIP: no CUDA objects in $build"; exit 77; }
bad=0
for o in "${objs[@]}"; do
  [ -f "$build/$o" ] || continue  # not built (a target left out of this build)
  n=$(ninja -C "$build" -t deps "$o" | sed -n '1s/.*#deps \([0-9]*\).*/\1/p')
  if [ "${n:-0}" -lt 2 ]; then
    echo "FAIL: $o: ninja knows ${n:-0} of its headers; set the build up with scripts/meson_setup.sh"
    bad=1
  fi
done
((bad)) || echo "ok: ${#objs[@]} CUDA objects, each with its headers recorded"
exit $bad
