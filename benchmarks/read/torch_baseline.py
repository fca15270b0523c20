#!/usr/bin/python3
"""PyTorch DataLoader baseline for bench_read: fixed-length records read with pread.

Usage: torch_baseline.py RECORD_BYTES BATCH LIMIT FILE...  -> prints records per second.
"""
import os
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class FixedRecords(Dataset):
    def __init__(self, files, rec, limit):
        self.files, self.rec = files, rec
        self.counts = [os.path.getsize(f) // rec for f in files]
        self.n = min(sum(self.counts), limit)
        self.fds = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.fds is None:  # opened in each worker
            self.fds = [os.open(f, os.O_RDONLY) for f in self.files]
        f = 0
        while i >= self.counts[f]:
            i -= self.counts[f]
            f += 1
        b = os.pread(self.fds[f], self.rec, i * self.rec)
        return torch.from_numpy(np.frombuffer(b, dtype=np.uint8).copy())


def main():
    rec, batch, limit = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    ds = FixedRecords(sys.argv[4:], rec, limit)
    dl = DataLoader(ds, batch_size=batch, num_workers=2, shuffle=False)
    t0 = time.perf_counter()
    n = 0
    for b in dl:
        n += b.shape[0]
    t = time.perf_counter() - t0
    print("%.1f" % (n / t))


if __name__ == "__main__":
    main()
