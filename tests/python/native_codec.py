"""`stowage/1` for stowd's Python tests, through stowd's own codec.

Frame 0 is written and read by the Python client's Rust core
(`stowage._core.encode_request` / `decode_reply`: `stowage_wire::native`,
the codec stowd runs), and a get_ok's descriptors are resolved against the
data frames by the core's `decode_get`, so these tests carry no copy of
the protocol. What is here is test scaffolding: a data
frame layout for puts (one frame per regular field and per nested row) and
a DEALER with timeouts. `hand_envelope` builds frame 0 by hand with msgpack
for the hostile-input tests, which send what no encoder would write: test
data, not a codec.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from stowage import _auth, _codec, _core
import stowd_harness

PROTO = "stowage/1"
DEFAULT_TIMEOUT_S = 10.0


def hand_envelope(op: str, id: int, body: Any, proto: str = PROTO) -> bytes:
    """Frame 0 built by hand (bodies stowd must refuse, or descriptors in
    the protocol's dict form): test data, not a codec."""
    return msgpack.packb({"proto": proto, "op": op, "id": id, "body": body})


def envelope(op: str, id: int, body: dict) -> bytes:
    """Frame 0 by stowd's encoder (a put's fields as `_codec` descriptors:
    `("regular", dtype, shape, [(frame, offset, len, rows)])`, ...)."""
    return _core.encode_request(op, id, body)


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
            desc[name] = ("regular", v.dtype.name, v.shape, [(len(frames), 0, v.nbytes, v.shape[0])])
        elif isinstance(v, Values):
            desc[name] = ("values", list(v.values))
        else:
            rows = []
            dtypes = {r.dtype.name for r in v}
            assert len(dtypes) == 1, dtypes
            for r in v:
                frames.append(_c_bytes(r))
                rows.append((r.shape, len(frames), 0, r.nbytes))
            desc[name] = ("nested", dtypes.pop(), rows)
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


#: Results as numpy arrays (no torch), nested fields as lists of rows.
_NUMPY = _core.GetOptions(_codec.WIRE_DTYPES, [], None)


def _decoded(frames: list) -> dict:
    """The fields of a get_ok (`frames`: as received) as the core makes
    them: read-only views of the frames where a field's bytes lie in one."""
    out, why = _core.decode_get(frames, _NUMPY)
    assert type(out) is dict, f"not a readable get_ok: {why}"
    return out


def decode_field(desc: tuple, frames: list) -> Any:
    """A get_ok descriptor (as `decode_reply` gives it) -> ndarray
    (regular), list of ndarrays (nested), or list of values, resolved by
    the client's decoder: zero-copy read-only views of the frames where
    possible."""
    # Only the frames it names, numbered anew (a get_ok uses every frame).
    used = sorted({p[0] for p in desc[3]} if desc[0] == "regular" else
                  {r[1] for r in desc[2]} if desc[0] == "nested" else set())
    new = {k: i for i, k in enumerate(used, start=1)}
    if desc[0] == "regular":
        desc = (*desc[:3], [(new[k], *rest) for k, *rest in desc[3]])
    elif desc[0] == "nested":
        desc = (*desc[:2], [(sh, new[k], o, n) for sh, k, o, n in desc[2]])
    head = envelope_get_ok({"the field": desc})
    return _decoded([head, *(frames[k] for k in used)])["the field"]


def envelope_get_ok(descs: dict) -> bytes:
    """Frame 0 of a get_ok with these descriptors (in `decode_reply`'s
    form), built by hand: test data."""
    def wire(d):
        if d[0] == "regular":
            return {"kind": "regular", "dtype": d[1], "shape": list(d[2]),
                    "parts": [{"frame": k, "offset": o, "len": n, "rows": r} for k, o, n, r in d[3]]}
        if d[0] == "nested":
            return {"kind": "nested", "dtype": d[1],
                    "rows": [{"shape": list(sh), "frame": k, "offset": o, "len": n} for sh, k, o, n in d[2]]}
        return {"kind": "values", "values": list(d[1])}
    return hand_envelope("get_ok", 1, {"fields": {name: wire(d) for name, d in descs.items()}})


@dataclass
class NReply:
    frames: list
    env: dict = field(init=False)

    def __post_init__(self):
        f0 = self.frames[0]
        self.env = _core.decode_reply(f0.bytes if isinstance(f0, zmq.Frame) else f0)

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
        assert self.body["code"] == code, f"error code {self.body['code']!r} != {code!r}: {self.body['message']!r}"
        if prefix is not None:
            assert self.body["message"].startswith(prefix), f"{self.body['message']!r} !~ {prefix!r}..."
        return self

    def fields(self) -> dict:
        """The get_ok's fields as arrays and values; every data frame must be
        used (the client's decoder checks)."""
        self.expect("get_ok")
        return _decoded(self.frames)


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
        stowd_harness.offer_token(self.sock, endpoint)
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
