#!/usr/bin/python3
"""Runs ferry-inspect on fixture files and checks its exact output against an independent
oracle written here in plain Python (TFRecord framing with its own table-driven CRC-32C,
text lines, fixed-length records; FNV-1a 64 over the payloads in read order).

Usage: test_inspect.py FERRY_INSPECT DATA_DIR   (DATA_DIR: tests/data/sources)
"""
import os
import shutil
import struct
import subprocess
import sys
import tempfile

exe, data = sys.argv[1], sys.argv[2]
failures = []

# --- the oracle ---------------------------------------------------------------------
_T = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    _T.append(c)


def crc32c(b):
    c = 0xFFFFFFFF
    for x in b:
        c = _T[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283  # CRC-32C's check value (the CRC catalogue's)


def masked(c):
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord_payloads(path):
    b = open(path, "rb").read()
    out, off = [], 0
    while off < len(b):
        n = struct.unpack_from("<Q", b, off)[0]
        assert struct.unpack_from("<I", b, off + 8)[0] == masked(crc32c(b[off:off + 8]))
        data = b[off + 12:off + 12 + n]
        assert struct.unpack_from("<I", b, off + 12 + n)[0] == masked(crc32c(data))
        out.append(data)
        off += 16 + n
    return out


def tfrecord(payload):
    n = struct.pack("<Q", len(payload))
    return n + struct.pack("<I", masked(crc32c(n))) + payload + struct.pack("<I", masked(crc32c(payload)))


def lines_payloads(path):
    b = open(path, "rb").read()
    out = b.split(b"\n")
    if out and out[-1] == b"":
        out.pop()
    return [x[:-1] if x.endswith(b"\r") else x for x in out]


def fnv1a64(payloads):
    h = 0xCBF29CE484222325
    for p in payloads:
        for x in p:
            h = ((h ^ x) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def expected(nfiles, payloads, digest=True, skipped=None):
    out = ["files: %d" % nfiles, "records: %d" % len(payloads), "bytes: %d" % sum(map(len, payloads)),
           "fnv1a64: %016x" % fnv1a64(payloads) if digest else "fnv1a64: -"]
    if skipped is not None:
        out.append("skipped: %d" % skipped)
    return out


def check(name, args, want_out, want_err=None, want_rc=0):
    r = subprocess.run([exe] + args, capture_output=True, timeout=60)
    out = r.stdout.decode().splitlines()
    err = r.stderr.decode().splitlines()
    ok = r.returncode == want_rc and out == want_out and (want_err is None or err == want_err)
    print("%s %s" % ("ok  " if ok else "FAIL", name))
    if not ok:
        failures.append(name)
        print("  args:", args)
        print("  rc: %d (want %d)" % (r.returncode, want_rc))
        print("  stdout:", out, "\n  want:  ", want_out)
        print("  stderr:", err, "\n  want:  ", want_err)


# --- the files ----------------------------------------------------------------------
tmp = tempfile.mkdtemp(prefix="ferry-inspect-")
try:
    vec = os.path.join(data, "vectors.tfrecord")
    exs = os.path.join(data, "examples.tfrecord")
    vec_p, exs_p = tfrecord_payloads(vec), tfrecord_payloads(exs)
    assert len(vec_p) >= 3 and len(exs_p) >= 10

    # Three more files with records of every size class, written by this script.
    gen = []
    for k in range(3):
        payloads = [bytes((i * 31 + j * 7 + k) & 0xFF for j in range((i * 977 + k) % 3000)) for i in range(40 + k)]
        p = os.path.join(tmp, "gen%d.tfrecord" % k)
        open(p, "wb").write(b"".join(tfrecord(x) for x in payloads))
        gen.append((p, payloads))
    files = [vec, exs] + [g[0] for g in gen]
    per_file = [vec_p, exs_p] + [g[1] for g in gen]
    allp = [x for ps in per_file for x in ps]

    check("tfrecord, one file", ["--format", "tfrecord", vec], expected(1, vec_p))
    check("tfrecord, five files", ["--format", "tfrecord"] + files, expected(5, allp))
    check("--no-digest", ["--format", "tfrecord", "--no-digest"] + files, expected(5, allp, digest=False))
    for n in (2, 3):
        for i in range(n):
            kept = [ps for j, ps in enumerate(per_file) if j % n == i]
            check("--shard %d/%d" % (i, n), ["--format", "tfrecord", "--shard", "%d/%d" % (i, n)] + files,
                  expected(len(kept), [x for ps in kept for x in ps]))

    # A data CRC mismatch in record 5 of gen1: the error names the file and the offset.
    bad = os.path.join(tmp, "bad.tfrecord")
    payloads = gen[1][1]
    raw = bytearray(open(gen[1][0], "rb").read())
    off5 = sum(16 + len(x) for x in payloads[:5])
    assert len(payloads[5]) > 0
    raw[off5 + 12] ^= 0x01
    open(bad, "wb").write(raw)
    line = "error: %s: corrupted record (data CRC mismatch) at offset %d" % (bad, off5)
    check("CRC mismatch: error and exit 1", ["--format", "tfrecord", vec, bad], [], [line], 1)
    good = vec_p + payloads[:5] + payloads[6:]
    check("CRC mismatch: --on-error skip", ["--format", "tfrecord", "--on-error", "skip", vec, bad],
          expected(2, good, skipped=1), [line])
    check("CRC mismatch: --no-verify reads it", ["--format", "tfrecord", "--no-verify", bad],
          expected(1, payloads[:5] + [bytes([payloads[5][0] ^ 1]) + payloads[5][1:]] + payloads[6:]))

    # A file cut inside record 7: a truncated record at its offset; skip keeps records 0-6.
    cut = os.path.join(tmp, "cut.tfrecord")
    off7 = sum(16 + len(x) for x in payloads[:7])
    open(cut, "wb").write(open(gen[1][0], "rb").read()[:off7 + 20])  # 4 of record 7's payload bytes
    tline = ("error: %s: truncated record (the length field says %d bytes, %d are left in the file) at offset %d"
             % (cut, len(payloads[7]), max(0, 20 - 16), off7))
    check("truncated: error and exit 1", ["--format", "tfrecord", cut], [], [tline], 1)
    check("truncated: --on-error skip", ["--format", "tfrecord", "--on-error", "skip", cut, vec],
          expected(2, payloads[:7] + vec_p, skipped=1), [tline])
    missing = os.path.join(tmp, "missing.tfrecord")
    r = subprocess.run([exe, "--format", "tfrecord", missing], capture_output=True, timeout=60)
    ok = r.returncode == 1 and r.stderr.decode().startswith("error: %s: cannot open" % missing)
    print("%s missing file" % ("ok  " if ok else "FAIL"))
    if not ok:
        failures.append("missing file")

    # Text lines and fixed-length records.
    txt = os.path.join(tmp, "a.txt")
    open(txt, "wb").write(b"alpha\nbeta\r\n\ngamma")
    check("lines", ["--format", "lines", txt], expected(1, lines_payloads(txt)))
    fixed = os.path.join(tmp, "f.bin")
    body = bytes(range(256)) * 3
    open(fixed, "wb").write(b"HDR" + body[:7 * 100] + b"FT")
    check("fixed:7:3:2", ["--format", "fixed:7:3:2", fixed],
          expected(1, [body[i * 7:(i + 1) * 7] for i in range(100)]))
    r = subprocess.run([exe, "--format", "bogus", txt], capture_output=True, timeout=60)
    ok = r.returncode == 2 and r.stdout == b""
    print("%s bad arguments exit 2" % ("ok  " if ok else "FAIL"))
    if not ok:
        failures.append("bad arguments")
finally:
    shutil.rmtree(tmp)

if failures:
    print("%d failed: %s" % (len(failures), ", ".join(failures)))
    sys.exit(1)
print("all passed")
