#!/usr/bin/python3
"""Runs ferry's benchmarks, keeps their results as JSON and draws the figures.

    scripts/bench.py                      # build ./build, run every benchmark, draw figures
    scripts/bench.py --only sweep,read    # a chosen part (benchmark names or suites)
    scripts/bench.py --quick              # smaller sizes for the CPU benchmarks (a smoke run)
    scripts/bench.py --figures-only       # redraw from the results already kept
    scripts/bench.py --list               # what there is to run

The benchmarks are the ones the build registers with Meson's benchmark() (read from
`meson introspect --benchmarks`), so a new one is picked up without touching this script.
Each run is kept as benchmarks/results/<name>-<host>-<date>.json: the command, exit
status (77 = skipped, no GPU), the full output, and what could be read from it (JSON
lines, `key: number` lines, tables). The figures (benchmarks/results/figures/*.png) use
the newest result of each benchmark, whichever machine it came from:
    throughput_vs_workers.png   sweep: items/s against map workers, ferry and the loop
    throughput_vs_batch.png     sweep: items/s against batch size, ferry and the loop
    ferry_vs_baselines.png      every benchmark's ferry/baseline ratio (same run), as speed
    gpu_copy_overlap.png        distribute on a GPU: copy GB/s and hidden-copy step times
                                (only once a GPU run's results exist)
Needs python3-matplotlib (Debian). Exits non-zero when a benchmark failed.
"""
import argparse
import datetime
import glob
import json
import os
import re
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
FIGURES = os.path.join(RESULTS, "figures")

# --quick: smaller arguments for the CPU benchmarks whose arguments are sizes.
QUICK_ARGS = {
    "overhead": ["4194304", "5"],
    "read": ["64", "1024"],
    "cache": ["64", "1024"],
    "sweep": ["262144", "32", "3"],
}
# Benchmarks that write their rows to a file given with --json.
JSON_FILE_ARG = {"collective_mpi_np2", "collective_mpi_np4", "collective_nccl"}

KEY_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):\s+(-?[0-9.]+(?:[eE][-+]?[0-9]+)?)\b")
NUM = re.compile(r"^-?[0-9.]+(?:[eE][-+]?[0-9]+)?$")
GPU_ROW = re.compile(r"^(raw cudaMemcpyAsync, pinned|raw cudaMemcpyAsync, pageable|distribute\(devices\{0\}\)|"
                     r"kernel on device-resident data|kernel fed by distribute)\s+(\d+)\s+(\d+)\s+([0-9.]+)\s+(\S+)$")
FED_ROW = re.compile(r"^(on-device|on-device-nograph|fed|fed-epoch1)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)$")


# ----------------------------------------------------------------------------- running
def introspect(build):
    out = subprocess.run(["meson", "introspect", "--benchmarks", build], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def suites(b):
    """A benchmark's suites, with and without the project prefix ("ferry:distribute")."""
    return {x for s in b.get("suite", []) for x in (s, s.split(":", 1)[-1])}


def selected(benches, only, exclude):
    def match(b, names):
        return b["name"] in names or bool(suites(b) & names)
    if only:
        names = set(only.split(","))
        unknown = names - {b["name"] for b in benches} - {s for b in benches for s in suites(b)}
        if unknown:  # e.g. a GPU benchmark this build could not make: run the others
            print(f"bench.py: not in this build, skipped: {', '.join(sorted(unknown))} (try --list)",
                  file=sys.stderr)
        benches = [b for b in benches if match(b, names)]
    if exclude:
        benches = [b for b in benches if not match(b, set(exclude.split(",")))]
    return benches


def parse_output(text):
    """What can be read from a benchmark's output, whatever its shape."""
    records, metrics, tables, gpu_rows, fed_rows = [], {}, [], [], []
    header = None
    rows = []
    for raw in text.splitlines():
        line = raw.strip()
        cand = line[5:] if line.startswith("JSON ") else line
        if cand.startswith("{"):
            try:
                obj = json.loads(cand)
                if isinstance(obj, dict):
                    records.append(obj)
                    continue
            except json.JSONDecodeError:
                pass
        m = KEY_LINE.match(line)
        if m:
            metrics[m[1]] = float(m[2])
        m = GPU_ROW.match(line)
        if m:
            gpu_rows.append({"what": m[1], "bytes_per_step": int(m[2]), "steps": int(m[3]),
                             "time_per_step_us": float(m[4]), "gbs": None if m[5] == "-" else float(m[5])})
        m = FED_ROW.match(line)
        if m:
            fed_rows.append({"what": m[1], "steps": int(m[2]), "time_per_step_us": float(m[3]),
                             "samples_per_s": float(m[4])})
        # Plain tables: a header of words, then rows of numbers with as many columns.
        toks = line.lstrip("# ").split()
        if toks and all(NUM.match(t) for t in toks) and header and len(toks) == len(header):
            rows.append({h: float(t) for h, t in zip(header, toks)})
            continue
        if rows:
            tables.append({"columns": header, "rows": rows})
        rows = []
        header = toks if toks and not any(NUM.match(t) for t in toks) and len(toks) > 2 else None
    if rows:
        tables.append({"columns": header, "rows": rows})
    return {"records": records, "metrics": metrics, "tables": tables, "gpu_rows": gpu_rows,
            "fed_rows": fed_rows}


def git_commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine():
    info = {"host": socket.gethostname(), "cpus": os.cpu_count()}
    # The lent GPU machines and the CPU machine share a host name ("vm"): a GPU's name is
    # added, so results and figures say which machine they came from.
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        pass
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        if gpu.returncode == 0 and gpu.stdout.strip():
            info["gpu"] = gpu.stdout.strip().splitlines()
            info["host"] += "-" + re.sub(r"[^a-z0-9]+", "-", info["gpu"][0].lower().replace("nvidia", "")).strip("-")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def run_one(b, build, quick, extra_args):
    cmd = list(b["cmd"])
    if b["name"] in extra_args:
        cmd = cmd[:1] + extra_args[b["name"]]
    elif quick and b["name"] in QUICK_ARGS:
        cmd = cmd[:1] + QUICK_ARGS[b["name"]]
    json_file = None
    if b["name"] in JSON_FILE_ARG:
        json_file = os.path.join("/tmp", f"ferry-bench-{b['name']}-{os.getpid()}.json")
        cmd += ["--json", json_file]
    env = dict(os.environ)
    env.update(b.get("env") or {})
    timeout = b.get("timeout") or None
    print(f"== {b['name']}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=b.get("workdir") or build, env=env, capture_output=True, text=True,
                           timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc = 124
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\nbench.py: timed out after {timeout} s\n"
    seconds = time.monotonic() - t0
    sys.stdout.write(out if out.endswith("\n") or not out else out + "\n")
    status = "pass" if rc == 0 else "skip" if rc == 77 else "fail"
    result = {"benchmark": b["name"], "suite": b.get("suite", []), "command": cmd, "returncode": rc,
              "status": status, "seconds": round(seconds, 3)}
    result.update(parse_output(out))
    if json_file and os.path.exists(json_file):
        try:
            with open(json_file) as f:
                rows = json.load(f)
            result["records"] += rows if isinstance(rows, list) else [rows]
        except (OSError, json.JSONDecodeError) as e:
            result["json_file_error"] = str(e)
        os.remove(json_file)
    result["output"] = out
    print(f"-- {b['name']}: {status} ({seconds:.1f} s)", flush=True)
    return result


def save(result, info, stamp):
    os.makedirs(RESULTS, exist_ok=True)
    result = dict(result, host=info["host"], date=stamp, machine=info, commit=git_commit())
    path = os.path.join(RESULTS, f"{result['benchmark']}-{info['host']}-{stamp}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return path


def latest_results():
    """The newest kept result of each benchmark that passed, by its date."""
    best = {}
    for path in glob.glob(os.path.join(RESULTS, "*.json")):
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(r, dict) or "benchmark" not in r or r.get("status") != "pass":
            continue
        if r["benchmark"] not in best or r.get("date", "") > best[r["benchmark"]].get("date", ""):
            best[r["benchmark"]] = r
    return best


# ----------------------------------------------------------------------------- figures
def ratios(latest):
    """(label, ferry speed / baseline speed, host) for every comparison we know how to read.

    Each benchmark prints its ratio its own way round; here all become "how fast ferry is
    relative to its baseline", so 1 is parity and more is better."""
    out = []

    def add(label, v, r, invert=False):
        if v is not None and v > 0:
            out.append((label, 1.0 / v if invert else v, r["host"]))

    def rec(r, bench=None):
        return [x for x in r.get("records", []) if bench is None or x.get("bench") == bench]

    for name, r in sorted(latest.items()):
        m = r.get("metrics", {})
        if name == "overhead":
            add("overhead: map|batch vs hand loop", m.get("overhead_ratio"), r, invert=True)
        elif name == "read":
            for x in rec(r, "read")[:1]:
                add("read: fixed_length vs cat", x.get("ratio_fixed_cat"), r)
                add("read: tfrecord (CRC) vs cat", x.get("ratio_tfrecord_cat"), r)
                if x.get("ratio_interleave_cat") is not None:
                    add("read: tfrecord interleave(4) vs cat", x.get("ratio_interleave_cat"), r)
                add("read: vs PyTorch DataLoader", x.get("ratio_torch"), r)
        elif name == "fmnist_pipeline":
            for x in rec(r, "fmnist_pipeline")[:1]:
                for f in x.get("ferry", []):
                    add(f"example pipeline, {f['workers']} map worker(s), steady epochs vs hand loop",
                        f.get("ratio_steady"), r)
                    add(f"example pipeline, {f['workers']} map worker(s), epoch 1 (gzip) vs hand loop",
                        f.get("ratio_epoch1"), r)
        elif name == "gzip":
            for x in rec(r, "gzip")[:1]:
                if x.get("isal"):
                    add("gzip read (ISA-L) vs gzip -dc", x.get("ratio_isal_gzip"), r)
                    add("gzip read (ISA-L) vs Python's gzip", x.get("ratio_isal_python"), r)
                add("gzip read (zlib) vs gzip -dc", x.get("ratio_zlib_gzip"), r)
        elif name == "cache":
            for x in rec(r, "cache")[:1]:
                add("cache(): replay vs hand copy loop", x.get("ratio_memory_loop"), r)
                add("cache(path): replay vs cat", x.get("ratio_file_cat"), r)
        elif name == "sweep":
            for x in rec(r, "sweep"):
                if (x["sweep"], x["workers"], x["batch"]) in {("workers", 1, 256), ("workers", 2, 256),
                                                               ("batch", 1, 1)}:
                    add(f"sweep: map workers={x['workers']} batch={x['batch']} vs threaded loop", x["ratio"], r)
                elif x["sweep"] == "autotune":
                    add("sweep: map autotune (learned) vs threaded loop", x["ratio"], r)
                elif x["sweep"] == "autotune-io":
                    add("sweep: map autotune, blocking fn, vs 8 threads", x["ratio"], r)
        elif name == "distribute_cpu":
            for t in r.get("tables", []):
                for row in t["rows"]:
                    if row.get("global") == 1024 and "ratio" in row:
                        add(f"distribute(host_replicas{{{int(row['replicas'])}}}) vs slicing loop", row["ratio"],
                            r, invert=True)
        elif name == "distribute_gpu":
            add("distribute GPU: H2D GB/s vs raw cudaMemcpyAsync", m.get("h2d_ratio"), r)
            add("distribute GPU: step time, on-device vs fed", m.get("hidden_copy_ratio"), r, invert=True)
        elif name.startswith("observe"):
            tag = "uninstrumented" if "uninstrumented" in name else "stats off"
            add(f"observe ({tag}): map|batch vs hand loop", m.get("off_ratio_bulk"), r, invert=True)
        elif name.startswith("collective"):
            rows = [x for x in r.get("records", []) if "ratio" in x and "bytes" in x]
            if rows:
                big = max(rows, key=lambda x: x["bytes"])
                bad = " (#wrong > 0!)" if any(x.get("wrong") for x in rows) else ""
                if name == "collective_nccl" and len(r.get("machine", {}).get("gpu") or []) < 2:
                    # One rank's all-reduce moves no data: both times are a call's cost.
                    add(f"{name}: one rank (no data moved), cost of a call vs raw call{bad}", big["ratio"], r,
                        invert=True)
                else:
                    add(f"{name}: all-reduce {big['bytes'] >> 20} MiB vs raw call{bad}", big["ratio"], r, invert=True)
        elif name.startswith("train_fashion_mnist"):
            for x in r.get("records", []):
                if x.get("benchmark") == "fashion_mnist_time_to_accuracy":
                    dev = "GPU" if "gpu" in name else "CPU"
                    add(f"train ({dev}): time to {x.get('target')} accuracy vs PyTorch", x.get("ratio"), r,
                        invert=True)
        elif name in ("train_fed_gpu", "train_fed_gpu_nographs"):
            # With CUDA graphs (the default since 2026-11-26; before, --graphs 1, kept as
            # train_fed_gpu_graphs, now superseded) the run also times a trainer without them:
            # its row says which the run was.
            graphed = any(x.get("what") == "on-device-nograph" for x in r.get("fed_rows", []))
            g = " (CUDA graphs)" if graphed else " (launches)"
            add(f"train GPU{g}: step time, on-device vs fed", m.get("train_fed_ratio"), r, invert=True)
            add(f"train GPU{g}: step time, on-device vs fed, epoch 1 (gzip)", m.get("train_fed_ratio_epoch1"), r,
                invert=True)
            if m.get("graph_step_speedup"):
                add("train GPU: on-device step, CUDA graphs vs launches", m.get("graph_step_speedup"), r)
    return out


def draw(latest, plt):
    os.makedirs(FIGURES, exist_ok=True)
    drawn = []

    def finish(fig, name):
        path = os.path.join(FIGURES, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        drawn.append(path)

    sweep = latest.get("sweep")
    if sweep:
        rows = [x for x in sweep.get("records", []) if x.get("bench") == "sweep"]
        sub = f"{sweep['host']}, {sweep['machine'].get('cpus')} CPUs, {sweep['date']}"
        w = sorted((x for x in rows if x["sweep"] == "workers"), key=lambda x: x["workers"])
        if w:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            xs = [x["workers"] for x in w]
            ax.plot(xs, [x["ferry_items_per_s"] / 1e6 for x in w], "o-", label="ferry map(workers) | batch(256)")
            ax.plot(xs, [x["loop_items_per_s"] / 1e6 for x in w], "s--", label="hand-written threads, same work")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(v) for v in xs])
            ax.set_yscale("log")
            ax.set_xlabel("map workers (threads)")
            ax.set_ylabel("million items/s (log)")
            ax.set_title(f"Throughput against workers ({w[0]['rounds']} mixing rounds/item)\n{sub}", fontsize=10)
            ax.axvline(sweep["machine"].get("cpus") or 1, color="grey", lw=0.8, ls=":")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            finish(fig, "throughput_vs_workers.png")
        bt = [x for x in rows if x["sweep"] == "batch"]
        if bt:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for wk, style in zip(sorted({x["workers"] for x in bt}), ["o", "^", "v", "d"]):
                s = sorted((x for x in bt if x["workers"] == wk), key=lambda x: x["batch"])
                xs = [x["batch"] for x in s]
                line, = ax.plot(xs, [x["ferry_items_per_s"] / 1e6 for x in s], style + "-",
                                label=f"ferry, {wk} worker{'s' if wk > 1 else ''}")
                ax.plot(xs, [x["loop_items_per_s"] / 1e6 for x in s], style + "--", color=line.get_color(),
                        alpha=0.6, label=f"hand loop, {wk} thread{'s' if wk > 1 else ''}")
            ax.set_xscale("log", base=2)
            bs = sorted({x["batch"] for x in bt})
            ax.set_xticks(bs, [str(v) for v in bs])
            ax.set_yscale("log")
            ax.set_xlabel("batch size (elements)")
            ax.set_ylabel("million items/s (log)")
            ax.set_title(f"Throughput against batch size\n{sub}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            finish(fig, "throughput_vs_batch.png")

    rs = ratios(latest)
    if rs:
        hosts = sorted({h for _, _, h in rs})
        fig, ax = plt.subplots(figsize=(9, 0.42 * len(rs) + 1.6))
        labels = [l + (f"  [{h}]" if len(hosts) > 1 else "") for l, _, h in rs]
        vals = [v for _, v, _ in rs]
        colors = ["#2a9d8f" if v >= 0.95 else "#e9c46a" if v >= 0.5 else "#e76f51" for v in vals]
        y = list(range(len(rs)))[::-1]
        ax.barh(y, vals, color=colors)
        ax.set_yticks(y, labels, fontsize=8)
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", lw=1)
        lo, hi = min(vals + [0.5]), max(vals + [2.0])
        ax.set_xlim(lo / 2, hi * 3)
        for yi, v in zip(y, vals):
            ax.text(v * 1.08, yi, f"{v:.3g}×", va="center", fontsize=8)
        ax.set_xlabel("ferry speed ÷ baseline speed, same run (log scale; 1 = parity, > 1: ferry faster)")
        dates = sorted(r.get("date", "?") for r in latest.values())
        when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
        ax.set_title(f"ferry against its baselines ({', '.join(hosts)})\nnewest passing results, {when}", fontsize=10)
        ax.grid(True, axis="x", which="both", alpha=0.3)
        finish(fig, "ferry_vs_baselines.png")

    gpu = latest.get("distribute_gpu")
    fed = latest.get("train_fed_gpu")
    if gpu and gpu.get("gpu_rows"):
        rows = {x["what"]: x for x in gpu["gpu_rows"]}
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
        names = ["raw cudaMemcpyAsync, pageable", "raw cudaMemcpyAsync, pinned", "distribute(devices{0})"]
        names = [n for n in names if n in rows]
        a1.bar(range(len(names)), [rows[n]["gbs"] for n in names], color=["#bbb", "#888", "#2a9d8f"][:len(names)])
        a1.set_xticks(range(len(names)), [n.replace("raw cudaMemcpyAsync, ", "raw, ") for n in names], fontsize=8)
        a1.set_ylabel("host-to-device GB/s")
        a1.set_title("Copy throughput (16 MiB steps)", fontsize=10)
        steps = ["kernel on device-resident data", "kernel fed by distribute"]
        labels = ["data already\non device", "fed by\ndistribute"]
        vals = [rows[n]["time_per_step_us"] for n in steps if n in rows]
        if fed and fed.get("fed_rows"):
            fr = {x["what"]: x for x in fed["fed_rows"]}
            if "on-device" in fr and "fed" in fr:
                vals += [fr["on-device"]["time_per_step_us"], fr["fed"]["time_per_step_us"]]
                step = "MLP graph" if "on-device-nograph" in fr else "MLP step"
                labels += [f"{step},\non device", f"{step},\nfed"]
            if "fed-epoch1" in fr:
                vals.append(fr["fed-epoch1"]["time_per_step_us"])
                labels.append("MLP step, fed,\nepoch 1 (gzip)")
        a2.bar(range(len(vals)), vals, color=(["#888", "#2a9d8f"] * 2 + ["#e9c46a"])[:len(vals)])
        a2.set_xticks(range(len(vals)), labels[:len(vals)], fontsize=8)
        a2.set_ylabel("µs per step")
        a2.set_title("Copy hidden behind compute (equal bars = fully hidden)", fontsize=10)
        dev = ", ".join(gpu["machine"].get("gpu") or [gpu["host"]])
        fig.suptitle(f"GPU copy overlap — {dev}, {gpu['date']}", fontsize=10)
        finish(fig, "gpu_copy_overlap.png")
    return drawn


# ----------------------------------------------------------------------------- main
def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.environ.get("FERRY_BUILD", os.path.join(ROOT, "build")))
    p.add_argument("--only", help="comma-separated benchmark names or suites")
    p.add_argument("--exclude", help="comma-separated benchmark names or suites to leave out")
    p.add_argument("--quick", action="store_true", help="smaller sizes for overhead, read and sweep")
    p.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                   help="replace a benchmark's arguments, e.g. --args 'sweep=4194304 64 5'")
    p.add_argument("--no-build", action="store_true", help="do not run ninja first")
    p.add_argument("--figures-only", action="store_true", help="draw from the kept results, run nothing")
    p.add_argument("--list", action="store_true")
    a = p.parse_args()

    failed = []
    if not a.figures_only:
        if not os.path.exists(os.path.join(a.build, "build.ninja")):
            sys.exit(f"bench.py: {a.build} is not a configured build (run scripts/setup.sh, or pass --build)")
        benches = selected(introspect(a.build), a.only, a.exclude)
        if a.list:
            for b in benches:
                print(f"{b['name']:40s} suites: {','.join(b.get('suite', []))}")
            return 0
        if not a.no_build:
            subprocess.run(["ninja", "-C", a.build], check=True)
        extra = {}
        for s in a.args:
            name, _, args = s.partition("=")
            extra[name] = args.split()
        info = machine()
        stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M%S")
        summary = []
        for b in benches:
            r = run_one(b, os.path.abspath(a.build), a.quick, extra)
            path = save(r, info, stamp)
            summary.append((b["name"], r["status"], r["seconds"], os.path.relpath(path, ROOT)))
            if r["status"] == "fail":
                failed.append(b["name"])
        print("\n== results")
        for name, status, secs, path in summary:
            print(f"{status:5s} {name:36s} {secs:8.1f} s  {path}")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench.py: matplotlib is missing (Debian: python3-matplotlib; use /usr/bin/python3): no figures")
        return 1 if failed else 0
    latest = latest_results()
    for path in draw(latest, plt):
        print("figure:", os.path.relpath(path, ROOT))
    for label, v, host in ratios(latest):
        print(f"ratio {v:8.3f}  {label}  [{host}]")
    if failed:
        print("bench.py: failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
