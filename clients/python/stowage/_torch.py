"""Optional torch bridging. torch is never imported to *inspect* an argument
(a torch tensor can only exist if the caller imported torch), and only
imported to *build* tensors when a get asks for them (`as_torch=True`, or
fields of a dtype numpy has no type for (`_dtypes.BITS_DTYPES`: bfloat16,
complex32, float8, float4) with `as_torch=None`).

Every tensor <-> ndarray conversion here shares memory (no copy), except
`.cpu()` of a tensor on another device (and resolving a conjugate or
negative view); a non-contiguous tensor becomes a strided array, which the
core's put sends as the blocks it is made of.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import warnings

import numpy as np

from ._dtypes import BITS_DTYPES, WIRE_DTYPES, wire_dtype_of

_available: bool | None = None


def _loaded():
    return sys.modules.get("torch")


def is_tensor(x) -> bool:
    torch = _loaded()
    return torch is not None and isinstance(x, torch.Tensor)


def available() -> bool:
    """Is torch installed? (Checked once, without importing it.)"""
    global _available
    if _available is None:
        _available = _loaded() is not None or importlib.util.find_spec("torch") is not None
    return _available


def require(what: str):
    if not available():
        raise ImportError(f"{what} needs torch, which is not installed (pip install torch)")
    import torch

    return torch


def is_nested(t) -> bool:
    return bool(getattr(t, "is_nested", False))


def unbind(t) -> list:
    """A nested (jagged or strided) tensor -> its rows, as tensors (views)."""
    return list(t.unbind())


def jagged_parts(t):
    """A jagged nested tensor whose rows lie back to back in its values
    (ragged on dim 1, no holes) -> (values, offsets as an int64 ndarray),
    without a tensor per row; None for any other nested tensor."""
    torch = _loaded()
    if t.layout != torch.jagged or t._lengths is not None or getattr(t, "_ragged_idx", 1) != 1:
        return None
    return t.values(), t.offsets().detach().cpu().numpy().astype(np.int64, copy=False)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_numpy(t, what: str) -> tuple[str, np.ndarray]:
    """A tensor -> (stowage/1 dtype name, ndarray sharing its memory, of its
    strides). bfloat16 becomes its uint16 bit patterns."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    return _as_numpy(t, what)


@contextlib.contextmanager
def quiet():
    """Silences torch's "The given NumPy array is not writable" (see
    `tensors_of`) for the tensors made inside: entered once for all of a
    get's fields, since entering it costs more than `torch.from_numpy`
    itself (2.4 µs against 0.6 a field)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def tensors_of(rows: list, dtype: str) -> list:
    """Each ndarray of `rows` (of stowage/1 dtype `dtype`) as a tensor
    sharing its memory; called inside `quiet()`. torch has no read-only
    tensors, so the arrays' memory must be writable even where numpy flags
    them read-only: a received frame or a copy of this client's own, or
    (same node) a private copy-on-write mapping (the core makes a get's
    tensor fields so), never the read-only mapping other readers share,
    where a write would kill the process with SIGSEGV. Writing to a tensor
    then changes this get's bytes only: never the server's data, another
    get's tensors or arrays, or another process's."""
    import torch

    if dtype in BITS_DTYPES:
        tdt = torch_dtype(dtype)
        if tdt is None:
            raise TypeError(f"torch {torch.__version__} has no dtype {dtype}; get it with as_torch=False")
        signed = _SIGNED[WIRE_DTYPES[dtype].itemsize]  # torch reads signed ints of every size
        return [torch.from_numpy(a.view(signed)).view(tdt) for a in rows]
    return [torch.from_numpy(a) for a in rows]


_SIGNED = {1: np.dtype(np.int8), 2: np.dtype(np.int16), 4: np.dtype(np.int32)}


def torch_dtype(name: str):
    """The installed torch's dtype of stowage/1 name `name`, or None if this
    torch has none of that name (float8_e8m0fnu is newer than float8_e4m3fn)."""
    import torch

    dt = getattr(torch, name, None)
    return dt if isinstance(dt, torch.dtype) else None


def out_view(t, what: str) -> tuple[str, np.ndarray]:
    """A preallocated CPU tensor (pinned or not) -> (dtype name, writable ndarray sharing its memory)."""
    torch = _loaded()
    if t.device.type != "cpu":
        raise TypeError(f"{what}: get_into fills CPU tensors (pinned or not); got a tensor on {t.device}")
    if is_nested(t):
        raise TypeError(f"{what}: get_into cannot fill a nested tensor")
    t = t.detach()
    return _as_numpy(t, what)


def _as_numpy(t, what: str) -> tuple[str, np.ndarray]:
    """A CPU tensor -> (stowage/1 dtype name, ndarray sharing its memory);
    bfloat16, complex32, the float8s and float4_e2m1fn_x2 as their raw bits
    (`_dtypes.WIRE_DTYPES`)."""
    torch = _loaded()
    name = _name(t.dtype)
    if name in BITS_DTYPES:
        bits = WIRE_DTYPES[name]
        signed = {1: torch.int8, 2: torch.int16, 4: torch.int32}[bits.itemsize]
        return name, t.view(signed).numpy().view(bits)
    try:
        a = t.numpy()
    except TypeError as e:
        raise TypeError(f"{what}: torch dtype {_name(t.dtype)} has no stowage/1 equivalent ({e})") from None
    return wire_dtype_of(a.dtype, what), a
