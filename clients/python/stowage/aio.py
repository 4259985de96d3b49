"""The asyncio client (`zmq.asyncio`): the same calls as `Client`, as coroutines.

Requests from concurrent tasks are pipelined on one DEALER socket; one reader
task hands each reply to its request by `id`. A timeout closes the socket and
opens a new one (lazily, on the next call); the other requests in flight on
the old socket then fail with `StowageTimeout` as well, since their replies
can no longer arrive.

`get` and `get_into` always go through the Rust core, as `Client`'s do
(same node too: the core reads the descriptor channel and stowd's
segments), and over tcp and ipc `put` does too (the same conditions,
`_Ops._core_serves`; the same request building, reply reading and error
mapping, `_Ops._core_*`): `get_into` reads each field's bytes from the
socket straight into the caller's arrays, `get` into one buffer per field,
`put` sends from the caller's arrays. A core call blocks (with the GIL
released while bytes move), so it runs in a worker thread and the event
loop serves other tasks meanwhile.
A core `Connection` serves one call at a time, where the DEALER pipelines
many: each running call takes a connection of its own from a small pool,
made on demand, at most `CORE_CONNECTIONS` per client (a thread pool of
that many workers, each call a job; calls beyond that queue for a worker),
so concurrent tasks still overlap. Neither the pool nor its threads belong
to an event loop: a client moved to another loop keeps them.

Cancellation: a call still queued is dropped and touches nothing; a call
already running in its thread cannot be stopped, and runs on until it
returns (by its deadline at the latest), its result thrown away. So the
`out` arrays of a cancelled `get_into` may still be written until then,
and a cancelled `put` may still be stored. Its connection goes back to the
pool only when the call returned: the core keeps a connection only after a
reply read to its end (a timeout or a broken reply drops it, and the next
call on it connects anew), so nothing stale reaches a later call. A call's
timeout counts from the call, its wait in the queue included, and raises
`StowageTimeout` in `Client`'s words; unlike a pyzmq timeout it resets
only that call's connection, not the requests in flight on the DEALER.
`aclose()` (and `close()`) waits for the calls running in threads to
return, so no thread writes into a caller's array after it; calls still
queued then fail with "the client was closed".

stats, checkpoint, restore and clear (and same-node's request for its
descriptor channel) go through the core over tcp and ipc, same-node mode
too: as small calls (below), or, every in-loop connection busy, in a
worker thread; their requests written and replies read by the core
(`_core.Connection.start_call`, `finish_call`, `call`).

Small calls take neither the worker thread nor the DEALER: the hop to a
worker thread and back cost about 56 µs (an async get of one 4 KiB row
took 237 µs through the core against 168 µs through pyzmq), and pyzmq's
asyncio socket itself most of the rest. A put of less than
`CORE_MIN_BYTES` and a get (not same node) go through the core on a
connection of their own (at most `CORE_CONNECTIONS` at once, `_in_loop`):
the core reads the arguments and writes the request, this event loop
awaits the socket's readability (`loop.add_reader`), and once the whole
reply has arrived (its frame headers walked in a peek) the core reads it
without waiting. A reply that arrives in pieces is read in a worker
thread. A put that finds every such connection busy goes through the
DEALER, its request written by the core's codec (`_core.encode_put`); a
get goes through the core in a worker thread. `STOWAGE_ASYNC_IN_LOOP=0`
sends every small call that way (the figures: docs/benchmarks.md, "Small
calls"). A put from `CORE_MIN_BYTES` of payload (the caller's arrays say
how many), a get_into, and a same-node get go through the core in a
worker thread, as described above.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import zmq
import zmq.asyncio

from . import _auth, _codec, _put, _shm
from .client import (_CORE_FAILURES, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT, _abs_dir, _core, _Ops, _run_get,
                     _run_get_into, _run_send_many)
from .errors import BadRequest, ProtocolError, StowageError, StowageTimeout, Unsupported, error_from_reply


class AsyncClient(_Ops):
    """`async with AsyncClient(endpoint) as c: await c.put(...)`. Use it from one
    event loop at a time (moving to another loop reconnects). `spin_us` is as
    for `Client`: how long a core call polls for its reply before sleeping.
    `token` and the `curve_*` keys are as for `Client`."""

    #: Most calls through the Rust core one client runs at once, each in a
    #: worker thread on a core connection of its own (more wait their
    #: turn): enough for concurrent tasks to overlap their round trips,
    #: few enough to bound a client's threads and sockets.
    CORE_CONNECTIONS = 4
    #: Payload from which a put goes through the core in a worker thread (see the module doc).
    CORE_MIN_BYTES = 1 << 20

    def __init__(self, endpoint: str, timeout: float = DEFAULT_TIMEOUT, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 context: zmq.asyncio.Context | None = None,
                 same_node: bool = False, shm_dir: str | None = None, spin_us: float | None = None,
                 token: str | None = None, curve_server_key: str | None = None,
                 curve_public_key: str | None = None, curve_secret_key: str | None = None) -> None:
        super().__init__(endpoint, timeout, max_message_bytes, same_node, shm_dir, spin_us, token,
                         (curve_server_key, curve_public_key, curve_secret_key))
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._closed = False
        self._channel_loop: asyncio.AbstractEventLoop | None = None
        self._channel_lock: asyncio.Lock | None = None
        # The Rust core (tcp and ipc put, get, get_into): its worker threads (made
        # on first use) and the connections no call is using.
        self._core_threads: ThreadPoolExecutor | None = None
        self._core_idle: list = []
        # Core connections whose replies this event loop awaits (small
        # calls, `_in_loop`): idle ones, and how many are in a call.
        self._loop_idle: list | None = [] if os.environ.get("STOWAGE_ASYNC_IN_LOOP", "1") != "0" else None
        self._loop_busy = 0

    # -- connection
    def _socket(self) -> zmq.asyncio.Socket:
        if self._closed:
            raise StowageError("the client is closed")
        loop = asyncio.get_running_loop()
        if self._sock is not None and self._loop is not loop:
            self._drop(lambda rid: StowageError("the client moved to another event loop", request_id=rid))
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            _auth.offer_token(sock, self.endpoint, self._token, self._curve)
            sock.connect(self.endpoint)
            self._sock, self._loop = sock, loop
            self._reader = loop.create_task(self._read(sock))
        return self._sock

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                return  # the socket was closed
            try:
                env = _codec.decode_envelope(frames[0].bytes)
            except ProtocolError as e:
                text = str(e)
                self._fail_pending(lambda rid: ProtocolError(text, request_id=rid))
                continue
            fut = self._pending.pop(env["id"], None)
            if fut is None and env["id"] == 0 and env["op"] == "error":
                # An error reply to a request the server could not read: ours, if only one is in flight.
                if len(self._pending) == 1:
                    fut = self._pending.popitem()[1]
                else:
                    b = env["body"]
                    self._fail_pending(lambda rid: error_from_reply(str(b.get("code")), str(b.get("message")), rid))
                    continue
            if fut is not None and not fut.done():
                fut.set_result((env, frames))
            # else: a reply to a request that was cancelled or timed out: dropped

    def _fail_pending(self, exc: Callable[[int], BaseException]) -> None:
        pending, self._pending = self._pending, {}
        for rid, fut in pending.items():
            if not fut.done():
                fut.set_exception(exc(rid))

    def _drop(self, exc: Callable[[int], BaseException]) -> asyncio.Task | None:
        """Closes the socket, stops its reader and fails the requests in flight."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._fail_pending(exc)
        return reader

    def close(self) -> None:
        """Closes the socket and the descriptor channel; requests in flight
        fail. Waits (blocking) for the calls running in the core's threads.
        Idempotent."""
        self._closed = True
        self._drop(lambda rid: StowageError("the client was closed", request_id=rid))
        self._close_channel()
        self._close_core()

    async def aclose(self) -> None:
        """`close()`, waiting for the core's running calls off the event loop."""
        self._closed = True
        reader = self._drop(lambda rid: StowageError("the client was closed", request_id=rid))
        self._close_channel()
        await asyncio.get_running_loop().run_in_executor(None, self._close_core)
        if reader is not None and reader.get_loop() is asyncio.get_running_loop():
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    def _close_core(self) -> None:
        """Waits for the core calls running in threads to return (queued ones
        fail: the client is closed), then closes the core's connections."""
        threads, self._core_threads = self._core_threads, None
        if threads is not None:
            threads.shutdown(wait=True)
        while self._core_idle:
            self._core_idle.pop().close()
        while self._loop_idle:
            self._loop_idle.pop().close()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the descriptor channel (same node)
    def _close_channel(self, leases: bool = True) -> None:
        """Closes the descriptor channel (and with `leases`, the descriptors
        of leases not yet filled)."""
        seg = self._segments
        if seg is None:
            return
        ch, loop = seg.channel, self._channel_loop
        if ch is not None and not ch.closed and loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                loop.remove_reader(ch.fileno())
        self._channel_loop = None
        if leases:
            seg.close()
        else:
            seg.close_channel()

    def _on_channel(self) -> None:
        """The channel is readable: a message is coming before its reply
        (a lease's, for a request on the DEALER; a get's is read by the
        core's thread that waits for it, unless this reads it first)."""
        ch = self._segments.channel
        if ch is None or ch.closed:
            return
        fd = ch.fileno()
        try:
            ch.pump(self.timeout)  # (at once when a core thread is reading it)
        except _CORE_FAILURES:
            pass  # closed; the request it was for fails on its own
        if ch.closed and self._channel_loop is not None:
            with contextlib.suppress(Exception):
                self._channel_loop.remove_reader(fd)

    async def _open_channel(self) -> None:
        """Same node: opens the descriptor channel if none is open."""
        if not self._channel_needed():
            return
        if self._channel_lock is None:
            self._channel_lock = asyncio.Lock()
        async with self._channel_lock:
            if self._channel_needed():
                await self._open_channel_now()

    async def _open_channel_now(self) -> None:
        if self._segments.channel is not None:  # closed: forget it and its reader
            self._close_channel()
        try:
            body = await self._ask("channel", {}, None, "channel_ok")
        except Unsupported as e:
            raise self._no_channel(e) from None
        loop = asyncio.get_running_loop()
        ch = await loop.run_in_executor(None, _shm.open_channel, self._channel_path(body), self.timeout)
        self._segments.channel = ch
        self._channel_loop = loop
        loop.add_reader(ch.fileno(), self._on_channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _call(self, op: str, body: dict, data_frames, timeout, expect: str,
                    extras: dict | None = None) -> tuple[dict, list]:
        try:
            return await self._call_once(op, body, data_frames, timeout, expect, extras)
        except BadRequest as e:
            if not self._stale_channel(extras, e):
                raise
        # stowd restarted (or dropped the channel): open a new one, ask again.
        self._close_channel()
        await self._open_channel()
        return await self._call_once(op, body, data_frames, timeout, expect, self._with_channel(extras))

    async def _call_once(self, op: str, body: dict, data_frames, timeout, expect: str,
                         extras: dict | None = None) -> tuple[dict, list]:
        timeout = self._call_timeout(timeout)
        sock = self._socket()
        loop = self._loop
        rid = next(self._ids)
        fut = loop.create_future()
        self._pending[rid] = fut
        return await self._exchange(op, sock, loop, rid, fut, body, data_frames, timeout, expect, extras)

    async def _call_encoded(self, op: str, rid: int, frame0: bytes, data_frames, timeout,
                            expect: str) -> tuple[dict, list]:
        """`_call_once` of a request the core wrote (`frame0`, of request id `rid`)."""
        timeout = self._call_timeout(timeout)
        sock = self._socket()
        loop = self._loop
        fut = loop.create_future()
        self._pending[rid] = fut
        return await self._exchange(op, sock, loop, rid, fut, frame0, data_frames, timeout, expect, None)

    async def _exchange(self, op, sock, loop, rid, fut, body, data_frames, timeout, expect, extras):
        """Sends the request (`body`, or frame 0 itself as bytes) and awaits its reply."""
        msg = [body if type(body) is bytes else _codec.envelope(op, rid, body, extras), *data_frames]
        deadline = loop.time() + timeout
        self._expect_fds(rid)
        try:
            await asyncio.wait_for(sock.send_multipart(msg, copy=False), timeout)
            del msg
            env, frames = await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - loop.time()))
        except StowageError:
            raise  # failed by someone else (a reset, close): not our timeout
        except asyncio.TimeoutError:
            if self._segments is not None and self._segments.channel is not None:
                self._segments.channel.forget(rid)
            if self._sock is sock:
                self._drop(lambda r: StowageTimeout(
                    f"request {r}: the connection to {self.endpoint} was reset because request {rid} timed out",
                    request_id=r))
            raise StowageTimeout(f"{op} (id {rid}): no reply from {self.endpoint} within {timeout:g} s; "
                                 "the connection was reset", request_id=rid) from None
        finally:
            self._pending.pop(rid, None)
        frames = self._reply_frames(env, frames, rid)
        return self._reply_body(env, expect, rid), frames

    # -- the calls (see Client for their documentation)
    async def put(self, global_indexes, data: Mapping[str, Any], *, timeout: float | None = None) -> int:
        """See `Client.put` (through the Rust core, a split put's messages go
        two on the wire, as there)."""
        if self._core_serves() and self._loop_idle is not None:
            # The usual small put: read, written and answered by the core on
            # a connection of its own, its reply awaited by this event loop
            # (None: not plainly that, or at least CORE_MIN_BYTES, or every
            # such connection busy; the ways below).
            limit = min(self.max_message_bytes, self.CORE_MIN_BYTES)
            got = await self._in_loop("put", timeout, lambda conn, rid, t: conn.start_put(
                rid, global_indexes, data, t, limit), lambda conn, rid, rows, t: conn.finish_put(rid, rows, t))
            if got is not None:
                rid, reply = got
                return reply if type(reply) is int else self._core_refused(rid, reply, "put_ok")
        if self._segments is None:
            # A small put on the DEALER: read and written by the core's codec
            # in one call (None: not plainly that, or at least
            # CORE_MIN_BYTES for the core's own connection; the general path
            # below).
            limit = min(self.max_message_bytes, self.CORE_MIN_BYTES if self._core_serves() else 1 << 62)
            rid = next(self._ids)
            enc = _core.encode_put(rid, global_indexes, data, limit)
            if enc is not None:
                frame0, frames, rows = enc
                try:
                    body, _ = await self._call_encoded("put", rid, frame0, frames, timeout, "put_ok")
                    if body != {"rows": rows}:
                        raise ProtocolError(f"put_ok {body!r} for a message of {rows} rows", request_id=rid)
                except StowageError as e:
                    e.rows_stored = 0
                    raise
                return rows
        core = self._core_serves() and _put.payload_bytes(data) >= self.CORE_MIN_BYTES
        put = _put.Put(global_indexes, data, self.max_message_bytes, self._segments, join=not core)
        await self._open_channel()
        try:
            if core:
                await self._core_put(put, put.plain(), timeout)
            else:
                for op, body, frames, expect, extras in put:
                    put.reply, _ = await self._call(op, body, frames, timeout, expect, extras)
        except StowageError as e:
            e.rows_stored = put.stored
            raise
        return put.n

    async def get(self, global_indexes, fields, *, as_torch: bool | None = None, nested: str = "rows",
                  timeout: float | None = None) -> dict:
        """See `Client.get`."""
        opts = self._get_options(as_torch, nested)
        if self._segments is None and self._loop_idle is not None:
            # The usual get: through the core, its reply awaited by this
            # event loop (see `put`).
            ranges = self._ranges_ok
            got = await self._in_loop("get", timeout, lambda conn, rid, t: conn.start_get(
                rid, global_indexes, fields, t, ranges), lambda conn, rid, n, t: conn.finish_get(t, opts))
            if got is not None:
                rid, reply = got
                try:
                    return self._got(rid, reply, as_torch)
                except BadRequest as e:
                    if not (ranges and "global_indexes must be an array" in str(e)):
                        raise
                    self._ranges_ok = False  # a stowd from before ranges: asked again below, as a list
        return await self._with_shm(lambda shm: self._get_threaded(global_indexes, fields, as_torch, opts, timeout, shm))

    async def _get_threaded(self, global_indexes, fields, as_torch, opts, timeout, shm) -> dict:
        """A get through the core in a worker thread (`shm`: same node)."""
        ranges = self._ranges_ok
        rid, got = await self._core_call("get", None, timeout, lambda core, rid, t: core.get_fast(
            rid, global_indexes, fields, t, opts, ranges, shm))
        if got is not None:
            try:
                return self._got(rid, got[1], as_torch)
            except BadRequest as e:
                if not (ranges and "global_indexes must be an array" in str(e)):
                    raise
                self._ranges_ok = False  # a stowd from before ranges: asked again below, as a list
        n, names, body = self._get_request(global_indexes, fields, self._ranges_ok)
        return await self._ranged(body, lambda b: self._core_call("get", b, timeout, _run_get(names, n, opts, shm)),
                                  lambda rid, got: self._got(rid, got, as_torch))

    async def _ranged(self, body: dict, ask, finish):
        """See `Client._ranged` (`ask` is a coroutine function)."""
        try:
            return finish(*await ask(body))
        except BadRequest as e:
            body = self._list_fallback(body, e)  # raises `e` unless stowd refused the ranges
        return finish(*await ask(body))

    async def _with_shm(self, run):
        """See `Client._with_shm` (`run` is a coroutine function)."""
        if self._segments is None:
            return await run(None)
        await self._open_channel()
        try:
            return await run(self._shm())
        except BadRequest as e:
            if "no descriptor channel has token" not in str(e):
                raise
        self._close_channel(leases=False)
        await self._open_channel()
        return await run(self._shm())

    async def _core_put(self, put: _put.Put, messages: list, timeout) -> None:
        """See `Client._core_put` (in a worker thread)."""
        t = self._call_timeout(timeout)
        sent = (await self._core_call("put", None, timeout, _run_send_many(self._ids, messages)))[1]
        self._core_put_replies(put, messages, sent, t)

    async def _ask(self, op: str, body: dict, timeout, expect: str) -> dict:
        """See `Client._ask`: through the core, its reply awaited by this
        event loop (`_in_loop`), or, every such connection busy, in a
        worker thread (`_core_call`)."""
        if not self._core_carries():
            return (await self._call(op, body, (), timeout, expect))[0]
        if self._loop_idle is not None:
            got = await self._in_loop(op, timeout, lambda conn, rid, t: conn.start_call(op, rid, body, t),
                                      lambda conn, rid, _, t: conn.finish_call(rid, t))
            if got is not None:
                return self._core_answer(*got, expect)
        rid, got = await self._core_call(op, None, timeout, lambda core, rid, t: core.call(op, rid, body, t))
        return self._core_answer(rid, got, expect)

    async def _in_loop(self, op: str, timeout, start, finish):
        """A small call on a core connection of its own, its reply awaited
        by this event loop (no worker thread, no DEALER): `start(conn, rid,
        time left)` writes the request (None: not this call's to make,
        nothing sent); once the socket is readable and the whole reply has
        arrived, `finish(conn, rid, what start returned, time left)` reads
        it without waiting (None from `finish`: a reply to another request,
        dropped; the next is awaited). (rid, what finish returned), or None: started
        nothing, or every in-loop connection is busy (the caller takes
        another way). A reply that arrives in pieces is read in a worker
        thread. Cancelled or timed out, the connection is dropped (its
        reply would be stale)."""
        if not self._loop_idle and self._loop_busy >= self.CORE_CONNECTIONS:
            return None
        timeout = self._call_timeout(timeout)
        if self._closed:
            raise StowageError("the client is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = self._loop_idle.pop() if self._loop_idle else _core.Connection(self.endpoint, 0.0, self._token, self._curve)
        self._loop_busy += 1
        rid = next(self._ids)
        keep = False
        try:
            if conn.connected:
                started = start(conn, rid, timeout)
            else:  # connecting may take a while: not on the loop
                started = await loop.run_in_executor(self._threads(), start, conn, rid, timeout)
            if started is None:
                keep = True
                return None
            got = None
            while got is None:  # None: a stray reply, dropped; the next awaited
                if not conn.reply_ready():
                    fd = conn.fileno()
                    woken = loop.create_future()
                    loop.add_reader(fd, _wake, woken)
                    timer = loop.call_at(deadline, _wake, woken)
                    try:
                        await woken
                    finally:
                        loop.remove_reader(fd)
                        timer.cancel()
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                if conn.reply_ready():
                    got = finish(conn, rid, started, left)
                else:
                    got = await loop.run_in_executor(self._threads(), finish, conn, rid, started, left)
            keep = True
            return rid, got
        except _CORE_FAILURES as e:
            raise self._core_failure(e, op, rid, timeout) from None
        finally:
            self._loop_busy -= 1
            if keep and not self._closed:
                self._loop_idle.append(conn)
            else:
                conn.close()

    def _threads(self) -> ThreadPoolExecutor:
        if self._core_threads is None:
            self._core_threads = ThreadPoolExecutor(self.CORE_CONNECTIONS, thread_name_prefix="stowage-core")
        return self._core_threads

    async def _core_call(self, op: str, body: dict | None, timeout, run) -> tuple:
        """`run(core connection, frame 0 of the request, time left)` in a
        worker thread: (request id, its result); with `body` None, `run`
        gets the request id instead and writes frame 0 itself."""
        timeout = self._call_timeout(timeout)
        rid = next(self._ids)
        frame0 = rid if body is None else _codec.envelope(op, rid, body)
        if self._closed:
            raise StowageError("the client is closed")
        deadline = time.monotonic() + timeout
        job = self._threads().submit(self._core_job, op, rid, frame0, timeout, deadline, run)
        return rid, await asyncio.wrap_future(job)

    def _core_job(self, op: str, rid: int, frame0: bytes, timeout: float, deadline: float, run):
        """One core call, in a worker thread: on an idle connection (or a new
        one), given back once the call returned (see the module doc)."""
        if self._closed:
            raise StowageError("the client was closed", request_id=rid)
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError  # the queue took the whole timeout
            try:
                core = self._core_idle.pop()
            except IndexError:
                core = _core.Connection(self.endpoint, self.spin_us, self._token, self._curve)
            try:
                return run(core, frame0, left)
            finally:
                self._core_idle.append(core)
        except _CORE_FAILURES as e:
            raise self._core_failure(e, op, rid, timeout) from None


    async def get_into(self, global_indexes, out: Mapping[str, Any], *,
                       timeout: float | None = None) -> Mapping[str, Any]:
        """See `Client.get_into` (through the core, in a worker thread)."""
        n, targets, body = self._get_into_request(global_indexes, out, self._ranges_ok)
        plan = self._core_plan(targets)
        await self._with_shm(lambda shm: self._ranged(
            body, lambda b: self._core_call("get", b, timeout, _run_get_into(plan, shm)), self._core_got_into))
        return out

    async def clear(self, global_indexes, fields=None, *, timeout: float | None = None) -> int:
        """See `Client.clear`."""
        return self._cleared(await self._ask("clear", self._clear_request(global_indexes, fields), timeout, "clear_ok"))

    async def checkpoint(self, dir: str, *, journal: bool = True, timeout: float | None = None) -> dict:
        """See `Client.checkpoint`."""
        return await self._ask("checkpoint", self._checkpoint_body(dir, journal), timeout, "checkpoint_ok")

    async def restore(self, dir: str, *, timeout: float | None = None) -> dict:
        """See `Client.restore`."""
        return await self._ask("restore", {"dir": _abs_dir(dir)}, timeout, "restore_ok")

    async def stats(self, *, timeout: float | None = None) -> dict:
        """See `Client.stats` (the same dict of ints, and of dicts per plugin
        and chain)."""
        return await self._ask("stats", {}, timeout, "stats_ok")


def _wake(fut: asyncio.Future) -> None:
    """Resolves `fut` (the socket is readable, or the deadline came)."""
    if not fut.done():
        fut.set_result(None)
