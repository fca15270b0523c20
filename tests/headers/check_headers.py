#!/usr/bin/env python3
"""Checks the CUDA boundary of every public header.

usage: check_headers.py INCLUDE_DIR CXX [NVCC]

- no .hpp includes a .cuh (directly);
- each .hpp compiles alone with CXX (-fsyntax-only), once plain and, when the CUDA runtime
  headers are present, once with FERRY_WITH_CUDART=1;
- each .cuh compiles alone with NVCC when given.
"""
import concurrent.futures as cf
import os
import re
import shutil
import subprocess
import sys
import tempfile

inc, cxx = sys.argv[1], sys.argv[2]
nvcc = sys.argv[3] if len(sys.argv) > 3 else ""
cuda = "/usr/local/cuda"
failures = []

headers = []
for root, _, files in os.walk(inc):
    for f in files:
        if f.endswith((".hpp", ".cuh")):
            headers.append(os.path.relpath(os.path.join(root, f), inc))
headers.sort()

include_re = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)
for h in headers:
    if h.endswith(".hpp"):
        with open(os.path.join(inc, h)) as f:
            for m in include_re.finditer(f.read()):
                if m.group(1).endswith(".cuh"):
                    failures.append(f"{h}: a .hpp includes a .cuh ({m.group(1)})")

# Thrust host backend for headers that use Thrust from g++ (the trainer's CPU math).
base = ["-std=c++20", "-I", inc, "-isystem", f"{cuda}/include/cccl", "-DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP"]
# MPI headers (ferry/collective/mpi.hpp, ferry/distributed.hpp) compile only with MPI's
# include path; without it they declare nothing, so check them with it where MPI exists.
if shutil.which("mpicxx"):
    base += subprocess.run(["mpicxx", "--showme:compile"], capture_output=True, text=True).stdout.split()
    base += ["-DOMPI_SKIP_MPICXX=1"]
have_cudart = os.path.exists(f"{cuda}/include/cuda_runtime_api.h")


def compile_one(job):
    h, variant = job
    with tempfile.NamedTemporaryFile("w", suffix=".cu" if variant == "nvcc" else ".cpp", delete=False) as t:
        t.write(f'#include "{h}"\n#include "{h}"\n')  # twice: include guards work
        path = t.name
    try:
        if variant == "nvcc":
            cmd = [nvcc, "-std=c++20", "-I", inc, "-c", path, "-o", os.devnull, "--expt-relaxed-constexpr", "--extended-lambda"]
        elif variant == "cudart":
            cmd = [cxx] + base + ["-fsyntax-only", "-Wall", "-Wextra", "-isystem", f"{cuda}/include", "-DFERRY_WITH_CUDART=1", path]
        else:
            cmd = [cxx] + base + ["-fsyntax-only", "-Wall", "-Wextra", path]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return (h, variant, r.returncode, r.stderr[-3000:])
    finally:
        os.unlink(path)


jobs = []
for h in headers:
    if h.endswith(".hpp"):
        jobs.append((h, "plain"))
        if have_cudart:
            jobs.append((h, "cudart"))
    elif nvcc:
        jobs.append((h, "nvcc"))

with cf.ThreadPoolExecutor(max_workers=2) as ex:
    for h, variant, rc, err in ex.map(compile_one, jobs):
        status = "ok" if rc == 0 else "FAILED"
        print(f"{status:6} {variant:6} {h}")
        if rc != 0:
            failures.append(f"{h} ({variant}):\n{err}")

for f in failures:
    print("error:", f)
print(f"{len(jobs)} header compiles, {len(failures)} problems")
sys.exit(1 if failures else 0)
