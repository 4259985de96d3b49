"""TransferQueue's values on stowage/1, and back, as SimpleStorage returns them.

The native TransferQueue backend (`stowage.transferqueue`, protocol
"stowage") stores a TensorDict's fields as stowage/1 fields and rebuilds a
TensorDict from a get. What comes back is what TransferQueue 0.1.11's own
SimpleStorage returns for the same input (its storage units keep one value
per row, and its manager packs a field's rows with
`AsyncSimpleStorageManager._pack_field_values`), including its quirks:

- a regular tensor `[n]` comes back dense `[n]`; one of `[n, d1, ...]` comes
  back as a *jagged nested* tensor of n rows `[d1, ...]` (SimpleStorage
  stacks 0-d rows and packs the others with `as_nested_tensor(jagged)`).
  Here it is a jagged nested tensor over the received buffer (`_njt`): no
  copy, no tensor per row;
- a jagged nested tensor travels as its values plus offsets (one piece per
  message, rows described by arithmetic) and comes back the same way;
- rows of one dtype whose shapes differ beyond the first axis come back as
  SimpleStorage gives them (it tries jagged, then strided, then a
  `NonTensorStack`), from tensors per row, as it does;
- non-tensor values (`NonTensorStack` rows): str, bytes, bool, None, ints
  of 64 bits and floats are stowage/1 values; anything else (dicts, lists,
  tuples, numpy arrays, tensors inside containers, objects) is encoded per
  row with TransferQueue's own serializer (`transfer_queue.utils.serial_utils`,
  msgspec with its tensor/numpy/pickle hooks) into one msgpack ext value
  (`EXT_TQ`), so it decodes to what SimpleStorage returns: a tuple or set
  comes back a list, a bytearray bytes, a numpy array a read-only array,
  an object its unpickled copy. One difference: SimpleStorage pickles a
  whole *message* when msgspec cannot encode one row (e.g. an int over 64
  bits), which then keeps the other rows' tuples as tuples; here only that
  row is pickled.
- a field whose rows are all tensors (a `NonTensorStack` of tensors) comes
  back as SimpleStorage packs it: 0-d rows stacked, others jagged, etc.

This module needs torch, tensordict and transfer_queue (it imports without
them, for the package's import checks; `IMPORT_ERROR` says why they are
missing); the backend imports it only when TransferQueue is installed.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import msgpack
import numpy as np

from . import _codec
from ._codec import Packed

try:  # only `stowage.transferqueue` imports this module, when TransferQueue is installed
    import torch
    from tensordict import TensorDict
    from transfer_queue.metadata import extract_field_schema
    from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
    from transfer_queue.utils import serial_utils
except ImportError as e:  # pragma: no cover - exercised only without transfer_queue
    IMPORT_ERROR: ImportError | None = e
else:
    IMPORT_ERROR = None

EXT_TQ = 84
"""The msgpack ext code of a value encoded with TransferQueue's serializer
(`serial_utils.encode`, its frames packed with `serial_utils.pack_into`)."""


def _direct_njt():
    """The jagged nested tensor of `values` split by `offsets`, made by
    torch's `NestedTensor` class itself where `nested_tensor_from_jagged`
    goes through its dispatcher (`_nested_view_from_jagged`, its schema
    normalized per call): 17 µs a field against 60 (torch 2.15, a 4-row
    field), most of a small `get_data` of 10 fields. The same tensor but
    for autograd's view link to `values`, which SimpleStorage's own
    `as_nested_tensor` copies have no use for (they own their buffer).

    A private class, so it is checked once, here, against the public
    function (type, layout, dtype, sizes, offsets, values and every row,
    on a tensor with a ragged row and a tail dimension); anything amiss,
    or no such class, and the public function is used."""
    public = torch.nested.nested_tensor_from_jagged
    try:
        from torch.nested._internal.nested_tensor import NestedTensor

        def direct(values, offsets):
            return NestedTensor(values, offsets, _ragged_idx=1)

        v = torch.arange(12, dtype=torch.float32).reshape(6, 2)
        off = torch.tensor([0, 2, 3, 6])
        a, b = public(v, off), direct(v, off)
        same = (type(a) is type(b) and a.layout == b.layout == torch.jagged and a.dtype == b.dtype
                and a.device == b.device and a.dim() == b.dim() and a.size(0) == b.size(0)
                and a.size(-1) == b.size(-1) and a._ragged_idx == b._ragged_idx
                and torch.equal(a.offsets(), b.offsets()) and torch.equal(a.values(), b.values())
                and len(a.unbind()) == len(b.unbind())
                and all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind())))
    except Exception:  # noqa: BLE001 - any failure of the private path: the public one
        return public
    return direct if same else public


_njt = _direct_njt() if IMPORT_ERROR is None else None


def _pack_field_values(values: list):
    """TransferQueue 0.1.11's own packing of a field's rows (SimpleStorage's get)."""
    return AsyncSimpleStorageManager._pack_field_values(values)

_INT_MIN, _UINT_MAX = -(1 << 63), (1 << 64) - 1


def _plain(v) -> bool:
    """A value stowage/1 carries as itself and msgspec returns unchanged."""
    t = type(v)
    if t is str or t is bytes or v is None or t is bool or t is float:
        return True
    return t is int and _INT_MIN <= v <= _UINT_MAX


def encode_value(v) -> Any:
    """One non-tensor row -> a stowage/1 value."""
    if _plain(v):
        return v
    if type(v) in (bytearray, memoryview):  # SimpleStorage returns these as bytes
        return bytes(v)
    items = serial_utils.encode(v)
    buf = bytearray(serial_utils.calc_packed_size(items))
    serial_utils.pack_into(buf, items)
    return msgpack.ExtType(EXT_TQ, bytes(buf))


def decode_value(v) -> Any:
    if type(v) is msgpack.ExtType and v.code == EXT_TQ:
        return serial_utils.decode(serial_utils.unpack_from(v.data))
    return v


def _wire_dtype_ok(t) -> bool:
    """stowage/1 carries this tensor's dtype (not: quantized, bits, sub-byte ints)."""
    return str(t.dtype).removeprefix("torch.") in _codec.WIRE_DTYPES


def to_wire(name: str, value: Any, n: int) -> Any:
    """One TensorDict field (as `td[name]` gives it) -> what `Client.put` takes."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(f"field {name!r}: a 0-d tensor has no rows")
        if _wire_dtype_ok(value):
            return value
        return [encode_value(r) for r in value.unbind()]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        # (extract_field_schema refused anything else of the wrong length first)
        raise TypeError(f"field {name!r}: expected a tensor or n values, got {type(value).__name__}")
    rows = list(value)
    if len(rows) != n:
        raise ValueError(f"field {name!r} has {len(rows)} rows but {n} global indexes were given")
    if rows and all(type(r) is torch.Tensor and not r.is_nested for r in rows):
        dtypes = {r.dtype for r in rows}
        if len(dtypes) == 1 and _wire_dtype_ok(rows[0]):
            return rows  # nested: one dtype, rows of any shape (SimpleStorage packs them on get)
    return [encode_value(r) for r in rows]


def _even_offsets(n: int, d1: int):
    """The offsets of n rows of d1 each (0, d1, ..., n * d1), int64, made
    in numpy: 2.3 µs against 12.7 for `torch.full`, `zeros` and `cumsum`
    (each torch op pays its dispatch; torch 2.15). A packed field's offsets
    are made in numpy too (`from_wire`)."""
    return torch.from_numpy(np.arange(n + 1, dtype=np.int64) * d1)


def from_wire(value: Any, n: int) -> Any:
    """One field of `Client.get(..., as_torch=True, nested="packed")` -> what
    SimpleStorage's get gives for it."""
    if isinstance(value, torch.Tensor):
        if value.dim() <= 1:
            return value  # rows of 0-d: stacked, as SimpleStorage does
        d1 = value.shape[1]
        return _njt(value.reshape(n * d1, *value.shape[2:]), _even_offsets(n, d1))
    if isinstance(value, Packed):
        shapes = value.shapes
        tails = {s[1:] for s in shapes}
        if len(tails) == 1 and all(len(s) >= 1 for s in shapes):
            tail = tails.pop()
            offsets = np.zeros(len(shapes) + 1, dtype=np.int64)
            np.cumsum([s[0] for s in shapes], out=offsets[1:])
            values = (value.values.reshape(-1, *tail) if math.prod(tail) else
                      value.values.new_empty((int(offsets[-1]), *tail)))
            return _njt(values, torch.from_numpy(offsets))
        counts = [math.prod(s) for s in shapes]
        starts = np.concatenate(([0], np.cumsum(counts))).tolist()
        rows = [value.values[starts[i]:starts[i + 1]].reshape(s) for i, s in enumerate(shapes)]
        return _pack_field_values(rows)
    return _pack_field_values([decode_value(v) for v in value])


def tensordict_of(fields: dict, n: int):
    """`TensorDict(fields, batch_size=n)` of a get's fields (each `n` rows,
    as `from_wire` made them). When every field is a tensor, regular or
    nested, it is made without TensorDict's checks of each value's batch
    dimension (`TensorDict._new_unsafe`, where tensordict has it): the core
    checked every field's row count against the request, and those checks
    of a nested tensor's shape cost 166 µs for 10 fields against 1.9
    (tensordict 0.15.3). The same TensorDict: the same value objects, batch
    size, device (None), names and lock state (asserted by the tests).
    Anything else (non-tensor values) goes through the checked
    constructor."""
    unsafe = getattr(TensorDict, "_new_unsafe", None)
    if unsafe is not None and all(isinstance(v, torch.Tensor) for v in fields.values()):
        return unsafe(fields, batch_size=torch.Size([n]))
    return TensorDict(fields, batch_size=n)


def field_schema(data) -> dict:
    """TransferQueue's `extract_field_schema(data)` (what the controller is
    told on put), the same dict, with no tensor per row for a jagged field:
    its per-row shapes come from its offsets, where TransferQueue unbinds
    it."""
    jagged = [name for name, v in data.items() if isinstance(v, torch.Tensor) and v.is_nested
              and v.layout == torch.jagged and v._lengths is None and getattr(v, "_ragged_idx", 1) == 1]
    if not jagged or data.batch_size[0] == 0:
        return extract_field_schema(data)
    n = data.batch_size[0]
    fast = {}
    for name in jagged:
        v = data[name]
        lengths = v.offsets().diff().tolist()
        if len(lengths) != n:
            raise ValueError(
                f"Inconsistent batch dimension for field '{name}': "
                f"expected batch_size[0]={n}, got nested tensor composed of {len(lengths)} tensors"
            )
        tail = tuple(v.values().shape[1:])
        fast[name] = {
            "dtype": v.dtype,
            "shape": torch.Size((lengths[0], *tail)),
            "is_nested": True,
            "is_non_tensor": False,
            "per_sample_shapes": [(k, *tail) for k in lengths],
        }
    rest = extract_field_schema(data.exclude(*jagged)) if len(jagged) < len(data.keys()) else {}
    return {name: fast[name] if name in fast else rest[name] for name in data.keys()}


def apply_parser(data_parser: Callable[[Any], Any], fields: dict) -> dict:
    """`data_parser` on the put's fields, with the checks SimpleStorage's unit
    makes (a dict, the same keys, the same element counts). It sees what a
    SimpleStorageUnit's parser sees: a regular tensor column as a tensor,
    nested tensors and non-tensor columns as lists of their rows."""
    if not callable(data_parser):
        raise TypeError(f"data_parser must be callable, got {type(data_parser).__name__}")
    field_data = {}
    for k, v in fields.items():
        if isinstance(v, torch.Tensor):
            field_data[k] = list(v.unbind()) if v.is_nested else v
        else:
            field_data[k] = list(v)
    original_keys = set(field_data)
    original_lengths = {k: _length(v) for k, v in field_data.items()}
    out = data_parser(field_data)
    if not isinstance(out, dict):
        raise TypeError(f"data_parser must return a dict, got {type(out).__name__}")
    if set(out) != original_keys:
        raise ValueError(
            f"data_parser must not change dict keys. Original keys: {sorted(original_keys)}, got: {sorted(out)}"
        )
    for k, v in out.items():
        new_len, orig_len = _length(v), original_lengths[k]
        if orig_len is not None and new_len is not None and orig_len != new_len:
            raise ValueError(f"data_parser changed the number of elements for key '{k}': "
                             f"expected {orig_len}, got {new_len}")
    return out


def _length(v) -> int | None:
    if hasattr(v, "shape") and isinstance(v.shape, tuple | list) and len(v.shape) > 0:
        return v.shape[0]
    try:
        return len(v)
    except Exception:  # noqa: BLE001 - SimpleStorage's own check
        return None



__all__ = ["EXT_TQ", "apply_parser", "decode_value", "encode_value", "field_schema", "from_wire", "to_wire"]
