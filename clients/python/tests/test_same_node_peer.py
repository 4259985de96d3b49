"""A same-node client against a peer that breaks the protocol: a pyzmq
ROUTER that answers as stowd does (`channel_ok`, then same-node `get_ok`s
that name segments) and a descriptor channel of its own that sends memory
files' descriptors (`SCM_RIGHTS`). Bad segment entries, ranges outside a
segment or a frame, a segment not sealed, a channel that closes mid-reply, a channel message
with more descriptors than names, descriptors for a request nobody waits
for: each a clear error (ProtocolError, or StowageTimeout), nothing read
out of bounds, no descriptor left open, and the next call served."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest

import stowage
from conftest import FakeServer

TOKEN = "ab" * 16


def message(body: dict) -> bytes:
    """A channel message: its 4-byte little-endian length, then msgpack."""
    raw = msgpack.packb(body)
    return struct.pack("<I", len(raw)) + raw


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def memfd(data: bytes, seals: int = SEALS) -> int:
    """A memory file holding `data`, sealed as stowd's segments are; its
    descriptor opened read-only."""
    fd = os.memfd_create("segment", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    os.close(fd)
    return ro


class Peer:
    """The ROUTER and the channel. `get(env, chan)` answers each get: it may
    send channel messages on `chan` (the channel's socket, or None) and
    returns the replies."""

    def __init__(self, tmp_path, get):
        self.get = get
        self.path = str(tmp_path / "chan.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.chan: socket.socket | None = None
        self.channels = 0
        self._stop = False
        self._accepter = threading.Thread(target=self._accept, daemon=True)
        self._accepter.start()
        self.server = FakeServer(self._handle)
        self.endpoint = self.server.endpoint

    def _accept(self):
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            # (Known before the greeting goes: the client names the channel
            # in a get as soon as it has read it.)
            self.chan, self.channels = conn, self.channels + 1
            conn.sendall(message({"token": TOKEN}))

    def _handle(self, ident, frames):
        env = msgpack.unpackb(frames[0])
        if env["op"] == "channel":
            return [[msgpack.packb({"proto": "stowage/1", "op": "channel_ok", "id": env["id"],
                                    "body": {"path": self.path}})]]
        if env["op"] == "get":
            assert env.get("same_node") is True and env.get("channel") == TOKEN, env
            deadline = time.monotonic() + 5
            while self.chan is None and time.monotonic() < deadline:
                time.sleep(0.01)
            return self.get(env, self.chan)
        return [[msgpack.packb({"proto": "stowage/1", "op": "error", "id": env["id"],
                                "body": {"code": "unsupported", "message": env["op"]}})]]

    def close(self):
        self._stop = True
        self.server.close()
        self.listener.close()
        if self.chan is not None:
            self.chan.close()


@pytest.fixture
def peer(tmp_path):
    made = []

    def make(get):
        d = tmp_path / f"p{len(made)}"
        d.mkdir()
        p = Peer(d, get)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


X = np.arange(2 * 4, dtype=np.float32).reshape(2, 4)
ROWS = [np.arange(3, dtype=np.int16), np.arange(0, dtype=np.int16)]
SEGMENT = b"\0" * 64 + X.tobytes() + ROWS[0].tobytes() + b"\0" * (4096 - 64 - X.nbytes - 6)


def fields(x_offset: int = 64, frame: int = 1) -> dict:
    """x (regular, two parts that follow on), n (nested, a row in the empty
    frame), v (values)."""
    return {
        "x": {"kind": "regular", "dtype": "float32", "shape": [2, 4],
              "parts": [{"frame": frame, "offset": x_offset, "len": 16, "rows": 1},
                        {"frame": frame, "offset": x_offset + 16, "len": 16, "rows": 1}]},
        "n": {"kind": "nested", "dtype": "int16", "rows": [{"shape": [3], "frame": 1, "offset": 64 + X.nbytes, "len": 6},
                                                            {"shape": [0], "frame": 2, "offset": 0, "len": 0}]},
        "v": {"kind": "values", "values": ["a", b"b"]},
    }


def get_ok(env, fields_, segments, *data) -> list:
    head = {"proto": "stowage/1", "op": "get_ok", "id": env["id"], "body": {"fields": fields_}}
    if segments is not None:
        head["segments"] = segments
    return [[msgpack.packb(head), *data]]


def send(chan, rid: int, named: dict) -> None:
    """A channel message for request `rid`: {name: descriptor}."""
    fds = list(named.values())
    socket.send_fds(chan, [message({"id": rid, "names": list(named)})], fds)
    for fd in fds:
        os.close(fd)


_shared: list = []


def shared_segment() -> int:
    """A new descriptor of one memory file, the same each time (as stowd
    sends a segment anew for every get)."""
    if not _shared:
        _shared.append(memfd(SEGMENT))
    return os.dup(_shared[0])


def good(env, chan):
    send(chan, env["id"], {"s1": shared_segment()})
    return get_ok(env, fields(), [["s1", 0, 4096], ["", 0, 0]])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def check_good(c) -> None:
    got = c.get([1, 2], ["x", "n", "v"])
    np.testing.assert_array_equal(got["x"], X)
    assert not got["x"].flags.writeable
    assert [r.tolist() for r in got["n"]] == [r.tolist() for r in ROWS]
    assert got["v"] == ["a", b"b"]


def test_a_good_reply_maps_one_segment_shared_by_two_gets(peer):
    p = peer(good)
    with stowage.Client(p.endpoint, timeout=5, same_node=True) as c:
        check_good(c)
        a = c.get([1, 2], ["x", "n", "v"])
        b = c.get([1, 2], ["x", "n", "v"])
        assert a["x"].__array_interface__["data"][0] == b["x"].__array_interface__["data"][0], \
            "two gets of the same rows (one memory file, two descriptors) do not share memory"
        assert c._segments.mapped() == 1
        out = {"x": np.zeros_like(X)}
        c.get_into([1, 2], out)
        np.testing.assert_array_equal(out["x"], X)
        del a, b
        c.release_segments()
        assert c._segments.mapped() == 0


BAD = {
    # name: (channel message names, the reply's segments, fields, data frames, error)
    "a segment without its descriptor": ({"s1"}, [["s2", 0, 4096], ["", 0, 0]], fields(), (),
                                         r"segment \"s2\" came without its descriptor"),
    "a range past the segment's end": ({"s1"}, [["s1", 4000, 200], ["", 0, 0]], fields(), (),
                                       r"range 4000\+200 lies outside segment \"s1\" \(4096 bytes\)"),
    "an offset past 2**64": ({"s1"}, [["s1", 2**64 - 1, 2], ["", 0, 0]], fields(), (), r"outside segment"),
    "a part outside its frame": ({"s1"}, [["s1", 0, 64], ["", 0, 0]], fields(), (), r"outside frame 1"),
    "a frame nobody uses": ({"s1"}, [["s1", 0, 4096], ["", 0, 0], ["s1", 0, 8]], fields(), (),
                            r"referenced by no descriptor"),
    "a frame that does not exist": ({"s1"}, [["s1", 0, 4096], ["", 0, 0]], fields(frame=3), (),
                                    r"frame 3 does not exist"),
    "data frames beside segments": ({"s1"}, [["s1", 0, 4096], ["", 0, 0]], fields(), (b"x",),
                                    r"a reply with segments must have no data frames"),
    "a segment entry of two items": ({"s1"}, [["s1", 0], ["", 0, 0]], fields(), (),
                                     r"a segment must be \[name, offset, len\]"),
    "a negative offset": ({"s1"}, [["s1", -1, 8], ["", 0, 0]], fields(), (),
                          r"a segment offset must be a non-negative integer"),
    "an unsealed segment": ({"s1"}, [["s1", 0, 4096], ["", 0, 0]], fields(), (),
                            r"a segment that is not sealed against shrinking and writes"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_same_node_reply_is_a_protocol_error(peer, case):
    names, segments, fields_, data, error = BAD[case]
    bad = [False]
    seals = 0 if case == "an unsealed segment" else SEALS

    def answer(env, chan):
        if not bad[0]:
            return good(env, chan)
        send(chan, env["id"], {n: memfd(SEGMENT, seals) for n in names})
        return get_ok(env, fields_, segments, *data)

    p = peer(answer)
    with stowage.Client(p.endpoint, timeout=5, same_node=True) as c:
        check_good(c)  # (the channel and the core's connection open)
        fds = open_fds()
        bad[0] = True
        with pytest.raises(stowage.ProtocolError, match=error):
            c.get([1, 2], ["x", "n", "v"])
        with pytest.raises(stowage.ProtocolError, match=error):
            c.get_into([1, 2], {"x": np.zeros_like(X)})
        assert open_fds() <= fds, "a descriptor of a refused reply was left open"
        bad[0] = False
        check_good(c)  # the next call is served


def test_a_channel_message_with_more_descriptors_than_names_closes_the_channel(peer):
    broken = [True]

    def answer(env, chan):
        if not broken[0]:
            return good(env, chan)
        socket.send_fds(chan, [message({"id": env["id"], "names": ["s1"]})], [memfd(SEGMENT), memfd(SEGMENT)])
        return get_ok(env, fields(), [["s1", 0, 4096], ["", 0, 0]])

    p = peer(answer)
    with stowage.Client(p.endpoint, timeout=5, same_node=True) as c:
        with pytest.raises(stowage.ProtocolError, match=r"names 1 segments and brings 2 descriptors"):
            c.get([1, 2], ["x", "n", "v"])
        ch = c._segments.channel
        assert ch.closed and "brings 2 descriptors" in ch.why
        broken[0] = False
        check_good(c)  # on a new channel
        assert p.channels == 2


def test_a_channel_that_closes_mid_reply(peer):
    """stowd's channel closes after the request, before the descriptors: the
    get_ok that names segments is a ProtocolError saying so; the next get
    opens a new channel."""
    closing = [True]

    def answer(env, chan):
        if not closing[0]:
            return good(env, chan)
        chan.shutdown(socket.SHUT_RDWR)
        chan.close()
        p.chan = None
        return get_ok(env, fields(), [["s1", 0, 4096], ["", 0, 0]])

    p = peer(answer)
    with stowage.Client(p.endpoint, timeout=5, same_node=True) as c:
        with pytest.raises(stowage.ProtocolError, match=r"descriptor channel is closed \(stowd closed the descriptor channel\)"):
            c.get([1, 2], ["x", "n", "v"])
        closing[0] = False
        check_good(c)
        assert p.channels == 2


def test_descriptors_nobody_waits_for_are_closed(peer):
    """Descriptors for another request (one that timed out, say) are closed
    as they come; the get's own are taken."""
    def answer(env, chan):
        send(chan, env["id"] + 1000, {"s9": memfd(SEGMENT), "s8": memfd(SEGMENT)})
        return good(env, chan)

    p = peer(answer)
    with stowage.Client(p.endpoint, timeout=5, same_node=True) as c:
        check_good(c)
        before = open_fds()
        for _ in range(5):
            check_good(c)
        assert open_fds() <= before, "descriptors for a request nobody waits for were kept open"


def test_descriptors_that_never_come_time_out(peer):
    def answer(env, chan):
        return get_ok(env, fields(), [["s1", 0, 4096], ["", 0, 0]])

    p = peer(answer)
    with stowage.Client(p.endpoint, timeout=1, same_node=True) as c:
        t0 = time.monotonic()
        with pytest.raises(stowage.StowageTimeout, match="descriptors did not arrive"):
            c.get([1, 2], ["x", "n", "v"])
        assert time.monotonic() - t0 < 3
