#!/usr/bin/python3
"""Writes the small committed fixtures in tests/data/sources/ with real writers (NumPy).

Run from the repository root: /usr/bin/python3 tests/sources/make_fixtures.py
The TFRecord fixtures are three records as TensorFlow's TFRecordWriter writes them (an
empty payload, b"hello", 32 zero bytes), concatenated; the tests check their test-side
writer byte for byte against them.
"""
import gzip
import os
import numpy as np

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "sources")
os.makedirs(out, exist_ok=True)
P = lambda n: os.path.join(out, n)

# --- npy, by numpy.save / numpy.lib.format ----------------------------------------
a = np.arange(6, dtype="<f4").reshape(2, 3)
np.save(P("f4_2x3.npy"), a)                       # 152 bytes: v1.0, header length 118
np.save(P("u1_4x2x3.npy"), np.arange(24, dtype=np.uint8).reshape(4, 2, 3))
np.save(P("i2be_5.npy"), np.array([1, -2, 300, -400, 5], dtype=">i2"))
np.save(P("scalar_f8.npy"), np.float64(2.5))
np.save(P("bool_3.npy"), np.array([True, False, True]))
np.save(P("empty_0x4.npy"), np.zeros((0, 4), dtype="<i4"))
np.save(P("fortran_1d.npy"), np.asfortranarray(np.arange(3, dtype="<i8")))
for v in [(2, 0), (3, 0)]:
    with open(P("f4_2x3_v%d.npy" % v[0]), "wb") as f:
        np.lib.format.write_array(f, a, version=v)
np.save(P("object.npy"), np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
np.save(P("structured.npy"), np.zeros(2, dtype=[("x", "<f4"), ("y", "<i4")]))
np.save(P("fortran_2d.npy"), np.asfortranarray(np.arange(6, dtype="<f4").reshape(2, 3)))

# --- IDX: written the way the MNIST files are --------------------------------------
def idx_bytes(arr, code):
    hdr = bytes([0, 0, code, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return hdr + arr.tobytes()

imgs = (np.arange(3 * 4 * 5) % 251).astype(np.uint8).reshape(3, 4, 5)
open(P("u1_3x4x5.idx"), "wb").write(idx_bytes(imgs, 0x08))
with gzip.open(P("u1_3x4x5.idx.gz"), "wb") as f:
    f.write(idx_bytes(imgs, 0x08))
open(P("f4be_2x2.idx"), "wb").write(idx_bytes(np.array([[1.5, -2], [3, 4]], dtype=">f4"), 0x0D))

# --- TFRecord: TensorFlow's bytes for three records -------------------------------
vec = bytes.fromhex("000000000000000029039807d8ea82a2"
                    "0500000000000000eab2043e68656c6c6fbb1f1c19"
                    "200000000000000029eda950" + "00" * 32 + "faffd70f")
open(P("vectors.tfrecord"), "wb").write(vec)
with gzip.open(P("vectors.tfrecord.gz"), "wb") as f:
    f.write(vec)
print("fixtures written to", os.path.normpath(out))
