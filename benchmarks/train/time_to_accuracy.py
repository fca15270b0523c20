#!/usr/bin/python3
"""Time to a test accuracy on Fashion-MNIST: ferry's train_fashion_mnist against the
PyTorch CPU baseline (torch_fashion_mnist.py), same MLP and hyper-parameters, in the same
run, one after the other. Prints a table, the ratio, and a JSON line.

usage: time_to_accuracy.py FERRY_EXE [--target 0.88] [--epochs 15] [--batch 128]
           [--hidden 256,128] [--seed 1] [--replicas R] [--json out.json]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

LINE = re.compile(r"^epoch (\d+) loss ([0-9.]+) test_accuracy ([0-9.]+) elapsed_s ([0-9.]+)$")


def run(name, cmd, target):
    print(f"# {name}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
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
    return {"name": name, "reached": reached, "epochs": epochs,
            "wall_s": time.monotonic() - t0}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser()
    p.add_argument("ferry")
    p.add_argument("--target", type=float, default=0.88)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--hidden", default="256,128")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--replicas", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json")
    a = p.parse_args()
    common = ["--epochs", str(a.epochs), "--batch", str(a.batch), "--hidden", a.hidden,
              "--seed", str(a.seed)]
    ferry = run("ferry", [a.ferry, "--replicas", str(a.replicas), "--quiet"] + common, a.target)
    torch = run("pytorch", [sys.executable, os.path.join(here, "torch_fashion_mnist.py")] + common,
                a.target)

    print(f"{'system':>10} {'epochs':>7} {'test_acc':>9} {'time_s':>8}")
    for r in (ferry, torch):
        if r["reached"]:
            x = r["reached"]
            print(f"{r['name']:>10} {x['epoch']:>7d} {x['test_accuracy']:>9.4f} {x['elapsed_s']:>8.1f}")
        else:
            best = max((e["test_accuracy"] for e in r["epochs"]), default=0.0)
            print(f"{r['name']:>10} {'-':>7} {best:>9.4f} {'not reached':>8}")
    ratio = None
    if ferry["reached"] and torch["reached"]:
        ratio = ferry["reached"]["elapsed_s"] / torch["reached"]["elapsed_s"]
        print(f"time to {a.target} test accuracy, ferry / pytorch: {ratio:.3f} "
              f"(target <= 0.5)")
    out = {"benchmark": "fashion_mnist_time_to_accuracy", "target": a.target,
           "batch": a.batch, "hidden": a.hidden, "replicas": a.replicas,
           "ferry": ferry, "pytorch": torch, "ratio": ratio}
    print("JSON " + json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ratio is not None else 1


if __name__ == "__main__":
    sys.exit(main())
