#!/usr/bin/env python3
"""Prints one closing line over Meson test logs: 'N passed, N failed, N skipped'.

Meson prints no such line itself. Exit status 1 when any test failed or a log is missing.
"""
import json
import sys

passed = failed = skipped = 0
missing = []
for path in sys.argv[1:]:
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
