"""Same-node shared memory (protocol page, "Same-node shared memory").

`Segments` maps the files `stowd` names in a reply's `segments` read-only
and keeps each mapping for as long as any array uses it, so two gets of the
same rows return arrays over the very same memory, and arrays stay valid
after the rows are cleared on the server. A write to such an array raises
`ValueError` (numpy refuses: the buffer is read-only).

torch has no read-only tensors, and a write through a tensor over a
`PROT_READ` page kills the process (SIGSEGV). So tensors are built over
`CopyOnWrite` mappings instead: a private (`MAP_PRIVATE`, `PROT_READ |
PROT_WRITE`) mapping of the same file, opened read-only. Until a write its
pages are the very pages every other reader maps (nothing is copied); a
write copies only the page it touches, into this process, and the file and
every other mapping of it never see it.

While a mapping of either kind lives, this process holds a shared `flock`
on the file (the protocol's rule): `stowd` reuses the file of cleared rows
for new data only when nobody holds one. It also fills leased segments for
puts.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import weakref

from .errors import ProtocolError

ALIGN = 64  # each range of a filled lease starts at a multiple of this



class SegmentGone(ProtocolError):
    """A segment a get reply named was gone (or renamed for reuse) before
    this reader locked it: its rows were overwritten or cleared after the
    reply and held for less time than this reader took (`[shm]
    reply_hold_ms`). The get is asked again (the clients do it, a few
    times): it then answers the new rows, or `key_not_found`."""

    def __init__(self, name: str):
        super().__init__(f"segment {name!r} named by the reply does not exist "
                         "(were its rows cleared meanwhile?)")

class Segments:
    """Read-only mappings of `stowd`'s segments in `directory`, by name."""

    def __init__(self, directory: str) -> None:
        if not os.path.isdir(directory):
            raise ValueError(f"shared-memory directory {directory!r} does not exist; is stowd on this node?")
        self.directory = directory
        # name -> mmap, for as long as some array (or a caller) holds it.
        self._maps: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def _path(self, name: str) -> str:
        if not name or "/" in name or name in (".", ".."):
            raise ProtocolError(f"bad segment name {name!r}")
        return os.path.join(self.directory, name)

    def _open(self, name: str) -> tuple[int, int]:
        """(fd, size) of segment `name`, opened read-only and under a shared
        lock, checked to be the file the name still names. The caller closes
        the fd; a mapping made from it keeps the lock (an mmap dups the fd,
        and the lock lives with the open file) until the mapping is gone."""
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise SegmentGone(name) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            try:
                still = os.stat(path)
            except FileNotFoundError:
                still = None
            if still is None or (still.st_dev, still.st_ino) != (st.st_dev, st.st_ino):
                # stowd renamed it for reuse before we locked: the rows are gone.
                raise SegmentGone(name)
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def _map(self, name: str) -> memoryview:
        """The whole of segment `name`, mapped read-only under a shared lock
        (one mapping per name, shared by every array over it)."""
        with self._lock:
            mm = self._maps.get(name)
            if mm is not None:
                return memoryview(mm)
            fd, size = self._open(name)
            try:
                if not size:
                    return memoryview(b"")
                mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[name] = mm
            return memoryview(mm)

    def private(self, name: str, lo: int, hi: int) -> tuple[memoryview, int]:
        """A new writable copy-on-write mapping of bytes lo..hi of segment
        `name`, the caller's own (never cached, never shared): `MAP_PRIVATE`
        of the file opened read-only, under a shared lock held until the
        mapping is gone. Returns (the mapping, the file offset of its first
        byte): it starts at the page holding byte `lo`. Untouched pages are
        the pages every reader maps; a write copies the page it touches,
        visible to no one else."""
        fd, size = self._open(name)
        try:
            if not 0 <= lo <= hi <= size:
                raise ProtocolError(f"range {lo}..{hi} lies outside segment {name!r} ({size} bytes)")
            first = lo - lo % mmap.ALLOCATIONGRANULARITY
            if hi == first:
                return memoryview(bytearray()), first
            mm = mmap.mmap(fd, hi - first, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                           offset=first)
        finally:
            os.close(fd)
        return memoryview(mm), first

    def view(self, name: str, offset: int, length: int) -> memoryview:
        """Read-only bytes offset..offset+length of segment `name`."""
        if name == "" and offset == 0 and length == 0:
            return memoryview(b"")
        mv = self._map(name)
        if offset < 0 or length < 0 or offset + length > len(mv):
            raise ProtocolError(f"range {offset}+{length} lies outside segment {name!r} ({len(mv)} bytes)")
        return mv[offset:offset + length]

    def views(self, segments) -> list:
        """The data frames of a reply whose envelope lists `segments`."""
        return self.frames(segments)[0]

    def frames(self, segments) -> tuple[list, list, list, "CopyOnWrite"]:
        """The data frames of a reply whose envelope lists `segments`, and
        where each lies: (views, bases, where, cow), where frame i is bytes
        where[i][1]..where[i][1] + len(views[i]) of the whole read-only
        mapping bases[where[i][0]] (so rows of many frames in one segment can
        be gathered in one go), and `cow` maps the same bases privately,
        copy-on-write (for tensors; see `CopyOnWrite`)."""
        if not isinstance(segments, list):
            raise ProtocolError(f"segments must be a list, got {type(segments).__name__}")
        views, where, bases, base_no = [], [], [], {}
        maps = {}  # name -> memoryview, for this reply (keeps each mapping alive)
        for s in segments:
            if not (type(s) is list and len(s) == 3 and type(s[0]) is str
                    and type(s[1]) is int and type(s[2]) is int):
                if not (isinstance(s, list) and len(s) == 3 and isinstance(s[0], str)
                        and all(isinstance(x, int) and not isinstance(x, bool) for x in s[1:])):
                    raise ProtocolError(f"bad segment entry {s!r:.100}")
            name, offset, length = s
            mv = maps.get(name)
            if mv is None or offset < 0 or length < 0 or offset + length > len(mv):
                views.append(self.view(name, offset, length))  # maps it, or raises
                if name == "" and offset == 0 and length == 0:  # the empty frame
                    where.append((-1, 0))
                    continue
                mv = maps[name] = self._map(name)
            else:
                views.append(mv[offset:offset + length])
            b = base_no.get(name)
            if b is None:
                b = base_no[name] = len(bases)
                bases.append(mv)
            where.append((b, offset))
        return views, bases, where, CopyOnWrite(self, list(base_no), bases)


    def mapped(self) -> int:
        """How many segments this client has mapped (some array uses them)."""
        return len(self._maps)

    def release(self) -> None:
        """Forgets the mappings; each is unmapped (and its lock let go) once
        no array uses it. Mappings no array uses are forgotten anyway."""
        with self._lock:
            self._maps.clear()

    def fill(self, name: str, size: int, buffers) -> list:
        """Writes `buffers` (each a buffer, or a list of buffers written back
        to back as one frame) into the leased segment `name` (of `size`
        bytes), each at a multiple of ALIGN; returns [[name, offset, len], ...].
        The writable mapping is closed before returning: after the put, only
        stowd's read-only mapping refers to these pages."""
        fd = os.open(self._path(name), os.O_RDWR)
        try:
            # MAP_POPULATE: fault the pages in one go, not one by one while copying.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None
        finally:
            os.close(fd)
        out, at = [], 0
        try:
            for b in buffers:
                at = -(-at // ALIGN) * ALIGN
                if isinstance(b, list):  # a shared frame's pieces: copied straight to their places
                    n = 0
                    for piece in b:
                        mv = memoryview(piece).cast("B")
                        mm[at + n:at + n + len(mv)] = mv
                        n += len(mv)
                else:
                    mv = memoryview(b).cast("B")
                    n = len(mv)
                    if n:
                        mm[at:at + n] = mv
                out.append([name, at, n])
                at += n
        finally:
            if mm is not None:
                mm.close()
        return out


class CopyOnWrite:
    """Private copy-on-write mappings of the segments of one reply:
    `map(base, lo, hi)` maps bytes lo..hi of `frames`' base number `base`
    anew (`Segments.private`). Each get maps its own, so a write through one
    get's tensors reaches no other get's."""

    def __init__(self, segments: Segments, names: list, bases: list) -> None:
        self._segments = segments
        self._names = names
        self._bases = bases  # the read-only mappings of `frames`, by base number

    def map(self, base: int, lo: int, hi: int) -> tuple[memoryview, int]:
        """(a writable private view, the file offset of its first byte)
        holding bytes lo..hi of base number `base`."""
        try:
            return self._segments.private(self._names[base], lo, hi)
        except ProtocolError:
            # The name is gone: the rows were cleared (and the file unlinked)
            # since this reply was mapped read-only. That mapping still holds
            # the bytes (and the lock): copy them instead.
            mv = self._bases[base]
            if not 0 <= lo <= hi <= len(mv):
                raise
            return memoryview(bytearray(mv[lo:hi])), lo


def lease_size(buffers) -> int:
    """Bytes a lease needs to hold `buffers` (each a buffer, or a list of
    buffers back to back) as `Segments.fill` lays them out."""
    at = 0
    for b in buffers:
        n = sum(memoryview(p).nbytes for p in b) if isinstance(b, list) else memoryview(b).nbytes
        at = -(-at // ALIGN) * ALIGN + n
    return at
