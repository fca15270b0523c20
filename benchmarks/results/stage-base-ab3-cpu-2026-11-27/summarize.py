# The A/B table of this folder: python3 summarize.py DIR (medians of the runs in DIR).
import sys,re,json,glob,statistics as st
d=sys.argv[1]
def med(xs): return st.median(xs) if xs else float('nan')
def grab(pat, side, rx, conv=float, multi=False):
    out=[]
    for f in sorted(glob.glob(f'{d}/{pat}-{side}-*.txt')):
        t=open(f).read()
        m=re.findall(rx,t)
        if m: out.append(conv(m[-1]))
    return out
rows=[]
def row(name,pat,rx):
    o=grab(pat,'old',rx); n=grab(pat,'new',rx)
    rows.append((name,med(o),med(n),o,n))
row('overhead_ratio 4Mi','overhead4',r'overhead_ratio: ([\d.]+)')
row('overhead_ratio 16Mi','overhead16',r'overhead_ratio: ([\d.]+)')
row('typed next ns 4Mi','overhead4',r'"typed_next_ns_per_elem":([\d.]+)')
row('typed next ns 16Mi','overhead16',r'"typed_next_ns_per_elem":([\d.]+)')
row('erased next ns 4Mi','overhead4',r'"erased_next_ns_per_elem":([\d.]+)')
row('erased batch ns 4Mi','overhead4',r'"erased_batch_ns_per_elem":([\d.]+)')
row('prefetch handoff ns 4Mi','overhead4',r'"prefetch_handoff_ns":([-\d.]+)')


# sweep: median of ratios per run
def sweep(side):
    out=[]
    for f in sorted(glob.glob(f'{d}/sweep-{side}-*.txt')):
        rs=[json.loads(l)['ratio'] for l in open(f) if l.startswith('{"bench":"sweep"')]
        if rs: out.append(st.median(rs))
    return out
o,n=sweep('old'),sweep('new'); rows.append(('sweep median ratio',med(o),med(n),o,n))
row('fmnist steady ratio','fmnist',r'pipeline_ratio_steady_w1: ([\d.]+)')
row('read fixed/cat','read',r'ratio fixed/cat: ([\d.]+)')
row('read tfrecord/cat','read',r'ratio tfrecord/cat: ([\d.]+)')
row('read tfrecord/cat ra0','read',r'ratio tfrecord/cat, read_ahead = 0: ([\d.]+)')
row('read interleave/cat','read',r'ratio tfrecord interleave/cat: ([\d.]+)')
row('read ferry/pytorch','read',r'ratio ferry/pytorch records/s: ([\d.]+)')
print('| figure | old | new | new/old | old runs | new runs |'); print('|---|---|---|---|---|---|')
for name,o,n,os_,ns in rows:
    print(f'| {name} | {o:.3f} | {n:.3f} | {n/o if o==o and o else float("nan"):.2f} | {", ".join(f"{x:.3g}" for x in os_)} | {", ".join(f"{x:.3g}" for x in ns)} |')
