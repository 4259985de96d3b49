"""Big batches: a put split across messages, get_into without an intermediate copy."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import stowage
from core_spy import CoreSpy
from stowage import _core

MiB = 1 << 20


def counting(client):
    """Puts a spy in front of the client's core connection (every put goes
    through it, one message or many) to record (op, data bytes, rows) of
    every put message sent."""
    sent = []
    client._core = CoreSpy(_core.Connection(client.endpoint, client.spin_us, client._token),
                           lambda op, nbytes, rows: sent.append((op, nbytes, rows)))
    return sent


def test_huge_put_is_split_across_messages(endpoint, fresh):
    """300 MiB with max_message_bytes = 64 MiB: several put requests, each
    within the limit, all fields together by rows; everything reads back."""
    n = 75_000
    idx = fresh(n)
    rng = np.random.default_rng(7)
    x = rng.integers(0, 2**31, size=(n, 1024), dtype=np.int32)  # 4 KiB rows: 292.97 MiB
    lens = rng.integers(0, 40, size=n)
    data = {
        "x": x,
        "n": [np.full(k, i % 251, np.uint8) for i, k in enumerate(lens)],
        "t": [f"row-{i}-é" for i in range(n)],
    }
    total = x.nbytes + int(lens.sum())
    assert total > 290 * MiB
    with stowage.Client(endpoint, timeout=60, max_message_bytes=64 * MiB) as c:
        sent = counting(c)
        try:
            assert c.put(idx, data) == n
            puts = [s for s in sent if s[0] == "put"]
            assert len(puts) >= 5, puts
            assert all(nbytes <= 64 * MiB for _, nbytes, _ in puts), puts
            assert sum(rows for _, _, rows in puts) == n
            assert sum(nbytes for _, nbytes, _ in puts) >= total

            got = c.get(idx, ["x", "t"])
            assert np.array_equal(got["x"], x) and got["t"] == data["t"]
            sample = list(range(0, n, 997)) + [n - 1]
            nested = c.get([idx[i] for i in sample], ["n"])["n"]
            assert all(np.array_equal(g, data["n"][i]) for g, i in zip(nested, sample))
        finally:
            assert c.clear(idx) == 3 * n


def test_small_put_is_one_message(endpoint, fresh):
    idx = fresh(10)
    with stowage.Client(endpoint, timeout=10, max_message_bytes=64 * MiB) as c:
        sent = counting(c)
        c.put(idx, {"x": np.ones((10, 1000), np.float32)})
        assert [s[0] for s in sent] == ["put"]
        c.clear(idx)


def test_single_row_larger_than_the_limit_goes_alone(endpoint, fresh):
    idx = fresh(3)
    rows = [np.full(10, 1, np.uint8), np.full(300_000, 2, np.uint8), np.full(5, 3, np.uint8)]
    with stowage.Client(endpoint, timeout=10, max_message_bytes=100_000) as c:
        sent = counting(c)
        c.put(idx, {"n": rows})
        assert [s[2] for s in sent] == [1, 1, 1]
        got = c.get(idx, ["n"])["n"]
        assert [g.tolist() for g in got] == [r.tolist() for r in rows]
        c.clear(idx)


@pytest.mark.parametrize("row_bytes", [4096, 256 * 1024], ids=["4KiB-rows-coalesced", "256KiB-rows-frame-each"])
def test_get_into_copies_once_without_intermediate(endpoint, fresh, row_bytes):
    """get_into of 64 MiB: correct, in any order, and no allocation near the
    batch size (tracemalloc sees numpy's allocations)."""
    n = (64 * MiB) // row_bytes
    idx = fresh(n)
    x = np.random.default_rng(1).standard_normal((n, row_bytes // 4)).astype(np.float32)
    order = np.random.default_rng(2).permutation(n)
    with stowage.Client(endpoint, timeout=60) as c:
        c.put(idx, {"x": x})
        out = np.empty_like(x)
        tracemalloc.start()
        try:
            ret = c.get_into([idx[i] for i in order], {"x": out})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert ret["x"] is out
        assert np.array_equal(out, x[order])
        assert peak < x.nbytes // 10, f"get_into allocated {peak} bytes for a {x.nbytes}-byte batch"
        # A non-contiguous (strided) destination is filled in place as well.
        wide = np.zeros((n, 2, row_bytes // 4), np.float32)
        c.get_into(idx[:8], {"x": wide[:8, 1]})
        assert np.array_equal(wide[:8, 1], x[:8]) and not wide[:8, 0].any()
        c.clear(idx)
