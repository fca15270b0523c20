#!/usr/bin/env python3
"""Runs train_multi_node under mpirun and checks what rank 0 prints.

usage: check_output.py MPIRUN [MPIRUN ARGS...] -- TRAIN_MULTI_NODE [ARGS...]
Passes when the job exits 0, prints one "epoch <k> loss <l> test_accuracy <a> elapsed_s <s>"
line per epoch (from rank 0 only) and a final "test_accuracy: <a>" with a > 0.6 (a short
run: far from the 0.88 of a full one, far above the 0.1 of a model that did not learn).
"""
import re
import subprocess
import sys

cmd = [a for a in sys.argv[1:] if a != "--"]
try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
except subprocess.TimeoutExpired:
    print("check_output: the job did not finish within 100 s")
    sys.exit(1)
print(r.stdout, end="")
print(r.stderr, end="", file=sys.stderr)
errors = []
if r.returncode != 0:
    errors.append(f"exit status {r.returncode}")
epochs = re.findall(r"^epoch (\d+) loss ([0-9.]+) test_accuracy ([0-9.]+) elapsed_s ([0-9.]+)$", r.stdout, re.M)
if [int(e[0]) for e in epochs] != [1]:
    errors.append(f"expected one epoch line, from rank 0 only; got {epochs}")
final = re.findall(r"^test_accuracy: ([0-9.]+)$", r.stdout, re.M)
if len(final) != 1:
    errors.append(f"expected one final test_accuracy line; got {final}")
elif not float(final[0]) > 0.6:
    errors.append(f"test_accuracy {final[0]} after a short run: the model did not learn")
for e in errors:
    print("check_output:", e)
sys.exit(1 if errors else 0)
