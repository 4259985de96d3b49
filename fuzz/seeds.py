#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets (run from anywhere):

    python3 fuzz/seeds.py [--fixtures DIR]

- tq_decode: every message of the golden TransferQueue 0.1.11 fixtures
  (../shared/fixtures/transferqueue-0.1.11 beside the repository), frames
  joined in the fuzz input format (each frame: u32 little-endian length,
  then its bytes; see fuzz/src/lib.rs), as fuzz/corpus/tq_decode/fixture-NAME;
  and the checkpoint golden frames in tests/fixtures (fixture-checkpoint-NAME).
  Plus seed-every-dtype: a PUT with a regular and a jagged field of every
  dtype stowd carries.
- native_decode: one message of each stowage/1 request and reply kind (and
  a put with a regular and a nested field of every dtype, and the two
  descriptor channel messages),
  written with `msgpack.packb` (the protocol page says that gives the Rust
  encoder's bytes), as fuzz/corpus/native_decode/seed-NAME.

plan_validate takes structured input (`arbitrary`) and needs no seeds.
Needs the `msgpack` package (pip install msgpack).
"""

import argparse
import pickle
import re
import struct
from pathlib import Path

import msgpack

FUZZ = Path(__file__).resolve().parent
ROOT = FUZZ.parent


def join(frames):
    return b"".join(struct.pack("<I", len(f)) + f for f in frames)


def write(target, name, frames):
    out = FUZZ / "corpus" / target / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(join(frames))
    return out


def tq_seeds(fixtures: Path, prefix: str = "fixture-"):
    frames = {}
    for p in sorted(fixtures.glob("*.frame*.bin")):
        m = re.fullmatch(r"(.+)\.frame(\d+)\.bin", p.name)
        frames.setdefault(m.group(1), {})[int(m.group(2))] = p.read_bytes()
    if not frames:
        raise SystemExit(f"no fixtures in {fixtures}")
    for name, parts in sorted(frames.items()):
        ordered = [parts[k] for k in sorted(parts)]
        assert sorted(parts) == list(range(len(parts))), f"{name}: frames not numbered 0..n"
        print(write("tq_decode", f"{prefix}{name}", ordered))


# Every dtype stowd carries, with its itemsize (torch's names and sizes).
DTYPES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16, "complex32": 4, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
}


def tq_dtype_seed():
    """A TransferQueue PUT of two rows with a regular [2, 1] field of every
    dtype (ext 3 over its own frame, pickled as TransferQueue pickles it) and
    a jagged one (ext 4)."""
    data, frames = {}, []
    for k, (d, size) in enumerate(DTYPES.items()):
        frames.append(bytes(range(k, k + 2 * size)))
        data[f"r_{d}"] = msgpack.ExtType(3, pickle.dumps((d, (2, 1), len(frames)), protocol=5))
        frames.append(bytes(range(k, k + size)))
        frames.append(bytes(range(k, k + 3 * size)))
        metas = [(d, (1,), len(frames) - 1), (d, (3,), len(frames))]
        data[f"j_{d}"] = msgpack.ExtType(4, pickle.dumps({"layout": "jagged", "tensors": metas}, protocol=5))
    frame0 = msgpack.packb({
        "request_type": "PUT", "sender_id": "TQ_STORAGE_seed", "receiver_id": "TQ_STORAGE_UNIT_seed",
        "request_id": "0dtypes0", "timestamp": 1.5,
        "body": {"global_indexes": [0, 2], "data": data, "data_parser": None},
    }, use_bin_type=True)
    print(write("tq_decode", "seed-every-dtype", [frame0, *frames]))


def env(op, id_, body, **extra):
    return msgpack.packb({"proto": "stowage/1", "op": op, "id": id_, "body": body, **extra}, use_bin_type=True)


def f32(*xs):
    return struct.pack(f"<{len(xs)}f", *xs)


def i64(*xs):
    return struct.pack(f"<{len(xs)}q", *xs)


def native_seeds():
    x = {"kind": "regular", "dtype": "float32", "shape": [2, 2],
         "parts": [{"frame": 1, "offset": 0, "len": 16, "rows": 2}]}
    tag = {"kind": "values", "values": ["a", "b"]}
    seeds = {
        # The protocol page's examples.
        "put": [env("put", 1, {"global_indexes": [0, 1], "fields": {"x": x, "tag": tag}}), f32(1, 2, 3, 4)],
        "put_ok": [env("put_ok", 1, {"rows": 2})],
        "get": [env("get", 2, {"global_indexes": [1, 0], "fields": ["x"]})],
        "get_ok": [
            env("get_ok", 2, {"fields": {"x": {"kind": "regular", "dtype": "float32", "shape": [2, 2], "parts": [
                {"frame": 1, "offset": 0, "len": 8, "rows": 1},
                {"frame": 2, "offset": 0, "len": 8, "rows": 1}]}}}),
            f32(3, 4), f32(1, 2),
        ],
        "error": [env("error", 3, {"code": "key_not_found", "message": "global index 9 not found"})],
        # Several fields and a nested one sharing one frame, parts split.
        "put_shared_frame": [
            env("put", 4, {"global_indexes": [7, 3], "fields": {
                "a": {"kind": "regular", "dtype": "int64", "shape": [2, 1], "parts": [
                    {"frame": 1, "offset": 0, "len": 8, "rows": 1},
                    {"frame": 1, "offset": 8, "len": 8, "rows": 1}]},
                "j": {"kind": "nested", "dtype": "int64", "rows": [
                    {"shape": [1], "frame": 1, "offset": 16, "len": 8},
                    {"shape": [3], "frame": 2, "offset": 0, "len": 24}]},
                "v": {"kind": "values", "values": [b"\x00\x01", {"k": [1, -2, 3.5, None, True]}]}}}),
            i64(10, 11, 0), i64(0, 1, 2),
        ],
        "put_bf16_empty_rows": [
            env("put", 5, {"global_indexes": [1], "fields": {
                "b": {"kind": "regular", "dtype": "bfloat16", "shape": [1, 0], "parts": [
                    {"frame": 1, "offset": 0, "len": 0, "rows": 1}]}}}),
            b"",
        ],
        "clear": [env("clear", 6, {"global_indexes": [0, 1]})],
        "clear_fields": [env("clear", 7, {"global_indexes": [2], "fields": ["x", "tag"]})],
        "clear_ok": [env("clear_ok", 7, {"cleared": 2})],
        "stats": [env("stats", 8, {})],
        "stats_ok": [env("stats_ok", 8, {"rows": 4, "bytes_pinned": 1024, "ratio": 0.5, "unit": "u0", "neg": -1})],
        "stats_ok_nested": [env("stats_ok", 8, {
            "rows": 4,
            "plugin.runs": {"version": "0.1.0", "capabilities": ["select"], "calls": 2, "disabled": False},
            "chain.*": {"select": ["runs", "gather"], "pack": [], "fail": "fallback", "allow_missing": True},
            "deep": [[[["x"]]]],
        })],
        "lease": [env("lease", 9, {"bytes": 4096})],
        "lease_ok": [env("lease_ok", 9, {"segment": "stowage-0-1", "bytes": 4096, "ttl_ms": 30000})],
        "put_same_node": [
            env("put", 10, {"global_indexes": [0], "fields": {"x": {
                "kind": "regular", "dtype": "float32", "shape": [1, 2],
                "parts": [{"frame": 1, "offset": 0, "len": 8, "rows": 1}]}}},
                segments=[["stowage-0-1", 0, 8]], same_node=True),
            f32(1, 2),
        ],
        "get_same_node": [env("get", 11, {"global_indexes": [0], "fields": ["x"]}, same_node=True)],
        "get_same_node_channel": [env("get", 13, {"global_indexes": [0], "fields": ["x"]}, same_node=True,
                                      channel="0123456789abcdef0123456789abcdef")],
        "lease_channel": [env("lease", 14, {"bytes": 4096}, channel="0123456789abcdef0123456789abcdef")],
        "channel": [env("channel", 15, {})],
        "channel_ok": [env("channel_ok", 15, {"path": "/dev/shm/stowd-1-0123456789abcdef/sock"})],
        "checkpoint": [env("checkpoint", 16, {"dir": "/var/lib/stowd/ckpt"})],
        "restore": [env("restore", 17, {"dir": "/var/lib/stowd/ckpt"})],
        "checkpoint_ok": [env("checkpoint_ok", 16, {"dir": "/ckpt", "seq": 3, "rows": 1 << 40, "bytes": 0,
                                                     "files": 4})],
        "restore_ok": [env("restore_ok", 17, {"dir": "/ckpt", "seq": 3, "rows": 10, "lost": 2})],
        # Peers (issue 19): a unit named in the envelope, versions.
        "versions": [env("versions", 18, {"global_indexes": {"ranges": [[0, 4, 2]]}, "fields": ["x"]}, unit=1)],
        "versions_ok": [env("versions_ok", 18, {"incarnation": 1 << 63, "versions": struct.pack("<4Q", 0, 1, 7, 1 << 40)})],
        "get_unit_with_versions": [env("get", 19, {"global_indexes": [1, 0], "fields": ["x"]}, unit=0,
                                       with_versions=True)],
        "get_ok_versions": [
            env("get_ok", 19, {"fields": {"x": {"kind": "regular", "dtype": "float32", "shape": [1, 2], "parts": [
                {"frame": 1, "offset": 0, "len": 8, "rows": 1}]}}}, incarnation=5, versions=struct.pack("<Q", 3)),
            f32(1, 2),
        ],
        "put_unit": [env("put", 20, {"global_indexes": [4], "fields": {"x": {
            "kind": "regular", "dtype": "float32", "shape": [1, 2],
            "parts": [{"frame": 1, "offset": 0, "len": 8, "rows": 1}]}}}, unit=3), f32(5, 6)],
        # The descriptor channel's messages: its framing is this input
        # format, so each is one frame (its body).
        "channel_hello": [msgpack.packb({"token": "0123456789abcdef0123456789abcdef"})],
        "channel_descriptors": [msgpack.packb({"id": 13, "names": ["s0", "s1f", "lease-2"]})],
    }
    # A regular [1, 2] and a nested field of every dtype, all in one frame.
    fields, blob = {}, b""
    for d, size in DTYPES.items():
        fields[f"r_{d}"] = {"kind": "regular", "dtype": d, "shape": [1, 2],
                            "parts": [{"frame": 1, "offset": len(blob), "len": 2 * size, "rows": 1}]}
        blob += bytes(range(2 * size))
        fields[f"n_{d}"] = {"kind": "nested", "dtype": d, "rows": [
            {"shape": [3], "frame": 1, "offset": len(blob), "len": 3 * size}]}
        blob += bytes(range(3 * size))
    seeds["put_every_dtype"] = [env("put", 12, {"global_indexes": [5], "fields": fields}), blob]
    for name, frames in seeds.items():
        print(write("native_decode", f"seed-{name}", frames))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path,
                    default=ROOT.parent / "shared" / "fixtures" / "transferqueue-0.1.11")
    args = ap.parse_args()
    tq_seeds(args.fixtures)
    tq_seeds(ROOT / "tests" / "fixtures" / "transferqueue-0.1.11-checkpoint", "fixture-checkpoint-")
    tq_dtype_seed()
    native_seeds()


if __name__ == "__main__":
    main()
