"""The Rust core (issue 17): a tcp `get_into` reads each field's bytes
from the socket straight into the caller's arrays, a `get` into one buffer
per field, and a `put` sends from the caller's arrays (`Connection.put`).
Checked here: the core is built and used, rows land byte for byte (rows
spread over units, an index asked twice, several fields; a put of every
dtype and kind, split or not, read back), mismatches are
refused before anything is written, errors keep their types, a hostile
reply is bounded, and no buffer of the payload's size is allocated (peak
RSS)."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time

import msgpack
import numpy as np
import pytest

import stowage
from core_spy import CoreSpy
from stowage import _core
from stowage import client as client_mod
from test_client_roundtrip import DTYPES, sample

MIB = 1 << 20


def test_the_core_is_built_and_reads_get_into(endpoint, fresh, monkeypatch):
    assert client_mod._core is not None, "stowage._core is not built (cargo xtask test builds it)"
    idx = fresh(64)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 300)).astype(np.float32)
    b = rng.integers(0, 2**16, (64, 5), dtype=np.uint16)
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(idx, {"x": x, "b": b})
        order = idx[::-1] + idx[:3]  # reversed, then three asked twice
        out = {"x": np.empty((67, 300), np.float32), "b": np.empty((67, 5), np.uint16)}
        assert c.get_into(order, out) is out
        assert c._core is not None, "the core did not read this get_into"
        want = {g: i for i, g in enumerate(idx)}
        rows = [want[g] for g in order]
        np.testing.assert_array_equal(out["x"], x[rows])
        np.testing.assert_array_equal(out["b"], b[rows])
        # Mismatches are refused before anything is written: `b` is valid,
        # `x` is not, and `b` keeps its bytes.
        bout = np.full((3, 5), 7, np.uint16)
        with pytest.raises(ValueError, match=r"out\['x'\] has dtype float64, but field 'x' is float32"):
            c.get_into(idx[:3], {"b": bout, "x": np.zeros((3, 300))})
        with pytest.raises(ValueError, match=r"has shape \[3, 299\]"):
            c.get_into(idx[:3], {"b": bout, "x": np.zeros((3, 299), np.float32)})
        np.testing.assert_array_equal(bout, 7)
        # Errors keep their types; the connection serves on.
        with pytest.raises(stowage.KeyNotFound):
            c.get_into([10**15], {"x": np.zeros((1, 300), np.float32)})
        c.put(idx[:1], {"t": ["text"]})
        with pytest.raises(TypeError, match="holds plain values"):
            c.get_into(idx[:1], {"t": np.zeros((1, 1))})
        one = np.empty((1, 300), np.float32)
        c.get_into(idx[5:6], {"x": one})
        np.testing.assert_array_equal(one, x[5:6])
        c.clear(idx)


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")


def test_get_into_allocates_nothing_the_size_of_the_payload(endpoint, fresh):
    """Through the core: no buffer of the payload's size."""
    rows, cols = 1024, 64 * 1024  # 256 MiB of float32 in 1,024 rows
    idx = fresh(rows)
    x = np.ones((rows, cols), np.float32)
    with stowage.Client(endpoint, timeout=120) as c:
        c.put(idx, {"x": x})
        del x
        out = np.empty((rows, cols), np.float32)
        out.fill(0)  # its pages faulted in now (np.zeros would fault them during the get)
        _reset_peak()
        base = _peak_rss()
        c.get_into(idx, {"x": out})
        grew = _peak_rss() - base
        assert out[0, 0] == 1 and out[-1, -1] == 1
        c.clear(idx)
    payload = rows * cols * 4
    assert grew < 64 * MIB, f"get_into through the core grew by {grew / MIB:.0f} MiB for {payload / MIB:.0f} MiB"


def test_get_allocates_the_result_once(endpoint, fresh):
    """A plain get through the core reads each field into one buffer of its
    size, which the returned array is a view of: the client's peak grows by
    the payload, once (pyzmq's frames and then the joined array took twice)."""
    rows, cols = 1024, 64 * 1024  # 256 MiB, spread over the units: several frames
    idx = fresh(rows)
    x = np.arange(rows, dtype=np.float32)[:, None] * np.ones((1, cols), np.float32)
    with stowage.Client(endpoint, timeout=120) as c:
        c.put(idx, {"x": x, "n": [np.arange(k % 7, dtype=np.int16) for k in range(rows)], "t": ["s"] * rows})
        del x
        _reset_peak()
        base = _peak_rss()
        got = c.get(idx, ["x", "n", "t"])
        grew = _peak_rss() - base
        a = got["x"]
        assert a[5, 7] == 5 and a[-1, -1] == rows - 1 and not a.flags.writeable
        assert [len(r) for r in got["n"][:8]] == [0, 1, 2, 3, 4, 5, 6, 0] and got["t"][0] == "s"
        owner = a
        while isinstance(owner, np.ndarray) and owner.base is not None:
            owner = owner.base
        owner = owner.obj if isinstance(owner, memoryview) else owner
        assert type(owner).__name__ == "Buffer", f"the array's memory belongs to {owner!r}"
        del got, a, owner
        c.clear(idx)
    payload = rows * cols * 4
    assert grew < payload + 32 * MIB, f"a get through the core grew by {grew / MIB:.0f} MiB for {payload / MIB:.0f} MiB"


def test_a_get_of_plain_lists_is_written_by_the_core(endpoint, fresh):
    """A get of a list of ints and a list of distinct str: the core checks
    them and writes the request (no envelope built in Python), and the rows
    are the same as the general path's. Anything else (a tuple, a numpy
    int, a bool, an int subclass, a repeated or non-str field, a negative,
    too large or empty index list) sends nothing that way and takes the
    general path: the same result, or the same error, as before."""
    idx = fresh(4)
    x = np.arange(4 * 3, dtype=np.int64).reshape(4, 3)
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(idx, {"x": x, "s": ["a", "b", "c", "d"]})
        # Each get the real core is asked: True through `get_fast` (the core
        # reads the arguments and writes the request, or declines and sends
        # nothing), False through `get` (frame 0 written by the general path).
        written_by_core = []
        real = c._core

        class Spy:
            def get_fast(self, *args):
                written_by_core.append(True)
                return real.get_fast(*args)

            def get(self, *args):
                written_by_core.append(False)
                return real.get(*args)

            def __getattr__(self, name):
                return getattr(real, name)

        c._core = Spy()

        class Int(int):
            pass

        for indexes in ([idx[2], idx[0]], (idx[2], idx[0]), np.asarray([idx[2], idx[0]], np.uint32)):
            written_by_core.clear()
            np.testing.assert_array_equal(c.get(indexes, ["x"])["x"], x[[2, 0]])
            assert written_by_core == [True], indexes
        for indexes in ([np.int64(idx[2]), idx[0]], [Int(idx[2]), idx[0]]):
            written_by_core.clear()
            np.testing.assert_array_equal(c.get(indexes, ["x"])["x"], x[[2, 0]])
            assert written_by_core[-1] is False, indexes  # the general path sent it
        assert c.get([idx[1]], ["s"])["s"] == ["b"]  # values: the general reader
        for indexes, fields, err, match in [
            ([idx[0]], ["x", "x"], ValueError, "named twice"),
            # Past the names a scan checks, a set finds the repeat.
            ([idx[0]], [f"n{i}" for i in range(20)] + ["n7"], ValueError, "named twice"),
            ([idx[0]], ["x", 3], TypeError, "field names must be str"),
            ([-1], ["x"], ValueError, "out of range"),
            ([1 << 64], ["x"], ValueError, "out of range"),
            ([], ["x"], ValueError, "empty batch"),
            ([idx[0]], [], ValueError, "empty batch"),
        ]:
            written_by_core.clear()
            with pytest.raises(err, match=match):
                c.get(indexes, fields)
            # The core declined (None, nothing sent); the general path refused.
            assert written_by_core == [True], written_by_core
        written_by_core.clear()
        with pytest.raises(stowage.KeyNotFound):
            # Index 1 as a numpy int (not an exact int: the general path), a field nobody puts.
            c.get([np.int64(1)], ["never_put_anywhere"])
        assert written_by_core == [True, False], written_by_core
        with pytest.raises(stowage.KeyNotFound):
            c.get([idx[3] + 1000], ["x"])


def test_overlapping_and_scattered_ranges_land_right(fake_server):
    """A get_ok whose parts share bytes (runs of rows that overlap, a row
    named twice) and skip bytes, across two frames: the core reads each
    frame once, in order, and every row lands where it belongs, through get
    and get_into."""
    import msgpack

    rows = np.arange(6 * 2, dtype=np.float32).reshape(6, 2)  # rows A..F, 8 bytes each
    f1 = rows[:4].tobytes()  # A B C D
    f2 = b"\xff" * 8 + rows[4:].tobytes()  # junk, E F
    parts = [
        {"frame": 1, "offset": 0, "len": 16, "rows": 2},   # A B
        {"frame": 1, "offset": 8, "len": 16, "rows": 2},   # B C (overlaps)
        {"frame": 2, "offset": 8, "len": 16, "rows": 2},   # E F (after a gap)
        {"frame": 1, "offset": 24, "len": 8, "rows": 1},   # D
        {"frame": 1, "offset": 4, "len": 16, "rows": 2},   # the last half of A .. the first of C
    ]
    want = np.concatenate([rows[[0, 1, 1, 2, 4, 5, 3]],
                           np.frombuffer(f1[4:20], np.float32).reshape(2, 2)])

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        desc = {"kind": "regular", "dtype": "float32", "shape": [9, 2], "parts": parts}
        head = msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": env["id"], "body": {"fields": {"x": desc}}})
        return [[head, f1, f2]]

    srv = fake_server(handler)
    with stowage.Client(srv.endpoint, timeout=5) as c:
        assert client_mod._core is not None
        got = c.get(list(range(9)), ["x"])["x"]
        np.testing.assert_array_equal(got, want)
        out = np.zeros((9, 2), np.float32)
        c.get_into(list(range(9)), {"x": out})
        np.testing.assert_array_equal(out, want)
        assert c._core is not None


def test_many_small_parts_are_read_together_right(fake_server):
    """Thousands of 64-byte parts over two frames of 256 KiB, mostly back
    to back (read together, straight into place, many a recvmsg), with
    gaps the core skips, rows named twice and parts that overlap what was
    read before: every row lands where it belongs, through get and
    get_into."""
    import msgpack

    rng = np.random.default_rng(7)
    frames = [rng.integers(0, 1 << 30, (4096, 16), dtype=np.int32) for _ in range(2)]
    parts, want = [], []
    for k, f in enumerate(frames, start=1):
        row = 0
        while row < len(f):
            step = rng.choice([1, 1, 1, 1, 1, 1, 3, 0, -2])  # on, a gap, the same row, back two
            row = max(0, row + int(step))
            if row >= len(f):
                break
            parts.append({"frame": k, "offset": row * 64, "len": 64, "rows": 1})
            want.append(f[row])
            row += 1
    want = np.stack(want)
    n = len(want)

    def handler(ident, frames_in):
        env = msgpack.unpackb(frames_in[0])
        desc = {"kind": "regular", "dtype": "int32", "shape": [n, 16], "parts": parts}
        head = msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": env["id"], "body": {"fields": {"x": desc}}})
        return [[head, *(f.tobytes() for f in frames)]]

    srv = fake_server(handler)
    with stowage.Client(srv.endpoint, timeout=10) as c:
        np.testing.assert_array_equal(c.get(list(range(n)), ["x"])["x"], want)
        out = np.zeros((n, 16), np.int32)
        c.get_into(list(range(n)), {"x": out})
        np.testing.assert_array_equal(out, want)
        assert c._core is not None


def test_a_regular_reply_that_does_not_answer_the_get_is_refused(fake_server):
    """A get_ok of regular fields (the core's direct path: arrays straight
    off its buffers) that answers another question: more rows than asked,
    the fields in another order, a field nobody asked for. Each is a
    ProtocolError; the next get is served."""
    import msgpack

    def regular(rows):
        a = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
        return a, {"kind": "regular", "dtype": "float32", "shape": [rows, 2], "parts": []}

    cases = [
        ({"x": 3, "y": 3}, r"field 'x': shape \[3, 2\] does not have 2 rows"),
        ({"y": 2, "x": 2}, r"get_ok has fields \['y', 'x'\], requested \['x', 'y'\]"),
        ({"x": 2, "y": 2, "z": 2}, r"get_ok has fields \['x', 'y', 'z'\], requested \['x', 'y'\]"),
        ({"x": 2, "y": 2}, None),
    ]
    current = {}

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        descs, data = {}, []
        for name, rows in current["fields"].items():
            a, d = regular(rows)
            data.append(a.tobytes())
            d["parts"] = [{"frame": len(data), "offset": 0, "len": a.nbytes, "rows": rows}]
            descs[name] = d
        head = msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": env["id"], "body": {"fields": descs}})
        return [[head, *data]]

    srv = fake_server(handler)
    with stowage.Client(srv.endpoint, timeout=5) as c:
        for fields, match in cases:
            current["fields"] = fields
            if match is None:
                got = c.get([4, 5], ["x", "y"])
                np.testing.assert_array_equal(got["x"], regular(2)[0])
                assert not got["x"].flags.writeable
            else:
                with pytest.raises(stowage.ProtocolError, match=match):
                    c.get([4, 5], ["x", "y"])
        assert c._core is not None


def test_a_hostile_reply_is_refused_without_harm(fake_server):
    """Replies a stowd never sends: a part naming data frame 2^40, a part
    past its frame, a frame no descriptor uses, a declared shape the parts do
    not fill. Each is a ProtocolError; the client serves the next call."""
    import msgpack

    def desc(parts, n=1):
        return {"kind": "regular", "dtype": "float32", "shape": [n, 2], "parts": parts}

    cases = iter([
        (desc([{"frame": 1 << 40, "offset": 0, "len": 8, "rows": 1}]), [b"\0" * 8], r"does not exist"),
        (desc([{"frame": 1, "offset": 4, "len": 8, "rows": 1}]), [b"\0" * 8], r"outside frame 1"),
        (desc([{"frame": 1, "offset": 0, "len": 8, "rows": 1}]), [b"\0" * 8, b"x"], r"referenced by no descriptor"),
        (desc([{"frame": 1, "offset": 0, "len": 8, "rows": 1}], n=2), [b"\0" * 8], r"rows|parts"),
    ])
    current = {}

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        d, data, _ = current["case"]
        head = msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": env["id"], "body": {"fields": {"x": d}}})
        return [[head, *data]]

    srv = fake_server(handler)
    with stowage.Client(srv.endpoint, timeout=5) as c:
        for case in cases:
            current["case"] = case
            for call in (lambda: c.get([1] * case[0]["shape"][0], ["x"]),
                         lambda: c.get_into([1] * case[0]["shape"][0], {"x": np.zeros((case[0]["shape"][0], 2), np.float32)})):
                with pytest.raises(stowage.ProtocolError, match=case[2]):
                    call()
        current["case"] = (desc([{"frame": 1, "offset": 0, "len": 8, "rows": 1}]), [np.ones(2, np.float32).tobytes()], None)
        assert c.get([1], ["x"])["x"].tolist() == [[1.0, 1.0]]


def _core_sends(c) -> list:
    """Records the op of every put message `c` sends through the core
    (each message of a `_core.Put` its `put` sends)."""
    ops = []
    c._core = CoreSpy(_core.Connection(c.endpoint, c.spin_us, c._token), lambda op, nbytes, rows: ops.append(op))
    return ops


def every_kind(n: int) -> dict:
    """A put's data of n rows: every dtype, nested rows (empty, scalar, one
    big enough for a frame of its own), values, empty rows and
    non-contiguous input."""
    data = {f"r_{dt}": sample(dt, (n, 3), seed=i) for i, dt in enumerate(DTYPES)}
    base = sample("float64", (n, 6), seed=99)
    data.update({
        "nested": [sample("int16", [(3,), (0,), (), (2, 4), (0, 5)][k % 5], seed=k) for k in range(n)],
        "big_row": [sample("float32", (70_000,) if k == 7 else (k,), seed=k) for k in range(n)],
        "values": [f"v{k}-é" if k % 2 else bytes([k]) * k for k in range(n)],
        "empty": np.zeros((n, 0), np.int8),
        "strided": base[:, ::2],
        "transposed": np.arange(n * 4, dtype=np.int32).reshape(4, n).T,
        "nested_strided": [base[k, ::3] for k in range(n)],
    })
    assert not data["strided"].flags.c_contiguous and not data["transposed"].flags.c_contiguous
    return data


def _same(got, want) -> bool:
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape \
            and got.tobytes() == want.tobytes()  # bit-exact (NaN-safe)
    if isinstance(want, list) and want and isinstance(want[0], np.ndarray):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    return got == want


@pytest.mark.parametrize("max_message_bytes", [256 * MIB, 3000], ids=["one-message", "split"])
def test_put_through_the_core_round_trips(endpoint, fresh, max_message_bytes):
    """Every dtype, nested rows (empty, scalar, one big enough for a frame of
    its own), values, empty rows and non-contiguous input, put through the
    core, in one message or split over many; read back."""
    n = 40
    idx = fresh(n)
    data = every_kind(n)
    with stowage.Client(endpoint, timeout=30, max_message_bytes=max_message_bytes) as c:
        ops = _core_sends(c)
        assert c.put(idx, data) == n
        assert ops and set(ops) == {"put"}, "the put did not go through the core"
        assert (len(ops) > 1) == (max_message_bytes == 3000), ops
        got = c.get(idx, list(data))
        bad = [name for name in data if not _same(got[name], list(data[name]) if name == "values" else data[name])]
        assert not bad, f"fields that did not round-trip: {bad}"
        c.clear(idx)


def test_a_put_of_more_slices_than_one_writev_takes(endpoint, fresh):
    """3,000 nested rows, every other one above the size the core copies
    into its write buffer (16 KiB): each of those is a slice of its own,
    about 1,500 slices plus the copied runs between them, more than IOV_MAX
    (1024) in one message. Every row comes back in place."""
    n = 3000
    idx = fresh(n)
    rows = [np.full(4500 if k % 2 else k % 7, k, np.int32) for k in range(n)]
    assert sum(r.nbytes > 16 << 10 for r in rows) > 1024
    with stowage.Client(endpoint, timeout=60) as c:
        ops = _core_sends(c)
        c.put(idx, {"n": rows})
        assert ops == ["put"]
        got = c.get(idx, ["n"])["n"]
        wrong = [k for k in range(n) if not _same(got[k], rows[k])]
        assert not wrong, f"rows not in place: {wrong[:10]}"
        c.clear(idx)


def test_put_errors_keep_their_types(small_server, fresh):
    """Through the core: stowd's errors keep their types (a split put stopped
    by a full unit says how many rows earlier messages stored), and the
    client serves on."""
    n = small_server.max_rows + 1
    with stowage.Client(small_server["native"], timeout=10) as c:
        ops = _core_sends(c)
        with pytest.raises(stowage.TooLarge):
            c.put(fresh(n), {"t": ["v"] * n})
        assert ops == ["put"]
    idx = fresh(10)
    rows = np.arange(10, dtype=np.uint8)[:, None].repeat(1024, axis=1)
    with stowage.Client(small_server["native"], timeout=10, max_message_bytes=2200) as c:
        ops = _core_sends(c)
        try:
            with pytest.raises(stowage.CapacityError) as ei:
                c.put(idx, {"x": rows})  # each unit holds 4 KiB: rows 0..7 fit, 8..9 do not
            assert ei.value.rows_stored == 8 and set(ops) == {"put"} and len(ops) > 1
            np.testing.assert_array_equal(c.get(idx[:8], ["x"])["x"], rows[:8])
        finally:
            c.clear(idx)


def test_a_split_put_keeps_two_messages_on_the_wire_and_counts_what_was_answered(fake_server):
    """A put of several messages through the core: the second is sent before
    the first's reply is read (the peer sees both before it answers), and
    when a later message gets no reply, StowageTimeout says how many leading
    rows the answered ones stored."""
    requests = []

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        requests.append(env["id"])
        if len(requests) == 2:
            # Both messages are here before the first is answered.
            body = {"rows": len(env["body"]["global_indexes"])}
            first = msgpack.packb({"proto": "stowage/1", "op": "put_ok", "id": requests[0], "body": body})
            return [[first]]
        return []

    srv = fake_server(handler)
    x = np.arange(6 * 1000, dtype=np.float32).reshape(6, 1000)  # 4,000-byte rows
    with stowage.Client(srv.endpoint, timeout=10, max_message_bytes=9000) as c:  # 2 rows a message
        ops = _core_sends(c)
        t = time.monotonic()
        with pytest.raises(stowage.StowageTimeout) as ei:
            c.put([1, 2, 3, 4, 5, 6], {"x": x}, timeout=0.5)
        assert time.monotonic() - t < 5
        assert ei.value.rows_stored == 2, "the first message's rows, answered"
        assert ops == ["put"] * 3
    assert len(requests) >= 2


def test_a_put_without_a_reply_times_out_and_the_next_is_served(fake_server):
    """A peer that takes a put and never answers: StowageTimeout within the
    call's timeout, no rows counted; the next put, on a new connection, is
    answered. The peer (libzmq) got the data frame byte for byte."""
    requests = []

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        requests.append(frames[1:])
        if len(requests) == 1:
            return []
        body = {"rows": len(env["body"]["global_indexes"])}
        return [[msgpack.packb({"proto": "stowage/1", "op": "put_ok", "id": env["id"], "body": body})]]

    srv = fake_server(handler)
    x = np.arange(4 * 1000, dtype=np.float32).reshape(4, 1000)
    with stowage.Client(srv.endpoint, timeout=10) as c:
        ops = _core_sends(c)
        t = time.monotonic()
        with pytest.raises(stowage.StowageTimeout) as ei:
            c.put([1, 2, 3, 4], {"x": x}, timeout=0.5)
        assert time.monotonic() - t < 5 and ei.value.rows_stored == 0
        assert c.put([1, 2, 3, 4], {"x": x}) == 4
        assert ops == ["put", "put"]
    assert [r for r in requests] == [[x.tobytes()]] * 2


class HostileZmtp:
    """A bare ZMTP 3.0 peer on a raw socket, for replies libzmq never sends:
    it answers the k-th request (counted over all connections) with the raw
    bytes `reply(k, request frame 0)`, or with a list of pieces of bytes,
    sent one by one with a pause before each (a None piece: send nothing
    more on that connection); with `reply=None` it reads nothing
    after the handshake. Each connection is served by a thread of its own
    (the client's idle pyzmq DEALER connects too); `requests` lists, per
    request, the number of the connection it came on. `pause`: seconds
    before each piece."""

    def __init__(self, reply, pause: float = 0.002):
        self.reply = reply
        self.pause = pause
        self.requests: list[int] = []
        self._lock = threading.Lock()
        self._connections = itertools.count(1)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def frame(data: bytes, more: bool = False, command: bool = False) -> bytes:
        flags = int(more) | 4 * int(command)
        head = bytes([flags, len(data)]) if len(data) < 256 else bytes([flags | 2]) + len(data).to_bytes(8, "big")
        return head + data

    def _run(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            try:
                self._exchange(conn)
            except (OSError, EOFError):
                pass  # the client dropped the connection, or never asked

    def _exchange(self, conn):
        conn.settimeout(10)
        f = conn.makefile("rb")

        def read(k):
            b = f.read(k)
            if len(b) < k:
                raise EOFError
            return b

        def frame():
            flags = read(1)[0]
            size = int.from_bytes(read(8), "big") if flags & 2 else read(1)[0]
            return flags, read(size)

        greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
        conn.sendall(greeting)
        read(64)
        # Numbered once its greeting is whole: a client reading ours to see
        # whether we ask for a token (and closing) makes no connection.
        number = next(self._connections)
        conn.sendall(self.frame(b"\x05READY\x0bSocket-Type" + (6).to_bytes(4, "big") + b"ROUTER", command=True))
        frame()  # the client's READY
        if self.reply is None:
            self._stop.wait()
        while not self._stop.is_set():
            flags, head = frame()
            while flags & 1:
                flags, _ = frame()
            with self._lock:
                self.requests.append(number)
                k = len(self.requests)
            out = self.reply(k, msgpack.unpackb(head))
            if isinstance(out, bytes):
                conn.sendall(out)
                continue
            for piece in out:  # pieces, each after a pause (None: stall)
                if piece is None:
                    self._stop.wait()
                    return
                time.sleep(self.pause)
                conn.sendall(piece)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=10)
        self.sock.close()


def test_a_hostile_reply_to_a_put_is_bounded(fresh):
    """Replies to a put that declare more than the core reads (a data frame
    of 2^40 bytes, a frame 0 of 2^40, more frames than a message may have)
    or break ZMTP (a command inside a reply): each a ProtocolError before
    anything of that size is allocated, the connection dropped; the next
    put, on a new connection, is served."""
    huge = bytes([2]) + (1 << 40).to_bytes(8, "big")  # a frame header, no bytes after it

    def put_ok(env, more=False):
        return HostileZmtp.frame(msgpack.packb({"proto": "stowage/1", "op": "put_ok", "id": env["id"],
                                                "body": {"rows": 1}}), more=more)

    cases = [
        (lambda env: put_ok(env, more=True) + huge, r"data frames of 1099511627776 bytes"),
        (lambda env: huge, r"frame 0 of 1099511627776 bytes"),
        (lambda env: put_ok(env, more=True) + b"\x01\x00" * (1 << 20) + b"\x00\x00", r"more than 1048576 frames"),
        (lambda env: put_ok(env, more=True) + HostileZmtp.frame(b"\x04PING", command=True), r"a command frame"),
    ]
    srv = HostileZmtp(lambda k, env: cases[k - 1][0](env) if k <= len(cases) else put_ok(env))
    try:
        with stowage.Client(srv.endpoint, timeout=10) as c:
            ops = _core_sends(c)
            for _, match in cases:
                peak = _peak_rss()
                with pytest.raises(stowage.ProtocolError, match=match):
                    c.put([1], {"x": np.ones((1, 8), np.float32)})
                assert _peak_rss() - peak < 64 * MIB
            assert c.put([1], {"x": np.ones((1, 8), np.float32)}) == 1
            assert ops == ["put"] * (len(cases) + 1)
        # One request per connection: each refused reply dropped its connection.
        assert len(srv.requests) == len(set(srv.requests)) == len(cases) + 1, srv.requests
    finally:
        srv.close()


def _get_ok(env, fields: dict) -> tuple[bytes, list]:
    """A get_ok's frame 0 and data frames: each field one regular frame."""
    descs, frames = {}, []
    for name, a in fields.items():
        frames.append(a.tobytes())
        descs[name] = {"kind": "regular", "dtype": str(a.dtype), "shape": list(a.shape),
                       "parts": [{"frame": len(frames), "offset": 0, "len": a.nbytes, "rows": a.shape[0]}]}
    head = msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": env["id"], "body": {"fields": descs}})
    return head, frames


def test_a_reply_that_arrives_in_pieces_is_read_whole():
    """The core reads a reply through a small read-ahead buffer, and long
    stretches straight into place: a reply sent a few bytes at a time (frame
    headers and frame 0 split anywhere, a 64-byte field and a 200 KiB one,
    each cut across the read-ahead's edges) gives the same rows through get
    and get_into, call after call on one connection."""
    small = np.arange(16, dtype=np.float32).reshape(1, 16)
    big = np.arange(50_000, dtype=np.float32).reshape(1, 50_000)

    def reply(k, env):
        head, frames = _get_ok(env, {"s": small * k, "b": big * k})
        raw = (HostileZmtp.frame(head, more=True) + HostileZmtp.frame(frames[0], more=True)
               + HostileZmtp.frame(frames[1]))
        cuts = [1, 2, 3, 9, 11, 40, 100, 101, 4000, 40_000, 65_536, 70_000, 131_000, len(raw)]
        return [raw[a:b] for a, b in itertools.pairwise([0, *cuts])]

    srv = HostileZmtp(reply)
    try:
        with stowage.Client(srv.endpoint, timeout=10) as c:
            for k in (1, 2, 3):
                got = c.get([7], ["s", "b"])
                np.testing.assert_array_equal(got["s"], small * (2 * k - 1))
                np.testing.assert_array_equal(got["b"], big * (2 * k - 1))
                out = {"s": np.zeros_like(small), "b": np.zeros_like(big)}
                c.get_into([7], out)
                np.testing.assert_array_equal(out["s"], small * 2 * k)
                np.testing.assert_array_equal(out["b"], big * 2 * k)
        assert len(set(srv.requests)) == 1, srv.requests  # one connection throughout
    finally:
        srv.close()


def test_a_reply_that_stops_halfway_times_out():
    """A peer that sends half a reply and then nothing: StowageTimeout at
    the call's timeout (the waits between pieces count against one
    deadline), the connection dropped; the next get, on a new connection,
    is served."""
    row = np.arange(64, dtype=np.float32).reshape(1, 64)

    def reply(k, env):
        head, frames = _get_ok(env, {"x": row})
        raw = HostileZmtp.frame(head, more=True) + HostileZmtp.frame(frames[0])
        return [raw[:50], raw[50:100], None] if k == 1 else raw

    srv = HostileZmtp(reply)
    try:
        with stowage.Client(srv.endpoint, timeout=10) as c:
            t = time.monotonic()
            with pytest.raises(stowage.StowageTimeout):
                c.get([1], ["x"], timeout=0.5)
            assert 0.4 < time.monotonic() - t < 5
            np.testing.assert_array_equal(c.get([1], ["x"])["x"], row)
        assert len(set(srv.requests)) == 2, srv.requests
    finally:
        srv.close()


def test_a_put_the_peer_does_not_read_times_out():
    """A peer that takes the handshake and reads nothing more: a put larger
    than the socket buffers cannot be sent, and raises StowageTimeout at
    its timeout (the core's writes wait for room until the deadline)."""
    srv = HostileZmtp(None)
    try:
        with stowage.Client(srv.endpoint, timeout=10) as c:
            t = time.monotonic()
            with pytest.raises(stowage.StowageTimeout) as ei:
                c.put([1], {"x": np.ones((1, 16 * MIB), np.float32)}, timeout=0.5)
            assert 0.4 < time.monotonic() - t < 5 and ei.value.rows_stored == 0
            assert c._core is not None
    finally:
        srv.close()


def test_put_sends_without_joining(endpoint, fresh):
    """256 MiB of nested rows of 32 KiB each: small enough that the layout
    packs them into shared frames, which pyzmq needed joined (a copy of the
    payload) and the core sends piece by piece from the caller's arrays:
    the client's peak RSS grows by little."""
    rows, cols = 8192, 8192  # float32: 32 KiB a row
    idx = fresh(rows)
    data = [np.full(cols, k, np.float32) for k in range(rows)]
    payload = rows * cols * 4
    # One message (the default would make five; 256 MiB, with each row's
    # 32 bytes of descriptor, two).
    with stowage.Client(endpoint, timeout=120, max_message_bytes=512 * MIB) as c:
        ops = _core_sends(c)
        _reset_peak()
        base = _peak_rss()
        assert c.put(idx, {"n": data}) == rows
        grew = _peak_rss() - base
        assert ops == ["put"]
        got = c.get(idx[::4093], ["n"])["n"]
        assert [g[0] for g in got] == list(range(0, rows, 4093)) and all(g.shape == (cols,) for g in got)
        c.clear(idx)
    assert grew < 32 * MIB, f"a put through the core grew by {grew / MIB:.0f} MiB for {payload / MIB:.0f} MiB"


def test_a_reply_of_more_rows_than_the_wire_default_is_read(endpoint, fresh):
    """stowd takes 2^24 rows a request by default (operators may raise it),
    more than the codec's own default of 2^20: the client decodes replies by
    what arrived, not by a limit of its own, so a get and a get_into of
    1,100,000 one-byte rows come back."""
    idx = fresh(10**6) + fresh(100_000)
    n = len(idx)
    x = (np.arange(n) % 251).astype(np.uint8).reshape(n, 1)
    with stowage.Client(endpoint, timeout=120) as c:
        c.put(idx, {"x": x})
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], x)
        out = np.zeros_like(x)
        c.get_into(idx, {"x": out})
        np.testing.assert_array_equal(out, x)
        c.clear(idx)


def test_a_get_reuses_the_buffer_of_a_result_nobody_holds(endpoint, fresh, monkeypatch):
    """A tcp get's result buffer goes back to the core when its last array is
    gone, and the next get of that size receives into it: the same address,
    every byte the new reply's. One held, or over STOWAGE_RECEIVE_POOL_BYTES,
    is never reused; release_receive_buffers frees what is kept."""
    monkeypatch.setenv("STOWAGE_RECEIVE_POOL_BYTES", str(64 << 20))
    stowage.release_receive_buffers()
    idx = fresh(512)
    a = np.full((512, 2048), 1, np.float32)  # 4 MiB
    b = np.full((512, 2048), 2, np.float32)
    addr = lambda arr: arr.__array_interface__["data"][0]  # noqa: E731
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(idx, {"x": a})
        first = c.get(idx, ["x"])["x"]
        np.testing.assert_array_equal(first, a)
        held = addr(first)
        c.put(idx, {"x": b})
        second = c.get(idx, ["x"])["x"]  # `first` is still held: fresh memory
        assert addr(second) != held
        np.testing.assert_array_equal(first, a)
        np.testing.assert_array_equal(second, b)
        del first
        c.put(idx, {"x": a})
        third = c.get(idx, ["x"])["x"]  # first's buffer, now overwritten by a
        assert addr(third) == held
        np.testing.assert_array_equal(third, a)
        np.testing.assert_array_equal(second, b)
        del second, third
        assert stowage.release_receive_buffers() == 2 * a.nbytes
        assert stowage.release_receive_buffers() == 0
        # Nothing kept above the cap.
        monkeypatch.setenv("STOWAGE_RECEIVE_POOL_BYTES", str(a.nbytes - 1))
        del c.get(idx, ["x"])["x"]
        assert stowage.release_receive_buffers() == 0
        c.clear(idx)


def test_a_reply_is_awaited_by_spinning_then_sleeping(monkeypatch):
    """`spin_us`: the core polls for a reply before it sleeps. A peer that
    answers after 0.2 s: with spin_us=0 the waiting thread uses almost no
    CPU; with a spin longer than the wait it polls the whole time (its CPU
    time, through `sched_yield`, is a real share of the wait); with a spin
    of 50 ms the first wait spins and gives up, and the next 8 waits on the
    connection sleep at once. Rows are right every time, and the call's
    timeout still bounds a spin longer than it. (No turn counts as crowded
    here, whatever else the machine runs: that has its own test.)"""
    monkeypatch.setenv("STOWAGE_SPIN_CROWDED_US", str(10**7))
    row = np.arange(64, dtype=np.float32).reshape(1, 64)

    def reply(k, env):
        time.sleep(0.2)
        head, frames = _get_ok(env, {"x": row * k})
        return HostileZmtp.frame(head, more=True) + HostileZmtp.frame(frames[0])

    def cpu_of_gets(c, n):
        out = []
        for _ in range(n):
            t = time.thread_time()
            got = c.get([1], ["x"])["x"]
            out.append(time.thread_time() - t)
            assert got.shape == row.shape and got[0, 1] >= 1
        return out

    srv = HostileZmtp(reply)
    try:
        with stowage.Client(srv.endpoint, timeout=10, spin_us=0) as c:
            assert c.spin_us == 0
            asleep = cpu_of_gets(c, 2)
        with stowage.Client(srv.endpoint, timeout=10, spin_us=5e6) as c:
            spinning = cpu_of_gets(c, 2)
        with stowage.Client(srv.endpoint, timeout=10, spin_us=50_000) as c:
            gave_up = cpu_of_gets(c, 10)
        assert max(asleep) < 0.02, asleep
        assert min(spinning) > 0.02, spinning
        assert sum(gave_up[1:9]) < gave_up[0], gave_up
        assert gave_up[9] > max(gave_up[1:9]), gave_up  # the 10th wait spins again
    finally:
        srv.close()

    def never(k, env):
        return [None]

    srv = HostileZmtp(never)
    try:
        with stowage.Client(srv.endpoint, timeout=10, spin_us=1e9) as c:
            t = time.monotonic()
            with pytest.raises(stowage.StowageTimeout):
                c.get([1], ["x"], timeout=0.3)
            assert 0.25 < time.monotonic() - t < 5
    finally:
        srv.close()


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "100"])
def test_a_bad_spin_is_refused(bad, monkeypatch):
    with pytest.raises(ValueError, match="spin_us"):
        stowage.Client("tcp://127.0.0.1:1", spin_us=bad)
    with pytest.raises(ValueError, match="spin_us"):
        stowage.AsyncClient("tcp://127.0.0.1:1", spin_us=bad)
    monkeypatch.setenv("STOWAGE_SPIN_US", "soon")
    with pytest.raises(ValueError, match="STOWAGE_SPIN_US"):
        stowage.Client("tcp://127.0.0.1:1")
    monkeypatch.setenv("STOWAGE_SPIN_US", "-5")
    with pytest.raises(ValueError, match="STOWAGE_SPIN_US"):
        stowage.Client("tcp://127.0.0.1:1")
    monkeypatch.setenv("STOWAGE_SPIN_US", "30")
    with stowage.Client("tcp://127.0.0.1:1") as c:
        assert c.spin_us == 30.0
    with pytest.raises(ValueError, match="spin_us"):
        client_mod._core.Connection("tcp://127.0.0.1:1", -1.0)
