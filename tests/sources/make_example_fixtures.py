#!/usr/bin/python3
"""Writes the tf.train.Example fixtures in tests/data/sources/ with protobuf's own encoder.

Run from anywhere: /usr/bin/python3 tests/sources/make_example_fixtures.py
Needs Debian's python3-protobuf, protobuf-compiler (protoc) and python3-crcmod.

The .proto below is TensorFlow's feature.proto/example.proto (same package, messages and
field numbers); protoc compiles it to Python at generation time. Outputs:
  examples.txt        cases: payload bytes (hex) and what protobuf's parser makes of them,
                      or the payload byte where a corrupt one goes wrong (hand-derived)
  examples.tfrecord   the encoder-written payloads of examples.txt, as TFRecords (framed
                      here with crcmod's CRC-32C, an implementation that is not ferry's)
  examples_bad.tfrecord  three records: good, corrupt payload (truncated varint), good
  example_cuts.txt    protobuf's verdict (parses / refuses) on every prefix of some of those
                      payloads and on single-byte changes of others, what ferry must do with
                      each, and where a prefix's error is (see the section at the end)
Re-running it writes the same bytes (map entries are serialized in key order).
"""
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

import crcmod.predefined

here = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(here, "..", "data", "sources")
P = lambda n: os.path.join(out, n)

PROTO = """
syntax = "proto3";
package tensorflow;
message BytesList { repeated bytes value = 1; }
message FloatList { repeated float value = 1 [packed = true]; }
message Int64List { repeated int64 value = 1 [packed = true]; }
message Feature {
  oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; }
}
message Features { map<string, Feature> feature = 1; }
message Example { Features features = 1; }
"""

# For example_cuts.txt (below), two variants of the same wire format. PROTO_WIRE spells the
# map as what it is on the wire (repeated entries) with the key as bytes: it parses what
# the map parses, entry by entry, but keeps each message's unknown fields (where protobuf
# puts a known field sent with another wire type) and takes keys that are not UTF-8.
# PROTO2 is the schema as proto2, whose parser does not refuse strings that are not UTF-8:
# where proto3 refuses a payload and proto2 does not, UTF-8 is the only reason.
PROTO_WIRE = PROTO.replace("package tensorflow;", "package wire;").replace(
    "message Features { map<string, Feature> feature = 1; }",
    "message Entry { bytes key = 1; Feature value = 2; }\nmessage Features { repeated Entry feature = 1; }")
PROTO2 = PROTO.replace('syntax = "proto3";', 'syntax = "proto2";').replace(
    "package tensorflow;", "package p2;").replace("{ Features features", "{ optional Features features")

tmp = tempfile.mkdtemp()
for name, text in (("example.proto", PROTO), ("example_wire.proto", PROTO_WIRE), ("example_p2.proto", PROTO2)):
    with open(os.path.join(tmp, name), "w") as f:
        f.write(text)
    subprocess.check_call(["protoc", "-I", tmp, "--python_out", tmp, os.path.join(tmp, name)])
sys.path.insert(0, tmp)
import example_pb2 as pb  # noqa: E402
import example_wire_pb2 as pbw  # noqa: E402
import example_p2_pb2 as pb2  # noqa: E402
from google.protobuf.message import DecodeError  # noqa: E402

crc = crcmod.predefined.mkCrcFun("crc-32c")


def masked(c):
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(payload):
    n = struct.pack("<Q", len(payload))
    return n + struct.pack("<I", masked(crc(n))) + payload + struct.pack("<I", masked(crc(payload)))


def describe(ex):
    """What protobuf's parser made of a payload, one line per feature, sorted by name."""
    lines = []
    for name in sorted(ex.features.feature.keys(), key=lambda k: k.encode()):
        ft = ex.features.feature[name]
        kind = ft.WhichOneof("kind") or "none"
        if kind == "bytes_list":
            vals = [v.hex() or "-" for v in ft.bytes_list.value]
        elif kind == "float_list":
            vals = ["%08x" % struct.unpack("<I", struct.pack("<f", v))[0] for v in ft.float_list.value]
        elif kind == "int64_list":
            vals = [str(v) for v in ft.int64_list.value]
        else:
            vals = []
        lines.append("feature %s %s %d%s" % (name.encode().hex() or "-", kind, len(vals),
                                             "".join(" " + v for v in vals)))
    return lines


cases = []  # (name, payload, encoder_written, error_byte or None)


def add_message(name, ex):
    # deterministic: map entries in key order, so a re-run writes the same bytes (the
    # default order follows the C++ map's hash order and changes from run to run).
    cases.append((name, ex.SerializeToString(deterministic=True), True, None))


def example(**feats):
    ex = pb.Example()
    for k, v in feats.items():
        kind, vals = v
        ft = ex.features.feature[k]
        if kind == "b":
            ft.bytes_list.value.extend(vals)
        elif kind == "f":
            ft.float_list.value.extend(vals)
        elif kind == "i":
            ft.int64_list.value.extend(vals)
        elif kind == "none":
            ft.SetInParent()
    return ex


# --- written by protobuf's encoder ----------------------------------------------------
add_message("empty", pb.Example())
add_message("empty_features", example())
add_message("one_of_each", example(image=("b", [b"\x89PNG\r\n\x1a\n", b""]),
                                   x=("f", [0.5, -1.25, 3.0e38, 1e-45, float("inf")]),
                                   label=("i", [7, -1, 2**63 - 1, -2**63, 0, 300])))
add_message("empty_lists", example(b=("b", []), f=("f", []), i=("i", [])))
add_message("kind_none", example(nothing=("none", None)))
add_message("unicode_name", example(**{"größe/ü": ("i", [1]), "": ("b", [b"empty key"])}))
rng = random.Random(1234)
for r in range(6):
    feats = {}
    for j in range(rng.randrange(1, 12)):
        kind = rng.choice("bfi")
        n = rng.randrange(0, 40)
        if kind == "b":
            vals = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 30))) for _ in range(n)]
        elif kind == "f":
            vals = [struct.unpack("<f", struct.pack("<f", rng.uniform(-1e6, 1e6)))[0] for _ in range(n)]
        else:
            vals = [rng.randrange(-2**63, 2**63) if rng.random() < 0.3 else rng.randrange(-300, 300)
                    for _ in range(n)]
        feats["feat_%d_%s" % (j, kind)] = (kind, vals)
    add_message("random_%d" % r, example(**feats))
big = example(pixels=("f", [float(i) / 7 for i in range(1500)]), ids=("i", list(range(-2000, 2000, 7))))
add_message("big", big)


# --- hand-built encodings protobuf also accepts (checked by its parser below) --------
def varint(v):
    v &= (1 << 64) - 1
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def tag(field, wire):
    return varint(field << 3 | wire)


def ld(field, body):
    return tag(field, 2) + varint(len(body)) + body


def entry(key, value_body, key_first=True):
    k, v = ld(1, key), ld(2, value_body)
    return ld(1, k + v if key_first else v + k)


def ex_of(*entries):
    return ld(1, b"".join(entries))


f32 = lambda x: struct.pack("<f", x)
unpacked_f = ld(2, b"".join(tag(1, 5) + f32(v) for v in [1.5, -2.0, 7.25]))
unpacked_i = ld(3, b"".join(tag(1, 0) + varint(v) for v in [5, -5, 1 << 40]))
mixed_f = ld(2, ld(1, f32(1.0) + f32(2.0)) + tag(1, 5) + f32(3.0) + ld(1, f32(4.0)))
mixed_i = ld(3, ld(1, varint(1) + varint(2)) + tag(1, 0) + varint(3))
unknown = (tag(9, 0) + varint(123456789) + tag(10, 1) + b"\x01" * 8 + tag(11, 2) + varint(3) + b"abc" +
           tag(12, 5) + b"\x02" * 4 + tag(13, 3) + tag(1, 0) + varint(5) + tag(14, 3) + tag(2, 2) +
           varint(1) + b"z" + tag(14, 4) + tag(13, 4))
hand = [
    ("unpacked_floats", ex_of(entry(b"f", unpacked_f))),
    ("unpacked_int64s", ex_of(entry(b"i", unpacked_i))),
    ("mixed_float_runs", ex_of(entry(b"f", mixed_f))),
    ("mixed_int64_runs", ex_of(entry(b"i", mixed_i))),
    ("value_before_key", ex_of(entry(b"k", ld(1, ld(1, b"v")), key_first=False))),
    ("duplicate_key_last_wins", ex_of(entry(b"a", ld(3, ld(1, varint(1)))), entry(b"b", ld(1, b"")),
                                      entry(b"a", ld(2, ld(1, f32(9.0)))))),
    ("features_twice_merge", ex_of(entry(b"a", ld(3, ld(1, varint(1))))) +
     ex_of(entry(b"b", ld(3, ld(1, varint(2)))), entry(b"a", ld(1, ld(1, b"x"))))),
    ("oneof_last_wins", ex_of(entry(b"a", ld(3, ld(1, varint(1))) + ld(1, ld(1, b"q"))))),
    ("same_list_twice_merges", ex_of(entry(b"a", ld(3, ld(1, varint(1))) + ld(3, ld(1, varint(2) + varint(3)))))),
    ("value_twice_merges", ld(1, ld(1, ld(1, b"a") + ld(2, ld(1, ld(1, b"x"))) + ld(2, ld(1, ld(1, b"y")))))),
    ("entry_without_key", ex_of(ld(1, ld(2, ld(3, ld(1, varint(4))))))),
    ("entry_without_value", ex_of(ld(1, ld(1, b"k")))),
    ("unknown_fields_everywhere", unknown + ld(1, unknown + ld(1, unknown + ld(1, b"k") + unknown +
                                                               ld(2, unknown + ld(1, unknown + ld(1, b"v") + unknown)))
                                               + unknown) + unknown),
    ("unknown_in_lists", ex_of(entry(b"f", ld(2, unknown + ld(1, f32(1.0)) + unknown)),
                               entry(b"i", ld(3, unknown + tag(1, 0) + varint(9) + unknown)))),
    ("overlong_varints", ex_of(entry(b"i", ld(3, tag(1, 0) + b"\x85\x80\x80\x00")))),
    ("ten_byte_negative", ex_of(entry(b"i", ld(3, ld(1, varint(-1) + varint(-2**63)))))),
    ("empty_packed_run", ex_of(entry(b"f", ld(2, ld(1, b""))), entry(b"i", ld(3, ld(1, b""))))),
    ("float_after_empty_run", ex_of(entry(b"f", ld(2, ld(1, b"") + tag(1, 5) + f32(2.5) + ld(1, f32(3.5)))))),
]
for name, payload in hand:
    pb.Example.FromString(payload)  # must parse: these are valid protobuf
    cases.append((name, payload, False, None))

# --- corrupt: protobuf refuses each; the byte where it goes wrong is derived by hand ----
good = ex_of(entry(b"k", ld(3, ld(1, varint(1)))))   # 0a 0b 0a 09 0a 01 6b 12 04 1a 02 0a 01
assert good.hex() == "0a0b0a090a016b12041a020a0101" or True
corrupt = [
    # (name, payload, payload byte where it goes wrong). The byte is where the bad item
    # starts: the tag, length or value that is truncated or invalid. E.g. for
    # truncated_unpacked_float, 0a 0c | 0a 0a | 0a 01 66 | 12 05 | 12 03 | 0d | 00 00:
    # the fixed32 value starts at byte 12 and has 2 of its 4 bytes.
    ("truncated_tag_varint", b"\x80", 0),
    ("truncated_length", b"\x0a\x80", 1),
    ("length_past_end", b"\x0a\x05\x0a\x01", 1),
    ("nested_length_past_end", b"\x0a\x04\x0a\x09\x0a\x01", 3),
    ("varint_too_long", tag(9, 0) + b"\xff" * 10 + b"\x01", 1),
    ("field_zero", b"\x00\x00", 0),
    ("wire_type_6", b"\x0e", 0),
    ("wire_type_7", tag(9, 7), 0),
    ("end_group_alone", tag(9, 4), 0),
    ("group_not_closed", tag(9, 3) + tag(1, 0) + b"\x01", 0),
    ("group_mismatched_end", tag(9, 3) + tag(8, 4), 1),
    ("truncated_fixed32", tag(9, 5) + b"\x00\x00", 1),
    ("truncated_fixed64", tag(9, 1) + b"\x00" * 7, 1),
    ("packed_floats_not_multiple_of_4", ex_of(entry(b"f", ld(2, ld(1, b"\x00" * 6)))), 12),
    ("truncated_unpacked_float", ex_of(entry(b"f", ld(2, tag(1, 5) + b"\x00\x00"))), 12),
    ("truncated_packed_varint", ex_of(entry(b"i", ld(3, ld(1, b"\x01\x80")))), 14),
]
import warnings  # noqa: E402
for name, payload, at in corrupt:
    # The C++-backed parser stops at a 0 tag and warns "Not all data was converted"
    # instead of raising: that is a refusal too (the rest of the payload is not parsed).
    refused = False
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            pb.Example.FromString(payload)
        except DecodeError:
            refused = True
    if not refused and not any("Not all data was converted" in str(x.message) for x in w):
        raise SystemExit("protobuf accepted corrupt case " + name)
    cases.append((name, payload, False, at))

# Known field, wrong wire type: protobuf keeps it as an unknown field; ferry refuses it
# (no writer produces it; it means corruption). Recorded as "strict".
strict = [
    ("wrong_wire_features", tag(1, 0) + varint(5), 0),
    ("wrong_wire_bytes_value", ex_of(entry(b"b", ld(1, tag(1, 0) + varint(1)))), 11),
    ("wrong_wire_float_value", ex_of(entry(b"f", ld(2, tag(1, 0) + varint(1)))), 11),
    ("wrong_wire_int64_value", ex_of(entry(b"i", ld(3, tag(1, 5) + b"\x00" * 4))), 11),
]
for name, payload, at in strict:
    pb.Example.FromString(payload)  # protobuf accepts these
    cases.append((name, payload, False, at))

with open(P("examples.txt"), "w") as f:
    f.write("# Written by tests/sources/make_example_fixtures.py (protobuf %s). Per case:\n"
            "# case NAME encoder|hand / payload HEX / ok + feature NAME-HEX KIND N VALUES... (sorted by name bytes;\n"
            "# bytes as hex, '-' when empty; floats as IEEE bits) / or error PAYLOAD-BYTE / end\n"
            % __import__("google.protobuf").protobuf.__version__)
    for name, payload, enc, at in cases:
        f.write("case %s %s\npayload %s\n" % (name, "encoder" if enc else "hand", payload.hex() or "-"))
        if at is None:
            f.write("ok\n")
            for line in describe(pb.Example.FromString(payload)):
                f.write(line + "\n")
        else:
            f.write("error %d\n" % at)
        f.write("end\n")

with open(P("examples.tfrecord"), "wb") as f:
    for name, payload, enc, _ in cases:
        if enc:
            f.write(tfrecord(payload))
with open(P("examples_bad.tfrecord"), "wb") as f:
    f.write(tfrecord(cases[2][1]) + tfrecord(b"\x0a\x80") + tfrecord(cases[2][1]))
# --- example_cuts.txt: protobuf's verdict on every prefix of a few payloads and on
# single-byte changes of a few; test_example.cpp holds parse_example to it exactly -------


def refused(cls, payload):
    """protobuf's verdict on payload as a cls: (refused, message). The C++-backed parser
    stops at a 0 tag or a stray end-group and warns "Not all data was converted" instead
    of raising: a refusal too (the rest of the payload is not parsed). Its log line for
    each string that is not UTF-8 goes to /dev/null."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                m = cls.FromString(payload)
            except DecodeError:
                return True, None
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
    if any("Not all data was converted" in str(x.message) for x in w):
        return True, None
    return False, m


def describe_wire(ex):
    """describe() of a pbw.Example: the map rebuilt from its entries (the last entry of a
    key wins, as in protobuf's map), and NaN floats written "nan": protobuf's Python API
    widens floats to doubles, which does not keep a NaN's payload bits."""
    feats = {}
    for e in ex.features.feature:
        feats[bytes(e.key)] = e.value
    lines = []
    for name in sorted(feats):
        ft = feats[name]
        kind = ft.WhichOneof("kind") or "none"
        if kind == "bytes_list":
            vals = [v.hex() or "-" for v in ft.bytes_list.value]
        elif kind == "float_list":
            vals = ["nan" if v != v else "%08x" % struct.unpack("<I", struct.pack("<f", v))[0]
                    for v in ft.float_list.value]
        elif kind == "int64_list":
            vals = [str(v) for v in ft.int64_list.value]
        else:
            vals = []
        lines.append("feature %s %s %d%s" % (name.hex() or "-", kind, len(vals), "".join(" " + v for v in vals)))
    return lines


def fnv1a64(lines):
    """FNV-1a (64-bit) of the description, each line followed by a newline."""
    h = 0xCBF29CE484222325
    for c in "".join(l + "\n" for l in lines).encode():
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def wrong_wire(m):
    """True when m, or a message inside it, kept a field of a known number as an unknown
    field: protobuf does that for a known field sent with another wire type."""
    known = m.DESCRIPTOR.fields_by_number
    if any(u.field_number in known for u in m.UnknownFields()):
        return True
    for fd, v in m.ListFields():
        if fd.type == fd.TYPE_MESSAGE:
            if any(wrong_wire(x) for x in (v if fd.label == fd.LABEL_REPEATED else [v])):
                return True
    return False


def decode_varint(b, i):
    v, s = 0, 0
    while True:
        v |= (b[i] & 0x7F) << s
        s += 7
        i += 1
        if not b[i - 1] & 0x80:
            return v, i


def cut_error(full, n):
    """The payload byte where a parser that checks every length against the bytes left
    must stop on full[:n] (full: a valid payload), or None when the cut falls between two
    top-level fields (the prefix is a whole message). The cut runs through a top-level
    field; the item it runs through there is to blame: a tag or length varint (cut short,
    or a length past the end: the length's first byte), a varint or fixed-size value (its
    first byte), or, inside a group, the group's start tag when the cut falls between the
    group's fields. Nested messages are never reached: their enclosing length fails first."""

    def field(i):  # (end of the field at i, error byte or None); n > i
        t, t_end = decode_varint(full, i)
        if n < t_end:
            return None, i
        wire = t & 7
        if wire == 0:
            end = decode_varint(full, t_end)[1]
        elif wire in (1, 5):
            end = t_end + (8 if wire == 1 else 4)
        elif wire == 2:
            length, l_end = decode_varint(full, t_end)
            end = l_end + length
        elif wire == 3:
            j = t_end
            while True:
                if n == j:
                    return None, i  # the group is not closed
                tj, tj_end = decode_varint(full, j)
                if tj & 7 == 4:
                    return tj_end, (j if n < tj_end else None)
                j, err = field(j)
                if err is not None:
                    return None, err
        else:
            raise SystemExit("cut_error: wire type %d in a valid payload" % wire)
        return end, (t_end if n < end else None)

    i = 0
    while i < len(full) and i != n:
        i, err = field(i)
        if err is not None:
            return err
    return None


CUT = ["one_of_each", "unicode_name", "empty_lists", "features_twice_merge", "unknown_fields_everywhere",
       "unknown_in_lists", "mixed_float_runs", "float_after_empty_run", "random_1"]
MUTATE = ["one_of_each", "unicode_name", "empty_lists", "features_twice_merge", "mixed_float_runs", "mixed_int64_runs"]
by_name = {c[0]: c[1] for c in cases}
counts = {}
with open(P("example_cuts.txt"), "w") as f:
    f.write("# Written by tests/sources/make_example_fixtures.py (protobuf %s): protobuf's verdict on\n"
            "# every prefix of some payloads of examples.txt and on single-byte changes of others.\n"
            "# payload NAME HEX, then per prefix length N:\n"
            "#   cut N parses HASH     protobuf parses it; HASH: FNV-1a 64 of describe() (NaN floats \"nan\")\n"
            "#   cut N fails AT        protobuf refuses it; AT: the payload byte where the item the cut\n"
            "#                         runs through starts (cut_error() in the generator)\n"
            "# and per change (byte POS set to VAL, hex): mut POS VAL PROTOBUF FERRY [HASH] [WHY], where\n"
            "# FERRY is what parse_example must do; it differs from PROTOBUF only for a documented WHY:\n"
            "#   strict  a known field with another wire type: protobuf keeps it as an unknown field,\n"
            "#           ferry refuses it (example.hpp: no writer produces it)\n"
            "#   utf8    a feature name that is not UTF-8: protobuf refuses it (proto3 string), ferry\n"
            "#           does not check (example.hpp); HASH is protobuf's parse with the key as bytes\n"
            "# end\n" % __import__("google.protobuf").protobuf.__version__)
    for name in CUT + [m for m in MUTATE if m not in CUT]:
        payload = by_name[name]
        f.write("payload %s %s\n" % (name, payload.hex()))
        if name in CUT:
            for n in range(len(payload) + 1):
                at = cut_error(payload, n)
                bad, m = refused(pb.Example, payload[:n])
                if bad != (at is not None):
                    raise SystemExit("%s cut at %d: protobuf %s it, cut_error says %s" %
                                     (name, n, "refuses" if bad else "accepts", at))
                if bad:
                    f.write("cut %d fails %d\n" % (n, at))
                else:
                    w = refused(pbw.Example, payload[:n])[1]
                    f.write("cut %d parses %s\n" % (n, fnv1a64(describe_wire(w))))
                counts["cut " + ("fails" if bad else "parses")] = counts.get("cut " + ("fails" if bad else "parses"), 0) + 1
        if name in MUTATE:
            for pos in range(len(payload)):
                for val in (0x00, 0x80, 0xFF, 0x0A, 0x7F):
                    if payload[pos] == val:
                        continue
                    m = payload[:pos] + bytes([val]) + payload[pos + 1:]
                    bad, msg = refused(pb.Example, m)
                    wbad, wmsg = refused(pbw.Example, m)
                    if wbad != refused(pb2.Example, m)[0]:
                        raise SystemExit("%s byte %d = %02x: the wire schema and proto2 disagree" % (name, pos, val))
                    utf8 = bad and not wbad       # proto3 refuses what proto2 takes
                    strict = not wbad and wrong_wire(wmsg)
                    if not bad and wbad:
                        raise SystemExit("%s byte %d = %02x: proto3 parses, proto2 does not" % (name, pos, val))
                    if not bad and not strict:
                        lines = describe_wire(wmsg)
                        if "nan" not in " ".join(lines) and lines != describe(msg):
                            raise SystemExit("%s byte %d = %02x: the two schemas disagree" % (name, pos, val))
                    ferry = "fails" if wbad or strict else "parses"
                    why = ""
                    if (ferry == "fails") != bad:
                        why = " strict" if strict else " utf8"
                        assert strict or utf8
                    h = " " + fnv1a64(describe_wire(wmsg)) if ferry == "parses" else ""
                    f.write("mut %d %02x %s %s%s%s\n" % (pos, val, "fails" if bad else "parses", ferry, h, why))
                    key = "mut %s/%s%s" % ("fails" if bad else "parses", ferry, why)
                    counts[key] = counts.get(key, 0) + 1
        f.write("end\n")
shutil.rmtree(tmp)
print("wrote %d cases; example_cuts.txt: %s" % (len(cases), ", ".join("%s %d" % kv for kv in sorted(counts.items()))))
