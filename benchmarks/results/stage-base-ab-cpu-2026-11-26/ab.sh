#!/usr/bin/env bash
# A/B: old (a845748, /tmp/ab-old/build-ab) against new (/work/main/build-ab), alternating:
# what this folder ran, now through scripts/bench_ab.sh (5 overhead rounds, 3 of the rest).
exec bash "$(dirname "$0")/../../../scripts/bench_ab.sh" /tmp/ab-old/build-ab /work/main/build-ab "${1:-/tmp/t/ab-results}" 5 3
