#!/usr/bin/python3
"""Time to a test accuracy on Fashion-MNIST: ferry's train_fashion_mnist against the
PyTorch baseline (torch_fashion_mnist.py), same MLP and hyper-parameters, in the same
run, one after the other. Prints a table (time to the target, training samples/s), the
ratio, and a JSON line.

--device cpu: ferry on host replicas against PyTorch on the CPU (both with OpenBLAS here).
--device gpu: ferry's GPU path (every GPU; cuBLAS, NCCL) against PyTorch on the same GPU,
with the same number of loader workers; prints "skipped: no GPU" and exits 77 when
PyTorch sees no CUDA device.

samples/s is training samples seen up to the target over the time to the target (the
per-epoch evaluation included, for both).

usage: time_to_accuracy.py FERRY_EXE [--device cpu|gpu] [--target 0.88] [--epochs 15]
           [--batch 128] [--hidden 256,128] [--seed 1] [--replicas R] [--workers W]
           [--json out.json]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

LINE = re.compile(r"^epoch (\d+) loss ([0-9.]+) test_accuracy ([0-9.]+) elapsed_s ([0-9.]+)$")


def run(name, cmd, target):
    print(f"# {name}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    err = tempfile.TemporaryFile(mode="w+")  # the backend line and any error, shown below
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    reached = None
    epochs = []
    for line in proc.stdout:
        line = line.strip()
        m = LINE.match(line)
        if not m:
            continue
        e, loss, acc, el = int(m[1]), float(m[2]), float(m[3]), float(m[4])
        epochs.append({"epoch": e, "loss": loss, "test_accuracy": acc, "elapsed_s": el})
        print(f"#   {name:8s} {line}", flush=True)
        if reached is None and acc >= target:
            reached = epochs[-1]
            proc.terminate()  # the figure is the time to the target: stop there
            break
    proc.wait()
    err.seek(0)
    for line in err.read().splitlines()[:20]:
        print(f"#   {name:8s} stderr: {line}", flush=True)
    return {"name": name, "reached": reached, "epochs": epochs,
            "wall_s": time.monotonic() - t0}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser()
    p.add_argument("ferry")
    load_before = os.getloadavg()
    p.add_argument("--target", type=float, default=0.88)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--hidden", default="256,128")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--replicas", type=int, default=None,
                   help="ferry's host replicas (default: the program's own: one per core, at most batch / 64)")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--workers", type=int, default=None,
                   help="loader workers for both (default: 1 on cpu, min(8, cores/2) on gpu)")
    p.add_argument("--json")
    a = p.parse_args()
    gpu = a.device == "gpu"
    if gpu:
        try:
            import torch
            ok = torch.cuda.is_available()
        except ImportError:
            ok = False
        if not ok:
            print("skipped: no GPU (PyTorch sees no CUDA device)")
            return 77
    workers = a.workers if a.workers is not None else (
        max(1, min(8, (os.cpu_count() or 2) // 2)) if gpu else 1)
    common = ["--epochs", str(a.epochs), "--batch", str(a.batch), "--hidden", a.hidden,
              "--seed", str(a.seed), "--workers", str(workers)]
    ferry_cmd = [a.ferry, "--quiet", "--device", a.device]
    if not gpu and a.replicas is not None:
        ferry_cmd += ["--replicas", str(a.replicas)]
    ferry = run("ferry", ferry_cmd + common, a.target)
    torch = run("pytorch", [sys.executable, os.path.join(here, "torch_fashion_mnist.py"),
                            "--device", "cuda" if gpu else "cpu"] + common, a.target)

    per_epoch = 60000 // a.batch * a.batch
    print(f"# load average (1, 5, 15 min): before {load_before}, after {os.getloadavg()}; "
          f"{os.cpu_count()} cores")
    print(f"{'system':>10} {'epochs':>7} {'test_acc':>9} {'time_s':>8} {'samples/s':>10}")
    for r in (ferry, torch):
        if r["reached"]:
            x = r["reached"]
            r["samples_per_s"] = x["epoch"] * per_epoch / max(x["elapsed_s"], 1e-9)
            print(f"{r['name']:>10} {x['epoch']:>7d} {x['test_accuracy']:>9.4f} "
                  f"{x['elapsed_s']:>8.1f} {r['samples_per_s']:>10.0f}")
        else:
            best = max((e["test_accuracy"] for e in r["epochs"]), default=0.0)
            print(f"{r['name']:>10} {'-':>7} {best:>9.4f} {'not reached':>8}")
    ratio = None
    if ferry["reached"] and torch["reached"]:
        ratio = ferry["reached"]["elapsed_s"] / torch["reached"]["elapsed_s"]
        print(f"time to {a.target} test accuracy, ferry / pytorch: {ratio:.3f} "
              f"(target <= 0.5)")
    out = {"benchmark": "fashion_mnist_time_to_accuracy", "device": a.device,
           "target": a.target, "batch": a.batch, "hidden": a.hidden,
           "replicas": None if gpu else a.replicas, "workers": workers,
           "load_before": load_before, "load_after": os.getloadavg(),
           "ferry": ferry, "pytorch": torch, "ratio": ratio}
    print("JSON " + json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ratio is not None else 1


if __name__ == "__main__":
    sys.exit(main())
