"""Same-node shared memory (protocol page, "Same-node shared memory"): what
a same-node client keeps beside the Rust core, which does the rest.

`stowd` hands its segments over as file descriptors on a descriptor
channel, never by name: a segment is an anonymous memory file that no
other process can open. The channel is the core's `_core.Channel` (read
whole messages, their descriptors, the table of descriptors by request;
`open_channel` opens one), and so are the mappings of the segments gets
read (`_core.Segments`: one read-only mapping per memory file, shared by
every array over it, private copy-on-write mappings for tensors) and the
results made over them; see the core's `channel`, `segments` and
`same_node` modules.

Here: `Segments`, a same-node client's state (its channel, its mappings,
the writable descriptors of its leases), and a put's lease: stowd sends
the lease's writable descriptor on the channel (`Segments.leased`), `fill`
writes the rows into it and closes it; stowd then seals it, which the
kernel refuses while any writable mapping of it is left.
"""

from __future__ import annotations

import os

from . import _core
from .errors import ProtocolError, StowageError, StowageTimeout

ALIGN = 64  # each range of a filled lease starts at a multiple of this


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def open_channel(path: str, timeout: float) -> _core.Channel:
    """stowd's descriptor channel at `path` (its `channel_ok`), connected and
    its greeting read, in the client's errors."""
    try:
        return _core.Channel(path, timeout)
    except ConnectionError as e:
        raise StowageError(str(e)) from None
    except TimeoutError:
        raise StowageTimeout(f"stowd's descriptor channel {path!r} did not greet within {timeout:g} s") from None
    except _core.ProtocolViolation as e:
        raise ProtocolError(str(e)) from None


def take(channel: _core.Channel | None, rid: int, timeout: float) -> dict:
    """{segment name: descriptor} stowd sent on `channel` for request `rid`
    (the caller closes them), in the client's errors."""
    if channel is None:
        raise ProtocolError("a same-node reply, but no descriptor channel is open", request_id=rid)
    try:
        return channel.take(rid, timeout)
    except TimeoutError as e:
        raise StowageTimeout(str(e), request_id=rid) from None
    except _core.ProtocolViolation as e:
        raise ProtocolError(f"request {rid}: {e}", request_id=rid) from None
    except ConnectionError as e:
        raise StowageError(f"request {rid}: {e}", request_id=rid) from None


#: Buffers one pwritev takes (IOV_MAX on Linux).
_IOV_MAX = 1024


def _pwrite_all(fd: int, pieces: list, offset: int) -> None:
    """Writes `pieces` back to back at `offset` (pwritev may write less than asked)."""
    while pieces:
        n = os.pwritev(fd, pieces[:_IOV_MAX], offset)
        offset += n
        while pieces and n >= len(pieces[0]):
            n -= len(pieces[0])
            pieces = pieces[1:]
        if n:
            pieces = [pieces[0][n:], *pieces[1:]]


class Segments:
    """A same-node client's state: its descriptor channel (`channel`, a
    `_core.Channel`, or None until opened), its mappings of stowd's
    segments (`maps`, a `_core.Segments`), and its leases' descriptors."""

    def __init__(self) -> None:
        self.maps = _core.Segments()
        self.channel: _core.Channel | None = None
        self._leased: dict[str, int] = {}  # lease name -> its writable descriptor

    def extras(self, get: bool) -> dict:
        """Envelope keys of a same-node get (`get`) or lease."""
        if self.channel is None or self.channel.closed:
            raise StowageError("no descriptor channel is open")
        return {"same_node": True, "channel": self.channel.token} if get else {"channel": self.channel.token}

    def shm(self) -> tuple:
        """What the core's same-node calls take: (channel, mappings)."""
        return self.channel, self.maps

    def mapped(self) -> int:
        """How many segments this client has mapped (some array uses them)."""
        return self.maps.mapped()

    def release(self) -> None:
        """Forgets the mappings; each is unmapped once no array uses it.
        Mappings no array uses are forgotten anyway."""
        self.maps.release()

    def leased(self, name: str, fds: dict) -> None:
        """Keeps the writable descriptor of lease `name` for `fill`."""
        fd = fds.pop(name, None)
        _close_all(fds.values())
        if fd is None:
            raise ProtocolError(f"lease {name!r:.100} came without its descriptor")
        old = self._leased.pop(name, None)
        if old is not None:
            os.close(old)
        self._leased[name] = fd

    def fill(self, name: str, size: int, buffers) -> list:
        """Writes `buffers` (each a buffer, or a list of buffers written back
        to back as one frame) into the leased segment `name` (of `size`
        bytes), each at a multiple of ALIGN; returns [[name, offset, len], ...].
        The descriptor is closed before returning (stowd seals the segment at
        the put, which the kernel refuses while any writable mapping of it is
        left; this writes without one)."""
        fd = self._leased.pop(name, None)
        if fd is None:
            raise ProtocolError(f"no descriptor for lease {name!r:.100}")
        # Written with pwritev, not through a mapping: stowd allocated the
        # pages, so the kernel only copies (no page-table entries to set up,
        # no mapping left behind to stop the seal).
        out, at, batch, batch_at, end = [], 0, [], 0, 0
        try:
            for b in buffers:
                at = -(-at // ALIGN) * ALIGN
                pieces = [memoryview(p).cast("B") for p in b] if isinstance(b, list) else [memoryview(b).cast("B")]
                n = sum(len(p) for p in pieces)
                if at != end:
                    _pwrite_all(fd, batch, batch_at)
                    batch, batch_at = [], at
                batch.extend(p for p in pieces if len(p))
                out.append([name, at, n])
                at += n
                end = at
            _pwrite_all(fd, batch, batch_at)
        finally:
            os.close(fd)
        if at > size:
            raise ProtocolError(f"{at} bytes do not fit lease {name!r:.100} of {size} bytes")
        return out

    def close_channel(self) -> None:
        """Closes the channel (a new one is opened when next needed)."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def close(self) -> None:
        """Closes the channel and any lease descriptors not yet filled."""
        leased, self._leased = self._leased, {}
        _close_all(leased.values())
        self.close_channel()


def lease_size(buffers) -> int:
    """Bytes a lease needs to hold `buffers` (each a buffer, or a list of
    buffers back to back) as `Segments.fill` lays them out."""
    at = 0
    for b in buffers:
        n = sum(memoryview(p).nbytes for p in b) if isinstance(b, list) else memoryview(b).nbytes
        at = -(-at // ALIGN) * ALIGN + n
    return at
