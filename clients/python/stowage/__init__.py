"""Stowage: the Python client of the `stowd` tensor storage sidecar
(native protocol stowage/1, docs/protocol-stowage1.md).

    import numpy as np, stowage

    with stowage.Client("tcp://127.0.0.1:5555") as c:
        c.put([0, 1], {"x": np.ones((2, 4), np.float32), "tag": ["a", "b"]})
        got = c.get([1, 0], ["x", "tag"])      # {"x": ndarray [2, 4], "tag": ["b", "a"]}

`AsyncClient` has the same calls as coroutines. numpy is required; torch is
optional and used only when a torch tensor is passed in or asked for.
"""

try:
    from . import _core
except ImportError as _e:
    # The Rust core carries every call and writes and reads every envelope:
    # there is no client without it.
    raise ImportError(
        f"stowage cannot import its Rust core, the extension stowage._core (_core.abi3.so in {__path__[0]}): "
        f"{_e}. The client has no way without it. Install a wheel built by `cargo xtask wheel` "
        "(`pip install target/wheels/stowage-*.whl`), or, from the repository root, "
        "`pip install ./clients/python -C stowd=skip` (builds the core; needs Rust); in a source checkout, "
        "`cargo xtask test` builds a debug core into clients/python/stowage/."
    ) from _e
from ._codec import BITS_DTYPES, WIRE_DTYPES, BFloat16Bits, Bits, Packed
from .aio import AsyncClient
from .client import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT, Client
from .errors import (
    BadRequest,
    CapacityError,
    DataLost,
    InternalError,
    KeyNotFound,
    ProtocolError,
    Rejected,
    StowageError,
    StowageTimeout,
    TooLarge,
    Unsupported,
)

__version__ = "0.1.0"


def release_receive_buffers() -> int:
    """Frees the buffers this process keeps for later gets to receive into
    (a tcp `get`'s result buffer is kept for the next get of a size it fits
    once no array uses it: at most `STOWAGE_RECEIVE_POOL_BYTES` in all,
    default an eighth of physical memory up to 4 GiB, 0 keeps none; a
    buffer unused for 10 s is freed anyway). Returns the bytes freed."""
    return _core.release_receive_buffers()


DTYPES = tuple(WIRE_DTYPES)
"""The dtype names stowage/1 carries."""
# (BITS_DTYPES: those numpy has no type for; see `Bits`.)

__all__ = [
    "AsyncClient",
    "BFloat16Bits",
    "BITS_DTYPES",
    "Bits",
    "BadRequest",
    "CapacityError",
    "Client",
    "DataLost",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TIMEOUT",
    "DTYPES",
    "Packed",
    "InternalError",
    "KeyNotFound",
    "ProtocolError",
    "Rejected",
    "StowageError",
    "StowageTimeout",
    "TooLarge",
    "Unsupported",
    "release_receive_buffers",
]
