"""stowage/1 requests and replies (docs/protocol-stowage1.md), around
stowd's own codec.

Pure functions and small classes; no sockets. Frame 0 is written and read
by the Rust core (`_core.encode_request`, `_core.decode_reply`: stowd's
`stowage_wire::native`, so the protocol has one implementation), and a
put is read, checked and laid out there too (`_core.Put`, which asks this
module to word bad indexes, `check_indexes`, and to hand over the arrays
it does not read itself, `_wire_array`): this module checks a get's
input. A get's reply is read and its results made by the core too
(`_core.Connection.get`, `_core.GetOptions`), over the socket or from
stowd's shared-memory segments.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Iterable

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


def _int_index(g: Any) -> int:
    if isinstance(g, (bool, np.bool_)):
        raise TypeError("a bool")
    return operator.index(g)


def check_indexes(global_indexes: Any, what: str, *, unique: bool, allow_empty: bool = False) -> list[int]:
    """global indexes -> a list of Python ints (ValueError/TypeError with a clear message)."""
    fast = _checked_fast(global_indexes, unique)
    if fast is not None:
        return fast
    if isinstance(global_indexes, (str, bytes, bytearray)) or not isinstance(global_indexes, Iterable):
        raise TypeError(f"{what}: global_indexes must be a sequence of non-negative ints, got "
                        f"{type(global_indexes).__name__}")
    if isinstance(global_indexes, np.ndarray):
        if global_indexes.ndim != 1 or (global_indexes.size and global_indexes.dtype.kind not in "iu"):
            raise TypeError(f"{what}: global_indexes must be a 1-d integer array, got {_describe(global_indexes)}")
        idx = global_indexes.tolist()
    elif type(global_indexes) in (list, range) and set(map(type, global_indexes)) <= {int}:
        idx = list(global_indexes)  # plain ints: checked at C speed (131,072 in ~2 ms)
    else:
        # A bool is an int to Python, but a list of them is a mask far more
        # often than the indexes 0 and 1 (a numpy bool array is refused too).
        items = list(global_indexes)
        try:
            idx = [_int_index(g) for g in items]
        except TypeError:
            bad = next(g for g in items if isinstance(g, (bool, np.bool_)) or not hasattr(g, "__index__"))
            hint = " (a bool: for a mask, pass numpy.flatnonzero(mask))" if isinstance(bad, (bool, np.bool_)) else ""
            raise TypeError(f"{what}: global indexes must be ints, got {bad!r}{hint}") from None
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
