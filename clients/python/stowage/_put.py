"""A same-node put's requests, sans IO: the sequence `Client.put` drives
(an `AsyncClient`'s same-node put runs on a lane, a `Client`), apart from
the transport, so what such a put sends, and in what order, is written
once. (Everything else about a put, its checks, its layout, its split
into messages and the bytes it writes, is the Rust core's `_core.Put`.)

    steps = same_node(put, segments)
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
data frames hold no byte at all (only empty rows, or values) has nothing
to lease: its frames go on the socket.
"""

from __future__ import annotations

import os
from typing import Generator

from .errors import ProtocolError


def same_node(put, segments) -> Generator[tuple, object, int]:
    """The requests of a same-node put of `put` (a `_core.Put` made with
    `same_node=True`), given the client's `_shm.Segments` (see the module
    doc)."""
    size = put.lease_bytes
    if not size:
        return (yield "put", None)
    reply = yield "lease", {"bytes": size}
    name = reply["segment"]
    fd = segments.pop_leased(name)
    if reply["bytes"] < size:
        os.close(fd)
        raise ProtocolError(f"a lease of {reply['bytes']} bytes for a put of {size}")
    return (yield "put", put.fill(name, fd))
