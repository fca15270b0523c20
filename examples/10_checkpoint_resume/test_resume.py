#!/usr/bin/python3
"""Runs 10_checkpoint_resume through, saving its position after step N, then resumes from
that file in a new process (on the same files, given by path) and checks that the resumed
run prints exactly the lines the uninterrupted run printed after step N: the same batches,
in the same order, with the same contents (checksums), and nothing else. N in epoch 1, at
the end of epoch 1 and in epoch 2; and on one shard of two. A damaged state file must be
refused (exit 1, no batch printed).

usage: test_resume.py 10_CHECKPOINT_RESUME
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

exe = sys.argv[1]
failures = []
line_re = re.compile(r"^epoch (\d+) step (\d+) rows (\d+) checksum ([0-9a-f]{16})$")


def run(args, want_rc=0):
    r = subprocess.run([exe] + args, capture_output=True, text=True, timeout=60)
    if r.returncode != want_rc:
        failures.append(f"{args}: exit status {r.returncode}, want {want_rc}; stderr: {r.stderr.strip()}")
    return r.stdout.splitlines(), r.stderr


def check(name, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + name)
    if not ok:
        failures.append(name + (": " + detail if detail else ""))


tmp = tempfile.mkdtemp(prefix="ferry-10-")
try:
    data, state = os.path.join(tmp, "data"), os.path.join(tmp, "state")
    full, _ = run(["--make-files", data])  # 4 x 300 records, batch 32: 37 steps an epoch
    files = sorted(glob.glob(os.path.join(data, "part-*.bin")))
    check("the example files are written", len(files) == 4, str(files))
    check("every line is a step line", full and all(line_re.match(x) for x in full), str(full[:3]))
    per_epoch = sum(1 for x in full if x.startswith("epoch 1 "))
    check("two epochs of 37 steps", per_epoch == 37 and len(full) == 74, f"{per_epoch}, {len(full)}")
    check("steps count from 1 in each epoch",
          [int(line_re.match(x)[2]) for x in full] == list(range(1, 38)) * 2)
    check("the batches differ", len({x.split()[-1] for x in full}) == len(full))
    check("epoch 2 is shuffled anew", [x.split()[-1] for x in full[:37]] != [x.split()[-1] for x in full[37:]])

    for n, extra in [(5, []), (37, []), (40, []), (3, ["--world", "2", "--rank", "1"])]:
        name = f"resume after step {n}" + (" " + " ".join(extra) if extra else "")
        ref = full if not extra else run(files + extra)[0]
        saving, err = run(["--make-files", data, "--save-after", str(n), "--state", state] + extra)
        check(name + ": saving does not change the run", saving == ref and os.path.exists(state), err)
        resumed, err = run(files + ["--resume", state] + extra)
        check(name + ": the resumed run hands out exactly the rest", resumed == saving[n:],
              f"got {len(resumed)} lines, want {len(saving) - n}; first {resumed[:1]} want {saving[n:n + 1]}")
        os.remove(state)

    # A state saved on rank 1 of 2, resumed as rank 0: refused, not silently wrong.
    run(["--make-files", data, "--world", "2", "--rank", "1", "--save-after", "3", "--state", state])
    out, err = run(files + ["--world", "2", "--rank", "0", "--resume", state], want_rc=1)
    check("another shard's state is refused", out == [] and "10_checkpoint_resume:" in err, err)
    # Cut short by 8 bytes: the check word catches it.
    raw = open(state, "rb").read()
    open(state, "wb").write(raw[:-8])
    out, err = run(files + ["--world", "2", "--rank", "1", "--resume", state], want_rc=1)
    check("a damaged state file is refused", out == [] and "cut short or damaged" in err, err)
finally:
    shutil.rmtree(tmp)

for f in failures:
    print("FAILED: " + f)
sys.exit(1 if failures else 0)
