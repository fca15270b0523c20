#!/usr/bin/env bash
# Prints how many compile jobs ninja should run here: one per core, and no more than the
# memory allows at 2 GiB a job (the heaviest test translation unit peaks at about 1.1 GiB
# under ASan+UBSan at -Og, 2 GiB at -O2 -g; see docs/testing.md). FERRY_JOBS overrides.
# ninja's own default, cores + 2, only makes compilers on 2 cores wait for each other.
if [ -n "${FERRY_JOBS:-}" ]; then echo "$FERRY_JOBS"; exit 0; fi
cores=$(nproc 2>/dev/null || echo 2)
mem_kib=$(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo 2>/dev/null)
jobs=$cores
if [ -n "$mem_kib" ]; then
  by_mem=$((mem_kib / (2 * 1024 * 1024)))
  ((by_mem < jobs)) && jobs=$by_mem
fi
((jobs < 1)) && jobs=1
echo "$jobs"
