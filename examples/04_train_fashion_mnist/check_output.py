#!/usr/bin/python3
"""Runs train_fashion_mnist for two short epochs and checks what it prints: one
`epoch <k> loss <l> test_accuracy <a> elapsed_s <s>` line per epoch (l: the epoch's mean
training loss), then `test_accuracy: <a>`, and the stderr line naming the backend. Its
progress lines (stderr, a pipe: plain lines) must never show a loss before there is one, and
each epoch's last one ("mean loss") must be the epoch line's loss. On a machine without a usable
GPU the nvcc-built program must fall back to host replicas; with `gpu` it must run on the
GPU: its stderr must name the GPU backend, and a host-replica line fails the check. Exits 1
with the reason on any mismatch.

usage: check_output.py TRAIN_FASHION_MNIST [gpu [--no-skip]] [-- ARG ...]
    gpu:       force --device gpu (suite gpu): exit 77 when there is no usable device
    --no-skip: with gpu, no usable device is a failure, not a skip (the simulator's build,
               whose two simulated GPUs are always there)
    -- ARG...: more arguments for the program (e.g. -- --graphs 0, -- --cache-on-device)
"""
import re
import subprocess
import sys

USAGE = "usage: check_output.py TRAIN_FASHION_MNIST [gpu [--no-skip]] [-- ARG ...]"
argv, extra = sys.argv, []
if "--" in argv:
    argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
if len(argv) < 2 or argv[2:] not in ([], ["gpu"], ["gpu", "--no-skip"]):
    print(USAGE)
    sys.exit(2)
exe = argv[1]
want_gpu = argv[2:3] == ["gpu"]
no_skip = argv[3:4] == ["--no-skip"]
p = subprocess.run([exe, "--epochs", "2", "--limit", "2048", "--batch", "128", "--replicas", "2",
                    "--device", "gpu" if want_gpu else "auto"] + extra,
                   capture_output=True, text=True, timeout=110)
if want_gpu and not no_skip and p.returncode != 0 and ("no usable CUDA device" in p.stderr
                                                       or "has no GPU path" in p.stderr):
    print("SKIP: " + p.stderr.strip())
    sys.exit(77)
out, err = p.stdout.splitlines(), p.stderr
print("stdout:\n" + p.stdout + "stderr:\n" + err)
fail = []
if p.returncode != 0:
    fail.append(f"exit status {p.returncode}")
if want_gpu and no_skip and ("no usable CUDA device" in err or "has no GPU path" in err):
    fail.append("no usable GPU, and --no-skip says this build must have one")
epoch = re.compile(r"^epoch (\d+) loss (\d+\.\d{4}) test_accuracy (\d\.\d{4}) elapsed_s (\d+\.\d)$")
if len(out) != 3:
    fail.append(f"expected 3 stdout lines, got {len(out)}")
else:
    for k in (1, 2):
        m = epoch.match(out[k - 1])
        if not m or int(m[1]) != k:
            fail.append(f"line {k} is not an epoch line: {out[k - 1]!r}")
    m = re.match(r"^test_accuracy: (\d\.\d{4})$", out[2])
    last = epoch.match(out[1])
    if not m:
        fail.append(f"last line is not 'test_accuracy: <a>': {out[2]!r}")
    elif last and m[1] != last[3]:
        fail.append("the final accuracy differs from the last epoch's")
    elif float(m[1]) < 0.6:  # 2 x 2048 images of a 10-class problem: chance is 0.1
        fail.append(f"test accuracy {m[1]} after 2 short epochs: not learning")
# The progress bar: its final line per epoch is the epoch line's loss.
if "loss -" in err:
    fail.append("a progress line shows 'loss -'")
for k, line in enumerate(out[:2], 1):
    m = epoch.match(line)
    bar = re.findall(rf"^epoch {k}: 2048/2048 samples, .* mean loss (\d+\.\d{{4}}), took", err, re.M)
    if m and bar != [m[2]]:
        fail.append(f"epoch {k}: the progress bar's final mean loss {bar} is not the epoch line's {m[2]}")
gpu_line = re.search(r"^train_fashion_mnist: \d+ GPU replica\(s\) on .*\(cuBLAS, NCCL(, CUDA graphs)?\)", err, re.M)
host_line = re.search(r"^train_fashion_mnist: 2 host replica\(s\)", err, re.M)
if want_gpu:
    if not gpu_line:
        fail.append("--device gpu: stderr does not name the GPU backend "
                    "('train_fashion_mnist: <n> GPU replica(s) on ... (cuBLAS, NCCL)')")
    if re.search(r"host replica\(s\)", err):
        fail.append("--device gpu ran on host replicas")
    if gpu_line and bool(gpu_line[1]) != (extra[-2:] != ["--graphs", "0"]):  # graphs: the default
        fail.append("stderr says CUDA graphs " + ("on" if gpu_line[1] else "off") + ", the arguments the other")
elif bool(gpu_line) == bool(host_line):
    fail.append("stderr does not say which one backend ran" if not gpu_line
                else "stderr names both backends")
if "--cache-on-device" in extra and not re.search(r"^train_fashion_mnist: after epoch 1 the training split comes "
                                                  r"from the replicas' memory \(cache_on_device", err, re.M):
    fail.append("--cache-on-device: stderr does not say the training split is cached")
for f in fail:
    print("FAILED: " + f)
sys.exit(1 if fail else 0)
