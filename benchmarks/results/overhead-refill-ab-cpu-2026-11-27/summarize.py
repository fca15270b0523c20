# Prints the A/B table of this folder's raw outputs: the median of each figure, old and new.
import glob, json, re


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def runs(pat, side):
    return [open(f).read() for f in sorted(glob.glob(pat.replace('SIDE', side)))]


def metric(pat, key):
    return {s: [float(re.search(re.escape(key) + r'\s*([0-9.]+)', t).group(1)) for t in runs(pat, s)] for s in ('old', 'new')}


def jfield(pat, field):
    out = {}
    for s in ('old', 'new'):
        out[s] = [json.loads(l)[field] for t in runs(pat, s) for l in t.splitlines() if l.startswith('{"bench":"overhead"')]
    return out


def sweep_median():
    return {s: [med([json.loads(l)['ratio'] for l in t.splitlines() if l.startswith('{')]) for t in runs('sweep-SIDE-*.txt', s)]
            for s in ('old', 'new')}


rows = [
    ('bench_overhead `overhead_ratio`, 4 Mi', metric('overhead4-SIDE-*.txt', 'overhead_ratio:')),
    ('bench_overhead `overhead_ratio`, 16 Mi', metric('overhead16-SIDE-*.txt', 'overhead_ratio:')),
    ('bench_overhead ferry ns/element, 16 Mi', jfield('overhead16-SIDE-*.txt', 'ferry_ns_per_elem')),
    ('bench_overhead hand loop ns/element, 16 Mi', jfield('overhead16-SIDE-*.txt', 'loop_ns_per_elem')),
    ('bench_overhead erased batch ns/element, 16 Mi', jfield('overhead16-SIDE-*.txt', 'erased_batch_ns_per_elem')),
    ('bench_overhead typed next() ns/element, 16 Mi', jfield('overhead16-SIDE-*.txt', 'typed_next_ns_per_elem')),
    ('bench_overhead erased next() ns/element, 16 Mi', jfield('overhead16-SIDE-*.txt', 'erased_next_ns_per_elem')),
    ('bench_overhead prefetch hand-off ns/batch, 16 Mi', jfield('overhead16-SIDE-*.txt', 'prefetch_handoff_ns')),
    ('bench_sweep, median ferry/loop over the sweep', sweep_median()),
    ('bench_sweep `sweep_min_ratio`', metric('sweep-SIDE-*.txt', 'sweep_min_ratio:')),
    ('bench_fmnist_pipeline steady ratio', metric('fmnist-SIDE-*.txt', 'pipeline_ratio_steady_w1:')),
    ('bench_fmnist_pipeline epoch-1 ratio', metric('fmnist-SIDE-*.txt', 'pipeline_ratio_epoch1_w1:')),
    ('bench_read fixed / cat', metric('read-SIDE-*.txt', 'ratio fixed/cat:')),
    ('bench_read tfrecord / cat', metric('read-SIDE-*.txt', 'ratio tfrecord/cat:')),
    ('bench_read interleave / cat', metric('read-SIDE-*.txt', 'ratio tfrecord interleave/cat:')),
    ('bench_read ferry / PyTorch DataLoader records/s', metric('read-SIDE-*.txt', 'ratio ferry/pytorch records/s:')),
]
print('| figure | old (f1e35ff) | new | new / old | runs |')
print('|---|---|---|---|---|')
for name, d in rows:
    o, n = med(d['old']), med(d['new'])
    print(f'| {name} | {o:.3g} | {n:.3g} | {n / o:.2f} | {len(d["old"])} + {len(d["new"])} |')
