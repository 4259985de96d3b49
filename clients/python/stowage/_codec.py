"""stowage/1 requests and replies (docs/protocol-stowage1.md), around
stowd's own codec.

Pure functions and small classes; no sockets. Frame 0 is written and read
by the Rust core (`_core.encode_request`, `_core.decode_reply`: stowd's
`stowage_wire::native`, so the protocol has one implementation): this
module checks the user's input and lays out a put's data frames
(`put_messages`). A get's reply is read and its results made by the core
too (`_core.Connection.get`, `_core.GetOptions`), over the socket or from
stowd's shared-memory segments.
"""

from __future__ import annotations

import math
import operator
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import msgpack
import numpy as np

from . import _core, _torch
from ._dtypes import (  # noqa: F401 - re-exported
    BITS_DTYPES,
    DTYPE_ALIASES,
    WIRE_DTYPES,
    canonical_dtype,
    ml_dtype,
    wire_dtype_of,
)
from .errors import ProtocolError

PROTO = "stowage/1"

# ---------------------------------------------------------------- dtypes
# (the tables and names live in `_dtypes`, which `_torch` uses too)


class Bits:
    """Marks unsigned (or signed) int numpy data as the bit patterns of a
    dtype numpy has no type for (`stowage.BITS_DTYPES`: bfloat16, complex32,
    the float8s, float4_e2m1fn_x2), so it is sent with that dtype:
    `Bits(array, "float8_e4m3fn")` for a regular field, or
    `Bits([row, ...], "float8_e4m3fn")` for a nested one. The ints must have
    the dtype's itemsize (uint8 for a float8, uint32 for complex32). This is
    the form a get returns these dtypes in when torch is not used, so it
    round-trips."""

    __slots__ = ("data", "dtype")

    def __init__(self, data, dtype: str):
        if dtype not in BITS_DTYPES:
            raise ValueError(f"Bits: dtype must be one of {sorted(BITS_DTYPES)}, got {dtype!r}")
        self.data = data
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"Bits({self.data!r}, {self.dtype!r})"


class BFloat16Bits(Bits):
    """`Bits(data, "bfloat16")`: uint16 (or int16) numpy data as bfloat16 bit
    patterns, `BFloat16Bits(array)` for a regular field, or
    `BFloat16Bits([row, ...])` for a nested one."""

    __slots__ = ()

    def __init__(self, data):
        super().__init__(data, "bfloat16")

    def __repr__(self) -> str:
        return f"BFloat16Bits({self.data!r})"


def typed_bits(v, dtype: str):
    """A get's raw-bits array (or list of row arrays) of `dtype` -> the same
    memory viewed as ml_dtypes' type when ml_dtypes is installed and has it;
    else unchanged."""
    dt = ml_dtype(dtype)
    if dt is None:
        return v
    return [r.view(dt) for r in v] if isinstance(v, list) else v.view(dt)


# ---------------------------------------------------------------- put input


@dataclass
class Regular:
    dtype: str
    array: np.ndarray  # C-contiguous, little-endian, rows on axis 0

    @property
    def row_bytes(self) -> int:
        return self.array.nbytes // self.array.shape[0] if self.array.shape[0] else 0


@dataclass
class Nested:
    """n rows of one dtype and several shapes: `rows`, a list of n
    C-contiguous little-endian ndarrays; or packed, with no array per row
    (a jagged torch tensor, `Packed`): `values` `[total, *tail]` holds every
    row's elements back to back and row i is `values[offsets[i]:offsets[i+1]]`
    (`offsets` int64 `[n + 1]`, from 0, never decreasing)."""

    dtype: str
    rows: list | None  # of C-contiguous little-endian ndarrays (None when packed)
    values: np.ndarray | None = None
    offsets: np.ndarray | None = None

    def row_nbytes(self, a: int, b: int) -> np.ndarray:
        """The bytes of rows a..b, as int64."""
        if self.rows is None:
            per = self.values.itemsize * math.prod(self.values.shape[1:])
            return np.diff(self.offsets[a:b + 1]) * per
        return np.fromiter((r.nbytes for r in self.rows[a:b]), dtype=np.int64, count=b - a)


@dataclass
class Packed:
    """A nested field's rows without an array per row (`get(...,
    nested="packed")`; `put` takes one too): `values`, a 1-D array or tensor
    of every row's elements back to back, in row order; `shapes`, each row's
    shape. Row i is `values[s:s + prod(shapes[i])]` reshaped, with `s` the
    element count of the rows before it."""

    values: Any
    shapes: list

    def offsets(self) -> np.ndarray:
        """int64 `[n + 1]`: where each row starts in `values`, in elements (and the end)."""
        counts = np.fromiter((math.prod(s) for s in self.shapes), dtype=np.int64, count=len(self.shapes))
        return np.concatenate(([0], np.cumsum(counts)))


@dataclass
class Values:
    values: list


def _little_contiguous(a: np.ndarray) -> np.ndarray:
    dt = a.dtype
    if dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big"):
        return a.astype(dt.newbyteorder("<"), order="C")
    # (not np.ascontiguousarray: it turns a 0-d array into a 1-d one)
    return a if a.flags.c_contiguous else a.copy(order="C")


def _tensor_like(x) -> bool:
    if isinstance(x, (str, bytes)):  # incl. numpy.str_ / numpy.bytes_
        return False
    return isinstance(x, (np.ndarray, np.generic, Bits)) or _torch.is_tensor(x)


def _to_wire_array(x, what: str) -> tuple[str, np.ndarray]:
    """An ndarray, torch tensor or Bits -> (dtype name, little-endian C-contiguous ndarray)."""
    if isinstance(x, Bits):
        a, bits = x.data, WIRE_DTYPES[x.dtype]
        if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu" or a.dtype.itemsize != bits.itemsize:
            n = 8 * bits.itemsize
            marker = "BFloat16Bits" if x.dtype == "bfloat16" else f"Bits(.., {x.dtype!r})"
            raise TypeError(f"{what}: {marker} needs a uint{n} or int{n} numpy array, got {_describe(a)}")
        return x.dtype, _little_contiguous(a).view(bits)
    if isinstance(x, (np.ndarray, np.generic)):  # a numpy scalar is a 0-d row
        x = np.asarray(x)
        return wire_dtype_of(x.dtype, what), _little_contiguous(x)
    name, a = _torch.to_numpy(x, what)
    return name, _little_contiguous(a)


def _describe(x) -> str:
    if isinstance(x, np.ndarray):
        return f"ndarray {x.dtype}{list(x.shape)}"
    return type(x).__name__


_PLAIN = (str, bytes, int, float, bool, type(None))


def normalize_field(name: Any, value: Any, n: int) -> Regular | Nested | Values:
    """One field of a put -> its wire form; TypeError/ValueError with the
    field's name for anything stowage/1 cannot carry."""
    if not isinstance(name, str):
        raise TypeError(f"field names must be str, got {name!r}")
    what = f"field {name!r}"
    if isinstance(value, Bits) and isinstance(value.data, (list, tuple)):
        value = [Bits(r, value.dtype) for r in value.data]
    elif _torch.is_tensor(value) and _torch.is_nested(value):
        parts = _torch.jagged_parts(value)
        if parts is None:  # strided, or a jagged tensor with holes: its rows
            value = _torch.unbind(value)
        else:
            return _jagged_field(what, *parts, n)
    if isinstance(value, Packed):
        return _packed_field(what, value, n)
    if isinstance(value, (np.ndarray, Bits)) or _torch.is_tensor(value):
        dtype, a = _to_wire_array(value, what)
        if a.ndim == 0:
            raise ValueError(f"{what}: a regular field needs a row axis, got a 0-d array")
        if a.shape[0] != n:
            raise ValueError(f"{what} has {a.shape[0]} rows but {n} global indexes were given")
        return Regular(dtype, a)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} rows but {n} global indexes were given")
        if value and all(type(v) is np.ndarray for v in value):
            dts = {v.dtype for v in value}
            if len(dts) == 1:
                dt = dts.pop()
                if dt.byteorder != ">" and not (dt.byteorder == "=" and sys.byteorder == "big"):
                    dname = wire_dtype_of(dt, what)
                    return Nested(dname, [v if v.flags.c_contiguous else v.copy(order="C") for v in value])
        kinds = {_tensor_like(v) for v in value}
        if kinds == {True}:
            rows, dtypes = [], set()
            for i, v in enumerate(value):
                d, a = _to_wire_array(v, f"{what} row {i}")
                dtypes.add(d)
                rows.append(a)
            if len(dtypes) > 1:
                raise ValueError(f"{what}: nested rows must share one dtype, got {sorted(dtypes)}")
            return Nested(dtypes.pop(), rows)
        if kinds == {True, False}:
            raise TypeError(f"{what} mixes arrays/tensors and plain values; a field is one or the other")
        vals = []
        for i, v in enumerate(value):
            if isinstance(v, (bytearray, memoryview)):
                v = bytes(v)
            elif not isinstance(v, _PLAIN):
                try:
                    msgpack.packb(v)
                except Exception as e:  # noqa: BLE001 - msgpack raises TypeError/ValueError/OverflowError
                    raise TypeError(f"{what} row {i}: cannot send {type(v).__name__} as a value ({e})") from None
            vals.append(v)
        return Values(vals)
    raise TypeError(
        f"{what}: expected a numpy array or torch tensor [n, ...], a list of n arrays/tensors (nested), "
        f"a nested torch tensor, or a list of n str/bytes values; got {type(value).__name__}"
    )


def _jagged_field(what: str, values, offsets: np.ndarray, n: int) -> Nested:
    """A jagged tensor's values `[total, *tail]` and offsets (int64 `[n + 1]`,
    row starts on the values' first axis) -> a packed `Nested`, checked."""
    dtype, values = _to_wire_array(values, what)
    if offsets.ndim != 1 or len(offsets) != n + 1:
        raise ValueError(f"{what} has {max(len(offsets) - 1, 0)} rows but {n} global indexes were given")
    if values.ndim == 0:
        raise ValueError(f"{what}: packed values need a first axis, got a 0-d array")
    if offsets[0] != 0 or offsets[-1] != values.shape[0] or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{what}: offsets must rise from 0 to {values.shape[0]} (the values' first axis)")
    return Nested(dtype, None, values, offsets)


def _packed_field(what: str, p: Packed, n: int) -> Nested:
    """A `Packed` -> a `Nested` (packed where the rows share a tail shape), checked."""
    dtype, values = _to_wire_array(p.values, what)
    shapes = p.shapes
    if not isinstance(shapes, (list, tuple)) or len(shapes) != n:
        got = len(shapes) if isinstance(shapes, (list, tuple)) else type(shapes).__name__
        raise ValueError(f"{what}: Packed.shapes must list {n} row shapes, got {got}")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if any(d < 0 for s in shapes for d in s):
        raise ValueError(f"{what}: a row shape has a negative dimension")
    counts = np.fromiter((math.prod(s) for s in shapes), dtype=np.int64, count=n)
    flat = values.reshape(-1)
    if int(counts.sum()) != flat.shape[0]:
        raise ValueError(f"{what}: the row shapes hold {int(counts.sum())} elements, values has {flat.shape[0]}")
    starts = np.concatenate(([0], np.cumsum(counts)))
    tails = {s[1:] for s in shapes}
    if len(tails) == 1 and all(len(s) >= 1 for s in shapes):
        # One tail shape: rows are runs of the first axis (no array per row).
        tail = tails.pop()
        per = math.prod(tail)
        if per:
            return Nested(dtype, None, flat.reshape(-1, *tail), starts // per)
    if n and not flat.flags.c_contiguous:
        flat = flat.copy()
    return Nested(dtype, [flat[starts[i]:starts[i + 1]].reshape(s) for i, s in enumerate(shapes)])


def _checked_fast(g: Any, unique: bool) -> list[int] | None:
    """The list check_indexes returns, read by the Rust core for the usual
    case (a list, tuple, range or 1-d integer buffer of indexes in
    0..2**64-1, with no repeat for a put: `_core.read_index_list`); None
    where the full checks below must say what is wrong."""
    read = _core.read_index_list(g, unique)
    if read is None:
        return None
    # A list or tuple as it is (its ints shared: a new int object per index
    # cost a put of 524,288 rows 16 MiB more at its peak), else new ints.
    return list(g) if type(g) in (list, tuple) else read.tolist()


def check_indexes(global_indexes: Any, what: str, *, unique: bool, allow_empty: bool = False) -> list[int]:
    """global indexes -> a list of Python ints (ValueError/TypeError with a clear message)."""
    fast = _checked_fast(global_indexes, unique)
    if fast is not None:
        return fast
    if isinstance(global_indexes, (str, bytes)) or not isinstance(global_indexes, Iterable):
        raise TypeError(f"{what}: global_indexes must be a sequence of non-negative ints, got "
                        f"{type(global_indexes).__name__}")
    if isinstance(global_indexes, np.ndarray):
        if global_indexes.ndim != 1 or (global_indexes.size and global_indexes.dtype.kind not in "iu"):
            raise TypeError(f"{what}: global_indexes must be a 1-d integer array, got {_describe(global_indexes)}")
        idx = global_indexes.tolist()
    elif type(global_indexes) in (list, range) and set(map(type, global_indexes)) <= {int}:
        idx = list(global_indexes)  # plain ints: checked at C speed (131,072 in ~2 ms)
    else:
        try:
            idx = [operator.index(g) for g in global_indexes]
        except TypeError:
            bad = next(g for g in global_indexes if not hasattr(g, "__index__"))
            raise TypeError(f"{what}: global indexes must be ints, got {bad!r}") from None
    if not idx and not allow_empty:
        raise ValueError(f"{what}: empty batch: global_indexes is empty (a {what} needs at least one index)")
    if idx and (min(idx) < 0 or max(idx) >= 1 << 64):
        bad = next(g for g in idx if g < 0 or g >= 1 << 64)
        raise ValueError(f"{what}: global index {bad} is out of range (0 .. 2**64-1)")
    if unique and len(set(idx)) != len(idx):
        seen: set[int] = set()
        dup = next(g for g in idx if g in seen or seen.add(g))
        raise ValueError(f"{what}: duplicate global index {dup} (each index may appear once in a put)")
    return idx


def get_indexes(global_indexes: Any, what: str, ranges: bool = True) -> tuple[int, Any]:
    """A get's global indexes -> (how many, their wire form).

    The usual inputs (a list, tuple or range of ints, a 1-d integer numpy
    array or other buffer) are read by the Rust core in one pass, which
    finds their arithmetic runs as it reads: an `_core.IndexList`, which
    frame 0 carries as ranges, ``{"ranges": [[start, count, step], ...]}``,
    where that is shorter than the list (a get of half a million rows in
    put order costs stowd and this client about what a get of one does),
    else as the list; with ``ranges=False`` (a stowd from before ranges)
    always as a list. Anything else goes through ``check_indexes``, which
    says what is wrong with it."""
    g = global_indexes
    read = _core.read_index_list(g)
    if read is not None:
        return len(read), (read if ranges else read.tolist())
    idx = check_indexes(g, what, unique=False)
    return len(idx), idx


def check_field_names(fields: Any, what: str) -> list[str]:
    if isinstance(fields, str):
        fields = [fields]
    fields = list(fields)
    if not fields:
        raise ValueError(f"{what}: empty batch: no fields requested")
    for f in fields:
        if not isinstance(f, str):
            raise TypeError(f"{what}: field names must be str, got {f!r}")
    if len(set(fields)) != len(fields):
        raise ValueError(f"{what}: a field is named twice in {fields}")
    return fields


# ---------------------------------------------------------------- put encoding

SMALL_PIECE_BYTES = 64 << 10  # pieces below this share a copied frame
COALESCED_FRAME_BYTES = 1 << 20  # most bytes in one shared frame


class _Frames:
    """Data frames of one message: big pieces go out as their own frame (no
    copy); small ones are copied into shared frames of at most 1 MiB, each
    starting at a multiple of its itemsize."""

    def __init__(self) -> None:
        self.frames: list = []
        # the shared frame being filled: its pieces (joined by `finish`) and length
        self._chunks: list | None = None
        self._len = 0
        self._shared_no = 0

    def add(self, a: np.ndarray) -> tuple[int, int]:
        """Adds the bytes of C-contiguous `a`; returns (frame number, offset)."""
        nbytes = a.nbytes
        if nbytes >= SMALL_PIECE_BYTES:
            self.frames.append(a.reshape(-1).view(np.uint8))
            return len(self.frames), 0
        align = a.dtype.itemsize
        align = 1 if align < 1 else 16 if align > 16 else align
        n = self._len
        if self._chunks is None or n + align + nbytes > COALESCED_FRAME_BYTES:
            self._close_shared()
            self._chunks, n = [], 0
            self.frames.append(None)  # the Pieces, once closed
            self._shared_no = len(self.frames)
        pad = (-n) % align
        if pad:
            self._chunks.append(_ZEROS[:pad])
            n += pad
        if nbytes:
            self._chunks.append(a)  # its buffer: C-contiguous (checked by normalize_field)
        self._len = n + nbytes
        return self._shared_no, n

    def _close_shared(self) -> None:
        """Ends the shared frame being filled."""
        if self._chunks is not None:
            self.frames[self._shared_no - 1] = Pieces(self._chunks)
            self._chunks = None
            self._len = 0

    def finish(self, join: bool = True) -> list:
        """The data frames, every shared frame joined into one bytes (one
        copy, no Python per byte), or with `join=False` left as `Pieces` for
        a writer that copies each piece to its place anyway (a same-node put
        into a leased segment)."""
        self._close_shared()
        if join:
            self.frames = join_frames(self.frames)
        return self.frames


def join_frames(frames: list) -> list:
    """Data frames with every `Pieces` joined into one bytes (one copy), as a
    socket sends them."""
    return [b"".join(f) if type(f) is Pieces else f for f in frames]


class Pieces(list):
    """A shared data frame not joined: its buffers, back to back (padding
    included), in order."""

    @property
    def nbytes(self) -> int:
        return sum(memoryview(c).nbytes for c in self)


_ZEROS = bytes(16)


def _row_costs(fields: Mapping[str, Regular | Nested | Values], n: int) -> np.ndarray:
    """Approximate bytes each row adds to a put message."""
    cost = np.full(n, 16 * (1 + len(fields)), dtype=np.int64)
    for f in fields.values():
        if isinstance(f, Regular):
            cost += f.row_bytes
        elif isinstance(f, Nested):
            cost += f.row_nbytes(0, n)
        else:
            cost += np.fromiter(
                (len(v) if isinstance(v, bytes) or (isinstance(v, str) and v.isascii())
                 else 4 * len(v) if isinstance(v, str) else 64 for v in f.values),
                dtype=np.int64, count=n,
            )
    return cost


def split_rows(fields: Mapping[str, Regular | Nested | Values], n: int, max_bytes: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) whose messages each stay under max_bytes (a row
    bigger than that goes alone)."""
    cum = np.cumsum(_row_costs(fields, n))
    if n == 0 or cum[-1] <= max_bytes:
        return [(0, n)]
    ranges = []
    a = 0
    while a < n:
        base = cum[a - 1] if a else 0
        b = int(np.searchsorted(cum, base + max_bytes, side="right"))
        b = max(b, a + 1)
        ranges.append((a, b))
        a = b
    return ranges


def _descriptor(f: Regular | Nested | Values, a: int, b: int, frames: _Frames) -> tuple:
    """Rows a..b of a field as `_core.encode_request` takes them."""
    if isinstance(f, Values):
        return ("values", f.values[a:b])
    if isinstance(f, Regular):
        piece = f.array[a:b]
        frame, offset = frames.add(piece)
        return ("regular", f.dtype, piece.shape, [(frame, offset, piece.nbytes, b - a)])
    if f.rows is None:
        # Packed rows: the run a..b is one piece (one frame, or one range of a
        # shared frame); each row's range in it follows from the offsets.
        off = f.offsets
        lo, hi = int(off[a]), int(off[b])
        frame, at = frames.add(f.values[lo:hi])
        tail = tuple(f.values.shape[1:])
        per = f.values.itemsize * math.prod(tail)
        starts = ((off[a:b] - lo) * per + at).tolist()
        lens = np.diff(off[a:b + 1]).tolist()
        return ("nested", f.dtype, [((k, *tail), frame, s, k * per) for k, s in zip(lens, starts)])
    add = frames.add
    return ("nested", f.dtype, [(r.shape, *add(r), r.nbytes) for r in f.rows[a:b]])


@dataclass
class PutMessage:
    body: dict
    frames: list  # data frames (buffers), numbered from 1
    rows: tuple[int, int]  # the rows [a, b) of the put it carries


def put_messages(indexes: list[int], fields: Mapping[str, Regular | Nested | Values],
                 max_bytes: int, join: bool = True) -> Iterator[PutMessage]:
    """The put split by rows into messages of at most ~max_bytes each (lazy);
    `join=False` leaves shared frames as `Pieces` (see `_Frames.finish`)."""
    for a, b in split_rows(fields, len(indexes), max_bytes):
        frames = _Frames()
        desc = {name: _descriptor(f, a, b, frames) for name, f in fields.items()}
        yield PutMessage({"global_indexes": indexes[a:b], "fields": desc}, frames.finish(join), (a, b))


# ---------------------------------------------------------------- envelopes


def envelope(op: str, req_id: int, body: dict, extras: dict | None = None) -> bytes:
    """Frame 0 of a request; `extras` adds same-node keys (`segments`,
    `same_node`, `channel`). A put's fields are `_descriptor`s."""
    return _core.encode_request(op, req_id, body, extras)


def decode_envelope(frame0) -> dict:
    """Frame 0 of a reply -> {"proto", "op", "id", "body"[, "segments", "same_node"]},
    checked by stowd's decoder (ProtocolError with its reason if malformed);
    a get_ok's descriptors are tuples (see `_core.decode_reply`)."""
    try:
        return _core.decode_reply(frame0)
    except _core.ProtocolViolation as e:
        raise ProtocolError(f"malformed reply: {e}") from None
