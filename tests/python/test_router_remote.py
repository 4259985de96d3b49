"""Router mode across processes: stowd B's router endpoint routes to the two
units of stowd A over tcp (`[router] units = [A0, A1]`), global index g to
unit g % 2."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

import native_codec as nc
from native_codec import NativeClient, Values
from stowd_harness import run_stowd
from tq_codec import TQClient, assert_cells_equal, expected_rows


@pytest.fixture(scope="module")
def stowd_a(stowd_bin, tmp_path_factory):
    # Unbounded units (not the default memory bound): the capacity test below.
    with run_stowd(tmp_path_factory.mktemp("stowd-a"), config="[units]\nmemory_percent = 0\n", name="stowd-a") as a:
        yield a


@pytest.fixture(scope="module")
def stowd_b(stowd_a, tmp_path_factory):
    units = ", ".join(f'"{u}"' for u in stowd_a.unit_endpoints)
    config = f"[units]\nlocal = 1\n\n[router]\nunits = [{units}]\ntimeout_secs = 10\n"
    with run_stowd(tmp_path_factory.mktemp("stowd-b"), config=config, name="stowd-b") as b:
        yield b


def batch10() -> dict:
    return {
        "reg": np.arange(40, dtype=np.float32).reshape(10, 4) * 0.5,
        "jag": [np.arange(i % 4, dtype=np.int64) + 100 * i for i in range(10)],  # rows 0, 4, 8 are empty
        "txt": [f"s{i}-ü{'🙂' * (i % 3)}" for i in range(10)],
    }


def check(reply, batch, put_idx, get_idx, sender, where=""):
    reply.check_envelope(sender)
    got = reply.values()
    assert list(got) == list(batch), where
    for name, value in batch.items():
        rows = expected_rows(value)
        assert len(got[name]) == len(get_idx), f"{where} {name}"
        for g, cell in zip(get_idx, got[name]):
            assert_cells_equal(cell, rows[put_idx.index(g)], f"{where} {name}@{g}")


def test_put_get_clear_through_remote_router(stowd_a, stowd_b):
    idx = list(range(10))
    batch = batch10()
    a0, a1 = stowd_a["units"]
    b_router = stowd_b["router"]
    with TQClient(b_router["endpoint"]) as b, TQClient(a0["endpoint"]) as u0, TQClient(a1["endpoint"]) as u1:
        b.put(idx, batch).expect("PUT_DATA_RESPONSE").check_envelope(b_router["id"])

        # Everything back through B, in request order.
        order = [7, 2, 9, 0, 5, 4, 1, 8, 3, 6]
        check(b.get(order, list(batch)), batch, idx, order, b_router["id"], "B")

        # A's unit 0 holds exactly the even indexes, unit 1 exactly the odd ones.
        for unit, client, mine in ((a0, u0, idx[0::2]), (a1, u1, idx[1::2])):
            check(client.get(mine, list(batch)), batch, idx, mine, unit["id"], unit["id"])
            for g in idx:
                if g not in mine:
                    for f in batch:
                        client.get([g], [f]).expect("GET_ERROR", "[TQKeyNotFound] ")
            m = client.metrics().body
            assert m["active_keys"] == 5, f"active_keys counts samples (global indexes): {m}"

        # B's own local unit is not a routing target: it holds nothing.
        with TQClient(stowd_b["units"][0]["endpoint"]) as bu:
            bu.get([0], ["reg"]).expect("GET_ERROR", "[TQKeyNotFound] ")

        # A missing key through B is a [TQKeyNotFound] GET_ERROR from B.
        r = b.get([0, 11], ["reg"]).expect("GET_ERROR", "[TQKeyNotFound] ")
        r.check_envelope(b_router["id"])

        # CLEAR through B removes the rows from A.
        b.clear(idx).expect("CLEAR_DATA_RESPONSE").check_envelope(b_router["id"])
        for g in idx:
            client = u0 if g % 2 == 0 else u1
            for f in batch:
                client.get([g], [f]).expect("GET_ERROR", "[TQKeyNotFound] ")
        b.get([3], ["txt"]).expect("GET_ERROR", "[TQKeyNotFound] ")
        assert u0.metrics().body["active_keys"] == 0
        assert u1.metrics().body["active_keys"] == 0
    assert stowd_a.alive() and stowd_b.alive()


def test_native_put_through_remote_router(stowd_a, stowd_b):
    """B's native endpoint uses the same routing: rows land on A's units."""
    idx = list(range(20, 26))
    x = np.arange(18, dtype=np.float64).reshape(6, 3)
    nested = [np.full((i % 3,), i, np.int32) for i in range(6)]
    words = ["α", "β", "", "δ", b"\x00\x01", None]
    with NativeClient(stowd_b["native"]) as b:
        b.put(idx, {"x": x, "n": nested, "w": Values(words)})
        got = b.get(idx[::-1], ["x", "n", "w"]).fields()
        assert np.array_equal(got["x"], x[::-1])
        assert [r.tolist() for r in got["n"]] == [r.tolist() for r in nested[::-1]]
        assert got["w"] == words[::-1]

        with TQClient(stowd_a["units"][0]["endpoint"]) as u0, TQClient(stowd_a["units"][1]["endpoint"]) as u1:
            v0 = u0.get(idx[0::2], ["x", "w"]).values()
            assert np.array_equal(np.stack(v0["x"]), x[0::2])
            assert v0["w"] == words[0::2]
            v1 = u1.get(idx[1::2], ["n"]).values()
            assert [r.tolist() for r in v1["n"]] == [r.tolist() for r in nested[1::2]]
            u0.get(idx[1:2], ["x"]).expect("GET_ERROR", "[TQKeyNotFound] ")

        b.clear(idx)
        b.get(idx[:1], ["x"]).expect_error("key_not_found")


@pytest.fixture(scope="module")
def stowd_deadpeer(stowd_a, tmp_path_factory):
    """A stowd routing to A's unit 0 and to an endpoint where nothing listens
    (router timeout 2 s)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    config = f'[units]\nlocal = 1\n\n[router]\nunits = ["{stowd_a.unit_endpoints[0]}", "{dead}"]\ntimeout_secs = 2\n'
    with run_stowd(tmp_path_factory.mktemp("stowd-deadpeer"), config=config, name="stowd-deadpeer") as c:
        yield c


def test_router_to_a_dead_unit_fails_in_time(stowd_deadpeer):
    """A remote unit that does not answer: the router replies with an error
    within its timeout, keeps serving, and the live unit still works."""
    c = stowd_deadpeer
    rid = c["router"]["id"]
    with TQClient(c["router"]["endpoint"], timeout=15) as b:
        t0 = time.monotonic()
        r = b.put([501], {"x": np.ones((1, 2), np.float32)})
        elapsed = time.monotonic() - t0
        r.expect("PUT_ERROR", f"Failed to put data into storage unit id #{rid}, detail error message: ")
        assert elapsed < 10, f"PUT_ERROR after {elapsed:.1f} s"
        # Only even indexes: served by the live unit.
        b.put([600, 602], {"x": np.ones((2, 2), np.float32)}).expect("PUT_DATA_RESPONSE")
        assert len(b.get([602, 600], ["x"]).values()["x"]) == 2
        r = b.get([601], ["x"])
        r.expect("GET_ERROR")
        assert not r.message.startswith("[TQKeyNotFound]"), "a dead unit is not a missing key"
        b.clear([600, 602]).expect("CLEAR_DATA_RESPONSE")
    assert c.alive()


def test_put_with_a_dead_unit_stores_nothing(stowd_deadpeer):
    """protocol-stowage1.md: a put is all-or-nothing. Index 700 goes to the
    live unit, 701 to the dead one: the put fails, so 700 must not be stored."""
    with NativeClient(stowd_deadpeer["native"], timeout=15) as b:
        i = b.next_id()
        r = b.request(nc.put_frames(i, [700, 701], {"x": np.ones((2, 2), np.float32)}))
        r.expect("error", i)
        b.get([700], ["x"]).expect_error("key_not_found")


def test_large_batch_through_remote_router(stowd_a, stowd_b):
    n = 3000
    idx = list(range(100_000, 100_000 + n))
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    j = [np.arange(i % 3, dtype=np.int64) for i in range(n)]
    with TQClient(stowd_b["router"]["endpoint"], timeout=30) as b:
        b.put(idx, {"x": x, "j": j}).expect("PUT_DATA_RESPONSE")
        got = b.get(idx[::-1], ["x", "j"]).values()
        assert np.array_equal(np.stack(got["x"]), x[::-1])
        assert all(np.array_equal(p, q) for p, q in zip(got["j"], j[::-1]))
        b.clear(idx).expect("CLEAR_DATA_RESPONSE")
    with TQClient(stowd_a["units"][1]["endpoint"]) as u1:
        u1.get(idx[1:2], ["x"]).expect("GET_ERROR", "[TQKeyNotFound] ")


def test_router_metrics_capacity_of_unbounded_remote_units(stowd_a, stowd_b):
    """A's units are unbounded (their metrics say capacity nil): B's router,
    whose units are all remote, must not report a capacity of 0."""
    with TQClient(stowd_a["units"][0]["endpoint"]) as u0:
        assert u0.metrics().body["capacity"] is None
    with TQClient(stowd_b["router"]["endpoint"]) as b:
        m = b.metrics().expect("METRICS_RESPONSE").body
    assert m["capacity"] is None, f"router metrics report capacity {m['capacity']!r} for unbounded units"


def test_native_clear_count_through_remote_router(stowd_a, stowd_b):
    """protocol-stowage1.md: clear_ok.cleared counts (index, field) values on
    local units; a remote TransferQueue unit does not report what it
    dropped, so each index sent to it counts as one."""
    idx = list(range(40, 44))
    with NativeClient(stowd_b["native"]) as b:
        b.put(idx, {"x": np.zeros((4, 2), np.float32), "w": Values(list("abcd"))})
        cleared = b.clear(idx).body["cleared"]
        b.get(idx[:1], ["x"]).expect_error("key_not_found")
    assert cleared == 4, f"cleared {cleared} for 4 indexes on remote units"
