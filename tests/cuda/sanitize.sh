#!/bin/sh
# compute-sanitizer TOOL over a GPU test: SKIP (77) when there is no device or no sanitizer.
# usage: sanitize.sh memcheck|racecheck EXE [doctest args...]
tool=$1; exe=$2; shift 2
"$exe" --ferry-probe >/dev/null || { echo "SKIP: no usable CUDA device"; exit 77; }
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$cs" ] || { echo "SKIP: compute-sanitizer not found"; exit 77; }
exec "$cs" --tool "$tool" --error-exitcode 1 "$exe" "$@"
