"""stowage/1 dtype names and their numpy dtypes: the leaf that both the
codec (`_codec`) and the torch bridging (`_torch`) import, so neither
imports the other's module for them (imports point one way: `_codec` ->
`_torch` -> `_dtypes`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import ProtocolError

# stowage/1 dtype name -> numpy dtype of its bytes (little-endian). numpy has
# no bfloat16: its 16-bit patterns are held as uint16 ("raw bits").
WIRE_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {
        "bool": "|b1", "uint8": "|u1", "int8": "|i1",
        "int16": "<i2", "uint16": "<u2", "int32": "<i4", "uint32": "<u4",
        "int64": "<i8", "uint64": "<u8",
        "float16": "<f2", "bfloat16": "<u2", "float32": "<f4", "float64": "<f8",
        "complex64": "<c8", "complex128": "<c16",
    }.items()
}
# Names a decoder also accepts (besides a "torch." prefix).
DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64",
                 "long": "int64", "int": "int32", "short": "int16"}


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
    if name in WIRE_DTYPES and name != "bfloat16" and dt.kind in "biufc":
        _NAME_OF[dt] = name
        return name
    raise TypeError(
        f"{what}: numpy dtype {dt} has no stowage/1 equivalent (supported: "
        + ", ".join(n for n in WIRE_DTYPES if n != "bfloat16")
        + "; bfloat16 through torch or stowage.BFloat16Bits)"
    )
