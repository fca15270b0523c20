#!/usr/bin/env bash
# ferry's API reference: Doxygen over include/ferry (docs/api/Doxyfile; the headers' own
# // comments, through docs/api/doxygen_filter.py) into ${1:-build-api}/html, then checks:
#   warnings   Doxygen warned about nothing (an undocumented public entity is a warning)
#   blocks     every stage and source header has its Threads / Errors / Memory /
#              Checkpoints paragraphs, in that order (docs/api/check_blocks.py)
# Last line: "api reference: N passed, N failed". Exits non-zero when one failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-build-api}")
passed=0
failed=0
if ! command -v doxygen >/dev/null; then
  echo "FAIL warnings: doxygen is not installed (bash scripts/setup.sh --packages-only installs it)"
  failed=$((failed + 1))
else
  rm -rf "$out" && mkdir -p "$out"
  if FERRY_API_OUT=$out doxygen docs/api/Doxyfile && [ ! -s "$out/warnings.log" ]; then
    echo "PASS warnings: no Doxygen warning; the reference is $out/html/index.html"
    passed=$((passed + 1))
  else
    echo "FAIL warnings: $(wc -l <"$out/warnings.log" 2>/dev/null || echo '?') Doxygen warnings ($out/warnings.log), the first:"
    head -n 20 "$out/warnings.log" 2>/dev/null | sed 's/^/    /'
    failed=$((failed + 1))
  fi
fi
if python3 docs/api/check_blocks.py; then
  echo "PASS blocks: every stage and source header has Threads / Errors / Memory / Checkpoints"
  passed=$((passed + 1))
else
  echo "FAIL blocks: see above"
  failed=$((failed + 1))
fi
echo "api reference: $passed passed, $failed failed"
[ "$failed" = 0 ]
