#!/usr/bin/python3
"""CI's smoke run of 12_image_classification, on a fresh clone (no data/images): writes
small WebDataset shards from Debian's Fashion-MNIST IDX files as make_image_corpus.py does
(28x28 greyscale JPEGs at quality 95, members %06d.jpg + %06d.cls): two training shards of
2048 images (so shard() has files to split) and a test shard of 2000, then
  1. runs two epochs on them: two `epoch <k> loss <l> test_accuracy <a> images_per_s <r>
     elapsed_s <s>` lines, `images_per_s: <r>`, `test_accuracy: <a>` equal to the last
     epoch's and above a floor that shows learning, and one stderr line naming the backend;
  2. runs it with --world 2 --rank 1: one of the two training files, still learning;
  3. runs it on a folder without shards: exit status 77 and the command that makes them.
Exits 1 with the reasons on any mismatch, 77 (skip) without Pillow or the IDX files.

usage: check_output.py 12_IMAGE_CLASSIFICATION [-- ARG ...]   (ARG: more program arguments)
"""
import gzip
import io
import os
import re
import struct
import subprocess
import sys
import tarfile
import tempfile

IDX = "/usr/share/datasets/fashion-mnist"
argv, extra = sys.argv, []
if "--" in argv:
    argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
if len(argv) != 2:
    print(__doc__.strip().splitlines()[-1])
    sys.exit(2)
exe = argv[1]
try:
    from PIL import Image
except ImportError:
    print("SKIP: no Pillow (python3-pil) to write the JPEGs")
    sys.exit(77)
if not os.path.exists(f"{IDX}/train-images-idx3-ubyte.gz"):
    print(f"SKIP: no Fashion-MNIST in {IDX} (dataset-fashion-mnist)")
    sys.exit(77)


def idx(path, n):
    with gzip.open(path, "rb") as f:
        head = f.read(4)
        dims = head[3]
        shape = struct.unpack(">" + "I" * dims, f.read(4 * dims))
        per = 1 if dims == 1 else shape[1] * shape[2]
        return [f.read(per) for _ in range(n)]


def shard(path, images, labels, first):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for k, (img, lab) in enumerate(zip(images, labels), first):
            buf = io.BytesIO()
            Image.frombytes("L", (28, 28), img).save(buf, "JPEG", quality=95)
            for ext, data in (("jpg", buf.getvalue()), ("cls", str(lab[0]).encode())):
                ti = tarfile.TarInfo(f"{k:06d}.{ext}")
                ti.size = len(data)
                tar.addfile(ti, io.BytesIO(data))


epoch = re.compile(r"^epoch (\d+) loss (\d+\.\d{4}) test_accuracy (\d\.\d{4}) images_per_s (\d+) elapsed_s (\d+\.\d)$")
fail = []


def run(args, what, epochs, floor):
    p = subprocess.run([exe] + args + extra, capture_output=True, text=True, timeout=100)
    print(f"== {what}: {' '.join([exe] + args + extra)}\nstdout:\n{p.stdout}stderr:\n{p.stderr}")
    out = p.stdout.splitlines()
    if p.returncode != 0:
        fail.append(f"{what}: exit status {p.returncode}")
        return
    if len(out) != epochs + 2:
        fail.append(f"{what}: expected {epochs + 2} stdout lines, got {len(out)}")
        return
    for k in range(1, epochs + 1):
        m = epoch.match(out[k - 1])
        if not m or int(m[1]) != k:
            fail.append(f"{what}: line {k} is not epoch {k}'s line: {out[k - 1]!r}")
    if not re.match(r"^images_per_s: \d+$", out[-2]):
        fail.append(f"{what}: not 'images_per_s: <r>': {out[-2]!r}")
    m, last = re.match(r"^test_accuracy: (\d\.\d{4})$", out[-1]), epoch.match(out[-3])
    if not m:
        fail.append(f"{what}: last line is not 'test_accuracy: <a>': {out[-1]!r}")
    elif last and m[1] != last[3]:
        fail.append(f"{what}: the final accuracy differs from the last epoch's")
    elif float(m[1]) < floor:  # 10 classes: chance is 0.1
        fail.append(f"{what}: test accuracy {m[1]} < {floor}: not learning")
    backends = re.findall(r"^12_image_classification: \d+ (host|GPU) replica\(s\)", p.stderr, re.M)
    if len(backends) != 1:
        fail.append(f"{what}: stderr does not name one backend")


with tempfile.TemporaryDirectory() as d:
    images, labels = idx(f"{IDX}/train-images-idx3-ubyte.gz", 4096), idx(f"{IDX}/train-labels-idx1-ubyte.gz", 4096)
    shard(f"{d}/train-0000.tar", images[:2048], labels[:2048], 0)
    shard(f"{d}/train-0001.tar", images[2048:], labels[2048:], 2048)
    shard(f"{d}/test-0000.tar", idx(f"{IDX}/t10k-images-idx3-ubyte.gz", 2000),
          idx(f"{IDX}/t10k-labels-idx1-ubyte.gz", 2000), 0)
    # Floors: measured 0.7455 (both files, 2 epochs) and 0.6640 (one file, 1 epoch, half
    # the test shard) on host replicas; set 0.1 below, for other seeds' and backends' noise.
    run(["--data", d, "--epochs", "2", "--batch", "128", "--replicas", "2", "--workers", "2"], "2 epochs", 2, 0.65)
    run(["--data", d, "--epochs", "1", "--batch", "128", "--replicas", "2", "--workers", "2", "--world", "2",
         "--rank", "1"], "rank 1 of 2", 1, 0.55)
    p = subprocess.run([exe, "--data", f"{d}/none"], capture_output=True, text=True, timeout=30)
    print(f"== no data:\nexit status {p.returncode}\nstdout:\n{p.stdout}")
    if p.returncode != 77 or "bash scripts/setup.sh --images" not in p.stdout:
        fail.append("no data: expected exit status 77 and the setup.sh --images command")
for f in fail:
    print("FAILED: " + f)
sys.exit(1 if fail else 0)
