#!/usr/bin/env python3
"""Checks a ferry Chrome trace: valid JSON, well-formed events inside the session, nesting
per thread, and the named stages present.

usage: check_trace.py TRACE.json [--events N] [--dropped N] [--named-threads] [NAME[=MIN] ...]
  --events N        exactly N complete ("X") events
  --dropped N       otherData.dropped_events must be exactly N
  --named-threads   every thread with events has a thread_name metadata event
  NAME[=MIN]        at least MIN (default 1) complete events with this name
"""
import json
import sys

args = sys.argv[1:]
path = args.pop(0)
want_events = None
want_dropped = None
named_threads = False
names = {}
while args:
    a = args.pop(0)
    if a == "--events":
        want_events = int(args.pop(0))
    elif a == "--dropped":
        want_dropped = int(args.pop(0))
    elif a == "--named-threads":
        named_threads = True
    else:
        name, _, least = a.partition("=")
        names[name] = int(least) if least else 1

with open(path) as f:
    doc = json.load(f)  # raises on invalid JSON
errors = []
evs = doc.get("traceEvents")
if not isinstance(evs, list):
    errors.append("no traceEvents list")
    evs = []
complete = [e for e in evs if e.get("ph") == "X"]
for e in complete:
    for k in ("name", "ts", "dur", "tid", "pid"):
        if k not in e:
            errors.append(f"event without {k}: {e}")
    if e.get("dur", 0) < 0 or e.get("ts", 0) < 0:
        errors.append(f"negative time: {e}")
# On each thread, events either nest or follow one another: one that overlaps a later
# one without containing it is drawn wrong (Perfetto stacks complete events by time).
# Times are printed to 3 decimals: allow for their rounding.
by_tid = {}
for e in complete:
    if all(k in e for k in ("ts", "dur", "tid")):
        by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e.get("name")))
for tid, spans in by_tid.items():
    spans.sort(key=lambda s: (s[0], -s[1]))
    open_ = []  # ends of the enclosing events
    for t0, t1, name in spans:
        while open_ and open_[-1] <= t0 + 0.005:
            open_.pop()
        if open_ and t1 > open_[-1] + 0.005:
            errors.append(f"thread {tid}: {name!r} [{t0}, {t1}] overlaps an enclosing event ending at {open_[-1]}")
        open_.append(t1)
# Every event lies inside the session: [0, session_us].
span = doc.get("otherData", {}).get("session_us")
if not isinstance(span, (int, float)):
    errors.append("otherData.session_us missing")
else:
    for e in complete:
        if e.get("ts", 0) + e.get("dur", 0) > span + 0.005:
            errors.append(f"event ends after the session ({span} us): {e}")
            break
for e in evs:
    if e.get("ph") == "M" and not e.get("args", {}).get("name"):
        errors.append(f"metadata event without a name: {e}")
seen = {}
for e in complete:
    if "name" in e:
        seen[e["name"]] = seen.get(e["name"], 0) + 1
for n, least in names.items():
    if seen.get(n, 0) < least:
        errors.append(f"{seen.get(n, 0)} events named {n!r}, expected at least {least} (have {sorted(seen)})")
if named_threads:
    named = {e.get("tid") for e in evs if e.get("ph") == "M" and e.get("name") == "thread_name"}
    for tid in by_tid:
        if tid not in named:
            errors.append(f"thread {tid} has events but no thread_name metadata")
if want_events is not None and len(complete) != want_events:
    errors.append(f"{len(complete)} events, expected {want_events}")
dropped = doc.get("otherData", {}).get("dropped_events")
if not isinstance(dropped, int):
    errors.append("otherData.dropped_events missing")
elif want_dropped is not None and dropped != want_dropped:
    errors.append(f"{dropped} dropped events, expected {want_dropped}")
if doc.get("otherData", {}).get("recorded_events") != len(complete):
    errors.append("otherData.recorded_events does not match the events written")
for e in errors:
    print("check_trace:", e)
print(f"check_trace: {len(complete)} events, {dropped} dropped, names {dict(sorted(seen.items()))}")
sys.exit(1 if errors else 0)
