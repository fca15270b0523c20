#!/usr/bin/python3
"""PyTorch baseline for bench_tokens: words as int64 token tensors (their bytes), shuffled,
batched by a DataLoader with a pad_sequence collate (and the lengths), num_workers workers.

Usage: torch_tokens.py WORKERS BATCH LIMIT DICT_DIR  -> prints real tokens per second.
"""
import os
import sys
import time

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

LISTS = ["american-english", "french", "ngerman", "spanish", "italian", "portuguese", "dutch"]


class Words(Dataset):
    def __init__(self, words):
        self.words = words

    def __len__(self):
        return len(self.words)

    def __getitem__(self, i):
        return torch.tensor(list(self.words[i]), dtype=torch.int64)


def collate(batch):
    return pad_sequence(batch, batch_first=True), torch.tensor([len(t) for t in batch])


def main():
    workers, batch, limit, d = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    words = []
    for name in LISTS:
        p = os.path.join(d, name)
        if os.path.exists(p):
            with open(p, "rb") as f:
                words += [w for w in f.read().split(b"\n") if w]
    g = torch.Generator().manual_seed(2026)
    words = [words[i] for i in torch.randperm(len(words), generator=g)[:limit].tolist()]
    dl = DataLoader(Words(words), batch_size=batch, shuffle=True, num_workers=workers, collate_fn=collate)
    t0 = time.perf_counter()
    tokens = 0
    for x, lengths in dl:
        tokens += int(lengths.sum())
    print(tokens / (time.perf_counter() - t0))


if __name__ == "__main__":
    main()
