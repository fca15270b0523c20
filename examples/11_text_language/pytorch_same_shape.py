#!/usr/bin/env python3
"""The model of 11_text_language.cpp in PyTorch, on the same words and the same split, for
the accuracy beside ferry's: EmbeddingBag(4352, 128, mode="sum") over a word's bytes and
hashed byte pairs, each weighted 1/len (the bag's mean one-hot times the table, as the C++
model's first layer computes it) + bias, ReLU, Linear(128, 7); Adam, lr 2e-3, batches of
128, shuffled each epoch. Held out: 1 word in 10 by FNV-1a of its bytes, as the C++.

    python3 examples/11_text_language/pytorch_same_shape.py [--epochs 3] [--dict /usr/share/dict]

Prints per epoch `epoch <k> loss <l> test_accuracy <a> words_per_s <w>` and last
`test_accuracy: <a>`. Exits 77 without word lists.
"""
import argparse
import os
import sys
import time

import torch

LISTS = ["american-english", "french", "ngerman", "spanish", "italian", "portuguese", "dutch"]
PAIRS = 4096
FEATURES = 256 + PAIRS


def fnv1a(b):
    h = 2166136261
    for c in b:
        h = ((h ^ c) * 16777619) & 0xFFFFFFFF
    return h


def bag(word):
    """The word's indices and per-index weights (1/len each)."""
    idx = list(word) + [256 + (a * 257 + b) % PAIRS for a, b in zip(word, word[1:])]
    return idx, [1.0 / len(word)] * len(idx)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(FEATURES, 128, mode="sum")
        self.bias = torch.nn.Parameter(torch.zeros(128))
        self.out = torch.nn.Linear(128, len(LISTS))

    def forward(self, idx, offsets, weights):
        h = self.bag(idx, offsets, per_sample_weights=weights) + self.bias
        return self.out(torch.relu(h))


def batches(words, batch, shuffle):
    order = torch.randperm(len(words)).tolist() if shuffle else range(len(words))
    order = list(order)
    for s in range(0, len(order), batch):
        idx, off, wts, ys = [], [], [], []
        for i in order[s:s + batch]:
            w, y = words[i]
            a, b = bag(w)
            off.append(len(idx))
            idx += a
            wts += b
            ys.append(y)
        yield (torch.tensor(idx), torch.tensor(off), torch.tensor(wts, dtype=torch.float32), torch.tensor(ys))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dict", default="/usr/share/dict")
    p.add_argument("--limit", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(1)
    train, test = [], []
    for lang, name in enumerate(LISTS):
        path = os.path.join(a.dict, name)
        if not os.path.exists(path):
            continue
        n = 0
        with open(path, "rb") as f:
            for line in f:
                w = line.rstrip(b"\n")
                if not w or len(w) > 64:
                    continue
                if a.limit and n >= a.limit:
                    break
                n += 1
                (test if fnv1a(w) % 10 == 0 else train).append((w, lang))
    if not train:
        print("pytorch_same_shape: no word list in", a.dict)
        sys.exit(77)
    print(f"words: {len(train)} train, {len(test)} test")
    m = Model()
    opt = torch.optim.Adam(m.parameters(), lr=2e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    acc = 0.0
    for e in range(1, a.epochs + 1):
        t0 = time.time()
        total, n = 0.0, 0
        m.train()
        for idx, off, wts, y in batches(train, 128, True):
            opt.zero_grad()
            loss = loss_fn(m(idx, off, wts), y)
            loss.backward()
            opt.step()
            total += loss.item() * len(y)
            n += len(y)
        secs = time.time() - t0
        m.eval()
        correct = 0
        with torch.no_grad():
            for idx, off, wts, y in batches(test, 1024, False):
                correct += (m(idx, off, wts).argmax(1) == y).sum().item()
        acc = correct / len(test)
        print(f"epoch {e} loss {total / n:.4f} test_accuracy {acc:.4f} words_per_s {len(train) / secs:.0f}", flush=True)
    print(f"test_accuracy: {acc:.4f}")


if __name__ == "__main__":
    main()
