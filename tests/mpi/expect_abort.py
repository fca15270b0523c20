#!/usr/bin/env python3
"""Runs a command that must fail: exit non-zero within --timeout seconds, with every
--expect string on its stderr or stdout. Used for the MPI abort tests (a rank's exception
must end the whole job with its rank and message, never hang)."""
import argparse
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--expect", action="append", default=[])
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired as e:
        print(f"FAIL: still running after {a.timeout} s (a hang): {' '.join(cmd)}")
        for s in (e.stdout, e.stderr):
            if s:
                print(s if isinstance(s, str) else s.decode(errors="replace"))
        return 1
    out = p.stdout + p.stderr
    print(out)
    if p.returncode == 0:
        print("FAIL: the job exited 0; a failing rank must make it exit non-zero")
        return 1
    missing = [e for e in a.expect if e not in out]
    if missing:
        print(f"FAIL: exit {p.returncode}, but the output lacks {missing}")
        return 1
    print(f"ok: exit {p.returncode}, output names the failing rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
