"""A tiny `stowage/1` encoder/decoder (docs/protocol-stowage1.md) for the tests.

Envelope: msgpack map {"proto", "op", "id", "body"}; regular fields are
described by parts {frame, offset, len, rows}, nested fields by one
{shape, frame, offset, len} per row, values inline.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from tq_codec import NUMPY_DTYPES

PROTO = "stowage/1"
DEFAULT_TIMEOUT_S = 10.0


# stowage/1 dtype names (torch names) -> numpy; bfloat16 is read as raw uint16.
DTYPES = dict(NUMPY_DTYPES) | {
    "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
    "complex64": np.complex64, "complex128": np.complex128,
}


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return np.dtype(np.uint16)  # numpy has no bfloat16: raw 16-bit view
    return np.dtype(DTYPES[name])


def torch_name(dtype) -> str:
    name = np.dtype(dtype).name
    assert name in DTYPES, f"no stowage/1 dtype for numpy {name}"
    return name


def envelope(op: str, id: int, body: Any, proto: str = PROTO) -> bytes:
    return msgpack.packb({"proto": proto, "op": op, "id": id, "body": body})


@dataclass
class Values:
    """A `values` field: n plain msgpack values."""

    values: list


def _c_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def describe(fields: dict) -> tuple[dict, list[bytes]]:
    """Field descriptors + data frames (numbered from 1), one frame per
    regular field and one per nested row. A field value is an ndarray
    (regular), a list of ndarrays (nested) or `Values`."""
    frames: list[bytes] = []
    desc = {}
    for name, v in fields.items():
        if isinstance(v, np.ndarray):
            frames.append(_c_bytes(v))
            desc[name] = {
                "kind": "regular", "dtype": torch_name(v.dtype), "shape": list(v.shape),
                "parts": [{"frame": len(frames), "offset": 0, "len": v.nbytes, "rows": v.shape[0]}],
            }
        elif isinstance(v, Values):
            desc[name] = {"kind": "values", "values": list(v.values)}
        else:
            rows = []
            dtypes = {torch_name(r.dtype) for r in v}
            assert len(dtypes) == 1, dtypes
            for r in v:
                frames.append(_c_bytes(r))
                rows.append({"shape": list(r.shape), "frame": len(frames), "offset": 0, "len": r.nbytes})
            desc[name] = {"kind": "nested", "dtype": dtypes.pop(), "rows": rows}
    return desc, frames


def put_frames(id: int, indexes, fields: dict) -> list[bytes]:
    desc, frames = describe(fields)
    return [envelope("put", id, {"global_indexes": list(indexes), "fields": desc}), *frames]


def get_frames(id: int, indexes, fields) -> list[bytes]:
    return [envelope("get", id, {"global_indexes": list(indexes), "fields": list(fields)})]


def clear_frames(id: int, indexes, fields=None) -> list[bytes]:
    body = {"global_indexes": list(indexes)}
    if fields is not None:
        body["fields"] = list(fields)
    return [envelope("clear", id, body)]


def stats_frames(id: int) -> list[bytes]:
    return [envelope("stats", id, {})]


def _buf(frame) -> memoryview | bytes:
    # pyzmq (27.x) hands out a *writable* memoryview of a received frame:
    # make it read-only (no copy) so decoded arrays cannot be written.
    return frame.buffer.toreadonly() if isinstance(frame, zmq.Frame) else frame


def _len(frame) -> int:
    return len(frame.buffer) if isinstance(frame, zmq.Frame) else len(frame)


def decode_field(desc: dict, frames: list) -> Any:
    """A get_ok descriptor -> ndarray (regular), list of ndarrays (nested),
    or list of values. Arrays are zero-copy views of the frames where possible."""
    kind = desc["kind"]
    if kind == "values":
        assert list(desc) == ["kind", "values"], desc
        return desc["values"]
    dt = np_dtype(desc["dtype"])
    if kind == "regular":
        assert list(desc) == ["kind", "dtype", "shape", "parts"], desc
        shape = desc["shape"]
        row_shape = shape[1:]
        row_bytes = dt.itemsize * int(np.prod(row_shape, dtype=np.int64))
        pieces = []
        total = 0
        for p in desc["parts"]:
            assert list(p) == ["frame", "offset", "len", "rows"], p
            assert 1 <= p["frame"] < len(frames), p
            assert p["rows"] >= 1 and p["len"] == p["rows"] * row_bytes, (p, row_bytes)
            assert p["offset"] + p["len"] <= _len(frames[p["frame"]]), p
            pieces.append(
                np.frombuffer(_buf(frames[p["frame"]]), dtype=dt, count=p["len"] // dt.itemsize, offset=p["offset"])
                .reshape(p["rows"], *row_shape)
            )
            total += p["rows"]
        assert total == shape[0], (total, shape)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    assert kind == "nested", desc
    assert list(desc) == ["kind", "dtype", "rows"], desc
    out = []
    for r in desc["rows"]:
        assert list(r) == ["shape", "frame", "offset", "len"], r
        n = int(np.prod(r["shape"], dtype=np.int64))
        assert r["len"] == n * dt.itemsize, r
        assert 1 <= r["frame"] < len(frames) and r["offset"] + r["len"] <= _len(frames[r["frame"]]), r
        out.append(
            np.frombuffer(_buf(frames[r["frame"]]), dtype=dt, count=n, offset=r["offset"]).reshape(r["shape"])
        )
    return out


@dataclass
class NReply:
    frames: list
    env: dict = field(init=False)

    def __post_init__(self):
        f0 = self.frames[0]
        self.env = msgpack.unpackb(f0.bytes if isinstance(f0, zmq.Frame) else f0, raw=False)
        assert list(self.env) == ["proto", "op", "id", "body"], f"envelope keys {list(self.env)}"
        assert self.env["proto"] == PROTO, self.env

    @property
    def op(self) -> str:
        return self.env["op"]

    @property
    def id(self) -> int:
        return self.env["id"]

    @property
    def body(self) -> dict:
        return self.env["body"]

    def expect(self, op: str, id: int | None = None) -> "NReply":
        assert self.op == op, f"expected {op}, got {self.op}: {self.body!r}"
        if id is not None:
            assert self.id == id, f"reply id {self.id} != {id}"
        return self

    def expect_error(self, code: str, id: int | None = None, prefix: str | None = None) -> "NReply":
        self.expect("error", id)
        assert list(self.body) == ["code", "message"], self.body
        assert self.body["code"] == code, f"error code {self.body['code']!r} != {code!r}: {self.body['message']!r}"
        assert isinstance(self.body["message"], str)
        if prefix is not None:
            assert self.body["message"].startswith(prefix), f"{self.body['message']!r} !~ {prefix!r}..."
        return self

    def fields(self) -> dict:
        self.expect("get_ok")
        assert list(self.body) == ["fields"], self.body
        descs = self.body["fields"]
        used = set()
        for d in descs.values():
            for p in d.get("parts", []) + d.get("rows", []):
                used.add(p["frame"])
        assert used == set(range(1, len(self.frames))), f"frames used {sorted(used)} of {len(self.frames) - 1}"
        return {name: decode_field(d, self.frames) for name, d in descs.items()}


_ids = itertools.count(1)


class NativeClient:
    """A DEALER to the native endpoint; every receive has a timeout."""

    def __init__(self, endpoint: str, timeout: float = DEFAULT_TIMEOUT_S):
        self.endpoint = endpoint
        self.timeout = timeout
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"native_pytest_{os.getpid()}_{next(_ids)}".encode())
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._next = itertools.count(1)

    def next_id(self) -> int:
        return next(self._next)

    def close(self):
        self.sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, copy: bool = True) -> NReply:
        try:
            frames = self.sock.recv_multipart(copy=copy)
        except zmq.Again:
            raise AssertionError(f"no reply from {self.endpoint} within {self.timeout} s") from None
        return NReply(frames)

    def request(self, frames: list[bytes], copy: bool = True) -> NReply:
        self.send(frames)
        return self.recv(copy=copy)

    def put(self, indexes, fields: dict) -> NReply:
        i = self.next_id()
        return self.request(put_frames(i, indexes, fields)).expect("put_ok", i)

    def get(self, indexes, fields, copy: bool = True) -> NReply:
        i = self.next_id()
        r = self.request(get_frames(i, indexes, fields), copy=copy)
        assert r.id == i, f"reply id {r.id} != {i}"
        return r

    def clear(self, indexes, fields=None) -> NReply:
        i = self.next_id()
        return self.request(clear_frames(i, indexes, fields)).expect("clear_ok", i)

    def stats(self) -> dict:
        i = self.next_id()
        return self.request(stats_frames(i)).expect("stats_ok", i).body
