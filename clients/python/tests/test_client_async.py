"""The asyncio client against the real stowd, and its timeout handling."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest

import stowage
from test_client_big import counting


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_async_round_trip(endpoint, fresh):
    idx = fresh(4)
    x = np.arange(4 * 5, dtype=np.float32).reshape(4, 5)
    nested = [np.arange(k, dtype=np.int64) for k in range(4)]
    tags = ["α", "β", b"\x00", ""]

    async def main():
        async with stowage.AsyncClient(endpoint, timeout=10) as c:
            assert await c.put(idx, {"x": x, "n": nested, "t": tags}) == 4
            got = await c.get(idx[::-1], ["x", "n", "t"])
            assert np.array_equal(got["x"], x[::-1]) and not got["x"].flags.writeable
            assert [g.tolist() for g in got["n"]] == [r.tolist() for r in nested[::-1]]
            assert got["t"] == tags[::-1]
            out = {"x": np.zeros_like(x)}
            assert (await c.get_into(idx, out)) is out and np.array_equal(out["x"], x)
            stats = await c.stats()
            assert stats["units"] == 2 and stats["keys"] >= 12
            with pytest.raises(stowage.KeyNotFound):
                await c.get(idx, ["missing"])
            with pytest.raises(ValueError, match="empty batch"):
                await c.put([], {"x": x[:0]})
            assert await c.clear(idx, ["t"]) == 4
            assert await c.clear(idx) == 8
        assert c.closed

    run(main())


def test_async_pipelined_requests(endpoint, fresh):
    """Many concurrent requests on one socket: each gets its own reply."""
    idx = fresh(64)
    x = np.arange(64 * 3, dtype=np.int32).reshape(64, 3)

    async def main():
        async with stowage.AsyncClient(endpoint, timeout=10) as c:
            await asyncio.gather(*(c.put(idx[i:i + 8], {"x": x[i:i + 8]}) for i in range(0, 64, 8)))
            gets = await asyncio.gather(*(c.get([idx[i]], ["x"]) for i in range(64)))
            for i, g in enumerate(gets):
                assert g["x"].tolist() == [x[i].tolist()], i
            assert sum(await asyncio.gather(*(c.clear([g]) for g in idx))) == 64

    run(main())


def test_async_big_put_is_split(endpoint, fresh):
    idx = fresh(256)
    x = np.random.default_rng(0).standard_normal((256, 4096)).astype(np.float32)  # 4 MiB

    async def main():
        async with stowage.AsyncClient(endpoint, timeout=30, max_message_bytes=1 << 20) as c:
            # A put of at least CORE_MIN_BYTES runs on a lane (a sync client in a
            # worker thread): this one, the only idle one, counted.
            assert x.nbytes >= c.CORE_MIN_BYTES
            lane = c._new_lane()
            sent = counting(lane)
            c._core_idle.append(lane)
            await c.put(idx, {"x": x})
            assert [op for op, _, _ in sent].count("put") >= 4
            assert np.array_equal((await c.get(idx, ["x"]))["x"], x)
            await c.clear(idx)

    run(main())


def test_async_timeouts_reset_only_their_own_connections(silent_endpoint):
    """Concurrent calls to a server that never answers each time out in
    time, on connections of their own; the next call connects anew."""
    ep, router = silent_endpoint

    async def main():
        async with stowage.AsyncClient(ep, timeout=0.3) as c:
            t0 = time.monotonic()
            results = await asyncio.gather(c.stats(), c.get([1], ["x"]), c.clear([1]), return_exceptions=True)
            assert time.monotonic() - t0 < 2.0
            assert all(isinstance(r, stowage.StowageTimeout) for r in results), results
            assert c._loop_idle == [] and c._loop_busy == 0  # each timed-out connection was dropped
            with pytest.raises(stowage.StowageTimeout, match="within 0.1 s"):
                await c.stats(timeout=0.1)

    run(main())
    assert router.poll(100, 1)


def test_async_late_reply_after_timeout(fake_server):
    """Request 1 times out; its late reply never reaches the new socket, and
    stray replies with foreign ids are ignored."""
    held = []

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        if env["id"] == 1:
            held.append(frames)
            return []
        reply = [msgpack.packb({"proto": "stowage/1", "op": "stats_ok", "id": env["id"], "body": {"n": env["id"]}})]
        stray = [msgpack.packb({"proto": "stowage/1", "op": "stats_ok", "id": env["id"] + 500, "body": {}})]
        late = [msgpack.packb({"proto": "stowage/1", "op": "stats_ok", "id": 1, "body": {"n": 1}})]
        return [late, stray, reply]

    srv = fake_server(handler)

    async def main():
        async with stowage.AsyncClient(srv.endpoint, timeout=0.3) as c:
            with pytest.raises(stowage.StowageTimeout):
                await c.stats()
            assert await c.stats(timeout=5) == {"n": 2}
            assert await c.stats(timeout=5) == {"n": 3}

    run(main())


def test_async_closed_client(endpoint):
    async def main():
        c = stowage.AsyncClient(endpoint, timeout=5)
        assert (await c.stats())["units"] == 2
        await c.aclose()
        with pytest.raises(stowage.StowageError, match="closed"):
            await c.stats()

    run(main())
