"""Same-node shared memory (protocol page, "Same-node shared memory").

`Segments` maps the files `stowd` names in a reply's `segments` read-only
and keeps each mapping for as long as any array uses it, so two gets of the
same rows return arrays over the very same memory, and arrays stay valid
after the rows are cleared on the server. While a mapping lives, this
process holds a shared `flock` on the file (the protocol's rule): `stowd`
reuses the file of cleared rows for new data only when nobody holds one.
It also fills leased segments for puts.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import weakref

from .errors import ProtocolError

ALIGN = 64  # each range of a filled lease starts at a multiple of this


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

    def _map(self, name: str) -> memoryview:
        """The whole of segment `name`, mapped read-only under a shared lock."""
        with self._lock:
            mm = self._maps.get(name)
            if mm is not None:
                return memoryview(mm)
            path = self._path(name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise ProtocolError(f"segment {name!r} named by the reply does not exist "
                                    "(were its rows cleared meanwhile?)") from None
            try:
                # The lock lives with the open file, which the mmap keeps (it
                # dups the descriptor) until the last array over it is gone.
                fcntl.flock(fd, fcntl.LOCK_SH)
                st = os.fstat(fd)
                try:
                    still = os.stat(path)
                except FileNotFoundError:
                    still = None
                if still is None or (still.st_dev, still.st_ino) != (st.st_dev, st.st_ino):
                    # stowd renamed it for reuse before we locked: the rows are gone.
                    raise ProtocolError(f"segment {name!r} named by the reply does not exist "
                                        "(were its rows cleared meanwhile?)")
                if not st.st_size:
                    return memoryview(b"")
                mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[name] = mm
            return memoryview(mm)

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

    def frames(self, segments) -> tuple[list, list, list]:
        """The data frames of a reply whose envelope lists `segments`, and
        where each lies: (views, bases, at), where frame i is bytes
        at[i]..at[i] + len(views[i]) of the whole mapping bases[..] (so rows of
        many frames in one segment can be gathered in one go)."""
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
        return views, bases, where

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


def lease_size(buffers) -> int:
    """Bytes a lease needs to hold `buffers` (each a buffer, or a list of
    buffers back to back) as `Segments.fill` lays them out."""
    at = 0
    for b in buffers:
        n = sum(memoryview(p).nbytes for p in b) if isinstance(b, list) else memoryview(b).nbytes
        at = -(-at // ALIGN) * ALIGN + n
    return at
