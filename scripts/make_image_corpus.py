#!/usr/bin/python3
"""Makes the image data for ferry's image benchmark and example, from Debian packages alone
(no download), as WebDataset tar shards:

  <out>/photos/photos-%04d.tar        ImageNet-like JPEGs for throughput: random crops of the
                                      photographs in mate-backgrounds, resized to 500x375
                                      (a quarter of them 375x500), re-encoded by Pillow at
                                      quality 90, 4:2:0; members %06d.jpg + %06d.cls
  <out>/fmnist-jpeg/{train,test}-%04d.tar   Fashion-MNIST (dataset-fashion-mnist), each image a
                                      28x28 greyscale JPEG at quality 95; %06d.jpg + %06d.cls
  <out>/fmnist-png/{train,test}-%04d.tar    the same images as PNG; %06d.png + %06d.cls

A .cls member is the class as ASCII digits (no newline): for the photos the index of the
source photograph (sorted by name) mod 10, for Fashion-MNIST the label. Keys run on across
the shards of one set (photos-0001.tar starts at 000500).

Run with Debian's Python (it has Pillow and NumPy):
    /usr/bin/python3 scripts/make_image_corpus.py [--out data/images] [--photos 4000]
        [--photo-shards 8] [--seed 2026] [--jobs N] [--only photos,fmnist]
Shards that exist are kept (each is written to a temporary name and renamed, so one that
exists is whole), so a rerun costs nothing. Every byte is a function of the inputs and the
options: fixed names, mtime, uid/gid and order, one random stream per shard (rerunning with
a shard deleted rewrites it identically, given the same Pillow and libjpeg).
`bash scripts/setup.sh --images` installs the packages and runs this.
"""
import argparse
import gzip
import io
import multiprocessing
import os
import random
import struct
import sys
import tarfile
import time

import numpy as np
from PIL import Image

PHOTO_DIR = "/usr/share/backgrounds/mate/nature"  # the photographs; abstract/ and desktop/
# hold drawings, renders and a painting (flat colours, gradients, blur), not photographs
FMNIST_DIR = "/usr/share/datasets/fashion-mnist"
MTIME = 1767225600  # 2026-01-01T00:00:00Z, in every header

_photos = []  # (name, RGB image): loaded once in the parent, shared with forked workers


def tar_add(tar, name, data):
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.mtime = MTIME
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.type = tarfile.REGTYPE
    tar.addfile(ti, io.BytesIO(data))


def write_shard(path, samples):
    """samples: an iterable of (key, [(extension, bytes), ...]); written to path.tmp, renamed."""
    tmp = path + ".tmp"
    n = 0
    with open(tmp, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for key, members in samples:
                for ext, data in members:
                    tar_add(tar, f"{key}.{ext}", data)
                n += 1
    os.replace(tmp, path)
    return n


# ---- photographs -------------------------------------------------------------------------

def photo_sources():
    if not os.path.isdir(PHOTO_DIR):
        sys.exit(f"make_image_corpus: no {PHOTO_DIR} (install mate-backgrounds: "
                 "bash scripts/setup.sh --packages-only)")
    names = sorted(n for n in os.listdir(PHOTO_DIR) if n.lower().endswith((".jpg", ".jpeg", ".png")))
    if not names:
        sys.exit(f"make_image_corpus: no photographs in {PHOTO_DIR}")
    return [os.path.join(PHOTO_DIR, n) for n in names]


def crop_to_jpeg(rng, src):
    """One random crop of src, 4:3 (or 3:4 a quarter of the time), a third to all of the
    largest such window, resized to 500x375 (375x500) and encoded at quality 90, 4:2:0."""
    W, H = src.size
    portrait = rng.random() < 0.25
    if portrait:
        out = (375, 500)
        hmax = min(H, W * 4 // 3)
        ch = rng.randint(min(hmax, max(500, hmax // 3)), hmax)
        cw = ch * 3 // 4
    else:
        out = (500, 375)
        wmax = min(W, H * 4 // 3)
        cw = rng.randint(min(wmax, max(500, wmax // 3)), wmax)
        ch = cw * 3 // 4
    left = rng.randint(0, W - cw)
    top = rng.randint(0, H - ch)
    img = src.resize(out, Image.Resampling.LANCZOS, box=(left, top, left + cw, top + ch),
                     reducing_gap=3.0)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, subsampling=2, optimize=False, progressive=False)
    return buf.getvalue()


def photo_shard(job):
    path, shard, first, count, seed = job
    rng = random.Random(f"ferry-photos-{seed}-{shard}")  # str seeds hash with SHA-512: stable

    def samples():
        for k in range(first, first + count):
            s = rng.randrange(len(_photos))
            yield f"{k:06d}", [("jpg", crop_to_jpeg(rng, _photos[s][1])), ("cls", str(s % 10).encode())]

    n = write_shard(path, samples())
    return path, n, os.path.getsize(path)


def make_photos(out, total, shards, seed, pool_size):
    d = os.path.join(out, "photos")
    os.makedirs(d, exist_ok=True)
    per = -(-total // shards)
    jobs = []
    for i in range(shards):
        first = i * per
        count = min(per, total - first)
        if count <= 0:
            break
        path = os.path.join(d, f"photos-{i:04d}.tar")
        if not os.path.exists(path):
            jobs.append((path, i, first, count, seed))
    if not jobs:
        print(f"photos: {d} complete ({shards} shards), kept")
        return
    srcs = photo_sources()
    for p in srcs:
        with Image.open(p) as im:
            _photos.append((os.path.basename(p), im.convert("RGB")))
    print(f"photos: {len(_photos)} photographs from {PHOTO_DIR}: "
          + ", ".join(f"{n} {im.size[0]}x{im.size[1]}" for n, im in _photos), flush=True)
    run_jobs(photo_shard, jobs, pool_size, "photos")


# ---- Fashion-MNIST -----------------------------------------------------------------------

_idx = {}  # path -> array, per process


def read_idx(path):
    if path in _idx:
        return _idx[path]
    with gzip.open(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    _idx[path] = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)
    return _idx[path]


def encode_grey(a, fmt):
    buf = io.BytesIO()
    img = Image.fromarray(a, "L")
    if fmt == "jpg":
        img.save(buf, "JPEG", quality=95, optimize=False, progressive=False)
    else:
        img.save(buf, "PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def fmnist_shard(job):
    path, images_path, labels_path, lo, hi, fmt = job
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    samples = ((f"{k:06d}", [(fmt, encode_grey(images[k], fmt)), ("cls", str(int(labels[k])).encode())])
               for k in range(lo, hi))
    n = write_shard(path, samples)
    return path, n, os.path.getsize(path)


def make_fmnist(out, per_shard, pool_size):
    splits = [("train", "train"), ("test", "t10k")]
    jobs = []
    for fmt, sub in (("jpg", "fmnist-jpeg"), ("png", "fmnist-png")):
        d = os.path.join(out, sub)
        os.makedirs(d, exist_ok=True)
        for split, stem in splits:
            ip = os.path.join(FMNIST_DIR, f"{stem}-images-idx3-ubyte.gz")
            lp = os.path.join(FMNIST_DIR, f"{stem}-labels-idx1-ubyte.gz")
            n = 60000 if split == "train" else 10000
            for i, lo in enumerate(range(0, n, per_shard)):
                path = os.path.join(d, f"{split}-{i:04d}.tar")
                if not os.path.exists(path):
                    jobs.append((path, ip, lp, lo, min(lo + per_shard, n), fmt))
    if not jobs:
        print(f"fmnist: {out}/fmnist-jpeg and fmnist-png complete, kept")
        return
    if not os.path.exists(os.path.join(FMNIST_DIR, "train-images-idx3-ubyte.gz")):
        sys.exit(f"make_image_corpus: no Fashion-MNIST in {FMNIST_DIR} (install dataset-fashion-mnist: "
                 "bash scripts/setup.sh --packages-only)")
    run_jobs(fmnist_shard, jobs, pool_size, "fmnist")


# ------------------------------------------------------------------------------------------

def run_jobs(fn, jobs, pool_size, what):
    t0 = time.monotonic()
    total_n = total_b = 0
    if pool_size > 1 and len(jobs) > 1:
        with multiprocessing.get_context("fork").Pool(min(pool_size, len(jobs))) as pool:
            results = pool.imap(fn, jobs)  # in order, so the printout is too
            for path, n, size in results:
                print(f"{what}: wrote {path}: {n} samples, {size / 1e6:.1f} MB", flush=True)
                total_n += n
                total_b += size
    else:
        for job in jobs:
            path, n, size = fn(job)
            print(f"{what}: wrote {path}: {n} samples, {size / 1e6:.1f} MB", flush=True)
            total_n += n
            total_b += size
    print(f"{what}: {len(jobs)} shards, {total_n} samples, {total_b / 1e6:.1f} MB "
          f"in {time.monotonic() - t0:.1f} s", flush=True)


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(root, "data", "images"))
    p.add_argument("--photos", type=int, default=4000, help="photo crops in all (default 4000)")
    p.add_argument("--photo-shards", type=int, default=8)
    p.add_argument("--fmnist-per-shard", type=int, default=10000)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: the cores)")
    p.add_argument("--only", default="photos,fmnist", help="photos, fmnist or both (default)")
    a = p.parse_args()
    parts = set(a.only.split(","))
    t0 = time.monotonic()
    if "photos" in parts:
        make_photos(a.out, a.photos, a.photo_shards, a.seed, a.jobs)
    if "fmnist" in parts:
        make_fmnist(a.out, a.fmnist_per_shard, a.jobs)
    print(f"make_image_corpus: {a.out} ready ({time.monotonic() - t0:.1f} s)")


if __name__ == "__main__":
    main()
