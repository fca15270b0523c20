#!/usr/bin/python3
"""PyTorch baseline for bench_tokens: words as int64 token tensors (their bytes, 0-255),
shuffled, batched by a DataLoader with a pad_sequence collate (and the lengths),
num_workers workers. The words are bench_tokens' own choice, read from WORDS (one a line),
so both sides read the same data.

Usage: torch_tokens.py WORKERS BATCH WORDS
  -> prints "<tokens of an epoch> <seconds: median of 3 epochs>". Each epoch is a new
     iterator over the DataLoader (its workers started in the epoch's time, as without
     persistent_workers), as each of bench_tokens' runs is a new pipeline.
"""
import statistics
import sys
import time

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset


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
    workers, batch, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    with open(path, "rb") as f:
        words = [w for w in f.read().split(b"\n") if w]
    dl = DataLoader(Words(words), batch_size=batch, shuffle=True, num_workers=workers, collate_fn=collate)
    times = []
    tokens = 0
    for _ in range(3):
        t0 = time.perf_counter()
        tokens = 0
        for x, lengths in dl:
            tokens += int(lengths.sum())
        times.append(time.perf_counter() - t0)
    print(tokens, statistics.median(times))


if __name__ == "__main__":
    main()
