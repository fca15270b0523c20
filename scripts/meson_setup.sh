#!/usr/bin/env bash
# meson setup BUILD [ARGS...], compiling CUDA through scripts/nvcc/nvcc when there is an
# nvcc, so ninja learns each .cu object's headers and rebuilds it when one changes (Meson
# before 1.4 asks nvcc for no dependency file; see that script). Meson 1.0's machine files
# cannot name a path relative to themselves, so the native file, with the absolute path,
# is written into BUILD.
set -euo pipefail
build=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
meson=(meson)
command -v meson >/dev/null || meson=(python3 -m mesonbuild.mesonmain)
native=()
if [ -n "${FERRY_NVCC:-}" ] || [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null; then
  mkdir -p "$build"
  printf "[binaries]\ncuda = '%s'\n" "$root/scripts/nvcc/nvcc" > "$build/ferry-nvcc.ini"
  native=(--native-file "$build/ferry-nvcc.ini")
fi
exec "${meson[@]}" setup "$build" "${native[@]}" "$@"
