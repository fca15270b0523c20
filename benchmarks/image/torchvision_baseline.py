#!/usr/bin/python3
"""PyTorch + torchvision's side of images_vs_torchvision: images/s of JPEG decode +
RandomResizedCrop(224) + RandomHorizontalFlip, batched by torch's DataLoader, from the
WebDataset tar shards that scripts/make_image_corpus.py writes (data/images/photos/).

What a PyTorch user writes for this, with no webdataset package: an IterableDataset that
splits the shards across the DataLoader's workers (shard i to worker i mod W, as
webdataset's split_by_worker does), streams each tar with Python's tarfile, groups members
into samples by key (WebDataset's rule: the name up to the first dot of its base name),
decodes each .jpg with PIL (convert("RGB"), a full-size decode: torchvision does not use
PIL's draft mode) and applies
    transforms.Compose([RandomResizedCrop(224), RandomHorizontalFlip(), PILToTensor()])
(uint8, no normalisation, as ferry's side outputs uint8; torchvision's layout is CHW, ferry's
HWC). The DataLoader batches (default 64, the last batch kept) with its default collate,
torch.set_num_threads(1) in each worker. No shuffling.

Run with Debian's Python (python3-torch, python3-torchvision):
    /usr/bin/python3 benchmarks/image/torchvision_baseline.py [--workers 2]
        [--shards 'data/images/photos/photos-*.tar'] [--epochs 1] [--warmup-images 512]
        [--batch 64] [--seed 1]
The clock starts once --warmup-images images have arrived (workers started, caches warm)
and stops after the last batch of the last epoch; the rate is the images in between over
that time. stdout is one line, for the C++ benchmark to read:
    torchvision_images_per_s: <rate> images <images timed> workers <W>
Progress and settings go to stderr. Exits 2 when there are no shards (make them:
/usr/bin/python3 scripts/make_image_corpus.py).
"""
import argparse
import glob
import io
import os
import sys
import tarfile
import time

import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchvision import transforms


def samples(path):
    """(key, {extension: bytes}) for each run of members with the same key, in tar order."""
    key, cur = None, {}
    with tarfile.open(path, mode="r|") as tar:  # streaming: one pass, no index
        for m in tar:
            if not m.isfile():
                continue
            d, base = os.path.split(m.name)
            if "." not in base:
                continue
            stem, ext = base.split(".", 1)
            k = os.path.join(d, stem)
            if k != key:
                if cur:
                    yield key, cur
                key, cur = k, {}
            cur[ext] = tar.extractfile(m).read()
    if cur:
        yield key, cur


class TarImages(IterableDataset):
    def __init__(self, shards, transform):
        self.shards, self.transform = shards, transform

    def __iter__(self):
        w = get_worker_info()
        mine = self.shards if w is None else self.shards[w.id::w.num_workers]
        for path in mine:
            for key, s in samples(path):
                if "jpg" not in s:
                    continue
                img = Image.open(io.BytesIO(s["jpg"])).convert("RGB")
                label = int(s["cls"]) if "cls" in s else -1
                yield self.transform(img), label


def one_thread(_):
    torch.set_num_threads(1)


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shards", default=os.path.join(root, "data/images/photos/photos-*.tar"),
                   help="a glob of tar shards (default: data/images/photos/photos-*.tar)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--warmup-images", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    shards = sorted(glob.glob(a.shards))
    if not shards:
        print(f"torchvision_baseline: no shards match {a.shards} "
              "(make them: /usr/bin/python3 scripts/make_image_corpus.py)", file=sys.stderr)
        return 2
    if a.workers > len(shards):
        print(f"torchvision_baseline: {a.workers} workers but {len(shards)} shards: "
              f"{a.workers - len(shards)} workers idle", file=sys.stderr)
    torch.manual_seed(a.seed)
    if a.workers == 0:
        torch.set_num_threads(1)
    tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                             transforms.PILToTensor()])
    dl = DataLoader(TarImages(shards, tf), batch_size=a.batch, num_workers=a.workers,
                    worker_init_fn=one_thread if a.workers > 0 else None,
                    persistent_workers=a.workers > 0 and a.epochs > 1)
    print(f"torchvision_baseline: torch {torch.__version__}, {len(shards)} shards, {a.workers} workers, "
          f"batch {a.batch}, {a.epochs} epochs, warm-up {a.warmup_images} images", file=sys.stderr)
    n = 0
    t0 = n0 = None
    checksum = 0
    for e in range(a.epochs):
        for x, y in dl:
            n += x.shape[0]
            checksum += int(x[0, 0, 0, 0]) + int(y[0])  # touch the batch
            if t0 is None and n >= a.warmup_images:
                t0, n0 = time.perf_counter(), n
        print(f"torchvision_baseline: epoch {e + 1}: {n} images so far", file=sys.stderr)
    if t0 is None or n == n0:
        print(f"torchvision_baseline: only {n} images, not more than the warm-up ({a.warmup_images}): "
              "lower --warmup-images or raise --epochs", file=sys.stderr)
        return 2
    t = time.perf_counter() - t0
    print(f"torchvision_baseline: {n - n0} images timed in {t:.2f} s (checksum {checksum})", file=sys.stderr)
    print(f"torchvision_images_per_s: {(n - n0) / t:.1f} images {n - n0} workers {a.workers}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
