"""The calls that move no rows (stats, checkpoint, restore, clear, and a
same-node client's request for its descriptor channel) go through the Rust
core over tcp, `Client` and `AsyncClient` alike (in-loop and in a worker
thread), same-node clients too: the core writes each request and reads
its reply (`_core.Connection.call`, `start_call`, `finish_call`), nothing
goes on the DEALER. stowd's error replies raise as they say; a reply to
another request is dropped; a reply the codec refuses is a ProtocolError
and the connection serves on."""

from __future__ import annotations

import asyncio
import os
import shutil

import msgpack
import numpy as np
import pytest

import stowage
from stowage import _core
from stowd_harness import CallNames, run_stowd


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    """A stowd of this module's own: its checkpoints and restores touch no other test's rows."""
    with run_stowd(tmp_path_factory.mktemp("calls"), config="[units]\nlocal = 2\n", name="stowd-calls") as s:
        yield s["native"]


def _no_dealer(c) -> None:
    """Any request on `c`'s DEALER fails the test."""
    def refuse(op, *args, **kwargs):
        raise AssertionError(f"{op} went over the DEALER")

    async def refuse_async(op, *args, **kwargs):
        refuse(op)

    c._call = refuse_async if isinstance(c, stowage.AsyncClient) else refuse


def test_stats_checkpoint_restore_and_clear_go_through_the_core(endpoint, fresh, tmp_path):
    idx = fresh(6)
    with stowage.Client(endpoint, timeout=30) as c:
        c._core = spy = CallNames(_core.Connection(endpoint, c.spin_us, c._token, c._curve))
        c.put(idx, {"x": np.ones((6, 2), np.float32), "t": list("abcdef")})
        assert spy.calls == ["put"]
        _no_dealer(c)
        stats = c.stats()
        assert stats["units"] == 2 and stats["rows"] >= 6 and all(type(v) in (int, dict) for v in stats.values())
        done = c.checkpoint(tmp_path / "ck", journal=False)
        assert done["rows"] >= 6 and done["dir"] == str(tmp_path / "ck")
        assert c.clear(idx[:2], "t") == 2  # read by the core's fast path
        assert c.clear(np.array(idx[2:4], dtype=np.uint64)) == 4
        back = c.restore(tmp_path / "ck")
        assert back["seq"] == done["seq"] and back["lost"] == 0
        assert c.clear(idx, ("x", "t")) == 12  # restored: every row again
        assert spy.calls == ["put", "call", "call", "clear_fast", "clear_fast", "call", "clear_fast"], spy.calls
        # Refused as before, by the same check, nothing sent.
        with pytest.raises(TypeError, match="checkpoint: journal must be True or False"):
            c.checkpoint(tmp_path / "ck", journal=1)
        assert len(spy.calls) == 7


def test_stowds_error_replies_raise_as_they_say_through_the_core(endpoint, tmp_path):
    with stowage.Client(endpoint, timeout=30) as c:
        _no_dealer(c)
        with pytest.raises(stowage.StowageError) as e:
            c.restore(tmp_path / "never-written")
        assert type(e.value) is not stowage.ProtocolError and e.value.request_id is not None
        assert c._core.connected  # an error reply read to its end keeps the connection
        assert c.stats()["units"] == 2


def test_the_async_client_goes_through_the_core_in_the_loop_and_in_threads(endpoint, fresh, tmp_path):
    idx = fresh(4)

    async def main():
        async with stowage.AsyncClient(endpoint, timeout=30) as c:
            await c.put(idx, {"t": list("abcd")})
            _no_dealer(c)
            assert (await c.stats())["units"] == 2
            assert not c._core_idle and len(c._loop_idle) == 1  # in the loop (its connect in a thread)
            done = await c.checkpoint(tmp_path / "ck")
            assert await c.clear(idx[:1]) == 1
            back = await c.restore(tmp_path / "ck")
            assert back["seq"] == done["seq"] and back["lost"] == 1
            # Every in-loop connection busy: in a worker thread, still the core.
            c._loop_busy, idle = c.CORE_CONNECTIONS, c._loop_idle[:]
            c._loop_idle.clear()
            stats = await asyncio.gather(*(c.stats() for _ in range(6)))
            assert all(s["units"] == 2 for s in stats) and c._core_idle
            c._loop_busy, c._loop_idle[:] = 0, idle
            assert sorted(await asyncio.gather(c.clear(idx[1:2]), c.clear(idx[2:]))) == [1, 2]

    asyncio.run(main())


def _reply(req_frame0: bytes, op: str, body: dict, id_delta: int = 0) -> list:
    env = msgpack.unpackb(req_frame0)
    return [msgpack.packb({"proto": "stowage/1", "op": op, "id": env["id"] + id_delta, "body": body})]


def _odd_peer(ident, frames):
    env = msgpack.unpackb(frames[0])
    op, rid = env["op"], env["id"]
    if op == "stats" and rid % 2:
        return [[b"\xc1 not msgpack"]]
    if op == "stats":
        return [_reply(frames[0], "stats_ok", {"n": rid}, id_delta=7), _reply(frames[0], "stats_ok", {"n": rid})]
    if op == "checkpoint":
        return [_reply(frames[0], "error", {"code": "bad_request", "message": "no"}, id_delta=-rid)]  # id 0
    if op == "restore":
        return [_reply(frames[0], "restore_ok", {"dir": "/x", "seq": 1, "rows": 0, "lost": 0}) + [b"extra"]]
    return [_reply(frames[0], "get_ok", {"fields": {}})]  # clear: the wrong op


@pytest.mark.parametrize("kind", ["sync", "async", "async-threads"])
def test_odd_replies_through_the_core(fake_server, kind, monkeypatch):
    """A peer's malformed reply is a ProtocolError and the connection serves
    on; a stray reply (another id) before the real one is dropped; an error
    of id 0 answers the one request in flight; the wrong reply op says so."""
    if kind == "async-threads":
        monkeypatch.setenv("STOWAGE_ASYNC_IN_LOOP", "0")
    srv = fake_server(_odd_peer)

    def check(stats, checkpoint, restore, clear):
        with pytest.raises(stowage.ProtocolError, match=r"^malformed reply: .*msgpack"):
            stats()
        assert stats() == {"n": 2}
        with pytest.raises(stowage.BadRequest, match=r"^bad_request: no$"):
            checkpoint("/ck")
        assert restore("/x") == {"dir": "/x", "seq": 1, "rows": 0, "lost": 0}  # data frames ignored, as before
        with pytest.raises(stowage.ProtocolError, match=r"expected a clear_ok reply to request \d+, got 'get_ok'"):
            clear()
        assert stats() == {"n": 6}

    if kind == "sync":
        with stowage.Client(srv.endpoint, timeout=5) as c:
            _no_dealer(c)
            check(c.stats, c.checkpoint, c.restore, lambda: c.clear([1]))
    else:
        async def main():
            async with stowage.AsyncClient(srv.endpoint, timeout=5) as c:
                _no_dealer(c)
                results = []
                for f, args in ((c.stats, ()), (c.stats, ()), (c.checkpoint, ("/ck",)), (c.restore, ("/x",)),
                                (c.clear, ([1],)), (c.stats, ())):
                    try:
                        results.append(await f(*args))
                    except stowage.StowageError as e:
                        results.append(e)
                return results

        results = asyncio.run(main())
        assert isinstance(results[0], stowage.ProtocolError) and str(results[0]).startswith("malformed reply: ")
        assert results[1] == {"n": 2}
        assert type(results[2]) is stowage.BadRequest and str(results[2]) == "bad_request: no"
        assert results[3] == {"dir": "/x", "seq": 1, "rows": 0, "lost": 0}
        assert isinstance(results[4], stowage.ProtocolError) and "expected a clear_ok reply" in str(results[4])
        assert results[5] == {"n": 6}
    # One connection throughout (sync, in-loop): nothing broke it.
    if kind != "async-threads":
        assert len({ident for ident, _ in srv.requests}) == 1, srv.requests


@pytest.fixture(scope="module")
def shm_endpoint(tmp_path_factory):
    shm_dir = f"/dev/shm/stowage-test-core-calls-{os.getpid()}"
    shutil.rmtree(shm_dir, ignore_errors=True)
    with run_stowd(tmp_path_factory.mktemp("shm"), config=f'[shm]\ndir = "{shm_dir}"\ninline_below = 0\n', name="stowd-shm") as s:
        yield s["native"]
    shutil.rmtree(shm_dir, ignore_errors=True)


def test_a_same_node_clients_small_calls_go_through_the_core(shm_endpoint, fresh, tmp_path, segment_puts):
    """Same node: the channel request, stats, checkpoint, restore and clear
    through the core, gets too (their rows in shared memory), and the put
    (a lease, then the put naming the segment the core filled)."""
    idx = fresh(3)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with stowage.Client(shm_endpoint, timeout=30, same_node=True) as c:
        c._core = spy = CallNames(_core.Connection(shm_endpoint, c.spin_us, c._token, c._curve))
        c.put(idx, {"x": x})
        assert spy.calls == ["call", "call", "put"]  # the channel, the lease, the put
        assert c._segments.channel is not None and not c._segments.channel.closed
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], x)
        assert c.stats()["rows"] >= 3
        c.checkpoint(tmp_path / "ck", journal=False)
        assert c.clear(idx) == 3
        assert c.restore(tmp_path / "ck")["lost"] == 0
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], x)
        assert spy.calls == ["call", "call", "put", "get_fast", "call", "call", "clear_fast", "call", "get_fast"], \
            spy.calls

    async def main():
        async with stowage.AsyncClient(shm_endpoint, timeout=30, same_node=True) as c:
            await c.put(idx, {"x": x + 1})  # opens the channel: through the core
            np.testing.assert_array_equal((await c.get(idx, ["x"]))["x"], x + 1)
            _no_dealer(c)
            assert (await c.stats())["rows"] >= 3
            assert await c.clear(idx) == 3

    asyncio.run(main())


def test_a_call_right_after_stowd_dies_fails_as_a_lost_connection_and_the_client_goes_on(tmp_path):
    """A kept connection is reused without asking whether stowd closed it
    when its last reply came less than a millisecond before (back-to-back
    calls skip that system call). A call made at once after stowd was sent
    SIGKILL, right after a reply, then fails with the client's error for a
    lost connection (not a timeout): whether it wrote on the connection the
    dying stowd held or closed, or asked and found no stowd. Once a stowd
    listens again on the endpoint, the same client reconnects."""
    import signal
    import socket as pysocket
    import time
    with pysocket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ep = f"tcp://127.0.0.1:{port}"
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    c = stowage.Client(ep, timeout=10, spin_us=0)
    try:
        for life in range(4):
            with run_stowd(tmp_path / f"life{life}", config=f"[server]\nnative_port = {port}\n") as server:
                c.put([0, 1], {"x": x + life})
                np.testing.assert_array_equal(c.get([0, 1], ["x"])["x"], x + life)
                server.proc.stowage_killed = True  # the harness's mark of a death on purpose
                t = time.monotonic()
                os.kill(server.proc.pid, signal.SIGKILL)
                with pytest.raises(stowage.errors.StowageError) as e:
                    c.stats()
                assert time.monotonic() - t < 5
                assert not isinstance(e.value, stowage.errors.StowageTimeout), e.value
                server.proc.wait(timeout=10)
    finally:
        c.close()


def test_the_same_clients_go_on_after_stowd_restarts(tmp_path):
    """A core connection stowd closed while it sat idle (stowd restarted on
    the same endpoint) is not reused: the next call connects anew, as pyzmq
    reconnects, instead of failing on the closed one."""
    import socket as pysocket
    with pysocket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ep = f"tcp://127.0.0.1:{port}"
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    c = stowage.Client(ep, timeout=20)
    ac = stowage.AsyncClient(ep, timeout=20)

    async def use(life):
        assert (await ac.stats())["rows"] == 2
        assert await ac.clear([2, 3]) == 0

    try:
        for life in range(2):
            with run_stowd(tmp_path / f"life{life}", config=f"[server]\nnative_port = {port}\n"):
                assert c.stats()["rows"] == 0
                c.put([0, 1], {"x": x + life})
                assert c._core is not None and c._core.connected
                assert c.stats()["rows"] == 2
                asyncio.run(use(life))
                assert c.clear([0, 1]) == 2
    finally:
        c.close()
        ac.close()
