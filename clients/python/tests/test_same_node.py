"""Same-node zero copy against a real stowd: gets map stowd's sealed memory
segments read-only, two gets share memory (in one process and across two),
writes raise, a mapping outlives a clear, puts go through leased segments
without a socket copy, a lease that is never used is dropped, and nothing
a client (or another user) does through what it holds can change stored
rows (issue 14)."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import stowage
from stowage import _auth, _shm
import stowd_harness
from stowd_harness import run_stowd

GIB = 1 << 30

# Puts here test the leased segments with small rows: every put that holds
# a byte leases one (a test of the bound sets its own on its client).
pytestmark = pytest.mark.usefixtures("segment_puts")


def eventually(cond, secs: float = 5.0) -> bool:
    """Polls `cond` until it holds or `secs` pass."""
    deadline = time.monotonic() + secs
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _shm_stowd(tmp_path_factory, tag: str, lease_secs: int):
    """A stowd whose channel directory lives in a directory of its own."""
    shm_dir = f"/dev/shm/stowage-test-{tag}-{os.getpid()}"
    shutil.rmtree(shm_dir, ignore_errors=True)
    config = f'[shm]\ndir = "{shm_dir}"\nlease_secs = {lease_secs}\ninline_below = 0\n'
    with run_stowd(tmp_path_factory.mktemp(tag), config=config, name=f"stowd-{tag}") as s:
        assert s["shm_dir"] == shm_dir
        yield s
    shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory):
    yield from _shm_stowd(tmp_path_factory, "same-node", 30)


@pytest.fixture(scope="module")
def short_lease_server(tmp_path_factory):
    """Leases expire after 1 second."""
    yield from _shm_stowd(tmp_path_factory, "short-lease", 1)


def stat(server, key: str) -> int:
    with stowage.Client(server["native"]) as c:
        return c.stats()[key]


def live_segments(server) -> int:
    """Sealed segments stowd holds (its `shm_segments` counter)."""
    return stat(server, "shm_segments")


def open_channel(server):
    """A descriptor channel opened by hand, as the client does."""
    with stowage.Client(server["native"]) as c:
        body, _ = c._call("channel", {}, (), None, "channel_ok")
    return _shm.open_channel(body["path"], 10)


def data_ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def inline_server(tmp_path_factory):
    """A stowd that answers same-node gets of under 64 KiB over the socket."""
    shm_dir = f"/dev/shm/stowage-test-inline-{os.getpid()}"
    shutil.rmtree(shm_dir, ignore_errors=True)
    config = f'[shm]\ndir = "{shm_dir}"\ninline_below = 65536\n'
    with run_stowd(tmp_path_factory.mktemp("inline"), config=config, name="stowd-inline") as s:
        yield s
    shutil.rmtree(shm_dir, ignore_errors=True)


def test_a_small_same_node_get_comes_over_the_socket_and_a_large_one_through_segments(inline_server, fresh):
    """Under `[shm] inline_below` bytes a same-node get is answered as any
    get (no segment made or named, `same_node_gets_inline` counts it); at
    or over it through segments, shared between gets, as before."""
    s = inline_server
    small, edge, large = fresh(4), fresh(1), fresh(64)
    rows = {
        "small": (small, {"x": np.arange(4 * 256, dtype=np.float32).reshape(4, 256),  # 4 KiB
                          "tag": [f"t{i}" for i in range(4)]}),
        "under": (edge, {"b": np.full((1, 65535), 7, np.uint8)}),  # one byte under
        "at": (edge, {"c": np.full((1, 65536), 9, np.uint8)}),  # the bound itself
        "large": (large, {"x": np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)}),  # 256 KiB
    }
    with stowage.Client(s["native"]) as tcp:
        for idx, data in rows.values():
            tcp.put(idx, data)
    with stowage.Client(s["native"], same_node=True) as c:
        def get(name):
            idx, data = rows[name]
            before = (stat(s, "same_node_gets_inline"), live_segments(s))
            got = c.get(idx, list(data), as_torch=False)
            for k, v in data.items():
                if isinstance(v, list):
                    assert got[k] == v, (name, k)
                else:
                    np.testing.assert_array_equal(got[k], v)
            return got, stat(s, "same_node_gets_inline") - before[0], live_segments(s) - before[1]

        got, inline, made = get("small")
        assert (inline, made) == (1, 0), "a 4 KiB same-node get went through a segment"
        with pytest.raises(ValueError):
            got["x"][0, 0] = 1.0  # read-only, as over the socket and through segments
        assert get("under")[1:] == (1, 0), "65,535 bytes under a bound of 65,536 went through a segment"
        _, inline, made = get("at")
        assert inline == 0 and made == 1, "65,536 bytes at a bound of 65,536 came over the socket"
        g1, inline, made = get("large")
        assert inline == 0 and made == 1
        g2, inline, made = get("large")
        assert inline == 0 and made == 0
        assert data_ptr(g1["x"]) == data_ptr(g2["x"]), "two large gets do not share the segment"
        # get_into takes either reply too.
        out = {"x": np.zeros((4, 256), np.float32)}
        before = stat(s, "same_node_gets_inline")
        c.get_into(small, out)
        np.testing.assert_array_equal(out["x"], rows["small"][1]["x"])
        assert stat(s, "same_node_gets_inline") == before + 1
        out = {"x": np.zeros((64, 1024), np.float32)}
        c.get_into(large, out)
        np.testing.assert_array_equal(out["x"], rows["large"][1]["x"])
        assert stat(s, "same_node_gets_inline") == before + 1
    with stowage.Client(s["native"]) as tcp:
        assert tcp.stats()["same_node_gets_inline"] == stat(s, "same_node_gets_inline")
        for idx, _ in rows.values():
            tcp.clear(idx)


def test_with_inline_below_0_every_same_node_get_goes_through_segments(shm_server, fresh):
    """`inline_below = 0` (this module's shm_server): no get is answered
    over the socket, not even a one-byte one."""
    idx = fresh(1)
    with stowage.Client(shm_server["native"]) as tcp:
        tcp.put(idx, {"b": np.ones((1, 1), np.uint8)})
    with stowage.Client(shm_server["native"], same_node=True) as c:
        before = live_segments(shm_server)
        np.testing.assert_array_equal(c.get(idx, ["b"])["b"], np.ones((1, 1), np.uint8))
        assert live_segments(shm_server) == before + 1, "the one-byte row was not moved into a segment"
    assert stat(shm_server, "same_node_gets_inline") == 0


def test_a_small_same_node_put_goes_on_the_socket_and_a_large_one_through_a_lease(shm_server, fresh):
    """Same node, a put under `SAME_NODE_INLINE_BELOW` bytes goes on the
    socket as any put: no lease, no segment, no descriptor channel opened;
    at or over the bound, or too large for one message of the client's
    `max_message_bytes`, through a leased segment as before. The rows read
    back equal either way, over tcp and same node."""
    s = shm_server
    small, under, at, large = fresh(4), fresh(1), fresh(1), fresh(64)
    rows = [
        (small, {"x": np.arange(4 * 256, dtype=np.float32).reshape(4, 256),  # 4 KiB
                 "tag": [f"t{i}" for i in range(4)]}, False),
        (under, {"b": np.full((1, 65472), 7, np.uint8)}, False),  # 64 bytes under (frames lie at multiples of 64)
        (at, {"c": np.full((1, 65536), 9, np.uint8)}, True),  # the bound itself
        (large, {"x": np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)}, True),  # 256 KiB
    ]
    with stowage.Client(s["native"], same_node=True) as c:
        c.SAME_NODE_INLINE_BELOW = 65536  # (this module's tests set 0 for every client)
        for idx, data, leased in rows:
            before = live_segments(s)
            assert c.put(idx, data) == len(idx)
            made = live_segments(s) - before
            assert made == (1 if leased else 0), (list(data), made)
            if not leased:
                assert c._segments.channel is None, "a put on the socket opened the descriptor channel"
        with stowage.Client(s["native"]) as tcp:
            for idx, data, _ in rows:
                for got in (tcp.get(idx, list(data)), c.get(idx, list(data))):
                    for k, v in data.items():
                        if isinstance(v, list):
                            assert got[k] == v, k
                        else:
                            np.testing.assert_array_equal(got[k], v)
    # A small put that would not fit one message of the client's
    # max_message_bytes still goes through a lease (one message whatever
    # its size), and is stored whole.
    idx = fresh(4)
    x = np.arange(4 * 256, dtype=np.float32).reshape(4, 256)
    with stowage.Client(s["native"], same_node=True, max_message_bytes=1024) as c:
        c.SAME_NODE_INLINE_BELOW = 65536
        before = live_segments(s)
        assert c.put(idx, {"x": x}) == 4
        assert live_segments(s) == before + 1
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], x)
    with stowage.Client(s["native"]) as tcp:
        for i, _, _ in rows:
            tcp.clear(i)
        tcp.clear(idx)


def test_the_async_client_puts_a_small_same_node_put_on_its_event_loop(shm_server, fresh):
    """An `AsyncClient`'s same-node put under the bound goes on the socket
    from the event loop (no lane, no worker thread, no lease); one at or
    over it, under `CORE_MIN_BYTES`, through a leased segment from the
    loop too (the lease and the put on one connection); one of
    `CORE_MIN_BYTES` or more on a lane."""
    s = shm_server
    small, large, huge = fresh(4), fresh(64), fresh(512)
    x = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    big = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)  # 256 KiB
    bigger = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB

    async def main():
        async with stowage.AsyncClient(s["native"], same_node=True) as c:
            c.SAME_NODE_INLINE_BELOW = 65536
            before = live_segments(s)
            for _ in range(3):
                assert await c.put(small, {"x": x}) == 4
            assert live_segments(s) == before, "a small async same-node put leased a segment"
            assert c._core_idle == [], "a small put took a lane"  # (its first connect runs in a thread)
            assert len(c._loop_idle) == 1
            for _ in range(2):
                assert await c.put(large, {"x": big}) == 64
            assert live_segments(s) == before + 1  # (the second replaced the first's rows)
            assert c._core_idle == [], "a 256 KiB same-node put took a lane"
            assert len(c._loop_idle) == 1, "the lease and its put did not share one connection"
            assert await c.put(huge, {"x": bigger}) == 512
            assert live_segments(s) == before + 2
            assert len(c._core_idle) == 1, "a 2 MiB same-node put did not take a lane"
    asyncio.run(main())
    with stowage.Client(s["native"], same_node=True) as c:
        np.testing.assert_array_equal(c.get(small, ["x"])["x"], x)
        np.testing.assert_array_equal(c.get(large, ["x"])["x"], big)
        np.testing.assert_array_equal(c.get(huge, ["x"])["x"], bigger)
        assert c.stats()["shm_leases"] == 0
        c.clear(small)
        c.clear(large)
        c.clear(huge)


def test_a_same_node_client_of_a_stowd_without_shared_memory(tmp_path_factory, fresh):
    """`[shm] enabled = false`: a same-node client's small put needs no
    channel and is stored; a get, and a put that would lease, are refused
    with the error that says why (stowd refused a descriptor channel),
    from `Client` and `AsyncClient` alike; nothing of the refused put is
    stored."""
    small, large = fresh(4), fresh(64)
    x = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    big = np.zeros((64, 1024), np.float32)  # 256 KiB
    why = "refused a descriptor channel"
    with run_stowd(tmp_path_factory.mktemp("no-shm"), config="[shm]\nenabled = false\n", name="stowd-no-shm") as s:
        with stowage.Client(s["native"], same_node=True) as c:
            c.SAME_NODE_INLINE_BELOW = 65536
            assert c.put(small, {"x": x}) == 4
            with pytest.raises(stowage.StowageError, match=why):
                c.get(small, ["x"])
            with pytest.raises(stowage.StowageError, match=why):
                c.put(large, {"x": big})

        async def main():
            async with stowage.AsyncClient(s["native"], same_node=True) as c:
                c.SAME_NODE_INLINE_BELOW = 65536
                assert await c.put(small, {"y": x}) == 4
                with pytest.raises(stowage.StowageError, match=why):
                    await c.get(small, ["y"])
                with pytest.raises(stowage.StowageError, match=why):
                    await c.get_into(small, {"y": np.zeros_like(x)})
                with pytest.raises(stowage.StowageError, match=why):
                    await c.put(large, {"y": big})
        asyncio.run(main())
        with stowage.Client(s["native"]) as tcp:
            got = tcp.get(small, ["x", "y"])
            np.testing.assert_array_equal(got["x"], x)
            np.testing.assert_array_equal(got["y"], x)
            with pytest.raises(stowage.KeyNotFound):
                tcp.get(large, ["x"])


def test_a_refused_lease_refuses_the_put_alike_from_either_client(tmp_path_factory, fresh):
    """`[shm] max_lease_bytes` of 64 KiB: a 128 KiB same-node put's lease is
    refused, and so is the put, with the same error from `Client` and from
    `AsyncClient` (which leases on its event loop), `rows_stored` 0 and
    nothing stored; both clients go on with a put under the limit."""
    idx = fresh(32)
    x = np.ones((32, 1024), np.float32)  # 128 KiB
    shm_dir = f"/dev/shm/stowage-test-lease-limit-{os.getpid()}"
    shutil.rmtree(shm_dir, ignore_errors=True)
    config = f'[shm]\ndir = "{shm_dir}"\nmax_lease_bytes = 65536\n'
    try:
        with run_stowd(tmp_path_factory.mktemp("lease-limit"), config=config, name="stowd-lease-limit") as s:
            with stowage.Client(s["native"], same_node=True) as c:
                with pytest.raises(stowage.StowageError) as sync_err:
                    c.put(idx, {"x": x})
                assert c.put(idx[:8], {"x": x[:8]}) == 8  # 32 KiB: on the socket

            async def main():
                async with stowage.AsyncClient(s["native"], same_node=True) as c:
                    with pytest.raises(stowage.StowageError) as async_err:
                        await c.put(idx, {"y": x})
                    assert c._core_idle == [], "the refused lease was asked on a lane"
                    assert await c.put(idx[:8], {"y": x[:8]}) == 8
                    return async_err.value
            async_err = asyncio.run(main())
            assert type(async_err) is type(sync_err.value)
            assert str(async_err).split(": ", 1)[1].split(" (request")[0] == \
                str(sync_err.value).split(": ", 1)[1].split(" (request")[0]
            assert "max_lease_bytes" in str(async_err)
            assert async_err.rows_stored == 0 and sync_err.value.rows_stored == 0
            with stowage.Client(s["native"]) as tcp:
                got = tcp.get(idx[:8], ["x", "y"])
                np.testing.assert_array_equal(got["x"], x[:8])
                np.testing.assert_array_equal(got["y"], x[:8])
                with pytest.raises(stowage.KeyNotFound):
                    tcp.get(idx[8:], ["x"])
                with pytest.raises(stowage.KeyNotFound):
                    tcp.get(idx[8:], ["y"])
                assert tcp.stats()["shm_leases"] == 0
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


async def _async_gets(endpoint, idx, n):
    async with stowage.AsyncClient(endpoint, same_node=True) as c:
        return [await c.get(idx, ["x"], as_torch=False) for _ in range(n)]


def test_the_async_client_takes_a_small_same_node_reply_over_the_socket(inline_server, fresh):
    s = inline_server
    idx = fresh(4)
    a = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    with stowage.Client(s["native"]) as tcp:
        tcp.put(idx, {"x": a})
    before = stat(s, "same_node_gets_inline")
    for got in asyncio.run(_async_gets(s["native"], idx, 3)):
        np.testing.assert_array_equal(got["x"], a)
    assert stat(s, "same_node_gets_inline") == before + 3


def test_the_async_client_gets_same_node_on_its_event_loop(inline_server, fresh):
    """An `AsyncClient`'s same-node get and get_into run on its event loop
    (no lane): a small one's reply comes over the socket and is read on
    the loop; a large one's names segments, read in a worker thread, and
    two such gets share the client's mapping, as a `Client`'s do."""
    s = inline_server
    small, large = fresh(4), fresh(64)
    x = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    big = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
    with stowage.Client(s["native"]) as tcp:
        tcp.put(small, {"x": x})
        tcp.put(large, {"x": big})

    async def main():
        async with stowage.AsyncClient(s["native"], same_node=True) as c:
            before = stat(s, "same_node_gets_inline")
            np.testing.assert_array_equal((await c.get(small, ["x"]))["x"], x)
            assert stat(s, "same_node_gets_inline") == before + 1
            g1 = (await c.get(large, ["x"]))["x"]
            g2 = (await c.get(large, ["x"]))["x"]
            np.testing.assert_array_equal(g1, big)
            assert data_ptr(g1) == data_ptr(g2), "two large gets do not share the mapping"
            with pytest.raises(ValueError):
                g1[0, 0] = 1.0
            out = {"x": np.zeros((4, 16), np.float32)}
            assert await c.get_into(small, out) is out
            np.testing.assert_array_equal(out["x"], x)
            out = {"x": np.zeros((64, 1024), np.float32)}
            await c.get_into(large, out)
            np.testing.assert_array_equal(out["x"], big)
            assert stat(s, "same_node_gets_inline") == before + 2
            assert c._core_idle == [], "a same-node get took a lane"
            assert c._segments.channel is not None and c._channel_watchers == 0
    asyncio.run(main())
    with stowage.Client(s["native"]) as tcp:
        tcp.clear(small)
        tcp.clear(large)


def test_an_async_same_node_reply_is_read_on_the_loop_unless_it_may_gather_much(shm_server, fresh):
    """Where an `AsyncClient` reads a same-node reply that names segments:
    on its event loop when it is one range (views, nothing to gather) or
    at most `LOOP_GATHER_MAX` bytes; in a worker thread when its rows lie
    in several ranges and come to more (a gather, a copy). Rows right
    either way."""
    from stowage import aio
    s = shm_server
    one, two = fresh(128), fresh(128)
    a = np.arange(128 * 1024, dtype=np.float32).reshape(128, 1024)  # 512 KiB
    with stowage.Client(s["native"]) as tcp:
        tcp.put(one, {"x": a})  # one put: one extent, one range
    with stowage.Client(s["native"], same_node=True) as c:
        c.put(two[:64], {"x": a[:64]})  # two puts through leases: two segments
        c.put(two[64:], {"x": a[64:]})

    async def main():
        async with stowage.AsyncClient(s["native"], same_node=True) as c:
            await c.get(one[:1], ["x"])  # (connected, the channel open: both run in a thread)
            real, hops = c._threads, []
            c._threads = lambda: hops.append(1) or real()
            np.testing.assert_array_equal((await c.get(one, ["x"]))["x"], a)
            on_loop_one = len(hops)
            np.testing.assert_array_equal((await c.get(two[:32], ["x"]))["x"], a[:32])  # 128 KiB, one segment
            np.testing.assert_array_equal((await c.get(two[48:80], ["x"]))["x"], a[48:80])  # 128 KiB, two
            on_loop_small = len(hops) - on_loop_one
            np.testing.assert_array_equal((await c.get(two, ["x"]))["x"], a)  # 512 KiB over two segments
            return on_loop_one, on_loop_small, len(hops) - on_loop_one - on_loop_small
    one_hops, small_hops, gather_hops = asyncio.run(main())
    assert one_hops == 0, "a reply of one range went to a worker thread"
    assert small_hops == 0, f"replies under {aio.LOOP_GATHER_MAX} bytes went to a worker thread"
    assert gather_hops == 1, "a 512 KiB reply over two ranges was read on the loop"
    with stowage.Client(s["native"]) as tcp:
        tcp.clear(one)
        tcp.clear(two)


def test_async_same_node_gets_on_the_loop_many_segments_and_at_once(shm_server, fresh):
    """Same-node gets on an `AsyncClient`'s event loop: one whose reply
    names 2,000 segments (their descriptors read from the channel while
    the loop awaits the reply), and 4 at once over the client's
    connections (small and large, their descriptors on one channel): all
    rows right, no lane taken, and once done the loop no longer watches the
    channel."""
    n = 2000
    idx = fresh(n)
    with stowage.Client(shm_server["native"], same_node=True) as c:
        for g in idx:  # one row a put, through a lease (this module's bound is 0): a segment a row
            c.put([g], {"x": np.full((1, 4), g, np.int64)})
    want = np.array(idx, np.int64)

    async def main():
        async with stowage.AsyncClient(shm_server["native"], same_node=True, timeout=20, spin_us=0) as c:
            got = await c.get(idx, ["x"])
            np.testing.assert_array_equal(got["x"][:, 0], want)
            k_at_once = c.CORE_CONNECTIONS  # (more would wait for a lane)
            parts = [idx[k::k_at_once] if k % 2 else idx[k * 100:k * 100 + 3] for k in range(k_at_once)]
            many = await asyncio.gather(*(c.get(p, ["x"]) for p in parts))
            for p, g in zip(parts, many):
                np.testing.assert_array_equal(g["x"][:, 0], np.array(p, np.int64))
            assert c._core_idle == [], "a get took a lane"
            assert c._channel_watchers == 0
            fd = c._segments.channel.fileno()
            selector = asyncio.get_running_loop()._selector
            assert fd not in selector.get_map(), "the loop still watches the channel"
    try:
        asyncio.run(main())
        assert live_segments(shm_server) >= n
    finally:
        with stowage.Client(shm_server["native"]) as tcp:
            tcp.clear(idx)


@pytest.mark.parametrize("kib", [4, 256], ids=["over-the-socket", "through-segments"])
def test_a_cancelled_or_timed_out_async_same_node_get_leaves_the_client_working(inline_server, fresh, kib):
    """With stowd stopped, an `AsyncClient` same-node get on the event loop
    is cancelled, and another times out (`StowageTimeout`); once stowd
    runs again the client's next gets are right, the loop no longer
    watches the channel, and the channel is still the client's."""
    s = inline_server
    idx = fresh(kib // 4)
    a = np.arange(kib * 256, dtype=np.float32).reshape(kib // 4, 1024)
    with stowage.Client(s["native"]) as tcp:
        tcp.put(idx, {"x": a})

    async def main():
        async with stowage.AsyncClient(s["native"], same_node=True, timeout=10, spin_us=0) as c:
            np.testing.assert_array_equal((await c.get(idx, ["x"]))["x"], a)  # the channel opened
            channel = c._segments.channel
            stowd_harness.pause(s["pid"])
            try:
                task = asyncio.ensure_future(c.get(idx, ["x"]))
                await asyncio.sleep(0.1)
                assert c._channel_watchers == 1, "the waiting get does not watch the channel"
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert c._channel_watchers == 0
                with pytest.raises(stowage.StowageTimeout):
                    await c.get(idx, ["x"], timeout=0.2)
                assert c._channel_watchers == 0
            finally:
                os.kill(s["pid"], signal.SIGCONT)
            for _ in range(3):
                np.testing.assert_array_equal((await c.get(idx, ["x"]))["x"], a)
            out = {"x": np.zeros_like(a)}
            await c.get_into(idx, out)
            np.testing.assert_array_equal(out["x"], a)
            assert c._segments.channel is channel and not channel.closed
            assert c._channel_watchers == 0
    asyncio.run(main())
    with stowage.Client(s["native"]) as tcp:
        tcp.clear(idx)


@pytest.mark.parametrize("kib", [4, 256], ids=["over-the-socket", "through-segments"])
def test_a_same_node_reply_is_awaited_by_spinning_then_sleeping(inline_server, fresh, monkeypatch, kib):
    """A same-node get polls its socket and channel for `spin_us` before
    it sleeps, as a get over the socket alone does: with stowd stopped for
    0.2 s, a client with a 5 s spin uses CPU for the wait, one with
    spin_us=0 almost none; the rows are right either way."""
    monkeypatch.setenv("STOWAGE_SPIN_CROWDED_US", str(10**7))
    s = inline_server
    idx = fresh(kib // 4)
    a = np.arange(kib * 256, dtype=np.float32).reshape(kib // 4, 1024)
    with stowage.Client(s["native"]) as tcp:
        tcp.put(idx, {"x": a})

    def paused_get(c):
        c.get(idx, ["x"])  # the channel opened, the rows where they will be
        stowd_harness.pause(s["pid"])
        threading.Timer(0.2, os.kill, (s["pid"], signal.SIGCONT)).start()
        t = time.thread_time()
        got = c.get(idx, ["x"], as_torch=False)
        cpu = time.thread_time() - t
        np.testing.assert_array_equal(got["x"], a)
        return cpu

    with stowage.Client(s["native"], same_node=True, timeout=10, spin_us=0) as c:
        asleep = paused_get(c)
    with stowage.Client(s["native"], same_node=True, timeout=10, spin_us=5e6) as c:
        spinning = paused_get(c)
    assert asleep < 0.02, asleep
    assert spinning > 0.05, spinning


def test_two_gets_share_memory_and_writes_raise(shm_server, fresh):
    idx = fresh(64)
    a = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    with stowage.Client(shm_server["native"]) as tcp:  # arrives over tcp...
        tcp.put(idx, {"x": a, "tag": [f"t{i}" for i in range(64)]})
    with stowage.Client(shm_server["native"], same_node=True) as c:
        g1 = c.get(idx, ["x", "tag"])  # ...moved to shared memory once
        after_first = live_segments(shm_server)
        g2 = c.get(idx, ["x"])
        assert live_segments(shm_server) == after_first, "the second get copied the rows again"
        np.testing.assert_array_equal(g1["x"], a)
        assert g1["tag"] == [f"t{i}" for i in range(64)]
        assert data_ptr(g1["x"]) == data_ptr(g2["x"]), "two gets of the same rows do not share memory"
        assert not g1["x"].flags.writeable
        with pytest.raises(ValueError):
            g1["x"][0, 0] = -1.0
        # A subset in another order still comes from the same pages.
        g3 = c.get([idx[5]], ["x"])
        assert data_ptr(g3["x"]) == data_ptr(g1["x"]) + 5 * a[0].nbytes
    with stowage.Client(shm_server["native"]) as tcp:
        np.testing.assert_array_equal(tcp.get(idx, ["x"])["x"], a)  # the store is intact


def test_a_mapping_stays_valid_after_a_clear(shm_server, fresh):
    idx = fresh(8)
    a = np.random.default_rng(1).random((8, 1024), dtype=np.float32)
    with stowage.Client(shm_server["native"], same_node=True) as c:
        c.put(idx, {"x": a})
        got = c.get(idx, ["x"])["x"]
        before = live_segments(shm_server)
        assert c.clear(idx) == 8
        assert eventually(lambda: live_segments(shm_server) < before), \
            "the cleared rows' segment was not released by stowd"
        np.testing.assert_array_equal(got, a)  # still mapped, still the same bytes
        with pytest.raises(stowage.KeyNotFound):
            c.get(idx, ["x"])


def test_puts_go_through_a_leased_segment_without_a_copy(shm_server, fresh):
    idx = fresh(16)
    a = np.arange(16 * 100, dtype=np.int64).reshape(16, 100)
    nested = [np.arange(i % 4, dtype=np.int8) for i in range(16)]
    with stowage.Client(shm_server["native"], same_node=True) as c:
        before = live_segments(shm_server)
        c.put(idx, {"x": a, "n": nested})
        assert live_segments(shm_server) == before + 1, "expected the one leased segment"
        got = c.get(idx, ["x", "n"])
        # Served from the adopted lease itself: no further segment was made.
        assert live_segments(shm_server) == before + 1
        np.testing.assert_array_equal(got["x"], a)
        for want, row in zip(nested, got["n"]):
            np.testing.assert_array_equal(row, want)
        assert stat(shm_server, "shm_leases") == 0
    with stowage.Client(shm_server["native"]) as tcp:  # and over tcp, the same rows
        np.testing.assert_array_equal(tcp.get(idx, ["x"])["x"], a)


def test_get_into_from_shared_memory(shm_server, fresh):
    idx = fresh(32)
    a = np.random.default_rng(2).random((32, 64))
    with stowage.Client(shm_server["native"], same_node=True) as c:
        c.put(idx, {"x": a})
        out = np.zeros_like(a)
        c.get_into(idx[::-1], {"x": out})
        np.testing.assert_array_equal(out, a[::-1])


def test_an_unused_lease_expires_and_a_crashed_client_leaks_nothing(short_lease_server):
    shm_server = short_lease_server
    # A client that leases a segment and dies before putting it.
    script = textwrap.dedent(f"""
        import os, stowage
        c = stowage.Client({shm_server["native"]!r}, same_node=True)
        c._open_channel()
        body, _ = c._call("lease", {{"bytes": 1 << 20}}, (), None, "lease_ok", c._segments.extras(get=False))
        print(body["segment"], flush=True)
        os._exit(9)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 9, out.stderr
    name = out.stdout.strip()
    assert name
    assert eventually(lambda: stat(shm_server, "shm_leases") == 0, 10), "the expired lease was not dropped"
    assert eventually(lambda: stat(shm_server, "shm_channels") == 0, 10), "the dead client's channel stayed open"
    # Naming it in a put afterwards is refused, not trusted.
    with stowage.Client(shm_server["native"], same_node=True) as c:
        msg = {"global_indexes": [1], "fields": {"x": ("regular", "uint8", [1, 4], [(1, 0, 4, 1)])}}
        with pytest.raises(stowage.BadRequest, match="lease"):
            c._call("put", msg, (), None, "put_ok", {"segments": [[name, 0, 4]]})


def _pfn(address: int) -> int:
    """Physical frame of the page at `address` in this process (needs root)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek((address // os.sysconf("SC_PAGE_SIZE")) * 8)
        entry = struct.unpack("<Q", f.read(8))[0]
    assert entry >> 63, "page not present"
    return entry & ((1 << 55) - 1)


def test_two_processes_read_the_same_pages(shm_server, fresh):
    if os.geteuid() != 0:
        pytest.fail("reading physical page numbers from /proc/self/pagemap needs root (CI runs as root)")
    idx = fresh(4)
    a = np.full((4, 4096), 7, dtype=np.uint8)
    with stowage.Client(shm_server["native"], same_node=True) as c:
        c.put(idx, {"x": a})
        mine = c.get(idx, ["x"])["x"]
        assert int(mine[2, 0]) == 7
        here = _pfn(data_ptr(mine) + 2 * 4096)
        script = textwrap.dedent(f"""
            import os, struct, stowage
            c = stowage.Client({shm_server["native"]!r}, same_node=True)
            x = c.get({idx!r}, ["x"])["x"]
            assert int(x[2, 0]) == 7
            addr = x.__array_interface__["data"][0] + 2 * 4096
            with open("/proc/self/pagemap", "rb") as f:
                f.seek((addr // os.sysconf("SC_PAGE_SIZE")) * 8)
                e = struct.unpack("<Q", f.read(8))[0]
            print(e & ((1 << 55) - 1))
        """)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert here != 0 and int(out.stdout) == here, "the other process reads different physical pages"


def test_a_1_gib_get_maps_without_copying(shm_server, fresh):
    """The Ray-style check: a 1 GiB same-node get returns in well under the
    time a copy would take and does not grow this process's RSS by the
    tensor's size; two gets share memory."""
    n = GIB // (4096 * 4)
    idx = fresh(n)
    a = np.ones((n, 4096), dtype=np.float32)
    with stowage.Client(shm_server["native"], same_node=True, timeout=120) as c:
        c.put(idx, {"x": a})
        del a
        rss0 = rss_bytes()
        t = time.perf_counter()
        g1 = c.get(idx, ["x"])["x"]
        took = time.perf_counter() - t
        grown = rss_bytes() - rss0
        g2 = c.get(idx, ["x"])["x"]
        assert g1.nbytes == GIB
        assert data_ptr(g1) == data_ptr(g2)
        assert grown < GIB // 10, f"RSS grew by {grown / GIB:.2f} GiB on a 1 GiB zero-copy get"
        assert float(g1[n - 1, 4095]) == 1.0
        print(f"1 GiB same-node get: {took * 1e3:.2f} ms, RSS +{grown >> 20} MiB")
        c.clear(idx)


@pytest.mark.parametrize("same_node", [True, False])
def test_scattered_rows_from_several_puts_are_gathered_right(shm_server, fresh, same_node):
    """A get of rows in random order, from two puts (two segments, or two
    received frames), some repeated: many parts that the client gathers with
    one numpy call per buffer (and the nested and scalar fields beside them)."""
    idx = fresh(300)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((300, 33)).astype(np.float32)  # 132-byte rows: offsets not multiples of 64
    s = np.arange(300, dtype=np.int64)
    ids = [np.arange(k, dtype=np.int16) for k in rng.integers(0, 40, 300)]
    with stowage.Client(shm_server["native"], same_node=same_node) as c:
        c.put(idx[:150], {"x": x[:150], "s": s[:150], "ids": ids[:150]})
        c.put(idx[150:], {"x": x[150:], "s": s[150:], "ids": ids[150:]})
        pick = [int(p) for p in rng.permutation(300)[:200]] + [5, 5, 299]
        got = c.get([idx[p] for p in pick], ["x", "s", "ids"])
        np.testing.assert_array_equal(got["x"], x[pick])
        np.testing.assert_array_equal(got["s"], s[pick])
        assert all(np.array_equal(a, ids[p]) for a, p in zip(got["ids"], pick))
        assert not got["x"].flags.writeable
        out = {"x": np.full((len(pick), 33), -1, np.float32), "s": np.zeros(len(pick), np.int64)}
        c.get_into([idx[p] for p in pick], out)
        np.testing.assert_array_equal(out["x"], x[pick])
        np.testing.assert_array_equal(out["s"], s[pick])
        c.clear(idx)


def test_rows_another_process_still_maps_are_never_rewritten(shm_server, fresh):
    """A reader's arrays stay what they were after the rows are cleared and
    new puts of the same size follow: cleared memory is never reused."""
    idx = fresh(64)
    a = np.full((64, 8192), 3, np.float32)
    script = textwrap.dedent(f"""
        import sys, numpy as np, stowage
        c = stowage.Client({shm_server["native"]!r}, same_node=True)
        x = c.get({idx!r}, ["x"])["x"]
        print("mapped", flush=True)
        sys.stdin.readline()
        assert (x == 3).all(), "rows this process maps were rewritten"
        print("intact", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with stowage.Client(shm_server["native"], same_node=True) as c:
        c.put(idx, {"x": a})
        reader = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env)
        try:
            assert reader.stdout.readline().strip() == "mapped"
            c.clear(idx)  # this process maps nothing; the other one does
            for k in range(4):
                c.put(idx, {"x": np.full((64, 8192), 10 + k, np.float32)})
                c.clear(idx)
            reader.stdin.write("go\n")
            reader.stdin.flush()
            assert reader.stdout.readline().strip() == "intact"
            assert reader.wait(timeout=60) == 0
        finally:
            reader.kill()
            reader.wait()


def test_a_same_node_get_names_each_segment_once(shm_server, fresh):
    """Scattered rows of one segment, regular and nested: the reply lists the
    segment once, as a whole file, its one descriptor comes on the channel,
    and every row is an offset in it (not one segment entry per row)."""
    import msgpack
    import zmq

    from stowage import _codec
    idx = fresh(300)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((300, 33)).astype(np.float32)
    ids = [np.arange(k, dtype=np.int16) for k in rng.integers(1, 40, 300)]
    pick = [idx[int(p)] for p in rng.permutation(300)[:200]]
    ch = open_channel(shm_server)
    with stowage.Client(shm_server["native"], same_node=True) as c:
        c.put(idx, {"x": x, "ids": ids})
        sock = zmq.Context.instance().socket(zmq.DEALER)
        stowd_harness.offer_token(sock, shm_server["native"])
        sock.connect(shm_server["native"])
        try:
            sock.send(_codec.envelope("get", 7, {"global_indexes": pick, "fields": ["x", "ids"]},
                                      {"same_node": True, "channel": ch.token}))
            assert sock.poll(30_000)
            frames = sock.recv_multipart()
        finally:
            sock.close(linger=0)
        env = msgpack.unpackb(frames[0], raw=False)
        assert env["op"] == "get_ok" and len(frames) == 1
        fds = ch.take(7, 10)
        try:
            assert len(fds) == 1
            (seg, fd), = fds.items()
            size = os.fstat(fd).st_size
        finally:
            for fd in fds.values():
                os.close(fd)
            ch.close()
        assert env["segments"] == [[seg, 0, size]]
        parts = env["body"]["fields"]["x"]["parts"]
        assert len(parts) > 100 and {p["frame"] for p in parts} == {1}
        assert {r["frame"] for r in env["body"]["fields"]["ids"]["rows"]} == {1}
        got = c.get(pick, ["x", "ids"])
        want = [int(p) - idx[0] for p in pick]
        np.testing.assert_array_equal(got["x"], x[want])
        assert all(np.array_equal(a, ids[w]) for a, w in zip(got["ids"], want))
        c.clear(idx)


def test_a_channel_is_usable_the_moment_its_greeting_arrives(shm_server, fresh):
    """A client names its token in a lease right after reading the greeting:
    stowd must already know it (it once registered the channel only after
    writing the greeting, and a fast client got "no descriptor channel")."""
    idx = fresh(40)
    for i in range(40):
        with stowage.Client(shm_server["native"], same_node=True) as c:
            c.put([idx[i]], {"x": np.full((1, 64), i, np.uint8)})
    with stowage.Client(shm_server["native"]) as tcp:
        np.testing.assert_array_equal(tcp.get(idx, ["x"])["x"], np.repeat(np.arange(40, dtype=np.uint8), 64).reshape(40, 64))


def test_a_client_opens_a_new_channel_when_stowd_restarts(tmp_path):
    """The same clients (sync and asyncio) before and after stowd restarts on
    the same endpoint: their old channel token is unknown to the new stowd,
    and they open a new channel and go on."""
    import asyncio
    import socket as pysocket
    with pysocket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shm_dir = f"/dev/shm/stowage-test-restart-{os.getpid()}"
    config = f'[server]\nnative_port = {port}\n[shm]\ndir = "{shm_dir}"\ninline_below = 0\n'
    x = np.arange(64, dtype=np.float32).reshape(4, 16)
    c = stowage.Client(f"tcp://127.0.0.1:{port}", same_node=True, timeout=20)
    ac = stowage.AsyncClient(f"tcp://127.0.0.1:{port}", same_node=True, timeout=20)
    try:
        for life in range(3):
            with run_stowd(tmp_path / f"life{life}", config=config):
                with stowage.Client(f"tcp://127.0.0.1:{port}") as tcp:
                    tcp.put([8, 9], {"y": x[:2] + life})
                # A get first: in the second life it names the first one's
                # channel, which the new stowd refuses; the get is asked
                # again on a new channel (sync and asyncio alike).
                np.testing.assert_array_equal(c.get([8, 9], ["y"])["y"], x[:2] + life)
                c.put([0, 1, 2, 3], {"x": x + life})
                np.testing.assert_array_equal(c.get([0, 1, 2, 3], ["x"])["x"], x + life)

                async def use():
                    # The asyncio client's first call after a restart: a get
                    # in the second life, a put through a lease (on its event
                    # loop) in the third; each asked again on a new channel.
                    big = np.full((32, 1024), life, np.float32)  # 128 KiB: leased
                    if life == 2:
                        await ac.put(list(range(100, 132)), {"z": big})
                    np.testing.assert_array_equal((await ac.get([8, 9], ["y"]))["y"], x[:2] + life)
                    await ac.put(list(range(100, 132)), {"z": big})
                    np.testing.assert_array_equal((await ac.get(list(range(100, 132)), ["z"]))["z"], big)
                    await ac.put([4, 5, 6, 7], {"x": x - life})
                    return (await ac.get([4, 5, 6, 7], ["x"]))["x"]

                np.testing.assert_array_equal(asyncio.run(use()), x - life)
    finally:
        c.close()
        ac.close()
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_same_node_requests_without_an_open_channel_are_refused(shm_server, fresh):
    """A same-node get or a lease must name an open channel of this stowd."""
    idx = fresh(2)
    with stowage.Client(shm_server["native"]) as c:
        c.put(idx, {"x": np.ones((2, 4), np.float32)})
        get = {"global_indexes": idx, "fields": ["x"]}
        with pytest.raises(stowage.BadRequest, match="needs the envelope key `channel`"):
            c._call("get", get, (), None, "get_ok", {"same_node": True})
        with pytest.raises(stowage.BadRequest, match="no descriptor channel has token"):
            c._call("get", get, (), None, "get_ok", {"same_node": True, "channel": "0" * 32})
        with pytest.raises(stowage.BadRequest, match="needs the envelope key `channel`"):
            c._call("lease", {"bytes": 64}, (), None, "lease_ok")
        assert stat(shm_server, "shm_leases") == 0
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], np.ones((2, 4), np.float32))


# ---------------------------------------------------------------- empty puts (issue 14, finding 7)

EMPTY_PUTS = {
    "regular [n, 0]": lambda n: np.zeros((n, 0), np.float32),
    "nested, every row empty": lambda n: [np.zeros(0, np.int64) for _ in range(n)],
}


@pytest.mark.parametrize("shape", list(EMPTY_PUTS))
def test_an_empty_same_node_put_and_its_get(shm_server, fresh, shape):
    """A same-node put whose tensors hold 0 bytes in all (nothing to lease)
    is stored, from the sync and the asyncio client, and gets (same node and
    tcp) return the empty arrays."""
    import asyncio
    idx = fresh(6)
    x = EMPTY_PUTS[shape](6)

    def check(got, n):
        if isinstance(x, np.ndarray):
            assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (n, 0)
        else:  # rows of one shape come back as one regular array; its rows iterate as before
            assert len(got) == n
            assert all(r.dtype == np.int64 and r.shape == (0,) for r in got)

    with stowage.Client(shm_server["native"], same_node=True) as c:
        assert c.put(idx[:3], {"e": x[:3], "tag": ["a", "b", "c"]}) == 3
        got = c.get(idx[:3], ["e", "tag"])
        check(got["e"], 3)
        assert got["tag"] == ["a", "b", "c"]

    async def put_async():
        async with stowage.AsyncClient(shm_server["native"], same_node=True) as c:
            return await c.put(idx[3:], {"e": x[3:], "tag": ["d", "e", "f"]})

    assert asyncio.run(asyncio.wait_for(put_async(), 60)) == 3
    with stowage.Client(shm_server["native"], same_node=True) as c:
        check(c.get(idx, ["e"])["e"], 6)
    with stowage.Client(shm_server["native"]) as tcp:
        got = tcp.get(idx, ["e", "tag"])
        check(got["e"], 6)
        assert got["tag"] == list("abcdef")


# ---------------------------------------------------------------- writes (issue 14, finding 8)


def test_numpy_arrays_of_same_node_gets_are_read_only_and_shared(shm_server, fresh):
    """Regular and nested: two gets give the same data pointers; a write
    raises ValueError (so does making the array writable), and the rows stay
    intact."""
    idx = fresh(8)
    x = np.arange(8 * 1024, dtype=np.int32).reshape(8, 1024)
    n = [np.full(100 + i, i, np.float64) for i in range(8)]
    with stowage.Client(shm_server["native"], same_node=True) as c:
        c.put(idx, {"x": x, "n": n})
        g1, g2 = c.get(idx, ["x", "n"]), c.get(idx, ["x", "n"])
        assert data_ptr(g1["x"]) == data_ptr(g2["x"])
        assert [data_ptr(r) for r in g1["n"]] == [data_ptr(r) for r in g2["n"]]
        for a in (g1["x"], g1["n"][3]):
            with pytest.raises(ValueError, match="read-only"):
                a[0] = 7
            with pytest.raises(ValueError):
                a.flags.writeable = True
            with pytest.raises(ValueError, match="read-only"):
                np.add(a, 1, out=a)
        np.testing.assert_array_equal(g2["x"], x)
        np.testing.assert_array_equal(g2["n"][3], n[3])
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], x)


# The reader's side of the in-place torch test, run in a process of its own: on
# a tensor over a read-only mapping, `add_` is a SIGSEGV, which would kill pytest.
_IN_PLACE_SCRIPT = """
import json, sys
import numpy as np, torch, stowage

native, idx = sys.argv[1], json.loads(sys.argv[2])
n = len(idx)
x = np.arange(n * 2048, dtype=np.float32).reshape(n, 2048)
rows = [np.arange(i * 1000, i * 1000 + 5000 + i, dtype=np.int64) for i in range(n)]
bf = torch.arange(n * 64, dtype=torch.float32).reshape(n, 64).to(torch.bfloat16)
c = stowage.Client(native, same_node=True)
c.put(idx, {"x": x, "rows": rows, "bf": bf})

t = c.get(idx, ["x", "rows"], as_torch=True)               # the tensors written to
other = c.get(idx, ["x", "rows"], as_torch=True)           # another get's tensors
arrays = c.get(idx, ["x", "rows"])                         # numpy arrays over the shared mapping
twice = c.get([idx[1], idx[1]], ["x", "rows"], as_torch=True)  # a row asked for twice
auto = c.get(idx, ["bf"])["bf"]                            # as_torch=None: bfloat16 is a tensor
print("got", flush=True)

t["x"].add_(1)
t["x"][0].sub_(5)
t["x"].masked_fill_(t["x"] > 1e6, 0)
t["x"].clamp_(max=1e5)
t["rows"][1].add_(100)
twice["x"][0].mul_(-1)
twice["rows"][0].zero_()
auto.add_(1)
print("written", flush=True)

want = torch.from_numpy(x) + 1
want[0] -= 5
assert torch.equal(t["x"], want.clamp(max=1e5)), "the write did not take"
assert torch.equal(t["rows"][1], torch.from_numpy(rows[1]) + 100)
assert torch.equal(auto.float(), bf.float() + 1)
assert torch.equal(other["x"], torch.from_numpy(x)), "another get's tensor changed"
assert all(torch.equal(a, torch.from_numpy(b)) for a, b in zip(other["rows"], rows)), "another get's rows changed"
np.testing.assert_array_equal(arrays["x"], x)
assert all(np.array_equal(a, b) for a, b in zip(arrays["rows"], rows)), "a numpy array changed"
assert torch.equal(twice["x"][1], torch.from_numpy(x[1])), "a row asked for twice is one tensor"
assert torch.equal(twice["rows"][1], torch.from_numpy(rows[1])), "a row asked for twice is one tensor"
assert torch.equal(twice["x"][0], -torch.from_numpy(x[1]))
again = c.get(idx, ["x", "rows", "bf"])                    # a fresh same-node get
np.testing.assert_array_equal(again["x"], x)
assert all(np.array_equal(a, b) for a, b in zip(again["rows"], rows))
assert torch.equal(again["bf"], bf)
print("ok", flush=True)
"""


def test_an_in_place_torch_op_on_a_same_node_tensor_changes_only_that_tensor(shm_server, fresh):
    """`add_` & co. on tensors of a same-node get (regular, nested rows, a
    bfloat16 field, a row asked for twice) work in the reader's process and
    leave every other reader's data unchanged: another get's tensors, numpy
    arrays, a fresh get (same node, and over tcp from this process) and the
    stored rows."""
    from stowage import _torch
    idx = fresh(4)
    if not _torch.available():
        # This client without torch: as_torch says what is missing.
        with stowage.Client(shm_server["native"], same_node=True) as c:
            c.put(idx, {"x": np.ones((4, 2), np.float32)})
            with pytest.raises(ImportError, match="needs torch"):
                c.get(idx, ["x"], as_torch=True)
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _IN_PLACE_SCRIPT, shm_server["native"], json.dumps(idx)], capture_output=True, text=True, env=env, timeout=120)
    how = f"killed by signal {-out.returncode}" if out.returncode < 0 else f"exit status {out.returncode}"
    assert out.returncode == 0 and out.stdout.split() == ["got", "written", "ok"], (
        f"the reader process failed ({how}) after printing {out.stdout.split()}:\n{out.stderr[-3000:]}")
    import torch
    x = np.arange(4 * 2048, dtype=np.float32).reshape(4, 2048)
    with stowage.Client(shm_server["native"]) as tcp:  # the stored rows, over tcp
        got = tcp.get(idx, ["x", "rows"], as_torch=True)
        assert torch.equal(got["x"], torch.from_numpy(x))
        assert torch.equal(got["rows"][1], torch.arange(1000, 6001, dtype=torch.int64))
    with stowage.Client(shm_server["native"], same_node=True) as c:
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], x)
        c.clear(idx)


def _torch_or_none(server, idx):
    """torch, or None after checking that a client without it says so."""
    from stowage import _torch
    if _torch.available():
        import torch
        return torch
    with stowage.Client(server["native"], same_node=True) as c:
        c.put(idx, {"x": np.ones((len(idx), 2), np.float32)})
        with pytest.raises(ImportError, match="needs torch"):
            c.get(idx, ["x"], as_torch=True)
    return None


def _perms(address: int) -> str:
    """The permissions of this process's mapping holding `address` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms
    raise AssertionError(f"address {address:#x} is not mapped")


def test_a_same_node_tensor_is_the_shared_pages_until_written(shm_server, fresh):
    """A tensor's own mapping (another data pointer than the numpy array's)
    reads the very physical pages every reader maps; a write copies only the
    page it touches."""
    if os.geteuid() != 0:
        pytest.fail("reading physical page numbers from /proc/self/pagemap needs root (CI runs as root)")
    idx = fresh(8)
    torch = _torch_or_none(shm_server, idx)
    if torch is None:
        return
    with stowage.Client(shm_server["native"], same_node=True) as c:
        c.put(idx, {"x": np.full((8, 4096), 7, np.uint8)})  # rows of one page (not page-aligned)
        a = c.get(idx, ["x"])["x"]
        t = c.get(idx, ["x"], as_torch=True)["x"]
        assert t.data_ptr() != data_ptr(a), "the tensor is a view of the read-only mapping numpy arrays share"
        assert t.data_ptr() % 4096 == data_ptr(a) % 4096  # the same file offset
        assert int(t[2, 0]) == int(t[5, 0]) == int(a[2, 0]) == int(a[5, 0]) == 7  # (faults the pages in)
        shared_2, shared_5 = _pfn(data_ptr(a) + 2 * 4096), _pfn(data_ptr(a) + 5 * 4096)
        assert _pfn(t.data_ptr() + 2 * 4096) == shared_2, "the tensor's pages were copied before any write"
        assert _pfn(t.data_ptr() + 5 * 4096) == shared_5
        # (Checked before writing: a write to a read-only page would kill pytest.)
        assert _perms(t.data_ptr()) == "rw-p", "the tensor's memory is not a private writable mapping"
        assert _perms(data_ptr(a)) == "r--s"
        t[2].add_(1)  # touches the pages holding row 2: rows 1-3 at most
        assert int(t[2, 0]) == 8 and int(a[2, 0]) == 7
        assert _pfn(t.data_ptr() + 2 * 4096) != shared_2, "the written page is still the shared one"
        assert _pfn(t.data_ptr() + 5 * 4096) == shared_5, "a page not written to was copied"
        assert _pfn(data_ptr(a) + 2 * 4096) == shared_2
        c.clear(idx)


# ---------------------------------------------------------------- trust (issue 14, findings 1-4)


def _lease_by_hand(c, nbytes: int) -> tuple[str, int]:
    """A lease taken as the client takes one: (segment name, its writable descriptor)."""
    c._open_channel()
    body, _ = c._call("lease", {"bytes": nbytes}, (), None, "lease_ok", c._segments.extras(get=False))
    return body["segment"], c._segments._leased.pop(body["segment"])


def _filled_lease(c, payload: bytes) -> tuple[str, int, mmap.mmap]:
    """A lease filled with `payload` through a shared writable mapping, then
    unmapped: (segment name, its writable descriptor, a read-only mapping of
    it made through a read-only descriptor; through the writable one it
    would stop the seal, as mprotect could make it writable)."""
    name, fd = _lease_by_hand(c, len(payload))
    with mmap.mmap(fd, len(payload)) as mm:
        mm[:] = payload
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    try:
        return name, fd, mmap.mmap(ro, len(payload), prot=mmap.PROT_READ)
    finally:
        os.close(ro)


def _put_body(idx: list, row_bytes: int) -> dict:
    n = len(idx)
    # (a descriptor as `_core.encode_request` takes them: (kind, dtype, shape, parts))
    return {"global_indexes": idx, "fields": {"x": ("regular", "uint8", [n, row_bytes], [(1, 0, n * row_bytes, n)])}}


def test_a_writer_that_keeps_a_writable_mapping_cannot_put_its_lease(shm_server, fresh):
    idx = fresh(4)
    with stowage.Client(shm_server["native"], same_node=True) as c:
        name, fd = _lease_by_hand(c, 4 * 4096)
        mm = mmap.mmap(fd, 4 * 4096)  # shared, writable: kept through the put
        mm[:] = b"\x01" * len(mm)
        with pytest.raises(stowage.BadRequest, match="still mapped writable"):
            c._call("put", _put_body(idx, 4096), (), None, "put_ok", {"segments": [[name, 0, 4 * 4096]]})
        mm.close()
        os.close(fd)
        # Nothing was stored, and the lease is void.
        with pytest.raises(stowage.KeyNotFound):
            c.get(idx, ["x"])
        with pytest.raises(stowage.BadRequest, match="lease"):
            c._call("put", _put_body(idx, 4096), (), None, "put_ok", {"segments": [[name, 0, 4 * 4096]]})


def test_no_descriptor_or_mapping_a_writer_keeps_can_change_rows_after_put_ok(shm_server, fresh):
    idx = fresh(4)
    data = np.full((4, 4096), 5, np.uint8)
    with stowage.Client(shm_server["native"], same_node=True) as c:
        name, fd, kept = _filled_lease(c, data.tobytes())  # `kept`: a read-only mapping, kept
        c._call("put", _put_body(idx, 4096), (), None, "put_ok", {"segments": [[name, 0, data.nbytes]]})
        # The writer still holds its read-write descriptor: every way to write fails.
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\xff" * 16, 0)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, data.nbytes)  # shared, writable
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        # So does the same file opened anew through /proc.
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"\xff" * 16, 0)
        finally:
            os.close(rw)
        # A private mapping may be written: its pages are its own.
        with mmap.mmap(fd, data.nbytes, flags=mmap.MAP_PRIVATE) as private:
            private[:16] = b"\xff" * 16
        os.close(fd)
        assert kept[:16] == b"\x05" * 16
        kept.close()
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], data)
    with stowage.Client(shm_server["native"]) as tcp:
        np.testing.assert_array_equal(tcp.get(idx, ["x"])["x"], data)


def test_a_reader_cannot_change_stored_rows_through_its_descriptor(shm_server, fresh):
    """The descriptor a same-node get hands over is read-only, and reopened
    read-write (as any process of stowd's user can) the seals still refuse
    every write."""
    import zmq

    from stowage import _codec
    idx = fresh(4)
    data = np.full((4, 4096), 9, np.uint8)
    with stowage.Client(shm_server["native"]) as tcp:
        tcp.put(idx, {"x": data})
    ch = open_channel(shm_server)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    stowd_harness.offer_token(sock, shm_server["native"])
    sock.connect(shm_server["native"])
    try:
        sock.send(_codec.envelope("get", 3, {"global_indexes": idx, "fields": ["x"]},
                                  {"same_node": True, "channel": ch.token}))
        assert sock.poll(30_000)
        sock.recv_multipart()
        fds = ch.take(3, 10)
    finally:
        sock.close(linger=0)
        ch.close()
    (fd,) = fds.values()
    try:
        with pytest.raises(OSError):
            os.pwrite(fd, b"\x00" * 16, 0)  # opened read-only
        with pytest.raises(PermissionError):
            mmap.mmap(fd, data.nbytes)  # a shared writable mapping
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"\x00" * 16, 0)
            with pytest.raises(PermissionError):
                mmap.mmap(rw, data.nbytes)
            with pytest.raises(PermissionError):
                os.ftruncate(rw, 0)
        finally:
            os.close(rw)
    finally:
        os.close(fd)
    with stowage.Client(shm_server["native"]) as tcp:
        np.testing.assert_array_equal(tcp.get(idx, ["x"])["x"], data)
    with stowage.Client(shm_server["native"], same_node=True) as c:
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], data)


def test_a_cleared_segment_is_never_reused_under_an_old_mapping(shm_server, fresh):
    """Client A keeps a (read-only) mapping of its lease, puts and clears; B's
    puts of the same size never land in those pages (finding 2)."""
    idx = fresh(64)
    a = np.full((64, 8192), 1, np.uint8)
    with stowage.Client(shm_server["native"], same_node=True) as c:
        name, fd, old = _filled_lease(c, a.tobytes())
        os.close(fd)
        c._call("put", _put_body(idx, 8192), (), None, "put_ok", {"segments": [[name, 0, a.nbytes]]})
        assert c.clear(idx) == 64
    with stowage.Client(shm_server["native"], same_node=True) as b:
        for k in range(3):
            b.put(idx, {"x": np.full((64, 8192), 2 + k, np.uint8)})
            np.testing.assert_array_equal(b.get(idx, ["x"])["x"], np.full((64, 8192), 2 + k, np.uint8))
            assert old[:8] == b"\x01" * 8 and old[-8:] == b"\x01" * 8, "another client's rows showed up"
        b.clear(idx)
    old.close()


_AS_NOBODY = """
import os, socket, sys
path, pid = sys.argv[1], int(sys.argv[2])
def refused(what, f):
    try:
        f()
    except PermissionError:
        return
    print("allowed:", what, flush=True)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
refused("connect to the channel", lambda: s.connect(path))
refused("list the channel directory", lambda: os.listdir(os.path.dirname(path)))
refused("create in the channel directory", lambda: open(os.path.join(os.path.dirname(path), "x"), "w"))
refused("list stowd's descriptors", lambda: os.listdir(f"/proc/{pid}/fd"))
for n in range(3, 64):
    refused(f"open stowd's descriptor {n}", lambda: os.open(f"/proc/{pid}/fd/{n}", os.O_RDONLY))
print("done", flush=True)
"""


def _as_nobody():
    os.setgid(65534)
    os.setgroups([])
    os.setuid(65534)


def test_another_user_cannot_reach_the_channel_or_a_segment(shm_server, fresh):
    if os.geteuid() != 0:
        pytest.fail("acting as another user (nobody) needs root (CI runs as root)")
    idx = fresh(4)
    with stowage.Client(shm_server["native"], same_node=True) as c:
        c.put(idx, {"x": np.ones((4, 4096), np.uint8)})
        c.get(idx, ["x"])
        body, _ = c._call("channel", {}, (), None, "channel_ok")
    # An interpreter nobody may run (this one may live under /root).
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    out = subprocess.run([python, "-c", _AS_NOBODY, body["path"], str(shm_server["pid"])], cwd="/",
                         capture_output=True, text=True, timeout=60, preexec_fn=_as_nobody)
    assert out.returncode == 0 and out.stdout.split() == ["done"], out.stdout + out.stderr


def test_a_restarted_stowd_with_the_same_pid_starts_cleanly(tmp_path):
    """stowd as PID 1 of a pid namespace (as in a container), killed, then
    started again as PID 1: it removes its predecessor's channel directory
    and serves same-node clients (finding 4)."""
    from stowd_harness import stowd_binary
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("a pid namespace needs root and unshare(1) (CI runs as root)")
    shm_dir = Path(f"/dev/shm/stowage-restart-{os.getpid()}")  # a socket path has at most 107 bytes
    shutil.rmtree(shm_dir, ignore_errors=True)
    cfg = tmp_path / "stowd.toml"
    cfg.write_text(f'[server]\nnative_port = 0\n[units]\nlocal = 1\n[shm]\ndir = "{shm_dir}"\ninline_below = 0\n')

    def start(n: int):
        ep = tmp_path / f"ep{n}.json"
        proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                                 str(stowd_binary()), "serve", "--config", str(cfg), "--endpoints-file", str(ep)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert eventually(ep.is_file, 30), "stowd did not start"
        return proc, json.loads(ep.read_text())

    first, ep1 = start(1)
    try:
        assert ep1["pid"] == 1
        (old,) = os.listdir(shm_dir)
        assert old.startswith("stowd-1-")
    finally:
        first.kill()  # SIGKILL: nothing is cleaned up on the way out
        first.wait()
    assert os.listdir(shm_dir) == [old]
    time.sleep(1.2)  # start times are known to about a second
    second, ep2 = start(2)
    try:
        assert ep2["pid"] == 1
        (new,) = os.listdir(shm_dir)
        assert new != old and new.startswith("stowd-1-"), "the predecessor's directory is still there"
        with stowage.Client(ep2["native"], same_node=True, timeout=20) as c:
            c.put([0, 1], {"x": np.arange(8, dtype=np.float32).reshape(2, 4)})
            np.testing.assert_array_equal(c.get([0, 1], ["x"])["x"], np.arange(8, dtype=np.float32).reshape(2, 4))
    finally:
        second.kill()  # (--kill-child: the stowd inside goes with it)
        second.wait(timeout=30)
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_a_reused_gather_buffer_shows_only_the_new_rows(shm_server, fresh):
    """A same-node get of rows from many segments is gathered by the core
    into a buffer of its receive pool (not a view of a segment); a second
    get of as many bytes, other rows, after the first result is dropped,
    reuses that very buffer and shows exactly its own rows."""
    n = 600
    idx = fresh(n)
    x = np.arange(n * 1024, dtype=np.float32).reshape(n, 1024)  # 4 KiB rows: 1.2 MiB gets
    rng = np.random.default_rng(3)
    with stowage.Client(shm_server["native"], timeout=30, same_node=True) as c:
        for k in range(0, n, 2):  # many parts: every two rows a put of their own
            c.put([idx[k], idx[k + 1]], {"x": x[k:k + 2]})
        stowage.release_receive_buffers()
        first = [int(p) for p in rng.permutation(n)[:300]]
        got = c.get([idx[p] for p in first], ["x"])["x"]
        np.testing.assert_array_equal(got, x[first])
        assert not got.flags.writeable
        assert type(got.base).__name__ == "Buffer", "not gathered into a buffer of the core's"
        where = data_ptr(got)
        del got
        second = [int(p) for p in rng.permutation(n)[:300]]
        again = c.get([idx[p] for p in second], ["x"])["x"]
        np.testing.assert_array_equal(again, x[second])
        assert data_ptr(again) == where, "the second gather did not reuse the first one's buffer"
        c.clear(idx)


# ---------------------------------------------------------------- every field kind, tcp and same node


def _every_kind(n: int) -> dict:
    """Fields of every kind, n rows each."""
    rng = np.random.default_rng(5)
    return {
        "f32": rng.standard_normal((n, 7)).astype(np.float32),
        "i64": rng.integers(-1000, 1000, (n, 2, 3)),
        "flag": rng.integers(0, 2, n).astype(bool),
        "c128": (rng.standard_normal(n) + 1j).astype(np.complex128),
        "empty": np.zeros((n, 0), np.float32),
        "bf16": stowage.BFloat16Bits(rng.integers(0, 1 << 16, (n, 4), dtype=np.uint16)),
        "f8": stowage.Bits(rng.integers(0, 256, (n, 3), dtype=np.uint8), "float8_e4m3fn"),
        "rows": [np.arange(k % 5, dtype=np.int16) + k for k in range(n)],
        "grid": [rng.standard_normal((k % 3 + 1, 2)) for k in range(n)],
        "bitrows": stowage.Bits([np.full(k % 4, k, np.uint8) for k in range(n)], "float8_e5m2"),
        "tag": [f"row {k}" if k % 3 else b"\x00raw" for k in range(n)],
        "obj": [{"k": k, "v": [k, None]} for k in range(n)],
    }


def _slice(v, a: int, b: int):
    """Rows a..b of a field of `_every_kind`."""
    if type(v) is stowage.BFloat16Bits:
        return stowage.BFloat16Bits(v.data[a:b])
    if isinstance(v, stowage.Bits):
        return stowage.Bits(v.data[a:b], v.dtype)
    return v[a:b]


def _same(a, b, where: str) -> None:
    if isinstance(a, stowage.Packed):
        assert isinstance(b, stowage.Packed), where
        _same(a.values, b.values, where + ".values")
        assert a.shapes == b.shapes, where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype)
        assert a.tobytes() == b.tobytes(), where
        assert not a.flags.writeable and not b.flags.writeable, where
    elif isinstance(a, list) and a and isinstance(a[0], np.ndarray):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("nested", ["rows", "packed"])
def test_every_field_kind_reads_the_same_over_tcp_and_same_node(shm_server, fresh, nested):
    """Regular fields of several dtypes (bits dtypes, an empty row shape),
    nested fields (rows of one and of two dimensions, empty rows, bits),
    values of every kind: a same-node get (from two puts: two segments,
    rows repeated and out of order) gives what a tcp get gives, byte for
    byte, as read-only arrays; get_into too."""
    n = 40
    idx = fresh(n)
    data = _every_kind(n)
    names = list(data)
    pick = [idx[k] for k in [3, 1, 39, 20, 21, 22, 3, 0, 38]]
    with stowage.Client(shm_server["native"], same_node=True) as c, stowage.Client(shm_server["native"]) as tcp:
        c.put(idx[:20], {k: _slice(v, 0, 20) for k, v in data.items()})  # through a leased segment
        tcp.put(idx[20:], {k: _slice(v, 20, n) for k, v in data.items()})  # copied into a segment by the get
        for as_torch in (False, None) if not _torch_installed() else (False,):
            near = c.get(pick, names, nested=nested, as_torch=as_torch)
            far = tcp.get(pick, names, nested=nested, as_torch=as_torch)
            assert list(near) == list(far) == names
            for k in names:
                _same(near[k], far[k], k)
        regular = [k for k, v in far.items() if isinstance(v, np.ndarray)]
        out_near = {k: np.full(far[k].shape, 7, far[k].dtype if far[k].dtype.kind in "biufc" else
                               f"u{far[k].dtype.itemsize}") for k in regular}
        out_far = {k: np.full_like(v, 7) for k, v in out_near.items()}
        c.get_into(pick, out_near)
        tcp.get_into(pick, out_far)
        for k in regular:
            assert out_near[k].tobytes() == out_far[k].tobytes(), k
        # A strided target: a column block of a wider array, every other row.
        wide = np.full((2 * len(pick), 3, 7), -1, np.float32)
        c.get_into(pick, {"f32": wide[::2, 1]})
        np.testing.assert_array_equal(wide[::2, 1], far["f32"])
        assert (wide[1::2] == -1).all() and (wide[::2, [0, 2]] == -1).all()

        # The asyncio client, same node: the same.
        async def near_async():
            async with stowage.AsyncClient(shm_server["native"], same_node=True) as ac:
                out = {k: np.full_like(v, 7) for k, v in out_near.items()}
                await ac.get_into(pick, out)
                return await ac.get(pick, names, nested=nested, as_torch=False), out

        got, out = asyncio.run(asyncio.wait_for(near_async(), 60))
        far = tcp.get(pick, names, nested=nested, as_torch=False)
        for k in names:
            _same(got[k], far[k], f"async {k}")
        for k in regular:
            assert out[k].tobytes() == out_far[k].tobytes(), f"async {k}"
        c.clear(idx)


def _torch_installed() -> bool:
    from stowage import _torch
    return _torch.available()


def test_arrays_for_tensors_are_private_copy_on_write_and_never_overlap(shm_server, fresh):
    """What a same-node get hands torch (made by the core as for
    `as_torch=True`, checked here without torch): writable arrays over a
    private copy-on-write mapping of the segment (not the read-only
    mapping numpy arrays share); a write reaches neither the store, nor
    the shared mapping, nor another array, nor another get's. A row asked
    for twice is two arrays that share no byte."""
    from stowage import _codec, _core
    idx = fresh(6)
    x = np.arange(6 * 1024, dtype=np.int32).reshape(6, 1024)  # 4 KiB rows
    rows = [np.full(1000 + k, k, np.int64) for k in range(6)]
    tensors = _core.GetOptions(_codec.WIRE_DTYPES, list(_codec.WIRE_DTYPES), None)
    with stowage.Client(shm_server["native"], same_node=True) as c:
        c.put(idx, {"x": x, "r": rows})
        shared = c.get(idx, ["x", "r"])
        c._open_channel()

        def private(pick):
            rid, got = c._core_call("get", None, 10, lambda core, rid, t: core.get_fast(
                rid, pick, ["x", "r"], t, tensors, True, c._shm()))
            out, glue = got[1]
            assert sorted(glue) == [("r", "int64"), ("x", "int32")]
            return out

        run = private([idx[2], idx[3]])  # rows back to back: views of one private mapping
        a = run["x"]
        assert np.array_equal(a, x[2:4]) and a.flags.writeable
        assert _perms(a.__array_interface__["data"][0]) == "rw-p", "not a private writable mapping"
        assert _perms(data_ptr(shared["x"])) == "r--s"
        pick = [3, 1, 3]  # row 3 twice: x gathered into a buffer of its own, r's second row 3 a copy
        twice = private([idx[k] for k in pick])
        assert np.array_equal(twice["x"], x[pick])
        assert [r.tolist() for r in twice["r"]] == [rows[k].tolist() for k in pick]
        # (views of the private mapping are writable; a gather or a copy is
        # this get's own memory, read-only to numpy, written through torch)
        assert all(r.flags.writeable for r in [*run["r"], twice["r"][0]])
        everything = [a, *run["r"], twice["x"], *twice["r"]]
        for i, p in enumerate(everything):
            assert not np.shares_memory(p, shared["x"]) and not any(np.shares_memory(p, r) for r in shared["r"]), \
                "a private array is a view of the shared read-only mapping"
            for q in everything[i + 1:]:
                assert not np.shares_memory(p, q), "two arrays share bytes"
        a += 1
        for r in [*run["r"], twice["r"][0]]:
            r[...] = -1
        assert np.array_equal(a, x[2:4] + 1)
        assert np.array_equal(twice["r"][2], rows[3]), "the copy of a row asked for twice changed"
        assert np.array_equal(shared["x"], x) and all(np.array_equal(s, r) for s, r in zip(shared["r"], rows))
        again = private([idx[2], idx[3]])
        assert np.array_equal(again["x"], x[2:4]), "another get's array changed"
        assert [r.tolist() for r in again["r"]] == [rows[k].tolist() for k in [2, 3]]
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], x)
        # The same arrays when the core makes the tensors itself (given
        # `from_numpy`, as `get(as_torch=True)` gives torch's): handed
        # over writable, the view over the private mapping, none glued.
        given = []
        direct = _core.GetOptions(_codec.WIRE_DTYPES, list(_codec.WIRE_DTYPES), None,
                                  lambda a: given.append(a) or ("made", len(given) - 1))
        rid, got = c._core_call("get", None, 10, lambda core, rid, t: core.get_fast(
            rid, [idx[2], idx[3]], ["x", "r"], t, direct, True, c._shm()))
        out, glue = got[1]
        assert glue == [] and out["x"] == ("made", 0) and out["r"] == [("made", 1), ("made", 2)]
        assert all(a.flags.writeable for a in given)
        assert _perms(data_ptr(given[0])) == "rw-p", "not a private writable mapping"
        assert np.array_equal(given[0], x[2:4]) and [r.tolist() for r in given[1:]] == [rows[2].tolist(), rows[3].tolist()]
        given[0][...] = -5
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], x)
    with stowage.Client(shm_server["native"]) as tcp:
        np.testing.assert_array_equal(tcp.get(idx, ["x"])["x"], x)
        tcp.clear(idx)


class _Signalled(Exception):
    pass


@pytest.mark.parametrize("spin_us", [0, None])
def test_a_signal_stops_a_waiting_same_node_get_and_the_client_and_store_stay_whole(inline_server, fresh,
                                                                                 spin_us):
    """A signal whose handler raises (KeyboardInterrupt on Ctrl-C; here an
    exception of the test's own) while a same-node get waits for a stopped
    stowd ends the get with it, long before its timeout, for a get through
    segments and one answered over the socket. stowd continued, the same
    client gets the rows right, puts same-node, and the store reads back
    whole over tcp."""
    s = inline_server
    idx, small = fresh(64), fresh(4)
    a = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)  # 256 KiB: through segments
    b = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)  # 256 bytes: over the socket
    with stowage.Client(s["native"]) as tcp:
        tcp.put(idx, {"x": a})
        tcp.put(small, {"y": b})

    def handler(signum, frame):
        raise _Signalled()

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        with stowage.Client(s["native"], same_node=True, timeout=20, spin_us=spin_us) as c:
            np.testing.assert_array_equal(c.get(idx, ["x"])["x"], a)  # the channel open
            for rows, field, want in ((idx, "x", a), (small, "y", b)):
                stowd_harness.pause(s["pid"])
                timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
                t0 = time.monotonic()
                timer.start()
                try:
                    with pytest.raises(_Signalled):
                        c.get(rows, [field])
                    took = time.monotonic() - t0
                finally:
                    timer.join()
                    os.kill(s["pid"], signal.SIGCONT)
                assert 0.25 < took < 5, (field, took)
                np.testing.assert_array_equal(c.get(rows, [field])[field], want)
            c.put(idx, {"z": a + 1})
            np.testing.assert_array_equal(c.get(idx, ["z"])["z"], a + 1)
    finally:
        signal.signal(signal.SIGUSR1, old)
    with stowage.Client(s["native"]) as tcp:
        got = tcp.get(idx, ["x", "z"])
        np.testing.assert_array_equal(got["x"], a)
        np.testing.assert_array_equal(got["z"], a + 1)
        np.testing.assert_array_equal(tcp.get(small, ["y"])["y"], b)
