"""Same-node shared memory (protocol page, "Same-node shared memory").

`stowd` hands its segments over as file descriptors on a descriptor
channel (`Channel`, a Unix socket), never by name: a segment is an
anonymous memory file that no other process can open. Segments that hold
stored rows are sealed against writes by the kernel, so nothing this
process does to its mappings can change what the store or any other reader
sees.

`Segments` maps the segments a reply names read-only and keeps each mapping
for as long as any array uses it, so two gets of the same rows return
arrays over the very same memory (the same `data_ptr`), and arrays stay
valid after the rows are cleared on the server. A write to such an array
raises `ValueError` (numpy refuses: the buffer is read-only).

torch has no read-only tensors, and a write through a tensor over a
`PROT_READ` page kills the process (SIGSEGV). So tensors are built over
`CopyOnWrite` mappings instead: a private (`MAP_PRIVATE`, `PROT_READ |
PROT_WRITE`) mapping of the same file, opened read-only. Until a write its
pages are the very pages every other reader maps (nothing is copied); a
write copies only the page it touches, into this process, and the file and
every other mapping of it never see it.

Puts go through a leased segment: `stowd` sends its writable descriptor
(`leased` keeps it until `pop_leased` hands it to the core's
`_core.Put.fill`, which writes the put's bytes with `pwritev`, never
through a mapping, and closes it); `stowd` then seals it, which the kernel
refuses while any writable mapping of it is left.

Each mapping keeps a descriptor open (Python's mmap holds one), so the
channel raises this process's soft open-file limit to its hard limit.
"""

from __future__ import annotations

import mmap
import os
import resource
import socket
import struct
import time
import weakref
import threading

import msgpack

from .errors import ProtocolError, StowageError, StowageTimeout

#: Descriptors one read of the channel can carry (the kernel's SCM_MAX_FD).
_MAX_FDS = 253
#: Longest channel message taken (names of a reply's segments).
_MAX_MESSAGE = 64 << 20
_LEN = struct.Struct("<I")


def _raise_nofile() -> None:
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _connect(sock: socket.socket, path: str) -> None:
    """Connects to the Unix socket `path`; a path longer than a socket
    address holds (107 bytes) is reached through a descriptor of its
    directory, as stowd binds it."""
    if len(os.fsencode(path)) <= 107:
        sock.connect(path)
        return
    d = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{d}/{os.path.basename(path)}")
    finally:
        os.close(d)


class Channel:
    """A descriptor channel to `stowd`: a Unix socket on which `stowd` sends,
    for each same-node reply or lease, the descriptors of its segments. Its
    `token` goes in the `channel` envelope key of those requests. The
    messages' formats: the protocol page, and their reference implementation
    `stowage_wire::channel` (wire/src/channel.rs)."""

    def __init__(self, path: str, timeout: float) -> None:
        _raise_nofile()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            _connect(sock, path)
        except OSError as e:
            sock.close()
            raise StowageError(f"cannot open stowd's descriptor channel {path!r}: {e} "
                               "(same-node mode needs the same node and the same user as stowd)") from None
        self._sock = sock
        self._lock = threading.Lock()
        self._ready: dict[int, dict] = {}  # request id -> {name: fd}
        hello, fds = self._message(time.monotonic() + timeout)
        _close_all(fds)
        token = hello.get("token") if isinstance(hello, dict) else None
        if not isinstance(token, str) or fds:
            self.close()
            raise ProtocolError(f"bad descriptor channel greeting {hello!r:.100}")
        self.token = token

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        ready, self._ready = self._ready, {}
        for fds in ready.values():
            _close_all(fds.values())

    def _recv(self, n: int, fds: list, deadline: float) -> bytes:
        """Exactly `n` bytes, and the descriptors that came with them."""
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout()
            self._sock.settimeout(left)
            data, got, flags, _ = socket.recv_fds(self._sock, n - len(buf), _MAX_FDS)
            fds.extend(got)
            if flags & getattr(socket, "MSG_CTRUNC", 0):
                raise ProtocolError("descriptors from stowd were dropped by the kernel (open-file limit reached?)")
            if not data:
                raise ProtocolError("stowd closed the descriptor channel")
            buf += data
        return bytes(buf)

    def _message(self, deadline: float) -> tuple:
        """One whole message: (its decoded body, its descriptors)."""
        fds: list = []
        try:
            (n,) = _LEN.unpack(self._recv(4, fds, deadline))
            if n > _MAX_MESSAGE:
                raise ProtocolError(f"descriptor channel message of {n} bytes")
            body = msgpack.unpackb(self._recv(n, fds, deadline), raw=False)
        except BaseException:
            _close_all(fds)
            raise
        return body, fds

    def pump(self, deadline: float, wanted=None) -> None:
        """Reads one message into the ready set (its descriptors closed at
        once if `wanted(id)` says no request waits for it)."""
        body, fds = self._message(deadline)
        ok = (isinstance(body, dict) and isinstance(body.get("id"), int)
              and isinstance(body.get("names"), list) and len(body["names"]) == len(fds)
              and all(isinstance(n, str) for n in body["names"]))
        if not ok:
            _close_all(fds)
            raise ProtocolError(f"bad descriptor channel message {body!r:.200} with {len(fds)} descriptors")
        rid = body["id"]
        if wanted is not None and not wanted(rid):
            _close_all(fds)
            return
        old = self._ready.pop(rid, None)
        if old:
            _close_all(old.values())
        self._ready[rid] = dict(zip(body["names"], fds))

    def _guarded(self, rid: int, step):
        """Runs `step()` (reads of the channel); a failure closes the
        channel, which is then out of step."""
        if self._sock is None:
            raise StowageError("the descriptor channel is closed", request_id=rid)
        try:
            return step()
        except (socket.timeout, TimeoutError):
            self.close()
            raise StowageTimeout(f"request {rid}: its descriptors did not arrive on the descriptor channel "
                                 "in time; the channel was closed", request_id=rid) from None
        except OSError as e:
            self.close()
            raise StowageError(f"request {rid}: the descriptor channel failed ({e}); it was closed",
                               request_id=rid) from None
        except ProtocolError:
            self.close()
            raise

    def take_early(self, rid: int, deadline: float, wanted=None) -> None:
        """Reads the one message that has begun to arrive (before the reply
        it goes with), keeping it if it is for `rid` or `wanted(id)`."""
        with self._lock:
            self._guarded(rid, lambda: self.pump(deadline, lambda i: i == rid or (wanted is not None and wanted(i))))

    def take(self, rid: int, deadline: float, wanted=None) -> dict:
        """{segment name: descriptor} sent for request `rid` (the caller
        closes them), waiting for it until `deadline` (monotonic)."""
        def step():
            while rid not in self._ready:
                self.pump(deadline, lambda i: i == rid or (wanted is not None and wanted(i)))
            return self._ready.pop(rid)
        with self._lock:
            return self._guarded(rid, step)


class _Fds:
    """Descriptors of one reply's segments, closed when no longer needed."""

    __slots__ = ("fds",)

    def __init__(self, fds: dict) -> None:
        self.fds = fds

    def __del__(self) -> None:
        _close_all(self.fds.values())


class Segments:
    """Read-only mappings of `stowd`'s segments, one per memory file."""

    def __init__(self) -> None:
        # (st_dev, st_ino) -> mmap, for as long as some array (or a caller) holds it.
        self._maps: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self.channel: Channel | None = None
        self._leased: dict[str, int] = {}  # lease name -> its writable descriptor

    def extras(self, get: bool) -> dict:
        """Envelope keys of a same-node get (`get`) or lease."""
        if self.channel is None or self.channel.closed:
            raise StowageError("no descriptor channel is open")
        return {"same_node": True, "channel": self.channel.token} if get else {"channel": self.channel.token}

    def _map(self, fd: int) -> memoryview:
        """The whole of the segment `fd` is, mapped read-only (one mapping per
        file, shared by every array over it)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            mm = self._maps.get(key)
            if mm is not None and len(mm) == st.st_size:
                return memoryview(mm)
            if not st.st_size:
                return memoryview(b"")
            mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
            self._maps[key] = mm
            return memoryview(mm)

    @staticmethod
    def private(fd: int, lo: int, hi: int) -> tuple[memoryview, int]:
        """A new writable copy-on-write mapping of bytes lo..hi of segment
        `fd`, the caller's own (never cached, never shared): `MAP_PRIVATE` of
        the file opened read-only. Returns (the mapping, the file offset of its
        first byte): it starts at the page holding byte `lo`. Untouched pages
        are the pages every reader maps; a write copies the page it touches,
        visible to no one else."""
        size = os.fstat(fd).st_size
        if not 0 <= lo <= hi <= size:
            raise ProtocolError(f"range {lo}..{hi} lies outside a segment of {size} bytes")
        first = lo - lo % mmap.ALLOCATIONGRANULARITY
        if hi == first:
            return memoryview(bytearray()), first
        mm = mmap.mmap(fd, hi - first, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                       offset=first)
        return memoryview(mm), first

    def frames(self, segments, fds: dict) -> tuple[list, list, list, "CopyOnWrite"]:
        """The data frames of a reply whose envelope lists `segments`, given
        the descriptors that came for it ({name: fd}, taken over: closed when
        done), and where each lies: (views, bases, where, cow), where frame i
        is bytes where[i][1]..where[i][1] + len(views[i]) of the whole
        read-only mapping bases[where[i][0]] (so rows of many frames in one
        segment can be gathered in one go), and `cow` maps the same bases
        privately, copy-on-write (for tensors; see `CopyOnWrite`)."""
        owned = _Fds(fds)
        if not isinstance(segments, list):
            raise ProtocolError(f"segments must be a list, got {type(segments).__name__}")
        views, where, bases, base_no, fd_of = [], [], [], {}, []
        maps = {}  # name -> memoryview, for this reply (keeps each mapping alive)
        for s in segments:
            if not (type(s) is list and len(s) == 3 and type(s[0]) is str
                    and type(s[1]) is int and type(s[2]) is int):
                if not (isinstance(s, list) and len(s) == 3 and isinstance(s[0], str)
                        and all(isinstance(x, int) and not isinstance(x, bool) for x in s[1:])):
                    raise ProtocolError(f"bad segment entry {s!r:.100}")
            name, offset, length = s
            if name == "" and offset == 0 and length == 0:  # the empty frame
                views.append(memoryview(b""))
                where.append((-1, 0))
                continue
            mv = maps.get(name)
            if mv is None:
                fd = fds.get(name)
                if fd is None:
                    raise ProtocolError(f"segment {name!r:.100} came without its descriptor")
                mv = maps[name] = self._map(fd)
            if offset < 0 or length < 0 or offset + length > len(mv):
                raise ProtocolError(f"range {offset}+{length} lies outside segment {name!r:.100} ({len(mv)} bytes)")
            views.append(mv[offset:offset + length])
            b = base_no.get(name)
            if b is None:
                b = base_no[name] = len(bases)
                bases.append(mv)
                fd_of.append(fds[name])
            where.append((b, offset))
        return views, bases, where, CopyOnWrite(owned, fd_of, bases)

    def mapped(self) -> int:
        """How many segments this client has mapped (some array uses them)."""
        return len(self._maps)

    def release(self) -> None:
        """Forgets the mappings; each is unmapped once no array uses it.
        Mappings no array uses are forgotten anyway."""
        with self._lock:
            self._maps.clear()

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

    def close(self) -> None:
        """Closes the channel and any lease descriptors not yet filled."""
        leased, self._leased = self._leased, {}
        _close_all(leased.values())
        if self.channel is not None:
            self.channel.close()
            self.channel = None


class CopyOnWrite:
    """Private copy-on-write mappings of the segments of one reply:
    `map(base, lo, hi)` maps bytes lo..hi of `frames`' base number `base`
    anew (`Segments.private`). Each get maps its own, so a write through one
    get's tensors reaches no other get's."""

    def __init__(self, owned: _Fds, fds: list, bases: list) -> None:
        self._owned = owned  # keeps the descriptors open while this lives
        self._fds = fds
        self._bases = bases  # the read-only mappings of `frames`, by base number

    def map(self, base: int, lo: int, hi: int) -> tuple[memoryview, int]:
        """(a writable private view, the file offset of its first byte)
        holding bytes lo..hi of base number `base`."""
        return Segments.private(self._fds[base], lo, hi)
