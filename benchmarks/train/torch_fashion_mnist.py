#!/usr/bin/python3
"""PyTorch baseline for train_fashion_mnist: the same MLP, loss, optimizer, batch,
normalisation and evaluation, fed by torch.utils.data.DataLoader from the same gzip IDX
files, on the CPU or (--device cuda) on a GPU with pinned memory and non-blocking copies,
the loss read back every step as ferry does. Prints the same lines as ferry's example:
    epoch <k> loss <l> test_accuracy <a> elapsed_s <seconds since start>
    test_accuracy: <a>
"""
import argparse
import gzip
import struct
import time

import numpy as np
import torch
from torch import nn


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


class FashionMNIST(torch.utils.data.Dataset):
    def __init__(self, root, split):
        self.images = read_idx(f"{root}/{split}-images-idx3-ubyte.gz").reshape(-1, 784)
        self.labels = read_idx(f"{root}/{split}-labels-idx1-ubyte.gz").astype(np.int64)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):  # bytes -> normalised floats, per sample, like ferry's map
        x = (self.images[i].astype(np.float32) / 255.0 - 0.2860) / 0.3530
        return torch.from_numpy(x), int(self.labels[i])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hidden", default="256,128")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    a = p.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    sizes = [784] + [int(s) for s in a.hidden.split(",")] + [10]
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator()
    g.manual_seed(a.seed)
    train = torch.utils.data.DataLoader(FashionMNIST(a.data, "train"), batch_size=a.batch,
                                        shuffle=True, drop_last=True, num_workers=a.workers,
                                        generator=g, persistent_workers=a.workers > 0,
                                        pin_memory=cuda)
    test = torch.utils.data.DataLoader(FashionMNIST(a.data, "t10k"), batch_size=a.batch,
                                       num_workers=a.workers, persistent_workers=a.workers > 0,
                                       pin_memory=cuda)
    t0 = time.monotonic()
    acc = 0.0
    for e in range(1, a.epochs + 1):
        model.train()
        total, steps = 0.0, 0
        for x, y in train:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
        model.eval()
        correct, n = 0, 0
        with torch.no_grad():
            for x, y in test:
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                correct += (model(x).argmax(1) == y).sum().item()
                n += len(y)
        acc = correct / n
        print(f"epoch {e} loss {total / max(steps, 1):.4f} test_accuracy {acc:.4f} "
              f"elapsed_s {time.monotonic() - t0:.1f}", flush=True)
    print(f"test_accuracy: {acc:.4f}")


if __name__ == "__main__":
    main()
