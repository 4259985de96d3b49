"""The Rust core (issue 17, first part): a tcp `get_into` reads each field's
bytes from the socket straight into the caller's arrays. Checked here: the
core is built and used, rows land byte for byte (rows spread over units,
an index asked twice, several fields), mismatches are refused before
anything is written, errors keep their types, and no buffer of the
payload's size is allocated (peak RSS), where the pure-Python path
(`STOWAGE_PURE_PYTHON=1`) needs one."""

from __future__ import annotations

import os

import numpy as np
import pytest

import stowage
from stowage import client as client_mod

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


@pytest.mark.parametrize("pure", [False, True])
def test_get_into_allocates_nothing_the_size_of_the_payload(endpoint, fresh, monkeypatch, pure):
    rows, cols = 1024, 64 * 1024  # 256 MiB of float32 in 1,024 rows
    idx = fresh(rows)
    x = np.ones((rows, cols), np.float32)
    with stowage.Client(endpoint, timeout=120) as c:
        c.put(idx, {"x": x})
        del x
        out = np.empty((rows, cols), np.float32)
        out.fill(0)  # its pages faulted in now (np.zeros would fault them during the get)
        if pure:
            monkeypatch.setenv("STOWAGE_PURE_PYTHON", "1")
        _reset_peak()
        base = _peak_rss()
        c.get_into(idx, {"x": out})
        grew = _peak_rss() - base
        assert out[0, 0] == 1 and out[-1, -1] == 1
        c.clear(idx)
    payload = rows * cols * 4
    if pure:
        # pyzmq's frames, then the copy: at least half the payload more.
        assert grew > payload // 2, f"the pure-Python path grew by only {grew / MIB:.0f} MiB"
    else:
        assert grew < 64 * MIB, f"get_into through the core grew by {grew / MIB:.0f} MiB for {payload / MIB:.0f} MiB"


@pytest.mark.parametrize("pure", [False, True])
def test_get_allocates_the_result_once(endpoint, fresh, monkeypatch, pure):
    """A plain get through the core reads each field into one buffer of its
    size, which the returned array is a view of: the client's peak grows by
    the payload, once (pyzmq's frames and then the joined array: twice)."""
    rows, cols = 1024, 64 * 1024  # 256 MiB, spread over the units: several frames
    idx = fresh(rows)
    x = np.arange(rows, dtype=np.float32)[:, None] * np.ones((1, cols), np.float32)
    with stowage.Client(endpoint, timeout=120) as c:
        c.put(idx, {"x": x, "n": [np.arange(k % 7, dtype=np.int16) for k in range(rows)], "t": ["s"] * rows})
        del x
        if pure:
            monkeypatch.setenv("STOWAGE_PURE_PYTHON", "1")
        _reset_peak()
        base = _peak_rss()
        got = c.get(idx, ["x", "n", "t"])
        grew = _peak_rss() - base
        a = got["x"]
        assert a[5, 7] == 5 and a[-1, -1] == rows - 1 and not a.flags.writeable
        assert [len(r) for r in got["n"][:8]] == [0, 1, 2, 3, 4, 5, 6, 0] and got["t"][0] == "s"
        owner = a
        while getattr(owner, "base", None) is not None and not isinstance(owner, memoryview):
            owner = owner.base
        made_by_core = isinstance(owner, memoryview) and type(owner.obj).__name__ == "Buffer"
        assert made_by_core == (not pure), f"the array's memory belongs to {owner!r}"
        del got, a, owner
        c.clear(idx)
    payload = rows * cols * 4
    if pure:
        assert grew > 1.5 * payload, f"the pure-Python get grew by only {grew / MIB:.0f} MiB"
    else:
        assert grew < payload + 32 * MIB, f"a get through the core grew by {grew / MIB:.0f} MiB for {payload / MIB:.0f} MiB"


def test_overlapping_and_scattered_ranges_land_right(fake_server):
    """A get_ok whose parts share bytes (runs of rows that overlap, a row
    named twice) and skip bytes, across two frames: the core reads each
    frame once, in order, and every row lands where it belongs, through get
    and get_into, as through the Python path."""
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
        for pure in (False, True):
            if pure:
                os.environ["STOWAGE_PURE_PYTHON"] = "1"
            try:
                got = c.get(list(range(9)), ["x"])["x"]
                np.testing.assert_array_equal(got, want)
                out = np.zeros((9, 2), np.float32)
                c.get_into(list(range(9)), {"x": out})
                np.testing.assert_array_equal(out, want)
            finally:
                os.environ.pop("STOWAGE_PURE_PYTHON", None)
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
