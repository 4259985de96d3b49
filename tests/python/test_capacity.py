"""Capacity: a stowd whose units hold at most 4096 bytes each
(`[units] capacity_bytes = 4096`). A PUT over capacity is refused and stores
nothing; smaller puts still work. Every test clears what it stored."""

from __future__ import annotations

import numpy as np
import pytest

import native_codec as nc
from native_codec import NativeClient
from stowd_harness import fresh_indexes
from tq_codec import TQClient

CAPACITY = 4096


def put_error_prefix(sender: str) -> str:
    return f"Failed to put data into storage unit id #{sender}, detail error message: "


@pytest.mark.parametrize("unit", [0, 1])
def test_unit_put_over_capacity_stores_nothing(stowd_small, unit):
    ep, uid = stowd_small["units"][unit]["endpoint"], stowd_small["units"][unit]["id"]
    idx = fresh_indexes(4)
    with TQClient(ep) as c:
        try:
            m = c.metrics().expect("METRICS_RESPONSE").body
            assert isinstance(m["capacity"], int), m
            assert m["active_keys"] == 0, f"unit not empty at start: {m}"

            big = np.ones((2, 1024), np.float32)  # 8 KiB > 4 KiB
            c.put(idx[:2], {"x": big, "t": ["a", "b"]}).expect("PUT_ERROR", put_error_prefix(uid))
            for g in idx[:2]:
                for f in ("x", "t"):
                    c.get([g], [f]).expect("GET_ERROR", "[TQKeyNotFound] ")
            assert c.metrics().body["active_keys"] == 0

            small = np.arange(32, dtype=np.float32).reshape(2, 16)  # 128 B
            c.put(idx[:2], {"x": small}).expect("PUT_DATA_RESPONSE")
            got = c.get(idx[:2], ["x"]).values()["x"]
            assert np.array_equal(np.stack(got), small)
            c.clear(idx[:2]).expect("CLEAR_DATA_RESPONSE")

            # Exactly full is allowed; one more byte is not; overwriting frees the old value.
            c.put(idx[2:3], {"y": np.zeros((1, CAPACITY), np.uint8)}).expect("PUT_DATA_RESPONSE")
            c.put(idx[3:4], {"y": np.zeros((1, 1), np.uint8)}).expect("PUT_ERROR", put_error_prefix(uid))
            c.get(idx[3:4], ["y"]).expect("GET_ERROR", "[TQKeyNotFound] ")
            c.put(idx[2:3], {"y": np.full((1, CAPACITY), 7, np.uint8)}).expect("PUT_DATA_RESPONSE")
            assert c.get(idx[2:3], ["y"]).values()["y"][0].tolist() == [7] * CAPACITY
            c.clear(idx[2:3]).expect("CLEAR_DATA_RESPONSE")
            # Clearing gave the space back.
            c.put(idx[3:4], {"y": np.zeros((1, CAPACITY), np.uint8)}).expect("PUT_DATA_RESPONSE")
        finally:
            c.clear(idx)
    assert stowd_small.alive()


def test_router_put_over_capacity_stores_nothing(stowd_small):
    """A router PUT whose rows go to two units, one of which is over capacity:
    the PUT fails and nothing is stored, on either unit."""
    ep, rid = stowd_small["router"]["endpoint"], stowd_small["router"]["id"]
    idx = fresh_indexes(2)  # idx[0] -> unit 0, idx[1] -> unit 1
    rows = [np.arange(16, dtype=np.uint8), np.zeros(CAPACITY + 904, np.uint8)]
    with TQClient(ep) as c:
        try:
            c.put(idx, {"n": rows}).expect("PUT_ERROR", put_error_prefix(rid))
            c.get(idx[1:], ["n"]).expect("GET_ERROR", "[TQKeyNotFound] ")
            c.get(idx[:1], ["n"]).expect("GET_ERROR", "[TQKeyNotFound] ")  # the row that fitted on unit 0
        finally:
            c.clear(idx)


def test_native_put_over_capacity(stowd_small):
    idx = fresh_indexes(2)
    with NativeClient(stowd_small["native"]) as c:
        try:
            i = c.next_id()
            r = c.request(nc.put_frames(i, idx[:1], {"x": np.zeros((1, CAPACITY + 1), np.uint8)}))
            r.expect_error("capacity", i)
            c.get(idx[:1], ["x"]).expect_error("key_not_found")

            c.put(idx, {"x": np.zeros((2, 100), np.uint8)})
            assert np.array_equal(c.get(idx, ["x"]).fields()["x"], np.zeros((2, 100), np.uint8))
        finally:
            c.clear(idx)


def test_native_put_is_all_or_nothing_across_units(stowd_small):
    """protocol-stowage1.md: "A put is all-or-nothing: if any check fails
    (including capacity) nothing is stored." Row 0 fits on unit 0, row 1 does
    not fit on unit 1."""
    idx = fresh_indexes(2)
    rows = [np.arange(16, dtype=np.uint8), np.zeros(CAPACITY + 904, np.uint8)]
    with NativeClient(stowd_small["native"]) as c:
        try:
            i = c.next_id()
            c.request(nc.put_frames(i, idx, {"n": rows})).expect_error("capacity", i)
            c.get(idx[1:], ["n"]).expect_error("key_not_found")
            c.get(idx[:1], ["n"]).expect_error("key_not_found")
        finally:
            c.clear(idx)


def test_native_stats_report_capacity(stowd_small):
    """protocol-stowage1.md, stats: stowd reports at least units, keys, rows,
    bytes and, if bounded, capacity (bytes)."""
    with NativeClient(stowd_small["native"]) as c:
        stats = c.stats()
    for key in ("units", "keys", "rows", "bytes", "capacity"):
        assert key in stats, f"stats lacks {key!r}: {stats}"
    assert isinstance(stats["capacity"], int) and stats["capacity"] >= CAPACITY, stats
