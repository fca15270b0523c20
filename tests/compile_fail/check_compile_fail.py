#!/usr/bin/env python3
"""Checks that misuses of ferry fail to compile with a message that says what is wrong.

usage: check_compile_fail.py CXX INCLUDE_DIR [SOURCE...]   (default: the .cpp files here)

Each source must not compile (CXX -std=c++20 -fsyntax-only -I INCLUDE_DIR), and its
comment lines say what the compiler must print:
  // first-error: REGEX   the first error line matches it (ferry's static_assert, not a
                          cascade from inside a stage)
  // expect: REGEX        some line of the output matches it (the type names)
  // max-errors: N        at most N error lines in all (the cascade stays short)
Prints the number of error lines of each.
"""
import concurrent.futures as cf
import os
import re
import subprocess
import sys
import time

cxx, inc = sys.argv[1], sys.argv[2]
here = os.path.dirname(os.path.abspath(__file__))
sources = sys.argv[3:] or sorted(os.path.join(here, f) for f in os.listdir(here) if f.endswith(".cpp"))
directive = re.compile(r"^//\s*(first-error|expect|max-errors):\s*(.*?)\s*$", re.M)
error_line = re.compile(r"^.*?: (?:fatal )?error: .*$", re.M)
# Plain quotes and no colour, whatever the caller's locale and terminal.
env = dict(os.environ, LC_ALL="C")


def check(path):
    with open(path) as f:
        rules = directive.findall(f.read())
    t0 = time.monotonic()
    r = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", "-fdiagnostics-color=never", "-I", inc, path],
                       capture_output=True, text=True, env=env)
    seconds = time.monotonic() - t0
    out = r.stdout + r.stderr
    errors = error_line.findall(out)
    problems = []
    if not rules:
        problems.append("no // first-error:, expect: or max-errors: line")
    if r.returncode == 0:
        problems.append("it compiled")
    for kind, arg in rules:
        if kind == "first-error" and not (errors and re.search(arg, errors[0])):
            problems.append(f"the first error is not /{arg}/: {errors[0] if errors else '(none)'}")
        elif kind == "expect" and not re.search(arg, out, re.M):
            problems.append(f"nothing matches /{arg}/")
        elif kind == "max-errors" and len(errors) > int(arg):
            problems.append(f"{len(errors)} error lines, more than {arg}")
    return os.path.basename(path), len(errors), seconds, problems, out


failed = 0
total_errors = 0
with cf.ThreadPoolExecutor(max_workers=2) as ex:
    for name, n, seconds, problems, out in ex.map(check, sources):
        total_errors += n
        print(f"{'ok' if not problems else 'FAILED':6} {name:36} {n} error lines  {seconds:.1f} s")
        if problems:
            failed += 1
            for p in problems:
                print("    " + p)
            print("    compiler output (first 40 lines):")
            for line in out.splitlines()[:40]:
                print("      " + line)
print(f"{len(sources)} compile-fail sources, {total_errors} error lines, {failed} failed")
sys.exit(1 if failed else 0)
