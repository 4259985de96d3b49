"""A same-node put's requests, sans IO: the sequence `Client.put` drives
(and an `AsyncClient` on its event loop, or on a lane for a put of
`CORE_MIN_BYTES` or more), apart from
the transport, so what such a put sends, and in what order, is written
once. (Everything else about a put, its checks, its layout, its split
into messages and the bytes it writes, is the Rust core's `_core.Put`.)

    steps = same_node(put, segments, inline_below)
    reply = None
    while True:
        try:
            op, arg = steps.send(reply)
        except StopIteration as done:
            return done.value  # the rows stored
        if op == "lease":
            reply = ...  # the lease_ok body of a lease request of body `arg`
                         # (its descriptor kept by `segments.leased`)
        else:  # "put"
            reply = ...  # the rows stored by `put` sent with segments `arg`
                         # (None: its data frames go on the socket)

The put is one message whatever its size: its bytes go into a segment
leased from stowd (a `lease` request, then `Put.fill` writes the bytes
with `pwritev`, each data frame at a multiple of 64, and closes the
descriptor, so that stowd can seal the segment), then the `put` naming the
ranges it wrote; nothing of the payload crosses the socket. A put whose
data frames hold fewer than `inline_below` bytes (and fit one message of
the client's `max_message_bytes`) goes on the socket as any put: a lease
costs a round trip, a descriptor, a segment of a page at least and its
mapping, where a small put's bytes take a few microseconds to send
(`Client.SAME_NODE_INLINE_BELOW`). So does a put whose data frames hold
no byte at all (only empty rows, or values): it has nothing to lease.
"""

from __future__ import annotations

import os
from typing import Generator

from .errors import ProtocolError


def on_socket(put, inline_below: int) -> bool:
    """Whether a same-node put goes on the socket as any put, no lease
    (see the module doc)."""
    size = put.lease_bytes
    return not size or (size < inline_below and put.fits_message)


def same_node(put, segments, inline_below: int = 0) -> Generator[tuple, object, int]:
    """The requests of a same-node put of `put` (a `_core.Put` made with
    `same_node=True`), given the client's `_shm.Segments`; one of fewer
    than `inline_below` bytes goes on the socket (see the module doc)."""
    if on_socket(put, inline_below):
        return (yield "put", None)
    size = put.lease_bytes
    reply = yield "lease", {"bytes": size}
    name = reply["segment"]
    fd = segments.pop_leased(name)
    if reply["bytes"] < size:
        os.close(fd)
        raise ProtocolError(f"a lease of {reply['bytes']} bytes for a put of {size}")
    return (yield "put", put.fill(name, fd))
