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
the writable descriptors of its leases). A put's lease: stowd sends the
lease's writable descriptor on the channel (`Segments.leased` keeps it
until `pop_leased` hands it to the core's `_core.Put.fill`, which writes
the put's bytes with `pwritev`, never through a mapping, and closes it);
stowd then seals it, which the kernel refuses while any writable mapping
of it is left.
"""

from __future__ import annotations

import os

from . import _core
from .errors import ProtocolError, StowageError, StowageTimeout


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
        """Keeps the writable descriptor of lease `name` (for `pop_leased`)."""
        fd = fds.pop(name, None)
        _close_all(fds.values())
        if fd is None:
            raise ProtocolError(f"lease {name!r:.100} came without its descriptor")
        old = self._leased.pop(name, None)
        if old is not None:
            os.close(old)
        self._leased[name] = fd

    def pop_leased(self, name: str) -> int:
        """The writable descriptor of lease `name` (`leased`), handed over:
        the caller closes it (`_core.Put.fill` does)."""
        fd = self._leased.pop(name, None)
        if fd is None:
            raise ProtocolError(f"no descriptor for lease {name!r:.100}")
        return fd

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
