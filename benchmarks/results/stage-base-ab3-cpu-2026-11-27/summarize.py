# The A/B table of this folder: python3 summarize.py DIR (medians of the runs in DIR).
# Each figure: (name, the outputs' file prefix, the regex whose last match is the figure).
import glob
import json
import re
import statistics
import sys

d = sys.argv[1]
FIGURES = [
    ("overhead_ratio 4Mi", "overhead4", r"overhead_ratio: ([\d.]+)"),
    ("overhead_ratio 16Mi", "overhead16", r"overhead_ratio: ([\d.]+)"),
    ("typed next ns 4Mi", "overhead4", r'"typed_next_ns_per_elem":([\d.]+)'),
    ("typed next ns 16Mi", "overhead16", r'"typed_next_ns_per_elem":([\d.]+)'),
    ("erased next ns 4Mi", "overhead4", r'"erased_next_ns_per_elem":([\d.]+)'),
    ("erased batch ns 4Mi", "overhead4", r'"erased_batch_ns_per_elem":([\d.]+)'),
    ("prefetch handoff ns 4Mi", "overhead4", r'"prefetch_handoff_ns":([-\d.]+)'),
    ("sweep median ratio", "sweep", None),  # the median of each run's sweep ratios
    ("fmnist steady ratio", "fmnist", r"pipeline_ratio_steady_w1: ([\d.]+)"),
    ("read fixed/cat", "read", r"ratio fixed/cat: ([\d.]+)"),
    ("read tfrecord/cat", "read", r"ratio tfrecord/cat: ([\d.]+)"),
    ("read tfrecord/cat ra0", "read", r"ratio tfrecord/cat, read_ahead = 0: ([\d.]+)"),
    ("read interleave/cat", "read", r"ratio tfrecord interleave/cat: ([\d.]+)"),
    ("read ferry/pytorch", "read", r"ratio ferry/pytorch records/s: ([\d.]+)"),
]


def runs(prefix, side, rx):
    out = []
    for f in sorted(glob.glob(f"{d}/{prefix}-{side}-*.txt")):
        text = open(f).read()
        if rx is None:
            rs = [json.loads(l)["ratio"] for l in text.splitlines() if l.startswith('{"bench":"sweep"')]
            if rs:
                out.append(statistics.median(rs))
        elif m := re.findall(rx, text):
            out.append(float(m[-1]))
    return out


print("| figure | old | new | new/old | old runs | new runs |")
print("|---|---|---|---|---|---|")
for name, prefix, rx in FIGURES:
    o, n = runs(prefix, "old", rx), runs(prefix, "new", rx)
    mo, mn = statistics.median(o), statistics.median(n)
    print(f"| {name} | {mo:.3f} | {mn:.3f} | {mn / mo:.2f} | {', '.join(f'{x:.3g}' for x in o)} | "
          f"{', '.join(f'{x:.3g}' for x in n)} |")
