"""stowage/1 dtype names and their numpy dtypes: the leaf that both the
codec (`_codec`) and the torch bridging (`_torch`) import, so neither
imports the other's module for them (imports point one way: `_codec` ->
`_torch` -> `_dtypes`)."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

from .errors import ProtocolError

# The names, their order, itemsizes and DTYPE_ALIASES are stowd's dtype table
# (the Rust crate stowage-plan's, which stowd's codecs read); a client test
# checks them against the core's copy of it, `_core.DTYPES`.
#
# stowage/1 dtype name -> numpy dtype of its bytes (little-endian). numpy
# has no bfloat16, complex32, float8 or float4: their bit patterns are held
# as unsigned ints of the same size ("raw bits": uint16 for bfloat16, uint32
# for complex32 (two float16), uint8 for the float8s and for float4_e2m1fn_x2
# (two 4-bit floats a byte)).
WIRE_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {
        "bool": "|b1", "uint8": "|u1", "int8": "|i1",
        "int16": "<i2", "uint16": "<u2", "int32": "<i4", "uint32": "<u4",
        "int64": "<i8", "uint64": "<u8",
        "float16": "<f2", "bfloat16": "<u2", "float32": "<f4", "float64": "<f8",
        "complex64": "<c8", "complex128": "<c16",
        "complex32": "<u4",
        "float8_e4m3fn": "|u1", "float8_e4m3fnuz": "|u1", "float8_e5m2": "|u1",
        "float8_e5m2fnuz": "|u1", "float8_e8m0fnu": "|u1", "float4_e2m1fn_x2": "|u1",
    }.items()
}
# The names numpy has no type for, carried as raw bits (above). A get returns
# them as torch tensors when torch is used (`as_torch=None` and torch
# installed, or `as_torch=True`), else as their bits, or, for the float8s
# when `ml_dtypes` is installed, as ml_dtypes arrays (`ML_DTYPES`).
BITS_DTYPES = frozenset({
    "bfloat16", "complex32", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
})
# The raw-bits names that `ml_dtypes` (optional, never imported unless
# installed) has a numpy type of the same name and bits for. (Its
# `float4_e2m1fn` holds one 4-bit float a byte, not torch's packed pair;
# bfloat16 keeps its documented uint16 form.)
ML_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
# Names a decoder also accepts (besides a "torch." prefix).
DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64",
                 "long": "int64", "int": "int32", "short": "int16",
                 "chalf": "complex32", "cfloat": "complex64", "cdouble": "complex128"}

_ml: dict | None = None  # ML_DTYPES name -> numpy dtype, once ml_dtypes was looked for


def ml_dtype(name: str) -> np.dtype | None:
    """The ml_dtypes numpy dtype for raw-bits dtype `name`, or None (not an
    ML_DTYPES name, or ml_dtypes not installed)."""
    global _ml
    if _ml is None:
        _ml = {}
        if importlib.util.find_spec("ml_dtypes") is not None:
            import ml_dtypes

            _ml = {n: np.dtype(getattr(ml_dtypes, n)) for n in ML_DTYPES if hasattr(ml_dtypes, n)}
    return _ml.get(name)


def canonical_dtype(name: Any) -> str:
    """A dtype name from a reply -> its canonical stowage/1 name."""
    if not isinstance(name, str):
        raise ProtocolError(f"dtype is not a string: {name!r}")
    n = name[6:] if name.startswith("torch.") else name
    n = DTYPE_ALIASES.get(n, n)
    if n not in WIRE_DTYPES:
        raise ProtocolError(f"unknown dtype {name!r}")
    return n


_NAME_OF: dict = {}  # numpy dtype -> stowage/1 name (dtype.name is slow per row)


def wire_dtype_of(dt: np.dtype, what: str) -> str:
    """numpy dtype -> stowage/1 name (TypeError for dtypes stowage/1 cannot carry)."""
    name = _NAME_OF.get(dt)
    if name is not None:
        return name
    name = dt.name
    if name in WIRE_DTYPES and name not in BITS_DTYPES and dt.kind in "biufc":
        _NAME_OF[dt] = name
        return name
    if name in ML_DTYPES and ml_dtype(name) == dt:  # an ml_dtypes float8
        _NAME_OF[dt] = name
        return name
    raise TypeError(
        f"{what}: numpy dtype {dt} has no stowage/1 equivalent (supported: "
        + ", ".join(n for n in WIRE_DTYPES if n not in BITS_DTYPES)
        + "; " + ", ".join(sorted(BITS_DTYPES))
        + " through torch, stowage.Bits or stowage.BFloat16Bits, the float8s also as ml_dtypes arrays)"
    )
