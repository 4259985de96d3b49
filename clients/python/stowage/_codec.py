"""stowage/1 requests and replies (docs/protocol-stowage1.md), around
stowd's own codec.

Pure functions and small classes; no sockets. Frame 0 is written and read
by the Rust core (`_core.encode_request`, `_core.decode_reply`: stowd's
`stowage_wire::native`, so the protocol has one implementation), and a
put is read, checked and laid out there too (`_core.Put`, which asks this
module to word bad indexes, `check_indexes`, and to hand over the arrays
it does not read itself, `_wire_array`): this module checks a get's
input and turns the checked descriptors of a reply into arrays
(`decode_get_fields`, `Part` / `FieldReply`).

Where a reply's bytes come from is pluggable: descriptors name bytes as
(data frame k, offset, len), and `decode_get_fields` resolves them through a
`FrameSource`, built from the socket's frames today, or (same-node mode)
from read-only mappings of the shared-memory segments a reply's envelope
lists instead of frames.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

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
# (read, checked and laid out by the Rust core, `_core.Put`; what it asks
# of Python is here)


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


def _wire_array(x, what: str, bits: str | None = None) -> tuple[str, np.ndarray]:
    """For the core's put reader (`_core.Put`), an array it does not read
    from its buffer format itself (a torch tensor, `Bits`, a numpy scalar
    row, an ml_dtypes float8, a dtype stowage/1 cannot carry): (its
    stowage/1 dtype name, a numpy array of its bytes, any strides and byte
    order, sharing its memory where torch can), or the TypeError that says
    why it cannot be sent. `bits`: `x` is the data of `Bits(x, bits)` (a row
    of a nested `Bits` field)."""
    if bits is not None:
        x = Bits(x, bits)
    if isinstance(x, Bits):
        a, b = x.data, WIRE_DTYPES[x.dtype]
        if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu" or a.dtype.itemsize != b.itemsize:
            n = 8 * b.itemsize
            marker = "BFloat16Bits" if x.dtype == "bfloat16" else f"Bits(.., {x.dtype!r})"
            raise TypeError(f"{what}: {marker} needs a uint{n} or int{n} numpy array, got {_describe(a)}")
        return x.dtype, a
    if isinstance(x, (np.ndarray, np.generic)):  # a numpy scalar is a 0-d row
        a = np.asarray(x)
        name = wire_dtype_of(a.dtype, what)
        return name, (a.view(f"u{a.dtype.itemsize}") if name in BITS_DTYPES else a)
    if _torch.is_tensor(x):
        return _torch.to_numpy(x, what)
    raise TypeError(f"{what}: expected a numpy array or torch tensor, got {type(x).__name__}")


def _nested_tensor(t):
    """For the core's put reader, a nested torch tensor: (its values, its
    offsets as an int64 ndarray) where its rows lie back to back in its
    values (a jagged tensor without holes), else its rows, as tensors."""
    parts = _torch.jagged_parts(t)
    return _torch.unbind(t) if parts is None else parts


def _describe(x) -> str:
    if isinstance(x, np.ndarray):
        return f"ndarray {x.dtype}{list(x.shape)}"
    return type(x).__name__


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


# ---------------------------------------------------------------- envelopes


def envelope(op: str, req_id: int, body: dict, extras: dict | None = None) -> bytes:
    """Frame 0 of a request; `extras` adds same-node keys (`segments`,
    `same_node`, `channel`). A put's fields are descriptors as
    `_core.encode_request` takes them (the client's puts are written by
    `_core.Put`)."""
    return _core.encode_request(op, req_id, body, extras)


def decode_envelope(frame0) -> dict:
    """Frame 0 of a reply -> {"proto", "op", "id", "body"[, "segments", "same_node"]},
    checked by stowd's decoder (ProtocolError with its reason if malformed);
    a get_ok's descriptors are tuples (see `_core.decode_reply`)."""
    try:
        return _core.decode_reply(frame0)
    except _core.ProtocolViolation as e:
        raise ProtocolError(f"malformed reply: {e}") from None


# ---------------------------------------------------------------- get replies


class FrameSource:
    """The data frames 1..n of one reply, as read-only memoryviews.

    This is the seam for where reply bytes come from. Descriptors always name
    bytes as (data frame k, offset, len); what "data frame k" is depends on
    the reply: `FrameSource.from_socket` for frames received on the socket
    (zmq.Frame with copy=False, or bytes; views share their memory). In the
    same-node mode a reply's envelope has `segments` = [[name, offset, len],
    ...] and no frames on the socket: data frame k is then bytes offset..
    offset+len of the file shm_dir/name, so that mode builds a FrameSource
    from read-only mappings of those files, and the decoder, `get`,
    `get_into` and the torch bridging stay as they are. There, `cow` maps the
    same bytes privately, copy-on-write (`_shm.CopyOnWrite`), for results
    that must be writable (torch tensors; see `to_private_numpy`).
    """

    def __init__(self, views: Sequence[memoryview], bases: Sequence | None = None,
                 where: Sequence[tuple[int, int]] | None = None, cow: Any = None) -> None:
        self._views = [None, *views]  # numbered from 1
        self.cow = cow
        self._used: set[int] = set()
        # Optional: data frame k is bytes where[k-1][1].. of bases[where[k-1][0]]
        # (base -1: unknown), so parts in many frames of one buffer can be
        # gathered with one numpy call.
        if bases is None or where is None:
            bases, where = list(views), [(i, 0) for i in range(len(views))]
        self.bases = bases
        self._where = [None, *where]

    @classmethod
    def from_socket(cls, frames: Sequence) -> "FrameSource":
        """frames[0] is the envelope; frames[1:] the data frames."""
        return cls([_readonly(f) for f in frames[1:]])

    def where_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(length, base, base offset) of every data frame k, indexed by k (0 unused)."""
        w = getattr(self, "_where_np", None)
        if w is None:
            m = len(self._views)
            lens = np.fromiter((len(v) if v is not None else 0 for v in self._views), np.int64, count=m)
            base = np.fromiter((b for b, _ in self._where[1:]), np.int64, count=m - 1)
            at = np.fromiter((a for _, a in self._where[1:]), np.int64, count=m - 1)
            w = self._where_np = (lens, np.concatenate(([-1], base)), np.concatenate(([0], at)))
        return w

    def mark_used(self, ks) -> None:
        self._used.update(ks)

    def where(self, k: int, offset: int) -> tuple[int, int]:
        """(base number, offset in that base) of byte `offset` of data frame k
        (already checked by `view`)."""
        b, at = self._where[k]
        return b, at + offset

    def view(self, k: Any, offset: int, length: int) -> memoryview:
        """Read-only bytes offset..offset+length of data frame k (ProtocolError if outside)."""
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k < len(self._views):
            raise ProtocolError(f"frame {k!r} does not exist (the reply has {len(self._views) - 1} data frames)")
        v = self._views[k]
        if offset + length > len(v):
            raise ProtocolError(f"range {offset}+{length} lies outside frame {k} ({len(v)} bytes)")
        self._used.add(k)
        return v[offset:offset + length]

    def finish(self) -> None:
        """Every data frame must be referenced by some descriptor."""
        if len(self._used) != len(self._views) - 1:
            unused = sorted(set(range(1, len(self._views))) - self._used)
            raise ProtocolError(f"reply data frames {unused[:10]} are referenced by no descriptor")


def _readonly(frame) -> memoryview:
    # pyzmq hands out *writable* memoryviews of frames received with copy=False:
    # make them read-only (no copy) so results cannot be written.
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv.toreadonly()


@dataclass
class Part:
    """`rows` rows of a field starting at row `start`; `data` their bytes (read-only)."""

    start: int
    rows: int
    data: memoryview
    base: int = -1  # FrameSource.bases[base] holds data at offset `at` (-1: unknown)
    at: int = 0


@dataclass
class FieldReply:
    """One field of a get_ok, resolved to byte views."""

    kind: str  # "regular", "nested", "values"
    dtype: str | None = None  # canonical stowage/1 name
    shape: tuple | None = None  # regular
    parts: list | None = None  # regular: [Part]
    rows: list | None = None  # nested: [(shape, memoryview)]
    values: list | None = None  # values
    bases: list | None = None  # regular: the buffers parts point into (Part.base)
    # regular, many parts: (start, rows, frame, offset, len, base, at) as int64
    # arrays instead of Part objects; `parts` is built from it on demand
    table: tuple | None = None
    src: Any = None  # the FrameSource `table` refers to
    # nested: the rows' descriptors as received (checked), for where each
    # row lies (FrameSource.where), which only `to_private_numpy` needs
    row_desc: list | None = None

    @property
    def np_dtype(self) -> np.dtype:
        return WIRE_DTYPES[self.dtype]


def _decode_field(name: str, d: tuple, n: int, frames: FrameSource) -> FieldReply:
    """A descriptor stowd's decoder checked in itself (kinds, shapes, lengths
    against the dtype, row sums) -> its rows as views of `frames`, checked
    against the request (`n` rows) and against the frames."""
    what = f"field {name!r}"
    kind = d[0]
    if kind == "values":
        if len(d[1]) != n:
            raise ProtocolError(f"{what}: values descriptor without {n} values")
        return FieldReply("values", values=d[1])
    _, dtype, shape_or_rows, *parts = d
    if kind == "regular":
        shape, parts = shape_or_rows, parts[0]
        if shape[0] != n:
            raise ProtocolError(f"{what}: shape {list(shape)} does not have {n} rows")
        if len(parts) >= GATHER_MIN_PARTS and parts[0][2]:
            table = _part_table(parts, frames)
            if table is not None:
                return FieldReply("regular", dtype=dtype, shape=shape, bases=frames.bases, table=table, src=frames)
        out: list[Part] = []
        start = 0
        end = None  # (frame, end offset) of the previous part, to merge parts that follow on directly
        view, where = frames.view, frames.where
        for k, off, ln, rows in parts:
            if end == (k, off):  # the same bytes as one merged part
                prev = out[-1]
                out[-1] = Part(prev.start, prev.rows + rows, view(k, off - len(prev.data), len(prev.data) + ln),
                               prev.base, prev.at)
            else:
                out.append(Part(start, rows, view(k, off, ln), *where(k, off)))
            end = (k, off + ln)
            start += rows
        return FieldReply("regular", dtype=dtype, shape=shape, parts=out, bases=frames.bases)
    rows = shape_or_rows
    if len(rows) != n:
        raise ProtocolError(f"{what}: nested descriptor without {n} rows")
    view = frames.view
    return FieldReply("nested", dtype=dtype, rows=[(shape, view(k, off, ln)) for shape, k, off, ln in rows],
                      row_desc=rows)


def _part_table(parts: list, frames: FrameSource):
    """Many parts of a regular field, checked against the frames with numpy:
    the arrays of a FieldReply.table, or None to take the part-by-part path
    (which also words any error)."""
    try:
        k, off, ln, rows = np.array(parts, dtype=np.int64).T
    except OverflowError:
        return None
    lens, wbase, wat = frames.where_arrays()
    if k.min() < 1 or k.max() >= len(lens) or np.any(off + ln > lens[k]):
        return None
    base = wbase[k]
    if base.min() < 0:
        return None
    frames.mark_used(np.unique(k).tolist())
    start = np.cumsum(rows) - rows
    return start, rows, k, off, ln, base, wat[k] + off


def _parts(f: FieldReply) -> list:
    """The parts of a regular field (built from its table if it has one)."""
    if f.parts is None and f.table is not None:
        start, rows, k, off, ln, base, at = (a.tolist() for a in f.table)
        view = f.src.view
        f.parts = [Part(*x[:2], view(*x[2:5]), *x[5:]) for x in zip(start, rows, k, off, ln, base, at)]
    return f.parts


def decode_get_fields(body: dict, requested: list[str], n: int, frames: FrameSource) -> dict:
    """A get_ok body -> {field: FieldReply}, in request order, every byte range
    resolved to a read-only view of `frames`."""
    descs = body["fields"]
    if list(descs) != requested:
        raise ProtocolError(f"get_ok has fields {list(descs)}, requested {requested}")
    out = {name: _decode_field(name, descs[name], n, frames) for name in requested}
    frames.finish()
    return out


# ---------------------------------------------------------------- results


def _frombuffer(data: memoryview, dt: np.dtype, shape: tuple) -> np.ndarray:
    if len(data) == 0:
        a = np.empty(shape, dt)
        a.flags.writeable = False
        return a
    return np.frombuffer(data, dtype=dt).reshape(shape)  # read-only: data is


def to_numpy(f: FieldReply, writable: bool = False):
    """Regular -> one read-only ndarray (a view of the received bytes if the
    field is one part, else one concatenating copy: by the core, into a
    buffer it may reuse, for a field of many parts; with `writable`, into a
    new numpy array the caller may make writable); nested -> a list of
    read-only views; values -> the list of values."""
    if f.kind == "values":
        return f.values
    dt = f.np_dtype
    if f.kind == "nested":
        return [_frombuffer(data, dt, shape) for shape, data in f.rows]
    row_shape = f.shape[1:]
    if f.table is None and len(f.parts) == 1:
        return _frombuffer(f.parts[0].data, dt, f.shape)
    if f.table is not None and not writable:
        # Many parts: one pass of copies by the core, into a buffer it may
        # reuse (`_core.gather`).
        _, _, _, _, ln, base, at = f.table
        total = int(ln.sum())
        if total == dt.itemsize * math.prod(f.shape) and total:
            return np.frombuffer(_core.gather(total, f.bases, base, at, ln), dtype=dt).reshape(f.shape)
    out = np.empty(f.shape, dt)
    if not _gather(f, out):
        for p in _parts(f):
            out[p.start:p.start + p.rows] = _frombuffer(p.data, dt, (p.rows, *row_shape))
    out.flags.writeable = False
    return out


def to_packed(f: FieldReply, frames: FrameSource, writable: bool = False) -> np.ndarray:
    """A nested field's rows as one 1-D array of their elements back to back
    (the `values` of a `Packed`), with no array per row: a view of the
    received bytes where the rows lie back to back in one buffer (as the
    Rust core receives a field's rows), else one gathering copy. Read-only
    unless `writable`: then over this reply's private copy-on-write mapping
    where `frames` are shared mappings (same node), or a copy of this
    client's own, as `to_private_numpy` gives."""
    dt = f.np_dtype
    rows = f.row_desc
    if not rows:
        return np.empty(0, dt)
    kol = np.array([r[1:] for r in rows], dtype=np.int64)  # (frame, offset, len) per row
    k, off, ln = kol[:, 0], kol[:, 1], kol[:, 2]
    total = int(ln.sum())
    lens, wbase, wat = frames.where_arrays()
    base, at = wbase[k], wat[k] + off
    b0 = int(base[0])
    if total and b0 >= 0 and np.all(base == b0) and np.array_equal(at[1:], at[:-1] + ln[:-1]):
        start = int(at[0])
        if frames.cow is None:
            return _frombuffer(memoryview(frames.bases[b0]).cast("B")[start:start + total], dt, (total // dt.itemsize,))
        if writable:
            mv, first = frames.cow.map(b0, start, start + total)
            return np.frombuffer(mv[start - first:start - first + total], dtype=dt)
    if total and base.min() >= 0 and not writable:
        return np.frombuffer(_core.gather(total, frames.bases, base, at, ln), dtype=dt)
    out = np.empty(total // dt.itemsize, dt)
    flat, pos = out.view(np.uint8), 0
    for _, d in f.rows:
        flat[pos:pos + len(d)] = np.frombuffer(d, np.uint8)
        pos += len(d)
    if not writable:
        out.flags.writeable = False
    return out


def to_private_numpy(fields: Mapping[str, FieldReply], frames: FrameSource) -> dict:
    """`to_numpy` of regular and nested fields, for results that become torch
    tensors (torch has no read-only tensors) when `frames` are read-only
    mappings shared with other readers (the same-node mode, `frames.cow`
    set): writable arrays over this reply's private copy-on-write mappings
    (one per segment, of the pages these fields use) where `to_numpy` would
    return a view of a shared mapping (a regular field of one part, nested
    rows), and `to_numpy`'s own result where that is a new array anyway (a
    regular field gathered from several parts, or no bytes). A write to one
    copies the pages it touches; no other reader sees it. No two arrays
    returned share a byte: one whose bytes overlap another's (a row asked
    for twice, or fields laid over the same bytes by their put) is a copy
    instead."""
    out: dict = {}
    # Views to make, in parallel lists: field, row (-1: the field's one
    # part), where its bytes lie (base, at, len), its shape, its read-only bytes.
    who, row, base, at, ln, shape, data = [], [], [], [], [], [], []
    where = frames.where
    for name, f in fields.items():
        if f.kind == "nested":
            rows = out[name] = [None] * len(f.rows)
            for i, ((sh, d), r) in enumerate(zip(f.rows, f.row_desc)):
                b, a = where(r[1], r[2])
                if b < 0 or not len(d):  # no bytes (or none of a shared mapping's): its own array
                    rows[i] = np.frombuffer(d, dtype=f.np_dtype).reshape(sh).copy()
                    continue
                who.append(name)
                row.append(i)
                base.append(b)
                at.append(a)
                ln.append(len(d))
                shape.append(sh)
                data.append(d)
        elif f.kind == "regular" and f.table is None and len(f.parts) == 1 and f.parts[0].base >= 0 \
                and len(f.parts[0].data):
            p = f.parts[0]
            out[name] = None
            who.append(name)
            row.append(-1)
            base.append(p.base)
            at.append(p.at)
            ln.append(len(p.data))
            shape.append(f.shape)
            data.append(p.data)
        elif f.kind == "regular" and f.table is not None:
            # Many parts: one pass of copies by the core into a buffer of this
            # result's own (read-only to numpy, private to this get: a tensor
            # over it may be written). numpy's gather path took 5x the
            # payload at its peak for a same-node get of 32,768 scattered
            # rows (docs/benchmarks.md, "TransferQueue users").
            out[name] = to_numpy(f)
        else:
            a = to_numpy(f, writable=True)  # gathered from several parts, or no bytes: a new array
            if not a.flags.owndata:  # (not with the segments stowd lists; never a shared view)
                a = a.copy()
            a.flags.writeable = True
            out[name] = a
    if not who:
        return out
    # One private mapping per segment, of the span these views use.
    if len(who) == 1:  # (the usual regular field: no numpy for one range)
        copy, maps = None, {base[0]: frames.cow.map(base[0], at[0], at[0] + ln[0])}
    else:
        b_np = np.array(base, dtype=np.int64)
        at_np = np.array(at, dtype=np.int64)
        end_np = at_np + np.array(ln, dtype=np.int64)
        copy = _overlapping(frames, b_np, at_np, end_np)
        maps = {}
        for b in np.unique(b_np).tolist():
            sel = b_np == b
            if copy is not None:
                sel &= ~copy
            if sel.any():
                maps[b] = frames.cow.map(b, int(at_np[sel].min()), int(end_np[sel].max()))
    for j, name in enumerate(who):
        dt = fields[name].np_dtype
        if copy is not None and copy[j]:
            a = np.frombuffer(data[j], dtype=dt).reshape(shape[j]).copy()
        else:
            mv, first = maps[base[j]]
            a = np.frombuffer(mv[at[j] - first:at[j] - first + ln[j]], dtype=dt).reshape(shape[j])
        if row[j] < 0:
            out[name] = a
        else:
            out[name][row[j]] = a
    return out


def _overlapping(frames: FrameSource, base: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray | None:
    """Which of the byte ranges start..end (each non-empty) of
    frames.bases[base] overlap an earlier one in address order: a bool
    array, or None if none can (fewer than two)."""
    n = len(base)
    if n < 2:
        return None
    sizes = np.array([len(b) for b in frames.bases], dtype=np.int64)
    first = np.concatenate(([0], np.cumsum(sizes)[:-1]))  # each base's place on one line
    start, end = first[base] + start, first[base] + end
    order = np.argsort(start, kind="stable")
    reach = np.maximum.accumulate(end[order])  # the furthest end of the ranges so far
    copy = np.zeros(n, dtype=bool)
    copy[order[1:]] = start[order[1:]] < reach[:-1]
    return copy if copy.any() else None


GATHER_MIN_PARTS = 16  # below this, one copy per part is as quick


def _gather(f: FieldReply, out: np.ndarray) -> bool:
    """Copies a regular field of many parts into `out` (C-contiguous) with one
    numpy call per buffer the parts lie in, instead of one per part; False if
    it does not apply (few parts, unknown buffers, rows not evenly spaced)."""
    n = f.shape[0]
    row_bytes = f.np_dtype.itemsize * math.prod(f.shape[1:])
    if f.table is not None:
        start, rows, _, _, _, base, at = f.table
    else:
        parts = f.parts
        if len(parts) < GATHER_MIN_PARTS or row_bytes == 0 or f.bases is None:
            return False
        m = len(parts)
        base = np.fromiter((p.base for p in parts), np.int64, count=m)
        if base.min() < 0:
            return False
        at = np.fromiter((p.at for p in parts), np.int64, count=m)
        start = np.fromiter((p.start for p in parts), np.int64, count=m)
        rows = np.fromiter((p.rows for p in parts), np.int64, count=m)
    # offset in its buffer of each output row
    row_at = np.repeat(at - start * row_bytes, rows) + np.arange(n, dtype=np.int64) * row_bytes
    row_base = np.repeat(base, rows)
    dst = out.reshape(n, -1).view(np.uint8)
    used = np.unique(base)
    for b in used.tolist():
        src = np.frombuffer(f.bases[b], np.uint8)
        sel = None if len(used) == 1 else row_base == b
        offs = row_at if sel is None else row_at[sel]
        first = int(offs[0]) % row_bytes
        if np.any(offs % row_bytes != first):
            return False
        table = src[first:first + (len(src) - first) // row_bytes * row_bytes].reshape(-1, row_bytes)
        idx = (offs - first) // row_bytes
        if sel is None:
            np.take(table, idx, axis=0, out=dst, mode="clip")
        else:
            dst[sel] = np.take(table, idx, axis=0, mode="clip")
    return True


def copy_into(f: FieldReply, out: np.ndarray) -> None:
    """Copies a regular field's bytes straight into `out` (already validated):
    one copy per byte, no intermediate buffer."""
    dt = f.np_dtype
    row_shape = f.shape[1:]
    for p in _parts(f):
        if p.rows and len(p.data):
            np.copyto(out[p.start:p.start + p.rows], np.frombuffer(p.data, dtype=dt).reshape(p.rows, *row_shape),
                      casting="no")

