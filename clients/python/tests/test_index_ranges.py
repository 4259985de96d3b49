"""A get of evenly spaced indexes goes as one range ({"ranges": [[start,
count, step]]}), not as a list: what it sends, and that the rows that come
back are the same as for the list, over tcp and same node, across units."""

from __future__ import annotations

import numpy as np
import pytest
from stowd_harness import shm_stowd

import stowage
from stowage import _codec


@pytest.fixture(scope="module")
def four_units(tmp_path_factory):
    """4 local units (index g in unit g % 4) with shared memory."""
    yield from shm_stowd(tmp_path_factory, "ranges", "[units]\nlocal = 4\n")


def _wire(g):
    """What frame 0 of a get of `g` carries as its global_indexes."""
    import msgpack

    n, wire = _codec.get_indexes(g, "get")
    gi = msgpack.unpackb(_codec.envelope("get", 1, {"global_indexes": wire, "fields": ["x"]}))["body"]["global_indexes"]
    return n, gi


def test_the_wire_form_of_a_gets_indexes():
    assert _wire(range(100, 300, 2)) == (100, {"ranges": [[100, 100, 2]]})
    a = np.arange(5, 5 + 3 * 1000, 3, dtype=np.int64)
    assert _wire(a) == (1000, {"ranges": [[5, 1000, 3]]})
    assert _wire(a.tolist()) == (1000, {"ranges": [[5, 1000, 3]]})  # a list too
    u = np.arange(2**64 - 20, 2**64 - 1, dtype=np.uint64)
    assert _wire(u) == (19, {"ranges": [[2**64 - 20, 19, 1]]})
    # Runs that are longer as ranges than as a list (short ones, decreasing,
    # repeated, no pattern) go as the list.
    for g in (range(4), [7, 9], np.arange(100)[::-1], np.zeros(50, np.int64), range(100, 0, -1),
              np.arange(100, dtype=np.uint64)[::-1], [int(x) for x in np.random.default_rng(3).permutation(64)]):
        n, gi = _wire(g)
        assert gi == [int(x) for x in g] and n == len(gi), g
    # Runs broken by one index: several ranges, the same indexes.
    n, gi = _wire(np.r_[np.arange(50), 7, np.arange(51, 100)])
    assert [s + k * step for s, c, step in gi["ranges"] for k in range(c)] == [*range(50), 7, *range(51, 100)]
    # A range whose last index would pass 2**64 - 1 is refused like the list.
    with pytest.raises(ValueError, match="out of range"):
        _codec.get_indexes(range(2**64 - 5, 2**64 + 20), "get")
    with pytest.raises(ValueError, match="out of range"):
        _codec.get_indexes(np.arange(-3, 30), "get")
    with pytest.raises(ValueError, match="empty batch"):
        _codec.get_indexes(np.arange(0), "get")


@pytest.mark.parametrize("same_node", [False, True])
def test_gets_by_range_and_by_list_bring_back_the_same_rows(four_units, fresh, same_node):
    server = four_units
    kw = {"same_node": True} if same_node else {}
    idx = fresh(4000)
    x = np.stack([np.asarray(idx, np.float64), np.arange(4000, dtype=np.float64)], axis=1)
    nested = [np.full(i % 5, i, np.int32) for i in range(4000)]
    with stowage.Client(server["native"], **kw) as c:
        # Put in two halves, the second reversed: runs cross puts and units.
        c.put(idx[:2000], {"x": x[:2000], "n": nested[:2000]})
        c.put(idx[2000:][::-1], {"x": x[2000:][::-1], "n": nested[2000:][::-1]})
        base = idx[0]
        for sel in (range(0, 4000), range(3, 3990, 7), range(1000, 3000, 2), range(3999, 3999 + 1)):
            rows = [base + i for i in sel]
            want_x = x[list(sel)]
            for asked in (range(base + sel.start, base + sel.stop, sel.step),
                          np.asarray(rows, np.int64), np.asarray(rows, np.uint64), rows):
                got = c.get(asked, ["x", "n"], as_torch=False)
                np.testing.assert_array_equal(got["x"], want_x)
                assert len(got["n"]) == len(rows)
                for i, r in zip(sel, got["n"]):
                    np.testing.assert_array_equal(r, nested[i])
        out = np.empty((4000, 2), np.float64)
        c.get_into(range(base, base + 4000), {"x": out})
        np.testing.assert_array_equal(out, x)
        # A range that runs into a row nobody put fails as the list does.
        with pytest.raises(stowage.KeyNotFound):
            c.get(range(base, base + 4001), ["x"])
        c.clear(idx)


def _old_stowd(ident, frames):
    """A stowd from before ranges: a get by ranges is refused in its words."""
    import msgpack

    env = msgpack.unpackb(frames[0])
    gi = env["body"]["global_indexes"]
    if isinstance(gi, dict):
        body, op = {"code": "bad_request", "message": "global_indexes must be an array"}, "error"
    else:
        body, op = {"fields": {"v": {"kind": "values", "values": [str(g) for g in gi]}}}, "get_ok"
    return [[msgpack.packb({"proto": "stowage/1", "op": op, "id": env["id"], "body": body})]]


def test_the_async_client_falls_back_to_lists_too(fake_server):
    import asyncio

    import msgpack

    srv = fake_server(_old_stowd)

    async def main():
        async with stowage.AsyncClient(srv.endpoint, timeout=5) as c:
            a = await c.get(range(0, 40, 2), ["v"])
            b = await c.get(range(0, 40, 2), ["v"])
            return a, b

    a, b = asyncio.run(asyncio.wait_for(main(), 30))
    assert a["v"] == b["v"] == [str(g) for g in range(0, 40, 2)]
    sent = [msgpack.unpackb(f[0])["body"]["global_indexes"] for _, f in srv.requests]
    assert sent == [{"ranges": [[0, 20, 2]]}, list(range(0, 40, 2)), list(range(0, 40, 2))]


def test_a_stowd_without_ranges_gets_lists_after_one_refusal(fake_server):
    """A stowd from before ranges refuses them with bad_request ("global_indexes
    must be an array", its words): the client sends the get again as a list,
    and every later get as a list, with the same result."""
    import msgpack

    srv = fake_server(_old_stowd)
    with stowage.Client(srv.endpoint, timeout=5) as c:
        assert c.get(range(100, 120), ["v"])["v"] == [str(g) for g in range(100, 120)]
        assert c.get(np.arange(7, 70, 3), ["v"])["v"] == [str(g) for g in range(7, 70, 3)]
    sent = [msgpack.unpackb(f[0])["body"]["global_indexes"] for _, f in srv.requests]
    assert sent == [{"ranges": [[100, 20, 1]]}, list(range(100, 120)), list(range(7, 70, 3))]
    # Any other bad_request is the caller's to see, and not sent again.
    srv2 = fake_server(lambda ident, frames: [[msgpack.packb({
        "proto": "stowage/1", "op": "error", "id": msgpack.unpackb(frames[0])["id"],
        "body": {"code": "bad_request", "message": "field 'v' is named twice"}})]])
    with stowage.Client(srv2.endpoint, timeout=5) as c:
        with pytest.raises(stowage.BadRequest, match="named twice"):
            c.get(range(100, 120), ["v"])
    assert len(srv2.requests) == 1


@pytest.mark.parametrize("what,unique", [("put", True), ("get", False)])
def test_long_index_lists_are_checked_as_short_ones_are(what, unique):
    """Index inputs are read by the Rust core first; whatever it does not
    read gets the same errors as a short list."""
    good = list(range(10, 210))
    assert _codec.check_indexes(good, what, unique=unique) == good
    assert _codec.check_indexes(np.asarray(good, np.uint64), what, unique=unique) == good
    assert _codec.check_indexes(range(10, 210), what, unique=unique) == good
    shuffled = good[::-1]
    assert _codec.check_indexes(shuffled, what, unique=unique) == shuffled
    bad = [
        (good[:50] + [-1] + good[50:], ValueError, "global index -1 is out of range"),
        (good[:50] + [2**64] + good[50:], ValueError, "out of range"),
        (good[:50] + [1.5] + good[50:], TypeError, "global indexes must be ints"),
        (good[:50] + ["7"] + good[50:], TypeError, "global indexes must be ints"),
        (np.r_[np.arange(100), -3], ValueError, "global index -3 is out of range"),
    ]
    if unique:
        bad.append((good + [good[7]], ValueError, f"duplicate global index {good[7]}"))
    for g, err, words in bad:
        with pytest.raises(err, match=words):
            _codec.check_indexes(g, what, unique=unique)
    # An int that is not exactly `int` takes the general path, and is read as its value.
    assert _codec.check_indexes([np.int16(1)] + list(range(2, 100)), what, unique=unique)[0] == 1
    # A bool is refused there, though Python counts it an int: a list of them is a mask.
    with pytest.raises(TypeError, match="got True \\(a bool"):
        _codec.check_indexes([True] + list(range(2, 100)), what, unique=unique)
