"""The put loop, sans IO: one `Put` that both `Client.put` and
`AsyncClient.put` drive, so what a put sends, and in what order, exists
once.

    put = Put(global_indexes, data, max_message_bytes, segments, join)
    try:
        for op, body, frames, expect, extras in put:
            put.reply, _ = call(op, body, frames, timeout, expect, extras)  # or `await call(...)`
    except StowageError as e:
        e.rows_stored = put.stored
        raise
    return put.n

Iterating yields each request as `(op, body, data_frames, expect,
extras)`; the driver sends it and sets `reply` to the reply's body before
asking for the next. A put larger than `max_message_bytes` is split into
messages of contiguous row ranges (each all-or-nothing, the whole put not:
`stored` counts the leading rows the messages so far stored). Same node
(`segments` given), the put is one message whatever its size: its bytes go
into a segment leased from stowd (a `lease` request, then the `put`
naming the segment), and nothing crosses the socket. Over tcp, `join`
says whether each shared data frame (small rows copied together) is
joined into one bytes, as pyzmq sends a frame from one buffer, or left as
the list of its pieces (`_codec.Pieces`) for the Rust core, which sends
them from the caller's arrays as they are.

(The driver reads requests with a `for` loop and hands replies over in
`reply`, not with `generator.send`: ending a `for` costs no StopIteration,
which measurably slowed a put of few rows.)
"""

from __future__ import annotations

import sys
from typing import Any, Iterator, Mapping

from . import _codec, _shm
from .errors import ProtocolError


class Put:
    """One put's requests (iterate), replies (`reply`) and progress (`stored`, of `n` rows)."""

    __slots__ = ("n", "stored", "reply", "_messages", "_segments")

    def __init__(self, global_indexes, data: Mapping[str, Any], max_message_bytes: int,
                 segments: _shm.Segments | None, join: bool = True) -> None:
        """Checks the put's arguments (TypeError, ValueError) and plans its messages (lazily)."""
        idx = _codec.check_indexes(global_indexes, "put", unique=True)
        if not isinstance(data, Mapping):
            raise TypeError(f"put: data must map field names to values, got {type(data).__name__}")
        if not data:
            raise ValueError("put: empty batch: data has no fields")
        fields = {name: _codec.normalize_field(name, v, len(idx)) for name, v in data.items()}
        # Same node: one message, and shared frames stay in pieces, copied
        # once, into the segment.
        limit = sys.maxsize if segments is not None else max_message_bytes
        self._messages = _codec.put_messages(idx, fields, limit, join=segments is None and join)
        self._segments = segments
        self.n = len(idx)
        self.stored = 0
        self.reply: dict | None = None

    def plain(self) -> list[tuple]:
        """Over tcp (no segments): every message at once, as (body, data
        frames, rows), for a sender that keeps two on the wire; each reply
        then goes to `took`, in order."""
        assert self._segments is None
        return [(m.body, m.frames, m.rows[1] - m.rows[0]) for m in self._messages]

    def took(self, reply: dict, rows: int) -> None:
        """A put_ok for the next message of `plain`, of `rows` rows."""
        if reply != {"rows": rows}:
            raise ProtocolError(f"put_ok {reply!r} for a message of {rows} rows")
        self.stored += rows

    def __iter__(self) -> Iterator[tuple]:
        segments = self._segments
        for m in self._messages:
            size = _shm.lease_size(m.frames) if segments is not None else 0
            if size:
                yield "lease", {"bytes": size}, (), "lease_ok", segments.extras(get=False)
                names = segments.fill(self.reply["segment"], size, m.frames)
                yield "put", m.body, (), "put_ok", {"segments": names}
            else:
                # (Same node with no bytes at all, e.g. only empty rows: nothing
                # to lease; the empty frames go on the socket, joined.)
                frames = m.frames if segments is None else _codec.join_frames(m.frames)
                yield "put", m.body, frames, "put_ok", None
            a, b = m.rows
            self.took(self.reply, b - a)


def payload_bytes(data) -> int:
    """About how many bytes a put of `data` carries (arrays and tensors by
    their size, lists by their items'; anything else counts nothing), to
    choose a transport before the put is planned."""
    total = 0
    for v in data.values() if isinstance(data, Mapping) else ():
        for x in v if isinstance(v, (list, tuple)) else (v,):
            n = getattr(x, "nbytes", None)
            if n is None and hasattr(x, "element_size") and hasattr(x, "nelement"):
                n = x.element_size() * x.nelement()  # a torch tensor
            if n is None and isinstance(x, (bytes, str)):
                n = len(x)
            total += n if isinstance(n, int) else 0
    return total
