"""The asyncio client: the same calls as `Client`, as coroutines.

Every call goes through the Rust core, one of two ways.

Every put is read, checked and laid out by the core (`_core.Put`) once,
before either way below is taken.

**Small calls on the event loop** (`_in_loop`): a put of less than
`CORE_MIN_BYTES` (one message), a get of numpy arrays or lists, a
`get_into` of arrays or CPU tensors, and stats, checkpoint,
restore and clear, over tcp or ipc. The core reads the arguments and
writes the request on a core connection of the loop's own (at most
`CORE_CONNECTIONS` at once); the loop awaits the socket's readability
(`loop.add_reader`), and once the whole reply has arrived (its frame
headers walked in a peek) the core reads it without waiting. A reply that
arrives in pieces is read in a worker thread. Before it awaits, the
loop yields its CPU once (`sched_yield`): a `stowd` on the same CPU then
answers at once, and the reply is read without the loop's machinery.
This takes no thread hop:
the hop to a worker thread and back cost about 56 µs a call (docs/benchmarks.md,
"Small calls"). When the reply is not there after the yield and the loop
has nothing else to run (no live handle in CPython's run queue), the core polls
for it for up to `spin_us` (default 200 µs) with the GIL released, as a
`Client` does, before the loop awaits the socket: a reply from a `stowd`
on another CPU is then caught without the loop's sleep and wake-up. A
spin that misses makes the connection's next 8 calls await at once.
A call answered without awaiting gives the loop no turn, so every
`YIELD_EVERY` (64) such calls in a row one yields to the loop once: timers
and other sockets' tasks run under a stream of small calls.
`STOWAGE_ASYNC_IN_LOOP=0` sends every call the other way.
Same node, so do the calls that move no rows, a put under
`SAME_NODE_INLINE_BELOW` bytes (it goes on the socket as any put, no
lease), and every get and get_into: the request names the client's
descriptor channel (opened on the loop once), which the loop reads while
it awaits the reply (`Channel.pump`), so descriptors never pile up in
front of stowd; the loop reads the reply itself when it names no segments
(stowd's `[shm] inline_below`), one segment range (views of the mapping,
nothing to gather) or rows of at most `LOOP_GATHER_MAX` (256 KiB) bytes,
and a worker thread reads the rest (their rows may be gathered, a copy
the loop should not wait for): a 4 MiB get of one range took 68-80 µs on
the loop, where through a worker thread it took 128-139. A one-field
same-node get took 20.4 µs this way and 89.8 µs on a lane, stowd on the
client's CPU (docs/benchmarks.md, "Same-node small puts, and an
AsyncClient's same-node calls"). A same-node put of one message under
`CORE_MIN_BYTES` that leases (64 KiB or more) runs on the loop too: the
lease, `Put.fill` writing the rows into the segment, and the put naming
it, on one connection (stowd takes a lease's put only on the connection
that leased it), in the steps `_put.same_node` gives.

**Everything else in a worker thread, on a lane**: a synchronous `Client`
of this client's settings (endpoint, timeouts, same-node mode, token, keys),
so every path exists once.
A lane serves one call at a time; each running call takes a lane of its
own from a small pool, made on demand, at most `CORE_CONNECTIONS` per
client (a thread pool of that many workers, each call a job; calls beyond
that queue for a worker), so concurrent tasks still overlap. Neither the
pool nor its threads belong to an event loop: a client moved to another
loop keeps them. (Same node, each lane has a descriptor channel and
segment mappings of its own.)

A call's timeout counts from the call, its wait for a lane included, and
raises `StowageTimeout`; it resets only that call's connection, never
another call's. Cancellation: a call still queued is dropped and touches
nothing; a call already running in its thread cannot be stopped, and runs
on until it returns (by its deadline at the latest), its result thrown
away. So the `out` arrays of a cancelled `get_into` may still be written
until then, and a cancelled `put` may still be stored. Its lane goes back
to the pool only when the call returned: the core keeps a connection only
after a reply read to its end (a timeout or a broken reply drops it, and
the next call on it connects anew), so nothing stale reaches a later call.
A cancelled or timed-out call on the loop drops its connection.
`aclose()` (and `close()`) waits for the calls running in threads to
return, so no thread writes into a caller's array after it; calls still
queued then fail with "the client was closed".
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

from . import _put, _shm
from .client import _CORE_FAILURES, _USUAL_GET, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT, Client, _abs_dir, _core, _Ops
from .errors import BadRequest, StowageError, StowageTimeout, Unsupported

#: Calls in a row answered on the event loop without awaiting, after which
#: the next one yields to the loop once (`asyncio.sleep(0)`): a turn every
#: 1-2 ms of back-to-back small calls. Every 16 cost a one-field call 4-7%
#: more client CPU on one CPU, every 64 cost 1.5-3.6% (docs/benchmarks.md,
#: "The AsyncClient's spin").
YIELD_EVERY = 64

#: The core connection's class: `_in_loop` calls its `start_*` and
#: `finish_*` methods unbound, with no closure a call.
_Conn = _core.Connection


class AsyncClient(_Ops):
    """`async with AsyncClient(endpoint) as c: await c.put(...)`. Use it from one
    event loop at a time. `spin_us` is as for `Client`: how long a call in
    a worker thread polls for its reply before sleeping, and how long a
    small call on the event loop does when the loop has nothing else to
    run (then the loop does not run for up to that long; `spin_us=0`
    always awaits the socket; see the module doc). `token` and the
    `curve_*` keys are as for `Client`. (`context` is accepted for older
    callers and not used: no pyzmq socket is made.)"""

    #: Most calls one client runs at once in worker threads, each on a lane
    #: of its own (more wait their turn), and most connections its event
    #: loop awaits at once: enough for concurrent tasks to overlap their
    #: round trips, few enough to bound a client's threads and sockets.
    CORE_CONNECTIONS = 4
    #: Payload from which a put goes through a worker thread (see the module doc).
    CORE_MIN_BYTES = 1 << 20

    def __init__(self, endpoint: str, timeout: float = DEFAULT_TIMEOUT, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, context: Any = None,
                 same_node: bool = False, shm_dir: str | None = None, spin_us: float | None = None,
                 token: str | None = None, curve_server_key: str | None = None,
                 curve_public_key: str | None = None, curve_secret_key: str | None = None) -> None:
        super().__init__(endpoint, timeout, max_message_bytes, same_node, shm_dir, spin_us, token,
                         (curve_server_key, curve_public_key, curve_secret_key))
        self._same_node = same_node
        self._closed = False
        # Worker threads (made on first use) and the lanes no call is using.
        self._core_threads: ThreadPoolExecutor | None = None
        self._core_idle: list[Client] = []
        # Core connections whose replies this event loop awaits (small
        # calls, `_in_loop`): idle ones, and how many are in a call.
        self._loop_idle: list | None = [] if os.environ.get("STOWAGE_ASYNC_IN_LOOP", "1") != "0" else None
        self._loop_busy = 0
        # Same node: the channel being opened for gets on the loop (a
        # future its other callers await), and the reader that pumps it
        # while such gets await their replies (`_watch_channel`).
        self._channel_opening: asyncio.Future | None = None
        self._channel_watchers = 0
        self._channel_fd: int | None = None
        # Calls in a row answered on the loop without awaiting (see `_in_loop`).
        self._unyielded = 0

    def _new_lane(self) -> Client:
        """A synchronous client of this client's settings."""
        server, public, secret = self._curve if self._curve is not None else (None, None, None)
        return Client(self.endpoint, self.timeout, max_message_bytes=self.max_message_bytes,
                      same_node=self._same_node, spin_us=self.spin_us, token=self._token,
                      curve_server_key=server, curve_public_key=public, curve_secret_key=secret)

    def close(self) -> None:
        """Closes every connection and descriptor channel. Waits (blocking)
        for the calls running in worker threads. Idempotent."""
        self._closed = True
        self._close_core()

    async def aclose(self) -> None:
        """`close()`, waiting for the running calls off the event loop."""
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._close_core)

    def _close_core(self) -> None:
        """Waits for the calls running in threads to return (queued ones
        fail: the client is closed), then closes the lanes and connections."""
        threads, self._core_threads = self._core_threads, None
        if threads is not None:
            threads.shutdown(wait=True)
        while self._core_idle:
            self._core_idle.pop().close()
        while self._loop_idle:
            self._loop_idle.pop().close()
        if self._segments is not None:
            self._segments.close()

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _ask_again(self, e: BadRequest, ranges: bool, shm) -> bool:
        """Whether a get refused on the event loop is asked again on a lane:
        a stowd from before ranges (the lane asks with a list), or one that
        no longer knows this client's channel (restarted: the channel is
        closed, the next get on the loop opens a new one)."""
        if ranges and "global_indexes must be an array" in str(e):
            self._ranges_ok = False
            return True
        if shm is not None and "no descriptor channel has token" in str(e):
            self._segments.close_channel()
            return True
        return False

    async def _loop_shm(self) -> tuple:
        """Same node: what the core's gets on the event loop take, (the
        client's channel, its mappings), the channel opened first if none
        is (one at a time: a task that finds another opening it waits)."""
        while self._channel_needed():
            if self._channel_opening is not None:
                await self._channel_opening
                continue
            done = self._channel_opening = asyncio.get_running_loop().create_future()
            try:
                try:
                    body = await self._ask("channel", {}, None, "channel_ok")
                except Unsupported as e:
                    raise self._no_channel(e) from None
                self._segments.channel = await asyncio.get_running_loop().run_in_executor(
                    self._threads(), _shm.open_channel, self._channel_path(body), self.timeout)
            finally:
                self._channel_opening = None
                done.set_result(None)
        return self._segments.shm()

    def _watch_channel(self, loop, ch) -> None:
        """While a same-node get on the loop awaits its reply, the loop
        reads the channel as descriptors come (`Channel.pump`), so that a
        long list of them never stops stowd before it answers; one reader
        for all such gets (`_unwatch_channel` when each is done)."""
        if self._channel_watchers == 0:
            fd = ch.fileno()
            if fd is None:  # closed: the get's reply says why
                return
            loop.add_reader(fd, _pump, loop, ch, fd)
            self._channel_fd = fd
        self._channel_watchers += 1

    def _unwatch_channel(self, loop) -> None:
        if self._channel_watchers == 0:
            return
        self._channel_watchers -= 1
        if self._channel_watchers == 0 and self._channel_fd is not None:
            loop.remove_reader(self._channel_fd)
            self._channel_fd = None

    # -- the calls (see Client for their documentation)
    async def put(self, global_indexes, data: Mapping[str, Any], *, timeout: float | None = None) -> int:
        """See `Client.put` (a split put's messages go two on the wire, as
        there). The put is read, checked and laid out by the core
        (`_core.Put`) before either way is taken, once."""
        put = _core.Put(global_indexes, data, self.max_message_bytes, self._segments is not None)
        on_loop = self._loop_idle is not None and put.messages == 1 and put.nbytes < self.CORE_MIN_BYTES
        if on_loop and (self._segments is None or _put.on_socket(put, self.SAME_NODE_INLINE_BELOW)):
            # The usual small put: written and answered by the core on a
            # connection of its own, its reply awaited by this event loop
            # (None: every such connection busy: a lane then).
            try:
                got = await self._in_loop("put", timeout, _Conn.start_put, (put,), _Conn.finish_put, ())
                if got is not None:
                    rid, reply = got
                    return reply if type(reply) is int else self._core_refused(rid, reply, "put_ok")
            except StowageError as e:
                e.rows_stored = 0
                raise
        elif on_loop:
            # Same node, through a lease, on the loop (a large one on a lane:
            # its bytes are written into the segment there).
            try:
                got = await self._leased_put(put, timeout)
                if got is not None:
                    return got
            except StowageError as e:
                if e.rows_stored is None:
                    e.rows_stored = 0
                raise
        return await self._on_lane("put", timeout, _lane_put(put))

    async def get(self, global_indexes, fields, *, as_torch: bool | None = None, nested: str = "rows",
                  timeout: float | None = None) -> dict:
        """See `Client.get`."""
        if self._loop_idle is not None:
            # The usual get: through the core, its reply awaited by this
            # event loop (see `put`); same node, naming the client's channel.
            opts = _USUAL_GET[0] if as_torch is None and nested == "rows" else None
            if opts is None:
                opts = self._get_options(as_torch, nested)
            ranges = self._ranges_ok
            shm = None if self._segments is None else await self._loop_shm()
            got = await self._in_loop("get", timeout, _Conn.start_get, (global_indexes, fields, ranges, shm),
                                      _Conn.finish_get, (opts, shm), shm)
            if got is not None:
                rid, reply = got
                out, glue = reply
                if type(out) is dict and not glue:  # (numpy arrays and lists only: nothing to glue)
                    return out
                try:
                    return self._got(rid, reply, as_torch)
                except BadRequest as e:
                    if not self._ask_again(e, ranges, shm):
                        raise
        return await self._on_lane("get", timeout, _lane_get(global_indexes, fields, as_torch, nested))

    async def get_into(self, global_indexes, out: Mapping[str, Any], *,
                       timeout: float | None = None) -> Mapping[str, Any]:
        """See `Client.get_into`."""
        if self._loop_idle is not None:
            # The usual get_into (a dict of arrays or CPU tensors of those
            # rows): through the core, its reply awaited by this event loop
            # and read straight into `out` (a large one in a worker thread).
            ranges = self._ranges_ok
            shm = None if self._segments is None else await self._loop_shm()
            got = await self._in_loop("get_into", timeout, _Conn.start_get_into, (global_indexes, out, ranges, shm),
                                      _Conn.finish_get_into, (shm,), shm)
            if got is not None:
                rid, reply = got
                try:
                    self._core_got_into(rid, None if reply is True else reply)
                    return out
                except BadRequest as e:
                    if not self._ask_again(e, ranges, shm):
                        raise
        return await self._on_lane("get_into", timeout, _lane_get_into(global_indexes, out))

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

    async def _ask(self, op: str, body: dict, timeout, expect: str) -> dict:
        """A call that moves no rows: on the event loop (`_in_loop`), or,
        every such connection busy, on a lane."""
        if self._loop_idle is not None:
            got = await self._in_loop(op, timeout, _Conn.start_call, (op, body), _Conn.finish_call, ())
            if got is not None:
                return self._core_answer(*got, expect)
        return await self._on_lane(op, timeout, _lane_ask(op, body, expect))

    async def _in_loop(self, op: str, timeout, start, start_args: tuple, finish, finish_args: tuple, shm=None,
                       conn=None):
        """A small call on a core connection of its own, its reply awaited
        by this event loop (no worker thread, no DEALER): `start(conn, rid,
        time left, *start_args)` writes the request (None: not this call's
        to make, nothing sent); once the socket is readable and the whole
        reply has arrived, `finish(conn, rid, what start returned, time
        left, *finish_args)` reads it without waiting (`start` and
        `finish` are the core connection's own methods, called as they
        are: no closure a call; None from `finish`: a reply to another request,
        dropped; the next is awaited). (rid, what finish returned), or None: started
        nothing, or every in-loop connection is busy (the caller takes
        another way). A reply that arrives in pieces is read in a worker
        thread. Cancelled or timed out, the connection is dropped (its
        reply would be stale).

        With `shm` (channel, mappings), a same-node get: the loop reads the
        channel while it awaits the reply (`_watch_channel`), reads the
        reply itself unless its rows may be gathered into more than
        `LOOP_GATHER_MAX` bytes (`Connection.reply_read_here`; then a worker
        thread does), and forgets the request on the channel when done.

        With `conn` (one `_take_conn` gave the caller), the call runs on it
        and the caller gives it back (`_give_conn`): a lease and the put
        through it go over one connection, as stowd asks."""
        held = conn is not None
        if not held and not self._loop_idle and self._loop_busy >= self.CORE_CONNECTIONS:
            return None
        timeout = self.timeout if timeout is None else self._check_timeout(timeout)
        if self._closed:
            raise StowageError("the client is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if not held:
            conn = self._take_conn()
        rid = next(self._ids)
        keep = False
        try:
            awaited = not conn.connected
            if conn.connected:
                started = start(conn, rid, timeout, *start_args)
            else:  # connecting may take a while: not on the loop
                started = await loop.run_in_executor(self._threads(), start, conn, rid, timeout, *start_args)
            if started is None:
                keep = True
                return None
            got = None
            # stowd on this CPU, woken by the request, answers in this
            # yield: the reply is then read at once, without the loop's
            # reader, timer and wake-up (about 25 µs of client CPU a
            # 10-field put). On another CPU it returns at once; then, if
            # the loop has nothing else to run (CPython's run queue empty),
            # the core polls for the reply for up to spin_us before the
            # loop sleeps: a reply from another CPU caught so costs no
            # wake-up (docs/benchmarks.md, "The AsyncClient's spin").
            os.sched_yield()
            # (A cancelled handle stays in the queue until the loop runs
            # again, which a run of calls answered here never lets it do:
            # such a handle is not work. None: another loop, e.g. uvloop:
            # no spin.)
            ready = getattr(loop, "_ready", None)
            spin = ready is not None and (not ready or all(h.cancelled() for h in ready))
            while got is None:  # None: a stray reply, dropped; the next awaited
                here = conn.reply_ready_spin() if spin else conn.reply_ready()
                spin = False  # (once a call)
                if here and (shm is None or conn.reply_read_here(LOOP_GATHER_MAX)):
                    # The whole reply is here: read without waiting (it came; no timeout).
                    got = finish(conn, rid, started, timeout, *finish_args)
                    continue
                left = deadline - loop.time()
                if here:  # a same-node reply whose rows may be gathered, a copy: off the loop
                    awaited = True
                    got = await loop.run_in_executor(self._threads(), finish, conn, rid, started, left, *finish_args)
                    continue
                awaited = True
                fd = conn.fileno()
                woken = loop.create_future()
                loop.add_reader(fd, _wake, woken)
                timer = loop.call_at(deadline, _wake, woken)
                if shm is not None:
                    self._watch_channel(loop, shm[0])
                try:
                    await woken
                finally:
                    loop.remove_reader(fd)
                    timer.cancel()
                    if shm is not None:
                        self._unwatch_channel(loop)
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                if conn.reply_ready() and (shm is None or conn.reply_read_here(LOOP_GATHER_MAX)):
                    got = finish(conn, rid, started, left, *finish_args)
                else:
                    got = await loop.run_in_executor(self._threads(), finish, conn, rid, started, left, *finish_args)
            keep = True
            # A call answered without awaiting gives the loop no turn: every
            # YIELD_EVERY such calls in a row, it yields once, so that timers
            # and other sockets' tasks still run under a stream of calls.
            self._unyielded = 0 if awaited else self._unyielded + 1
            if self._unyielded >= YIELD_EVERY:
                self._unyielded = 0
                await asyncio.sleep(0)
            return rid, got
        except _CORE_FAILURES as e:
            raise self._core_failure(e, op, rid, timeout) from None
        finally:
            if shm is not None and not shm[0].closed:
                shm[0].forget(rid)  # (descriptors that come late are closed)
            if not held:
                self._give_conn(conn, keep)

    def _take_conn(self):
        """An idle event-loop connection, or a new one; counted as busy until
        `_give_conn`."""
        conn = self._loop_idle.pop() if self._loop_idle else _core.Connection(self.endpoint, self.spin_us, self._token,
                                                                              self._curve)
        self._loop_busy += 1
        return conn

    def _give_conn(self, conn, keep: bool) -> None:
        """Back to the idle ones (`keep`: its last reply was read to its end),
        or closed."""
        self._loop_busy -= 1
        if keep and not self._closed:
            self._loop_idle.append(conn)
            return
        try:
            conn.close()
        except RuntimeError as e:
            # Cancelled while a worker thread reads the reply: the
            # connection is that read's until it ends ("Already
            # borrowed"), and closes with it, never to be used again.
            if "borrowed" not in str(e):
                raise

    async def _leased_put(self, put, timeout):
        """A same-node put through a lease on the event loop (one message,
        under `CORE_MIN_BYTES`): the lease, `Put.fill` writing the rows into
        the leased segment, and the put naming it, all on one connection
        (`_put.same_node` says what to send). The rows stored, or None when
        every loop connection is busy (nothing sent)."""
        if not self._loop_idle and self._loop_busy >= self.CORE_CONNECTIONS:
            return None
        timeout = self.timeout if timeout is None else self._check_timeout(timeout)
        await self._loop_shm()  # (the channel, for the lease's descriptor)
        if not self._loop_idle and self._loop_busy >= self.CORE_CONNECTIONS:
            return None
        conn = self._take_conn()
        keep = False
        try:
            steps = _put.same_node(put, self._segments, self.SAME_NODE_INLINE_BELOW)
            reply = None
            while True:
                try:
                    step, arg = steps.send(reply)
                except StopIteration as done:
                    return done.value
                keep = False
                if step == "lease":
                    reply = await self._loop_lease(conn, arg, timeout)
                else:
                    rid, got = await self._in_loop("put", timeout, _Conn.start_put, (put, arg), _Conn.finish_put,
                                                   (), conn=conn)
                    reply = got if type(got) is int else self._core_refused(rid, got, "put_ok")
                keep = True
        finally:
            self._give_conn(conn, keep)

    async def _loop_lease(self, conn, body: dict, timeout) -> dict:
        """A lease on `conn`: its lease_ok body, its descriptor kept
        (`Segments.leased`) for `Put.fill`. A stowd that no longer knows
        the channel (restarted) gets a new one, and the lease is asked again."""
        for again in (False, True):
            shm = await self._loop_shm()
            extras = self._segments.extras(get=False)
            rid, (got, fds) = await self._in_loop("lease", timeout, _start_lease, (shm[0], body, extras),
                                                  _finish_lease, (shm[0],), shm, conn=conn)
            try:
                reply = self._core_answer(rid, got, "lease_ok")
            except BadRequest as e:
                if again or not self._stale_channel(extras, e):
                    raise
                self._segments.close_channel()
                continue
            self._segments.leased(reply["segment"], fds)
            return reply
        raise AssertionError("unreachable")

    def _threads(self) -> ThreadPoolExecutor:
        if self._core_threads is None:
            self._core_threads = ThreadPoolExecutor(self.CORE_CONNECTIONS, thread_name_prefix="stowage-core")
        return self._core_threads

    async def _on_lane(self, op: str, timeout, call: Callable[[Client, float], Any]):
        """`call(lane, time left)` in a worker thread, on an idle lane (or a
        new one), given back once the call returned (see the module doc)."""
        timeout = self._call_timeout(timeout)
        if self._closed:
            raise StowageError("the client is closed")
        deadline = time.monotonic() + timeout
        job = self._threads().submit(self._lane_job, op, timeout, deadline, call)
        return await asyncio.wrap_future(job)

    def _lane_job(self, op: str, timeout: float, deadline: float, call):
        if self._closed:
            raise StowageError("the client was closed")
        left = deadline - time.monotonic()
        if left <= 0:  # the queue took the whole timeout
            raise StowageTimeout(f"{op}: no connection was free within {timeout:g} s; nothing was sent")
        try:
            lane = self._core_idle.pop()
        except IndexError:
            lane = self._new_lane()
        # What this client learnt of stowd (it takes no ranges), the lane knows, and the other way.
        lane._ranges_ok = lane._ranges_ok and self._ranges_ok
        try:
            return call(lane, left)
        except StowageTimeout as e:
            # In the call's words: its timeout, not what was left of it.
            t = StowageTimeout(f"{op} (id {e.request_id}): no reply from {self.endpoint} within {timeout:g} s; "
                               "the connection was reset", request_id=e.request_id)
            t.__dict__.update((k, v) for k, v in e.__dict__.items() if k not in t.__dict__)  # rows_stored
            raise t from None
        finally:
            self._ranges_ok = self._ranges_ok and lane._ranges_ok
            self._core_idle.append(lane)


# The lane calls, made here and not as lambdas in the calls themselves: a
# name a lambda takes is a cell in its function's every call, whichever
# branch runs (see `Client.get`).
def _lane_put(put):
    return lambda c, t: c._put(put, t)


def _lane_get(global_indexes, fields, as_torch, nested):
    return lambda c, t: c.get(global_indexes, fields, as_torch=as_torch, nested=nested, timeout=t)


def _lane_get_into(global_indexes, out):
    return lambda c, t: c.get_into(global_indexes, out, timeout=t)


def _lane_ask(op, body, expect):
    return lambda c, t: c._ask(op, body, t, expect)


def _start_lease(conn, rid: int, timeout: float, ch, body: dict, extras: dict):
    """`start` of a lease on the loop: its descriptor expected on the
    channel `ch` first, then the request written."""
    ch.expect(rid)
    return conn.start_call(rid, timeout, "lease", body, extras)


def _finish_lease(conn, rid: int, started, timeout: float, ch):
    """`finish` of a lease on the loop: (the reply as `finish_call` gives
    it, the descriptors stowd sent for a lease_ok: {name: fd}, else None);
    None for a stray reply."""
    got = conn.finish_call(rid, started, timeout)
    if got is None:
        return None
    env = got[0]
    ok = type(env) is dict and env.get("op") == "lease_ok"
    return got, (_shm.take(ch, rid, timeout) if ok else None)


#: Most bytes of rows a same-node reply naming several segment ranges may
#: come to and still be read on the event loop: its rows may be gathered
#: into one buffer, a copy of up to this many bytes (about 25 µs warm),
#: where the hop to a worker thread and back cost about 80 µs.
LOOP_GATHER_MAX = 256 << 10


#: Most seconds the event loop waits for the rest of a channel message that
#: has begun to arrive (stowd writes each whole, a few hundred bytes).
PUMP_WAIT = 1.0


def _pump(loop, ch, fd: int) -> None:
    """The channel is readable: its messages read (descriptors kept for
    the requests that expect them). A closed or broken channel is no
    longer watched (a get that needs it says why). A message is sent
    whole; the rest of one that has begun to arrive is waited for up to
    `PUMP_WAIT` seconds."""
    try:
        while ch.pump(PUMP_WAIT):
            pass
        if not ch.closed:
            return
    except Exception:  # noqa: BLE001  (the channel closed itself, and says why)
        pass
    loop.remove_reader(fd)


def _wake(fut: asyncio.Future) -> None:
    """Resolves `fut` (the socket is readable, or the deadline came)."""
    if not fut.done():
        fut.set_result(None)
