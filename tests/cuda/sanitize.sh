#!/bin/sh
# compute-sanitizer TOOL over a GPU test: SKIP (77) when there is no device or no sanitizer.
# usage: sanitize.sh memcheck|racecheck EXE [doctest args...]
tool=$1; exe=$2; shift 2
"$exe" --ferry-probe >/dev/null || { echo "SKIP: no usable CUDA device"; exit 77; }
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$cs" ] || { echo "SKIP: compute-sanitizer not found"; exit 77; }
# Some machines (gVisor) refuse the sanitizer: "Device not supported". Then SKIP, not fail.
probe=$("$cs" --tool "$tool" "$exe" --ferry-probe 2>&1)
case $probe in
  *"not supported"*|*"Unable to"*|*"error 999"*) echo "SKIP: compute-sanitizer cannot run here: $(echo "$probe" | head -3)"; exit 77 ;;
esac
exec "$cs" --tool "$tool" --error-exitcode 1 "$exe" "$@"
