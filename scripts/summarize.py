#!/usr/bin/env python3
"""Prints one closing line over Meson test logs: 'N passed, N failed, N skipped'.

Meson prints no such line itself. Exit status 1 when any test failed or a log is missing.
"""
import json
import sys

import re

passed = failed = skipped = 0
missing = []
args = sys.argv[1:]
# --extra "consumers: N passed, N failed": counts from a check that is not a Meson test.
while args and args[0] == "--extra":
    m = re.search(r"(\d+) passed, (\d+) failed", args[1])
    if m:
        passed += int(m.group(1))
        failed += int(m.group(2))
    else:
        print(f"extra check printed no result: {args[1]!r}")
        failed += 1
    args = args[2:]
for path in args:
    try:
        with open(path) as f:
            lines = [json.loads(l) for l in f if l.strip()]
    except OSError:
        missing.append(path)
        continue
    for t in lines:
        r = t.get("result")
        if r in ("OK", "EXPECTEDFAIL"):
            passed += 1
        elif r == "SKIP":
            skipped += 1
        else:
            failed += 1
            print(f"failed: {t.get('name')} ({r}) in {path}")
for m in missing:
    print(f"missing test log: {m} (its build failed)")
    failed += 1
print(f"{passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
