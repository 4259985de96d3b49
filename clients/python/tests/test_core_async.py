"""`AsyncClient` through the Rust core: small calls on the event loop's
own core connections, the rest on lanes (sync clients in worker threads),
each call on a connection of its own. Checked here: every dtype and kind
round-trips, concurrent tasks overlap and each gets its own rows, the event loop keeps running during a 256 MiB transfer, a
cancelled call leaves the client usable (and its connection unused until
it returned), a timeout raises StowageTimeout in the sync client's words
and the next call is served, and aclose waits for a running call."""

from __future__ import annotations

import asyncio
import re
import time

import msgpack
import numpy as np
import pytest

import stowage
from stowage import client as client_mod
from test_core import _same, every_kind

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _lanes_on(monkeypatch):
    """Puts take the lanes whatever their size (the tests below use small
    payloads; the size rule has its own test)."""
    monkeypatch.setattr(stowage.AsyncClient, "CORE_MIN_BYTES", 0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def routes(c) -> list:
    """Records ("loop" or "lane", op) of every call `c` makes: on the
    event loop's own connections, or on a lane in a worker thread."""
    sent = []

    def on_lane(op, *rest, inner=c._on_lane):
        sent.append(("lane", op))
        return inner(op, *rest)

    async def in_loop(op, *rest, inner=c._in_loop):
        got = await inner(op, *rest)
        if got is not None:  # (None: the call went another way)
            sent.append(("loop", op))
        return got

    c._on_lane, c._in_loop = on_lane, in_loop
    return sent


def counted_lane(c) -> list:
    """Puts one lane in `c`'s pool whose put messages are counted: each
    `_core_put` call appends how many messages it sent."""
    lane = c._new_lane()
    messages = []

    def core_put(put, timeout, segments=None, inner=lane._core_put):
        messages.append(put.messages)
        return inner(put, timeout, segments)

    lane._core_put = core_put
    c._core_idle.append(lane)
    return messages


async def until(cond, what: str, within: float = 30.0) -> None:
    """Waits (yielding to the loop) until `cond()`."""
    end = time.monotonic() + within
    while not cond():
        assert time.monotonic() < end, f"no {what} within {within} s"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("max_message_bytes", [256 * MIB, 3000], ids=["one-message", "split"])
def test_every_kind_round_trips_through_the_core(endpoint, fresh, max_message_bytes):
    """Every dtype, nested and values, put in one message or many, read
    back by get and (the regular fields) get_into: all through the core,
    on the loop's connections and the lanes."""
    n = 40
    idx = fresh(n)
    data = every_kind(n)
    order = idx[::-1] + idx[:2]
    rows = [idx.index(g) for g in order]
    want = {name: [v[r] for r in rows] if isinstance(v, list) else v[rows] for name, v in data.items()}
    regular = [name for name, v in data.items() if isinstance(v, np.ndarray)]

    async def main():
        async with stowage.AsyncClient(endpoint, timeout=30, max_message_bytes=max_message_bytes) as c:
            sent = routes(c)
            messages = counted_lane(c)
            assert await c.put(idx, data) == n
            got = await c.get(order, list(data))
            out = {name: np.empty((len(order), *data[name].shape[1:]), data[name].dtype) for name in regular}
            assert await c.get_into(order, out) is out
            return sent, got, out, messages

    sent, got, out, messages = run(main())
    # A split put's messages go in one core call, two on the wire.
    assert sent == [("lane", "put"), ("loop", "get"), ("loop", "get_into")], sent
    assert len(messages) == 1 and (messages[0] > 1) == (max_message_bytes == 3000), messages
    bad = [name for name in data if not _same(got[name], want[name])]
    bad += [f"get_into {name}" for name in regular if not _same(out[name], want[name])]
    assert not bad, f"fields that did not round-trip: {bad}"


def test_concurrent_tasks_overlap_and_each_gets_its_own_rows(endpoint, fresh):
    """8 puts, then 8 gets and 8 get_intos of those rows beside 8 puts of
    others, all at once: each task's rows are its own, and the calls ran on
    several core connections (at most CORE_CONNECTIONS)."""
    k, rows, cols = 8, 16, 64 * 1024  # 4 MiB a task
    a = [fresh(rows) for _ in range(k)]
    b = [fresh(rows) for _ in range(k)]
    xs = [np.full((rows, cols), i, np.float32) + np.arange(rows, dtype=np.float32)[:, None] for i in range(k)]
    outs = [np.zeros((rows, cols), np.float32) for _ in range(k)]

    async def main():
        async with stowage.AsyncClient(endpoint, timeout=60) as c:
            sent = routes(c)
            assert await asyncio.gather(*(c.put(a[i], {"x": xs[i]}) for i in range(k))) == [rows] * k
            got = await asyncio.gather(
                *(c.get(a[i][::-1], ["x"]) for i in range(k)),
                *(c.get_into(a[i], {"x": outs[i]}) for i in range(k)),
                *(c.put(b[i], {"x": -xs[i]}) for i in range(k)))
            again = await asyncio.gather(*(c.get(b[i], ["x"]) for i in range(k)))
            for i in range(k):
                np.testing.assert_array_equal(got[i]["x"], xs[i][::-1])
                np.testing.assert_array_equal(outs[i], xs[i])
                np.testing.assert_array_equal(again[i]["x"], -xs[i])
            # Gets on the loop (the rest on lanes once its connections are busy).
            assert {op for way, op in sent if way == "loop"} == {"get"}, sent
            lanes = len(c._core_idle)
            assert 1 < lanes <= c.CORE_CONNECTIONS, f"{lanes} lanes"
            await c.clear([g for block in a + b for g in block])

    run(main())


async def ticking(coro) -> tuple:
    """Awaits `coro` while a ticker task sleeps 5 ms at a time: (its
    result, seconds it took, the longest the ticker waited for the loop,
    ticks)."""
    gaps = []

    async def ticker():
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    t = asyncio.get_running_loop().create_task(ticker())
    t0 = time.monotonic()
    try:
        result = await coro
    finally:
        took = time.monotonic() - t0
        t.cancel()
    return result, took, max(gaps, default=took), len(gaps)


def test_the_event_loop_runs_during_a_large_transfer(endpoint, fresh):
    """A 256 MiB put, get_into and get: the ticker keeps ticking while each
    runs (its longest wait a small part of the call's time), since the bytes
    move in a worker thread with the GIL released (the get_into's and the
    get's requests written on the loop, their replies read in a worker)."""
    rows, cols = 1024, 64 * 1024  # 256 MiB of float32
    idx = fresh(rows)
    x = np.arange(rows, dtype=np.float32)[:, None] * np.ones((1, cols), np.float32)
    out = np.zeros_like(x)

    async def main():
        async with stowage.AsyncClient(endpoint, timeout=120) as c:
            sent = routes(c)
            timed = {"put": await ticking(c.put(idx, {"x": x})),
                     "get_into": await ticking(c.get_into(idx, {"x": out})),
                     "get": await ticking(c.get(idx, ["x"]))}
            assert sent == [("lane", "put"), ("loop", "get_into"), ("loop", "get")], sent
            await c.clear(idx)
            return timed

    timed = run(main())
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(timed["get"][0]["x"], x)
    for op, (_, took, gap, ticks) in timed.items():
        assert ticks >= 5 and gap < max(0.1, took / 4), \
            f"{op} took {took:.3f} s and the loop stalled for up to {gap:.3f} s ({ticks} ticks)"


@pytest.mark.parametrize("op", ["get_into", "put"])
def test_a_cancelled_call_leaves_the_client_usable(endpoint, fresh, op):
    """A 256 MiB get_into or put cancelled while its thread moves the bytes:
    the task is cancelled at once; the next call, made while the cancelled
    one still runs, is served right on another connection (the cancelled
    call's is given back only once it returned, so the pool ends with two);
    and the cancelled call runs to its end (documented: `out` written, the
    rows stored)."""
    rows, cols = 1024, 64 * 1024
    big, small = fresh(rows), fresh(4)
    x = np.arange(rows, dtype=np.float32)[:, None] * np.ones((1, cols), np.float32)
    y = np.arange(4 * 3, dtype=np.int64).reshape(4, 3)
    out = np.zeros_like(x)

    async def main():
        # One put message (the default would make four): one core call to cancel.
        async with stowage.AsyncClient(endpoint, timeout=120, max_message_bytes=256 << 20) as c:
            c._loop_idle = None  # small calls through worker threads too (the pool under test)
            if op == "get_into":
                await c.put(big, {"x": x})
            await c.put(small, {"y": y})  # one connection, idle
            assert len(c._core_idle) == 1
            call = c.get_into(big, {"x": out}) if op == "get_into" else c.put(big, {"x": x})
            task = asyncio.get_running_loop().create_task(call)
            await until(lambda: not c._core_idle, "core call taking the connection")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not c._core_idle, "the cancelled call returned before the next one: the test proves nothing"
            np.testing.assert_array_equal((await c.get(small[::-1], ["y"]))["y"], y[::-1])
            await until(lambda: len(c._core_idle) == 2, "both connections back in the pool")
            if op == "put":
                np.testing.assert_array_equal((await c.get(big[::97], ["x"]))["x"], x[::97])
            await c.clear(big + small)

    run(main())
    if op == "get_into":
        np.testing.assert_array_equal(out, x)


def test_a_timeout_raises_stowage_timeout_and_the_next_call_is_served(fake_server):
    """A peer that never answers the first request: StowageTimeout within
    the call's timeout, in the sync client's words; a call queued behind it
    (one worker) past its own timeout fails so without being sent, and says
    so; the next get and put, on a new connection, are served."""
    x = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)
    seen = []

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        seen.append(env["op"])
        if len(seen) == 1:
            return []
        if env["op"] == "put":
            return [[msgpack.packb({"proto": "stowage/1", "op": "put_ok", "id": env["id"], "body": {"rows": 2}})]]
        desc = {"kind": "regular", "dtype": "float32", "shape": [2, 3],
                "parts": [{"frame": 1, "offset": 0, "len": x.nbytes, "rows": 2}]}
        head = msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": env["id"], "body": {"fields": {"x": desc}}})
        return [[head, x.tobytes()]]

    srv = fake_server(handler)

    async def main():
        async with stowage.AsyncClient(srv.endpoint, timeout=10) as c:
            c.CORE_CONNECTIONS = 1
            c._loop_idle = None  # small calls through worker threads too (their queue under test)
            sent = routes(c)
            t = time.monotonic()
            first, queued = await asyncio.gather(c.get([1, 2], ["x"], timeout=0.5),
                                                 c.get([1, 2], ["x"], timeout=0.2), return_exceptions=True)
            took = time.monotonic() - t
            assert isinstance(first, stowage.StowageTimeout), first
            assert isinstance(queued, stowage.StowageTimeout), queued
            assert 0.4 < took < 5
            pattern = (r"get \(id {}\): no reply from " + srv.endpoint + r" within {} s; the connection was reset")
            assert re.fullmatch(pattern.format(first.request_id, "0.5"), str(first)), str(first)
            assert str(queued) == "get: no connection was free within 0.2 s; nothing was sent", str(queued)
            assert seen == ["get"], "the queued call was sent after its deadline"
            np.testing.assert_array_equal((await c.get([1, 2], ["x"]))["x"], x)
            out = np.zeros_like(x)
            await c.get_into([1, 2], {"x": out})
            np.testing.assert_array_equal(out, x)
            assert await c.put([1, 2], {"x": x}) == 2
            assert {way for way, _ in sent} == {"lane"}

    run(main())
    assert seen == ["get", "get", "get", "put"]


def test_aclose_waits_for_a_running_call_and_a_new_loop_reuses_the_pool(endpoint, fresh):
    """The client used from two event loops in turn keeps its core
    connection; aclose during a 256 MiB get_into returns only once the call
    did (every row in `out` then), and the client refuses calls after."""
    rows, cols = 1024, 64 * 1024
    idx = fresh(rows)
    x = np.arange(rows, dtype=np.float32)[:, None] * np.ones((1, cols), np.float32)
    out = np.zeros_like(x)
    c = stowage.AsyncClient(endpoint, timeout=120)
    c._loop_idle = None  # the get_into on a lane too (the pool under test)

    async def first():
        await c.put(idx, {"x": x})
        return c._core_idle[:]

    async def second():
        assert c._core_idle == pool  # the same connection object, on another loop
        want = {"x": out}
        task = asyncio.get_running_loop().create_task(c.get_into(idx, want))
        await until(lambda: not c._core_idle, "core call taking the connection")
        await c.aclose()
        # Written to its end before aclose returned (the last row first: a
        # call still running would be writing the rows before it).
        assert out[-1, -1] == x[-1, -1]
        np.testing.assert_array_equal(out, x)
        assert await task is want
        with pytest.raises(stowage.StowageError, match="closed"):
            await c.get(idx[:1], ["x"])

    pool = run(first())
    assert len(pool) == 1
    run(second())
    with stowage.Client(endpoint, timeout=60) as s:
        s.clear(idx)


@pytest.mark.parametrize("in_loop", [True, False])
def test_small_calls_skip_the_thread_hop_and_bulk_ones_take_the_core(endpoint, fresh, monkeypatch, in_loop):
    """The hop to a worker thread costs more than a small call: a put under
    CORE_MIN_BYTES, a get and a get_into go through the core with their
    reply awaited by the event loop itself (with STOWAGE_ASYNC_IN_LOOP=0, on
    a lane); larger puts on a lane, in a worker thread."""
    monkeypatch.undo()  # the defaults, not the autouse fixture's zeros
    if not in_loop:
        monkeypatch.setenv("STOWAGE_ASYNC_IN_LOOP", "0")
    idx = fresh(256)
    small = np.ones((4, 16), np.float32)
    big = np.ones((256, 1024), np.float32)  # 1 MiB
    assert big.nbytes >= stowage.AsyncClient.CORE_MIN_BYTES > small.nbytes
    way = "loop" if in_loop else "lane"

    async def go():
        async with stowage.AsyncClient(endpoint, timeout=30) as c:
            sent = routes(c)
            await c.put(idx[:4], {"s": small})
            np.testing.assert_array_equal((await c.get(idx[:4], ["s"]))["s"], small)
            await c.get_into(idx[:4], {"s": np.empty_like(small)})
            assert sent == [(way, "put"), (way, "get"), (way, "get_into")], sent
            del sent[:]
            await c.put(idx, {"b": big})
            got = await c.get(idx, ["b"])
            out = np.empty_like(big)
            await c.get_into(idx, {"b": out})
            assert sent == [("lane", "put"), (way, "get"), (way, "get_into")], sent
            np.testing.assert_array_equal(got["b"], big)
            np.testing.assert_array_equal(out, big)
            await c.clear(idx)

    run(go())


def test_an_in_loop_call_times_out_and_is_cancelled_cleanly(fake_server, monkeypatch):
    """A small call whose reply never comes: StowageTimeout within its
    timeout, the loop free meanwhile; one cancelled while it waits: the
    task is cancelled at once. Either way its connection is dropped (a late
    reply can never be taken for a later call's) and the next calls, on a
    new connection, are served."""
    monkeypatch.undo()  # the defaults: small puts in the loop
    x = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)
    seen = []

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        seen.append(env["op"])
        if len(seen) <= 2:
            return []
        return [[msgpack.packb({"proto": "stowage/1", "op": "put_ok", "id": env["id"], "body": {"rows": 2}})]]

    srv = fake_server(handler)

    async def main():
        async with stowage.AsyncClient(srv.endpoint, timeout=10) as c:
            ticks = 0

            async def tick():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.get_running_loop().create_task(tick())
            t = time.monotonic()
            with pytest.raises(stowage.StowageTimeout, match=r"put \(id \d+\): no reply .* within 0.5 s"):
                await c.put([1, 2], {"x": x}, timeout=0.5)
            assert 0.4 < time.monotonic() - t < 5 and ticks >= 10
            task = asyncio.get_running_loop().create_task(c.put([1, 2], {"x": x}))
            await until(lambda: len(seen) == 2, "the second put sent")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert c._loop_idle == [] and c._loop_busy == 0
            assert await c.put([1, 2], {"x": x}) == 2
            assert await c.put([1, 2], {"x": x}) == 2
            assert len(c._loop_idle) == 1
            ticker.cancel()

    run(main())
    assert len({ident for ident, _ in srv.requests}) == 3, "a dropped connection was used again"


def test_an_async_split_put_keeps_two_messages_on_the_wire_and_counts_what_was_answered(fake_server):
    """As the sync client's (test_core): the second message is sent before
    the first's reply is read, and when a later one gets no reply,
    StowageTimeout says how many leading rows the answered ones stored; the
    next put, on a fresh connection, is answered whole."""
    requests = []

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        requests.append(env["id"])
        body = {"rows": len(env["body"]["global_indexes"])}
        if len(requests) == 2:
            # Both messages are here before the first is answered.
            first = msgpack.packb({"proto": "stowage/1", "op": "put_ok", "id": requests[0], "body": body})
            return [[first]]
        if len(requests) > 3:
            return [[msgpack.packb({"proto": "stowage/1", "op": "put_ok", "id": env["id"], "body": body})]]
        return []

    srv = fake_server(handler)
    x = np.arange(6 * 1000, dtype=np.float32).reshape(6, 1000)  # 4,000-byte rows

    async def main():
        async with stowage.AsyncClient(srv.endpoint, timeout=10, max_message_bytes=9000) as c:  # 2 rows a message
            sent = routes(c)
            t = time.monotonic()
            with pytest.raises(stowage.StowageTimeout) as ei:
                await c.put([1, 2, 3, 4, 5, 6], {"x": x}, timeout=0.5)
            assert time.monotonic() - t < 5
            assert ei.value.rows_stored == 2, "the first message's rows, answered"
            assert len(requests) >= 2
            del requests[:]
            requests.extend([0, 0, 0])  # answer every message from now on
            assert await c.put([1, 2, 3, 4, 5, 6], {"x": x}) == 6
            assert len(requests) == 6
            assert sent == [("lane", "put")] * 2, sent

    run(main())


def test_an_in_loop_reply_that_arrives_in_pieces_is_read_whole(monkeypatch):
    """A reply whose frames come in pieces, with pauses between them: the
    event loop wakes at the first piece, finds the reply incomplete (its
    frame headers walked in a peek), and a worker thread reads the rest;
    the loop stays free, the result is whole, the connection serves the
    next call. A reply whose declared frame never comes in full ends in
    StowageTimeout, not a stuck loop."""
    from test_core import HostileZmtp

    monkeypatch.undo()
    x = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)

    def reply(k, env):
        desc = {"kind": "regular", "dtype": "float32", "shape": [4, 3],
                "parts": [{"frame": 1, "offset": 0, "len": x.nbytes, "rows": 4}]}
        head = HostileZmtp.frame(msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": env["id"],
                                                "body": {"fields": {"x": desc}}}), more=True)
        data = HostileZmtp.frame(x.tobytes())
        if k == 1:  # in three pieces, the data frame's header split
            return [head[:5], head[5:] + data[:1], data[1:]]
        if k == 2:  # whole
            return head + data
        return [head + data[:7], None]  # the rest never comes

    # (50 ms between pieces: a loop woken late, on a busy machine, must
    # still find the reply incomplete.)
    srv = HostileZmtp(reply, pause=0.05)

    async def main():
        loop = asyncio.get_running_loop()
        hops = []
        inner = loop.run_in_executor

        def counted(executor, fn, *args):
            hops.append(fn.__name__)  # the core connection's own start_get or finish_get
            return inner(executor, fn, *args)

        loop.run_in_executor = counted
        async with stowage.AsyncClient(srv.endpoint, timeout=5) as c:
            sent = routes(c)
            np.testing.assert_array_equal((await c.get([1, 2, 3, 4], ["x"]))["x"], x)
            assert hops == ["start_get", "finish_get"], hops  # connected in a thread; the reply in pieces read in one
            np.testing.assert_array_equal((await c.get([1, 2, 3, 4], ["x"]))["x"], x)
            assert hops == ["start_get", "finish_get"], hops  # the whole reply: read on the loop
            assert sent == [("loop", "get"), ("loop", "get")], sent
            assert len(c._loop_idle) == 1
            t = time.monotonic()
            with pytest.raises(stowage.StowageTimeout):
                await c.get([1, 2, 3, 4], ["x"], timeout=0.5)
            assert time.monotonic() - t < 5
            assert c._loop_idle == []

    try:
        run(main())
        assert srv.requests[:2] == [1, 1], "the second get did not reuse the first's connection"
    finally:
        srv.close()


def test_reply_ready_is_true_only_for_a_whole_reply_larger_than_the_read_ahead(monkeypatch):
    """`reply_ready` on a reply of 100 KB, more than the core's 64 KiB
    read-ahead: once it has all arrived, True, and `finish_get` reads it
    back equal without waiting; while only 70 KB of it have come (the rest
    never does), False every time it is asked, with the read-ahead full."""
    from test_core import HostileZmtp

    monkeypatch.undo()
    x = np.arange(25_000, dtype=np.float32).reshape(250, 100)

    def reply(k, env):
        desc = {"kind": "regular", "dtype": "float32", "shape": list(x.shape),
                "parts": [{"frame": 1, "offset": 0, "len": x.nbytes, "rows": 250}]}
        head = HostileZmtp.frame(msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": env["id"],
                                                "body": {"fields": {"x": desc}}}), more=True)
        data = HostileZmtp.frame(x.tobytes())
        if k == 1:
            return head + data
        return [head + data[:70_000], None]  # the rest never comes

    srv = HostileZmtp(reply)
    opts = stowage.Client._get_options(None, "rows")
    rows = list(range(250))
    try:
        conn = client_mod._core.Connection(srv.endpoint, 0.0, None, None)
        n = conn.start_get(1, 5.0, rows, ["x"])
        deadline = time.monotonic() + 5
        while not conn.reply_ready():
            assert time.monotonic() < deadline, "a whole reply was never ready"
            time.sleep(0.001)
        out, glue = conn.finish_get(1, n, 0.001, opts)  # no time to wait: it is all here
        np.testing.assert_array_equal(out["x"], x)
        conn.start_get(2, 5.0, rows, ["x"])
        time.sleep(0.3)
        assert [conn.reply_ready() for _ in range(3)] == [False] * 3
        conn.close()
    finally:
        srv.close()


def _raw_connection(endpoint: str, spin_us: float):
    from stowage import _core
    with stowage.Client(endpoint) as c:
        token = c._token  # (stowd's, as the client found it)
    return _core.Connection(endpoint, spin_us, token)


def test_reply_ready_spin_polls_for_its_window_then_rests(endpoint, monkeypatch):
    """The core's `reply_ready_spin`: true at once for a reply already
    here, true within its window for one on its way; with none coming,
    false after the whole window, and then false at once for the next 8
    calls (a connection whose replies are slow stops spinning), the 9th
    spinning again. Real stowd; a 150 ms window so the times are plain
    (and no turn counts as crowded: see the next test)."""
    monkeypatch.setenv("STOWAGE_SPIN_CROWDED_US", str(10**7))
    window = 0.15
    conn = _raw_connection(endpoint, window * 1e6)
    assert conn.reply_ready_spin(), "no connection yet: ready (the finish says why)"
    for rid in (1, 2):
        assert conn.start_call(rid, 10.0, "stats", {})
        assert conn.reply_ready_spin()
        assert conn.finish_call(rid, True, 10.0) is not None
    assert conn.loop_spin_rest == 0
    t = time.monotonic()
    assert not conn.reply_ready_spin()  # nothing asked: nothing comes
    assert time.monotonic() - t >= window
    assert conn.loop_spin_rest == 8
    t = time.monotonic()
    assert not any(conn.reply_ready_spin() for _ in range(8))
    assert time.monotonic() - t < window, "the calls after a missed spin spun"
    assert conn.loop_spin_rest == 0
    t = time.monotonic()
    assert not conn.reply_ready_spin()
    assert time.monotonic() - t >= window, "the spin did not come back after its rest"
    assert conn.start_call(3, 10.0, "stats", {})  # (resting again: not caught by a spin, read all the same)
    assert conn.finish_call(3, True, 10.0) is not None
    conn.close()


def test_a_spin_on_a_crowded_cpu_ends_and_backs_off(endpoint, monkeypatch):
    """A turn of the spin whose `sched_yield` comes back late (another
    process held the CPU for its time slice; here every turn, with the
    threshold set to 0 µs) ends the spin at once, and the next 8 calls do
    not spin; the next crowded spin rests 16, then 32: where spinning
    costs a time slice a turn, the client sleeps and is woken instead."""
    monkeypatch.setenv("STOWAGE_SPIN_CROWDED_US", "0")
    conn = _raw_connection(endpoint, 2e6)  # a 2 s window, never waited out
    assert conn.start_call(1, 10.0, "stats", {}) and conn.finish_call(1, True, 10.0) is not None
    for rest in (8, 16, 32):
        t = time.monotonic()
        assert not conn.reply_ready_spin()
        assert time.monotonic() - t < 1.0, "a crowded spin polled on"
        assert conn.loop_spin_rest == rest
        assert not any(conn.reply_ready_spin() for _ in range(rest))
        assert conn.loop_spin_rest == 0
    assert conn.start_call(2, 10.0, "stats", {}) and conn.finish_call(2, True, 10.0) is not None
    conn.close()


def test_an_in_loop_call_spins_only_when_the_loop_has_nothing_else_to_run(fake_server, monkeypatch):
    """A small call whose reply takes 20 ms: on an idle loop, the core
    polls for it (within spin_us) and the loop never registers a reader,
    also with a cancelled handle left in the loop's queue (not work); with
    another task ready to run, or with spin_us=0, the loop awaits the
    socket instead. Every call is answered either way. (No turn counts as
    crowded here, whatever else the machine runs.)"""
    monkeypatch.undo()  # the defaults: small puts in the loop
    monkeypatch.setenv("STOWAGE_SPIN_CROWDED_US", str(10**7))
    x = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        time.sleep(0.02)
        return [[msgpack.packb({"proto": "stowage/1", "op": "put_ok", "id": env["id"], "body": {"rows": 2}})]]

    srv = fake_server(handler)

    async def readers(spin_us, busy: bool, cancelled: bool = False) -> int:
        loop = asyncio.get_running_loop()
        added = []
        real = loop.add_reader

        def add_reader(fd, *args):
            added.append(fd)
            return real(fd, *args)

        loop.add_reader = add_reader
        stop = False

        async def spinner():
            while not stop:
                await asyncio.sleep(0)

        other = loop.create_task(spinner()) if busy else None
        if other is not None:
            await asyncio.sleep(0)  # it runs, and is ready again
        try:
            async with stowage.AsyncClient(srv.endpoint, timeout=10, spin_us=spin_us) as c:
                assert await c.put([1, 2], {"x": x}) == 2  # (connected: the calls below yield nowhere)
                if cancelled:  # a cancelled handle, left in the loop's queue until the loop runs again
                    loop.call_soon(lambda: None).cancel()
                for _ in range(3):
                    assert await c.put([1, 2], {"x": x}) == 2
        finally:
            stop = True
            if other is not None:
                await other
            del loop.add_reader
        return len(added)

    assert asyncio.run(readers(500_000.0, busy=False)) == 0, "an idle loop's call did not spin"
    assert asyncio.run(readers(500_000.0, busy=False, cancelled=True)) == 0, "a cancelled handle counted as work"
    assert asyncio.run(readers(500_000.0, busy=True)) >= 3, "a loop with work to do spun"
    assert asyncio.run(readers(0.0, busy=False)) == 4, "spin_us=0 spun"


def test_a_large_in_loop_reply_ends_the_spin_at_once(endpoint, fresh):
    """A get whose reply is larger than the core's read-ahead (8 MiB here)
    ends the spin as soon as its first bytes fill it, and is read in a
    worker thread: with a 1 s spin_us on an idle loop, every such get is
    back well within the spin's window (a spin that polled for the whole
    reply would wait out the window: the reply is larger than what the
    socket holds unread)."""
    idx = fresh(4)
    x = np.arange(4 * (1 << 19), dtype=np.float32).reshape(4, 1 << 19)  # 2 MiB a row

    async def main():
        async with stowage.AsyncClient(endpoint, timeout=30, spin_us=1_000_000.0) as c:
            await c.put(idx, {"x": x})
            for _ in range(3):
                t = time.monotonic()
                got = await c.get(idx, ["x"])
                took = time.monotonic() - t
                np.testing.assert_array_equal(got["x"], x)
                assert took < 0.5, f"a large get took {took:.2f} s: it spun through its window"
            await c.clear(idx)

    run(main())


def test_a_stream_of_in_loop_calls_lets_timers_run(fake_server, monkeypatch):
    """Small calls answered on the loop without awaiting (here every reply
    is caught by the spin: a 1 s window, no turn counted as crowded) still
    give the loop a turn every 64 calls in a row: a task woken by a 1 ms
    timer runs while another task makes 1,600 puts back to back, not only
    after them. (A call that finds the woken ticker ready awaits its reply
    instead of spinning: at most one such call a tick; without the turns
    there would be neither ticks nor such calls.)"""
    monkeypatch.undo()  # the defaults: small puts in the loop
    monkeypatch.setenv("STOWAGE_SPIN_CROWDED_US", str(10**7))
    x = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        return [[msgpack.packb({"proto": "stowage/1", "op": "put_ok", "id": env["id"], "body": {"rows": 2}})]]

    srv = fake_server(handler)

    async def main():
        loop = asyncio.get_running_loop()
        added = []
        real = loop.add_reader
        loop.add_reader = lambda fd, *args: (added.append(fd), real(fd, *args))[1]
        async with stowage.AsyncClient(srv.endpoint, timeout=30, spin_us=1e6) as c:
            assert await c.put([1, 2], {"x": x}) == 2  # (connected)
            ticks, done = [], False

            async def ticker():
                while not done:
                    await asyncio.sleep(0.001)
                    ticks.append(1)

            task = loop.create_task(ticker())
            await asyncio.sleep(0.005)  # the ticker now waits on its timer
            added.clear()
            before = len(ticks)
            for _ in range(1600):
                assert await c.put([1, 2], {"x": x}) == 2
            during = len(ticks) - before
            done = True
            await task
        del loop.add_reader
        return during, len(added)

    during, readers = run(main())
    assert during >= 3, f"{during} ticks during 1,600 calls: the loop got no turn"
    assert readers <= during + 1, f"{readers} calls awaited their replies for {during} ticks: the spin did not answer"




@pytest.mark.parametrize("op", ["get", "get_into"])
def test_an_in_loop_call_cancelled_while_a_worker_reads_its_reply(endpoint, fresh, op):
    """A 64 MiB get or get_into on the loop's connection, cancelled once a
    worker thread reads its reply: the task is cancelled (CancelledError,
    not the core's "Already borrowed" from closing a connection the read
    still holds); that connection is never used again; the next calls are
    served, and the rows are intact."""
    rows, cols = 64, 1 << 18  # 64 MiB of float32
    idx = fresh(rows)
    x = np.arange(rows, dtype=np.float32)[:, None] * np.ones((1, cols), np.float32)

    async def main():
        loop = asyncio.get_running_loop()
        reading = []
        real = loop.run_in_executor

        def run_in_executor(pool, fn, *args):
            if getattr(fn, "__name__", "").startswith("finish_"):
                reading.append(fn.__name__)
            return real(pool, fn, *args)

        async with stowage.AsyncClient(endpoint, timeout=120) as c:
            await c.put(idx, {"x": x})
            loop.run_in_executor = run_in_executor
            out = {"x": np.zeros_like(x)}
            call = c.get(idx, ["x"]) if op == "get" else c.get_into(idx, out)
            task = loop.create_task(call)
            await until(lambda: reading, "the reply's read in a worker thread")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert reading == [f"finish_{op}"], reading
            del loop.run_in_executor
            got = await c.get(idx[::7], ["x"])
            np.testing.assert_array_equal(got["x"], x[::7])
            small = {"x": np.zeros((2, cols), np.float32)}
            assert await c.get_into(idx[:2], small) is small
            np.testing.assert_array_equal(small["x"], x[:2])
            await c.clear(idx)

    run(main())
