"""A tiny TransferQueue 0.1.11 storage-unit client for the tests.

Messages are built by hand exactly as TransferQueue builds them: frame 0 is a
msgpack map {request_type, sender_id, receiver_id, request_id, timestamp,
body}; a tensor is msgpack ext 3 holding `pickle.dumps((dtype, shape,
frame_index), protocol=5)` and its bytes travel in data frame `frame_index`.
Replies are decoded with an unpickler that refuses every global, so nothing
a server sends can run code here.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import re
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zmq

DEFAULT_TIMEOUT_S = 10.0

# torch dtype names (without `torch.`) -> numpy dtypes; bfloat16 has no numpy
# type and is carried as raw bytes (`Raw`).
NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}
ITEMSIZE = {name: np.dtype(t).itemsize for name, t in NUMPY_DTYPES.items()} | {"bfloat16": 2}


def torch_name(dtype: np.dtype) -> str:
    name = np.dtype(dtype).name
    assert name in NUMPY_DTYPES, f"no TransferQueue dtype for numpy {name}"
    return name


@dataclass(frozen=True)
class Raw:
    """A tensor given as dtype name + shape + bytes (for bfloat16, or for
    deliberately inconsistent tensors)."""

    dtype: str
    shape: tuple
    data: bytes


@dataclass(frozen=True)
class TensorRef:
    """A decoded ext 3: (dtype, shape, frame_index)."""

    dtype: str
    shape: tuple
    frame: int


def tensor_pickle(dtype: str, shape, frame_index: int) -> bytes:
    return pickle.dumps((dtype, tuple(shape), frame_index), protocol=5)


def tensor_ext(dtype: str, shape, frame_index: int) -> msgpack.ExtType:
    return msgpack.ExtType(3, tensor_pickle(dtype, shape, frame_index))


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):  # pragma: no cover - only on a bad server reply
        raise pickle.UnpicklingError(f"reply pickle refers to global {module}.{name}")


def safe_unpickle(data: bytes):
    return _NoGlobals(io.BytesIO(data)).load()


def _ext_hook(code: int, data: bytes):
    if code == 3:
        dtype, shape, frame = safe_unpickle(data)
        assert isinstance(dtype, str) and isinstance(shape, tuple) and isinstance(frame, int), (dtype, shape, frame)
        return TensorRef(dtype, shape, frame)
    return msgpack.ExtType(code, data)


def unpack(frame0: bytes) -> Any:
    return msgpack.unpackb(frame0, raw=False, strict_map_key=False, ext_hook=_ext_hook)


def unpack_raw_ext(frame0: bytes) -> Any:
    """frame 0 with ext values left as msgpack.ExtType (payload bytes untouched)."""
    return msgpack.unpackb(frame0, raw=False, strict_map_key=False)


def envelope(
    request_type: str,
    body: Any,
    *,
    sender_id: str = "TQ_STORAGE_pytest",
    receiver_id: str | None = None,
    request_id: str | None = None,
    timestamp: float | None = None,
) -> bytes:
    return msgpack.packb(
        {
            "request_type": request_type,
            "sender_id": sender_id,
            "receiver_id": receiver_id,
            "request_id": request_id if request_id is not None else os.urandom(4).hex(),
            "timestamp": float(time.time() if timestamp is None else timestamp),
            "body": body,
        },
        use_bin_type=True,
    )


def _tensor_bytes(a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.tobytes()


def _is_tensor(v) -> bool:
    return isinstance(v, (np.ndarray, Raw))


def put_frames(indexes, data: dict, *, data_parser: Any = None, **env) -> list[bytes]:
    """A PUT. Each field value is
    - an ndarray or Raw: a regular tensor [n, ...], one ext 3 and one frame;
    - a list of ndarray/Raw: a nested tensor, one ext 3 and one frame per row;
    - any other list: n plain values, sent as given (str, bytes, ExtType, ...)."""
    frames: list[bytes] = [b""]

    def ext_for(t) -> msgpack.ExtType:
        if isinstance(t, Raw):
            frames.append(t.data)
            return tensor_ext(t.dtype, t.shape, len(frames) - 1)
        frames.append(_tensor_bytes(t))
        return tensor_ext(torch_name(t.dtype), t.shape, len(frames) - 1)

    body_data = {}
    for name, value in data.items():
        if _is_tensor(value):
            body_data[name] = ext_for(value)
        elif isinstance(value, list) and value and all(_is_tensor(v) for v in value):
            body_data[name] = [ext_for(v) for v in value]
        else:
            body_data[name] = list(value)
    body = {"global_indexes": list(indexes), "data": body_data, "data_parser": data_parser}
    frames[0] = envelope("PUT", body, **env)
    return frames


def get_frames(indexes, fields, **env) -> list[bytes]:
    return [envelope("GET", {"global_indexes": list(indexes), "fields": list(fields)}, **env)]


def clear_frames(indexes, **env) -> list[bytes]:
    return [envelope("CLEAR_DATA", {"global_indexes": list(indexes)}, **env)]


def metrics_frames(**env) -> list[bytes]:
    return [envelope("GET_METRICS", {}, **env)]


HEX8 = re.compile(r"^[0-9a-f]{8}$")


class Reply:
    """A decoded reply: `frames` (bytes), `env` (frame 0 decoded, ext 3 as TensorRef)."""

    def __init__(self, frames: list[bytes]):
        assert frames, "empty reply"
        self.frames = frames
        self.env = unpack(frames[0])
        assert isinstance(self.env, dict), f"frame 0 is not a map: {self.env!r}"

    @property
    def request_type(self) -> str:
        return self.env.get("request_type")

    @property
    def body(self):
        return self.env.get("body")

    @property
    def message(self) -> str:
        return (self.body or {}).get("message", "")

    def check_envelope(self, sender_id: str) -> None:
        """The envelope rules every reply follows."""
        assert list(self.env) == ["request_type", "sender_id", "receiver_id", "request_id", "timestamp", "body"], (
            f"envelope keys/order: {list(self.env)}"
        )
        assert self.env["sender_id"] == sender_id, f"sender_id {self.env['sender_id']!r} != {sender_id!r}"
        assert self.env["receiver_id"] is None, f"receiver_id {self.env['receiver_id']!r} is not nil"
        assert isinstance(self.env["request_id"], str) and HEX8.match(self.env["request_id"]), (
            f"request_id {self.env['request_id']!r} is not 8 lowercase hex chars"
        )
        assert isinstance(self.env["timestamp"], float), f"timestamp {self.env['timestamp']!r} is not a float"
        # A float64 (0xcb), as Python's msgpack writes time.time().
        assert b"\xa9timestamp\xcb" in self.frames[0], "timestamp is not encoded as msgpack float 64"
        assert abs(self.env["timestamp"] - time.time()) < 300, f"timestamp {self.env['timestamp']} is not now"

    def expect(self, request_type: str, prefix: str | None = None) -> "Reply":
        assert self.request_type == request_type, (
            f"expected {request_type}, got {self.request_type}: {self.body!r}"
        )
        if prefix is not None:
            assert isinstance(self.message, str) and self.message.startswith(prefix), (
                f"{request_type} message {self.message!r} does not start with {prefix!r}"
            )
        return self

    def values(self) -> dict[str, list]:
        """GET_DATA_RESPONSE -> {field: [value per index]}: tensors as
        ndarrays (bfloat16 as Raw), plain values as decoded.
        Checks every tensor row has its own, valid frame and every data
        frame is used exactly once."""
        self.expect("GET_DATA_RESPONSE")
        data = self.body["data"]
        used: list[int] = []
        out: dict[str, list] = {}
        for name, cells in data.items():
            assert isinstance(cells, list), f"field {name!r}: {cells!r} is not a list"
            vals = []
            for cell in cells:
                if isinstance(cell, TensorRef):
                    assert 1 <= cell.frame < len(self.frames), f"frame index {cell.frame} of {len(self.frames)}"
                    used.append(cell.frame)
                    raw = self.frames[cell.frame]
                    n = int(np.prod(cell.shape, dtype=np.int64))
                    assert len(raw) == n * ITEMSIZE[cell.dtype], (
                        f"field {name!r}: frame {cell.frame} has {len(raw)} bytes for {cell.dtype}{list(cell.shape)}"
                    )
                    if cell.dtype in NUMPY_DTYPES:
                        vals.append(np.frombuffer(raw, dtype=NUMPY_DTYPES[cell.dtype]).reshape(cell.shape))
                    else:
                        vals.append(Raw(cell.dtype, cell.shape, bytes(raw)))
                else:
                    vals.append(cell)
            out[name] = vals
        assert sorted(used) == list(range(1, len(self.frames))), (
            f"data frames used {sorted(used)} but the reply has {len(self.frames) - 1}: every tensor row must "
            "have its own frame"
        )
        return out


_identities = itertools.count()


def identity(prefix: str = "TQ_STORAGE_pytest") -> bytes:
    return f"{prefix}_{os.getpid()}_{next(_identities)}".encode()


class TQClient:
    """A DEALER to a TransferQueue endpoint; every receive has a timeout."""

    def __init__(self, endpoint: str, ident: bytes | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        self.endpoint = endpoint
        self.timeout = timeout
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, ident if ident is not None else identity())
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv_frames(self) -> list[bytes]:
        try:
            return self.sock.recv_multipart()
        except zmq.Again:
            raise AssertionError(f"no reply from {self.endpoint} within {self.timeout} s") from None

    def recv(self) -> Reply:
        return Reply(self.recv_frames())

    def no_reply_within(self, seconds: float) -> bool:
        return self.sock.poll(int(seconds * 1000), zmq.POLLIN) == 0

    def request(self, frames: list[bytes]) -> Reply:
        self.send(frames)
        return self.recv()

    def put(self, indexes, data, **kw) -> Reply:
        return self.request(put_frames(indexes, data, **kw))

    def get(self, indexes, fields) -> Reply:
        return self.request(get_frames(indexes, fields))

    def clear(self, indexes) -> Reply:
        return self.request(clear_frames(indexes))

    def metrics(self) -> Reply:
        return self.request(metrics_frames())


def assert_cells_equal(got, want, what: str = "") -> None:
    """Compares one cell: ndarray (dtype, shape, bytes), Raw, or plain value."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{what}: expected a tensor, got {got!r}"
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), f"{what}: {got!r} != {want!r}"
    elif isinstance(want, Raw):
        assert got == Raw(want.dtype, tuple(want.shape), want.data), f"{what}: {got!r} != {want!r}"
    else:
        assert type(got) is type(want) and got == want, f"{what}: {got!r} != {want!r}"


def expected_rows(value) -> list:
    """The per-row cells a GET returns for a PUT field value."""
    if isinstance(value, np.ndarray):
        return [value[i : i + 1].reshape(value.shape[1:]) for i in range(value.shape[0])]
    if isinstance(value, Raw):
        n = value.shape[0]
        row = len(value.data) // n
        return [Raw(value.dtype, tuple(value.shape[1:]), value.data[i * row : (i + 1) * row]) for i in range(n)]
    return list(value)
