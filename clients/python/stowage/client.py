"""The synchronous client, and what it shares with the asyncio one (`_Ops`)."""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
import time
from typing import Any, Mapping

import numpy as np

# The Rust core (clients/python/core): stowd's codec for every envelope, and
# tcp and ipc get, get_into and put without copies.
from . import _auth, _codec, _core, _put, _shm, _torch
from .errors import (BadRequest, InternalError, ProtocolError, StowageError, StowageTimeout, Unsupported,
                     error_from_reply)

DEFAULT_TIMEOUT = 30.0
#: Bytes of a put message (a bigger put is split): stowd's own frame size
#: (`[limits] max_message_bytes`, 64 MiB), so that the buffers a stowd
#: receives puts into and those it receives other stowds' replies into are
#: one size and its receive pool reuses each for the other. With 256 MiB
#: messages a stowd routing 2 GiB to a peer's units received every get
#: into fresh pages (0.35-0.59 GB/s), with 64 MiB at 1.31-1.46 GB/s;
#: direct puts moved at the same speed either way (docs/benchmarks.md,
#: "Peer units: one stowd routing to another's units").
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
#: How long the Rust core polls for a reply before it sleeps, µs (see `Client`).
DEFAULT_SPIN_US = 200.0


class _Ops:
    """Request building and reply reading, shared by `Client` and `AsyncClient`."""

    #: Same node, a put whose rows come to fewer bytes than this goes on the
    #: socket as any put, not through a segment leased from stowd (0: every
    #: put that holds a byte leases one). A lease costs a round trip, a
    #: descriptor and a segment of a page at least: a 4-row put of float32
    #: [16] took 79.9 µs that way against 19.2 µs on the socket, stowd on the
    #: client's CPU (docs/benchmarks.md, "Same-node small puts, and an
    #: AsyncClient's same-node calls"). stowd's
    #: `[shm] inline_below` (64 KiB by default) answers a small get the same way.
    SAME_NODE_INLINE_BELOW = 64 << 10

    def __init__(self, endpoint: str, timeout: float, max_message_bytes: int,
                 same_node: bool = False, shm_dir: str | None = None, spin_us: float | None = None,
                 token: str | None = None,
                 curve: tuple[str | None, str | None, str | None] = (None, None, None)) -> None:
        # (`shm_dir` is accepted for older callers and not used: segments come
        # as descriptors over the channel stowd names, not as files.)
        self._segments = _shm.Segments() if same_node else None
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")) or endpoint in (
                "tcp://", "ipc://"):
            raise ValueError("endpoint must be a ZeroMQ address over tcp or ipc, like 'tcp://127.0.0.1:5555' or "
                             f"'ipc:///run/stowd.sock', got {endpoint!r}")
        self.endpoint = endpoint
        self.timeout = self._check_timeout(timeout)
        if not isinstance(max_message_bytes, int) or max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be a positive int, got {max_message_bytes!r}")
        self.max_message_bytes = max_message_bytes
        self.spin_us = self._check_spin(spin_us)
        self._token = _auth.resolve(token)
        self._curve = _auth.curve_keys(*curve)
        self._ids = itertools.count(1)  # id 0 is reserved for replies to unreadable requests

    @staticmethod
    def _check_timeout(t) -> float:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or math.isinf(t):
            raise ValueError(f"timeout must be a positive finite number of seconds, got {t!r}")
        return float(t)

    @staticmethod
    def _check_spin(us) -> float:
        where = "spin_us"
        if us is None:
            us = os.environ.get("STOWAGE_SPIN_US")
            if us is None:
                return DEFAULT_SPIN_US
            where = "STOWAGE_SPIN_US"
            try:
                us = float(us)
            except ValueError:
                raise ValueError(f"STOWAGE_SPIN_US must be a number of microseconds, got {us!r}") from None
        if isinstance(us, bool) or not isinstance(us, (int, float)) or not 0 <= us < math.inf:
            raise ValueError(f"{where} must be a finite number of microseconds >= 0, got {us!r}")
        return float(us)

    def _call_timeout(self, t) -> float:
        return self.timeout if t is None else self._check_timeout(t)

    @property
    def same_node(self) -> bool:
        """True if bulk bytes go through shared memory instead of the socket."""
        return self._segments is not None

    def release_segments(self) -> None:
        """Drops this client's cached mappings of stowd's segments (each is
        unmapped once no returned array uses it)."""
        if self._segments is not None:
            self._segments.release()

    def _take_fds(self, rid: int) -> dict:
        """{segment name: descriptor} stowd sent for request `rid` on the channel."""
        return _shm.take(self._segments.channel if self._segments is not None else None, rid, self.timeout)

    def _expect_fds(self, rid: int) -> None:
        """Before sending request `rid` (a lease): keep its descriptors when
        they come on the channel."""
        ch = self._segments.channel if self._segments is not None else None
        if ch is not None and not ch.closed:
            ch.expect(rid)

    def _forget_fds(self, rid: int) -> None:
        """Request `rid` (a lease) failed: its descriptors, if some come,
        are closed."""
        ch = self._segments.channel if self._segments is not None else None
        if ch is not None and not ch.closed:
            ch.forget(rid)

    def _reply_frames(self, env: dict, frames: list, rid: int | None = None) -> list:
        """The frames of a reply to a request built by hand (`_call`): a lease_ok's
        descriptor is kept for a put's `fill`; any
        other reply's descriptors, if some come, are closed. No such call
        asks for its reply in shared memory (gets go through the core)."""
        seg = self._segments
        if seg is not None and seg.channel is not None:
            if env["op"] == "lease_ok":
                seg.leased(env["body"].get("segment"), self._take_fds(env["id"]))
            else:
                seg.channel.forget(env["id"] if rid is None else rid)
        if "segments" in env:
            raise ProtocolError("the reply carries shared-memory segments, but this client did not ask for "
                                "same-node replies", request_id=env["id"])
        return frames

    def _channel_path(self, body: dict) -> str:
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise ProtocolError(f"malformed channel_ok body {body!r:.200}")
        return path

    @staticmethod
    def _no_channel(e: Unsupported) -> StowageError:
        return StowageError(f"same-node mode: stowd refused a descriptor channel ({e}); it needs shared memory "
                            "enabled ([shm]) and a stowd of this client's release")

    def _stale_channel(self, extras: dict | None, e: BadRequest) -> bool:
        """Whether `e` refused a request for naming a channel stowd does not
        know (a restarted stowd, or a channel it closed): worth one more try
        on a new channel."""
        return (self._segments is not None and bool(extras) and "channel" in extras
                and "no descriptor channel has token" in str(e))

    def _with_channel(self, extras: dict) -> dict:
        return dict(extras, channel=self._segments.channel.token)

    def _channel_needed(self) -> bool:
        seg = self._segments
        return seg is not None and (seg.channel is None or seg.channel.closed)

    @staticmethod
    def _reply_body(env: dict, expect: str, req_id: int) -> dict:
        if env["op"] == "error":
            b = env["body"]
            raise error_from_reply(b["code"], b["message"], req_id)
        if env["op"] != expect:
            raise ProtocolError(f"expected a {expect} reply to request {req_id}, got {env['op']!r}", request_id=req_id)
        return env["body"]

    # -- get
    #: Whether the server takes a get's indexes as ranges. A stowd from
    #: before them answers the first such get with bad_request; the get is
    #: then sent again as a list, and so is every later one.
    _ranges_ok = True

    def _list_fallback(self, body: dict, e: BadRequest) -> dict:
        """`body` with its ranges as a list, if `e` is a stowd that does not
        take ranges refusing them; else `e` is raised again."""
        gi = body.get("global_indexes")
        if not (isinstance(gi, (dict, _core.IndexList)) and "global_indexes must be an array" in str(e)):
            raise e
        self._ranges_ok = False
        if type(gi) is _core.IndexList:
            return dict(body, global_indexes=gi.tolist())
        return dict(body, global_indexes=[g for s, c, k in gi["ranges"] for g in range(s, s + c * k, k)])

    @staticmethod
    def _get_options(as_torch, nested: str):
        """The core's `GetOptions` for a get with `as_torch` and `nested`
        (checked here; torch required for `as_torch=True`)."""
        if as_torch not in (None, True, False):
            raise TypeError(f"get: as_torch must be None, True or False, got {as_torch!r}")
        if nested not in ("rows", "packed"):
            raise ValueError(f"get: nested must be 'rows' or 'packed', got {nested!r}")
        torch = _torch.require("get(as_torch=True)") if as_torch else None
        opts = _GET_OPTIONS.get((as_torch, nested))
        if opts is None:
            # Tensors: every dtype with as_torch=True; with None, the dtypes
            # numpy has no type for, if torch is installed (whether the
            # installed torch has each is seen in `_glue`, which imports it
            # only when such a field comes). With as_torch=True the core
            # makes the tensors of the dtypes numpy has itself
            # (`torch.from_numpy`); the rest go through `_glue`.
            tensors = list(_codec.WIRE_DTYPES) if as_torch else (
                sorted(_codec.BITS_DTYPES) if as_torch is None and _torch.available() else [])
            opts = _GET_OPTIONS[(as_torch, nested)] = _core.GetOptions(
                _codec.WIRE_DTYPES, tensors, _codec.Packed if nested == "packed" else None,
                torch.from_numpy if torch is not None else None)
            if as_torch is None and nested == "rows":
                _USUAL_GET[0] = opts
        return opts

    @staticmethod
    def _get_request(global_indexes, fields, ranges: bool = True) -> tuple[int, list, dict]:
        n, wire = _codec.get_indexes(global_indexes, "get", ranges)
        names = _codec.check_field_names(fields, "get")
        return n, names, {"global_indexes": wire, "fields": names}

    def _got(self, rid: int, got: tuple, as_torch) -> dict:
        """A get's result from the core (`Connection.get`, `get_fast`'s
        second item): (results, glue) of a get_ok, made by the core, each
        field of `glue` (field, dtype) then made a tensor or a typed array
        here; or (frame 0, why the core's codec refused it) of any other
        reply, raised as it says (BadRequest: the caller may ask again as
        a list)."""
        out, glue = got
        if type(out) is dict:
            if glue:
                with _torch.quiet():  # (once for every field)
                    for name, dtype in glue:
                        out[name] = _glue(out[name], dtype, as_torch)
            return out
        env = _codec.decode_envelope(out)
        self._reply_body(env, "get_ok", rid)
        raise ProtocolError(f"get (id {rid}): {glue}", request_id=rid)

    # -- get_into
    @staticmethod
    def _get_into_request(global_indexes, out, ranges: bool = True) -> tuple[int, dict, dict]:
        n, wire = _codec.get_indexes(global_indexes, "get_into", ranges)
        if not isinstance(out, Mapping):
            raise TypeError(f"get_into: out must map field names to arrays, got {type(out).__name__}")
        names = _codec.check_field_names(list(out), "get_into")
        targets = {}
        for name in names:
            o = out[name]
            what = f"get_into: out[{name!r}]"
            if isinstance(o, np.ndarray):
                dtype = _codec.wire_dtype_of(o.dtype, what)
                if o.dtype.byteorder == ">" or (o.dtype.byteorder == "=" and sys.byteorder == "big"):
                    raise ValueError(f"{what} is big-endian ({o.dtype.str}); get_into fills little-endian arrays")
                a = o
            elif _torch.is_tensor(o):
                dtype, a = _torch.out_view(o, what)
            else:
                raise TypeError(f"{what} must be a numpy array or a torch tensor, got {type(o).__name__}")
            if not a.flags.writeable:
                raise ValueError(f"{what} is read-only")
            if a.ndim == 0 or a.shape[0] != n:
                raise ValueError(f"{what} has shape {list(a.shape)}, but {n} rows were requested")
            targets[name] = (dtype, a)
        return n, targets, {"global_indexes": wire, "fields": names}

    # -- clear, stats
    @staticmethod
    def _clear_request(global_indexes, fields) -> dict:
        idx = _codec.check_indexes(global_indexes, "clear", unique=False, allow_empty=True)
        body: dict = {"global_indexes": idx}
        if fields is not None:
            names = list([fields] if isinstance(fields, str) else fields)
            if not names:
                raise ValueError("clear: fields is empty (pass None to clear every field)")
            body["fields"] = _codec.check_field_names(names, "clear")
        return body

    @staticmethod
    def _checkpoint_body(dir, journal) -> dict:
        if not isinstance(journal, bool):
            raise TypeError(f"checkpoint: journal must be True or False, got {journal!r}")
        body = {"dir": _abs_dir(dir)}
        if not journal:
            body["journal"] = False
        return body

    @staticmethod
    def _cleared(body: dict) -> int:
        return body["cleared"]

    # -- through the Rust core (tcp and ipc put, get, get_into). What each call runs
    # on a core `Connection` (`_run_get`, `_run_get_into`, a put's `core.put`) and
    # how its result reads are here once; `Client._core_call` runs it under
    # the client's lock, `AsyncClient._core_call` in a worker thread.
    def _shm(self):
        """The core's `shm` argument of a get: (channel, mappings) in
        same-node mode (the channel open), else None."""
        return self._segments.shm() if self._segments is not None else None

    def _core_answer(self, rid: int, got: tuple, expect: str) -> dict:
        """The body of a reply the core's `call` read, (frame 0 decoded or
        why the codec refused it, how many frames), checked as `_call`
        checks one: an error reply raised as it says."""
        env, frames = got
        if type(env) is str:
            raise ProtocolError(f"malformed reply: {env}", request_id=rid)
        body = self._reply_body(env, expect, rid)
        if "segments" in env:
            raise ProtocolError("the reply carries shared-memory segments, but this call asked for none",
                                request_id=rid)
        return body

    def _core_failure(self, e: Exception, op: str, rid: int, timeout: float) -> StowageError:
        """A core call's failure (one of `_CORE_FAILURES`: the core dropped
        its connection) in the client's words."""
        if isinstance(e, TimeoutError):
            if "descriptor" in str(e):
                return StowageTimeout(f"{op} (id {rid}): {e}; the connection was reset", request_id=rid)
            return StowageTimeout(f"{op} (id {rid}): no reply from {self.endpoint} within {timeout:g} s; "
                                  "the connection was reset", request_id=rid)
        if isinstance(e, _core.ProtocolViolation):
            return ProtocolError(f"{op} (id {rid}): {e}", request_id=rid)
        return InternalError(f"{op} (id {rid}): {e}", request_id=rid)

    @staticmethod
    def _core_plan(targets: dict) -> list:
        """A get_into's arrays as the core takes them: (field, accepted
        dtypes, shape, the array: contiguous or strided, a dtype numpy
        exports no buffer format for seen as uints of its size)."""
        plan = []
        for name, (dtype, a) in targets.items():
            accepted = [dtype]
            if dtype in _INT_NAMES:  # raw bits fill ints of their size
                accepted += [b for b in _codec.BITS_DTYPES if _codec.WIRE_DTYPES[b].itemsize == a.dtype.itemsize]
            if a.dtype.kind not in "biufc":
                a = a.view(f"u{a.dtype.itemsize}")
            plan.append((name, accepted, list(a.shape), a))
        return plan

    def _core_got_into(self, rid: int, other) -> None:
        """Checks a get_into through the core: None, the rows are in place;
        else (frame 0, why the core's codec refused it) of a reply that was
        not a get_ok to read, raised as it says (BadRequest: the caller may
        ask again as a list)."""
        if other is None:
            return
        head, problem = other
        env = _codec.decode_envelope(head)
        self._reply_body(env, "get_ok", rid)
        raise ProtocolError(f"get_into (id {rid}): {problem}", request_id=rid)

    def _core_refused(self, rid: int, reply: list, expect: str):
        """Raises the reply (its frames) the core did not take as the
        success of a fast path: an error reply as it says; anything else
        (another request's id, data frames, same-node keys, a put_ok of
        other rows) as a ProtocolError."""
        env = _codec.decode_envelope(reply[0])
        body = self._reply_body(env, expect, rid)
        raise ProtocolError(f"{expect} (id {env['id']}, {len(reply)} frames) {body!r:.200} does not answer "
                            f"request {rid} as expected", request_id=rid)

    def _put_result(self, got, timeout) -> int:
        """What the core's `put` returned: the rows stored; else the reply
        that was not a put_ok for its message (an error reply raised as it
        says, anything else as a ProtocolError) or the failure that dropped
        the core's connection, raised with `rows_stored`, the rows of the messages
        answered before it."""
        if type(got) is int:
            return got
        stored, rid, reply, failure = got
        if failure is not None and not isinstance(failure, _CORE_FAILURES):
            # What a signal handler raised while the put waited
            # (KeyboardInterrupt on Ctrl-C): raised as it is.
            try:
                failure.rows_stored = stored
            except AttributeError:
                pass
            raise failure
        try:
            if failure is not None:
                raise self._core_failure(failure, "put", rid, self._call_timeout(timeout)) from None
            self._core_refused(rid, reply, "put_ok")
        except StowageError as e:
            e.rows_stored = stored
            raise
        raise AssertionError("unreachable")  # _core_refused raises

    def _lease_reply(self, rid: int, got: tuple) -> dict:
        """A lease_ok through the core (`_core_answer`), its descriptor taken
        from the channel (expected before the lease was sent) and kept
        (`Segments.leased`); any other reply: the descriptors are no longer
        expected."""
        try:
            reply = self._core_answer(rid, got, "lease_ok")
        except BaseException:
            self._forget_fds(rid)
            raise
        self._segments.leased(reply["segment"], self._take_fds(rid))
        return reply


_INT_NAMES = frozenset(f"{s}int{n}" for s in ("", "u") for n in (8, 16, 32, 64))

#: What a core call raises when the core dropped its connection (a timeout,
#: a reply that breaks the protocol, an I/O error): `_Ops._core_failure`.
_CORE_FAILURES = (TimeoutError, _core.ProtocolViolation, ConnectionError)


def _get_fast(core, rid: int, timeout: float, indexes, fields, opts, ranges: bool, shm):
    """A get through the core as `_core_call` runs it."""
    return core.get_fast(rid, indexes, fields, timeout, opts, ranges, shm)


def _put_fast(core, rid: int, timeout: float, ids, put, segments):
    """A put through the core as `_core_call` runs it."""
    return core.put(rid, ids, put, timeout, segments)


#: The core's `GetOptions` made so far, by (as_torch, nested).
_GET_OPTIONS: dict = {}
#: The options of a get with the defaults (as_torch None, nested "rows"),
#: once made: `get` takes them without a call.
_USUAL_GET: list = [None]


def _glue(v, dtype: str, as_torch):
    """A field's result from the core (a numpy array, a list of them, or a
    `Packed`) of `dtype`, which the core listed for this: a torch tensor
    (or tensors) when the get asked for them (`as_torch=True`, or None for
    a dtype numpy has no type for and the installed torch has), else the
    raw bits as ml_dtypes arrays where ml_dtypes has the dtype."""
    packed = type(v) is _codec.Packed
    a = v.values if packed else v
    rows = type(a) is list
    if as_torch or (as_torch is None and dtype in _codec.BITS_DTYPES and _torch.available()
                    and _torch.torch_dtype(dtype) is not None):
        a = _torch.tensors_of(a, dtype) if rows else _torch.tensors_of([a], dtype)[0]
    else:
        # (Read-only as numpy arrays of a get always are; the core made
        # this one writable for a tensor the installed torch cannot type.)
        for r in a if rows else [a]:
            r.flags.writeable = False
        a = _codec.typed_bits(a, dtype) if dtype in _codec.BITS_DTYPES else a
    return _codec.Packed(a, v.shapes) if packed else a


def _run_get(names: list, n: int, opts, shm):
    """`run` for `_core_call`: the get (frame 0 given) through `core.get`."""
    return lambda core, frame0, timeout: core.get(frame0, names, n, timeout, opts, shm)


def _run_get_into(plan: list, shm=None):
    return lambda core, frame0, timeout: core.get_into(frame0, plan, timeout, shm)


# `run`s for `_core_call` with the request id (body None), the call's
# arguments passed through it: no closure a call.
def _get_into_fast(core, rid, timeout, global_indexes, out, ranges, shm):
    return core.get_into_fast(rid, global_indexes, out, timeout, ranges, shm)


def _clear_fast(core, rid, timeout, global_indexes, fields):
    return core.clear_fast(rid, global_indexes, fields, timeout)


def _call(core, rid, timeout, op, body):
    return core.call(op, rid, body, timeout)


class Client(_Ops):
    """A synchronous stowage/1 client of `stowd`'s native endpoint: one
    connection of the Rust core (`_core.Connection`, stowd's ZMTP as a
    DEALER) carries every call, same node too (a put's lease and the put
    through it included; the descriptor channel beside it). Calls are
    serialized by a lock, so one client may be shared by threads (one
    request at a time).

    Every call waits at most `timeout` seconds (or its own `timeout=`) for
    its reply; then it raises `StowageTimeout` after dropping the
    connection (the next call connects anew), so a late reply is never
    taken for the answer to a later request.

    Calls through the Rust core (tcp and ipc) await their reply by polling the
    socket for up to `spin_us` microseconds (default 200, or the
    `STOWAGE_SPIN_US` environment variable) before sleeping: a client still
    running when the reply comes is not woken across CPUs, which is most of
    a small call's round trip on a VM. Each turn yields the CPU, so
    anything else runnable goes first; a wait the spin misses makes the
    connection's next 8 waits sleep at once. `spin_us=0` always sleeps.

    `token` is stowd's token, which its native endpoint asks for by default
    (`[security] auth = "token"`); `None` takes `$STOWAGE_TOKEN`, else the
    token file of this user's stowd (see `stowage._auth`), so stowd's own
    user needs none. It is only ever offered to a server that asks.

    `curve_server_key` (stowd's public key), `curve_public_key` and
    `curve_secret_key` (a key pair stowd allows), in Z85, are for a stowd
    with `[security] auth = "curve"`; `None` takes `$STOWAGE_CURVE_SERVER_KEY`
    and `$STOWAGE_CURVE_DIR`, else stowd's curve directory (see
    `stowage._auth`), so stowd's own user needs none. They are only used
    with a server whose greeting says CURVE.
    """

    def __init__(self, endpoint: str, timeout: float = DEFAULT_TIMEOUT, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, context: Any = None,
                 same_node: bool = False, shm_dir: str | None = None, spin_us: float | None = None,
                 token: str | None = None, curve_server_key: str | None = None,
                 curve_public_key: str | None = None, curve_secret_key: str | None = None) -> None:
        # (`context`, once pyzmq's, is accepted for older callers and not used.)
        super().__init__(endpoint, timeout, max_message_bytes, same_node, shm_dir, spin_us, token,
                         (curve_server_key, curve_public_key, curve_secret_key))
        self._lock = threading.Lock()
        self._closed = False
        # The Rust core's connection (made on first use, and anew after one is dropped).
        self._core: Any = None

    def close(self) -> None:
        """Closes the connection and the descriptor channel. Idempotent."""
        with self._lock:
            self._closed = True
            if self._core is not None:
                self._core.close()
                self._core = None
            if self._segments is not None:
                self._segments.close()

    def _open_channel(self) -> None:
        """Same node: opens the descriptor channel if none is open."""
        if not self._channel_needed():
            return
        try:
            body = self._ask("channel", {}, None, "channel_ok")
        except Unsupported as e:
            raise self._no_channel(e) from None
        self._segments.channel = _shm.open_channel(self._channel_path(body), self.timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, op: str, body: dict, data_frames, timeout, expect: str,
              extras: dict | None = None) -> tuple[dict, list]:
        """A request built by hand (no call of the client's goes this way;
        tests use it), through the core: (the reply's body, []). A
        lease_ok's descriptor is kept for a put, as a put's own lease keeps it."""
        try:
            return self._call_once(op, body, data_frames, timeout, expect, extras)
        except BadRequest as e:
            if not self._stale_channel(extras, e):
                raise
        # stowd restarted (or dropped the channel): open a new one, ask again.
        self._segments.close()
        self._open_channel()
        return self._call_once(op, body, data_frames, timeout, expect, self._with_channel(extras))

    def _call_once(self, op: str, body: dict, data_frames, timeout, expect: str,
                   extras: dict | None = None) -> tuple[dict, list]:
        if data_frames:
            raise ValueError("a request built by hand carries no data frames")
        asked = []

        def run(core, rid, t):
            asked.append(rid)
            self._expect_fds(rid)
            return core.call(op, rid, body, t, extras)

        try:
            rid, (env, _) = self._core_call(op, None, timeout, run)
            if type(env) is str:
                raise ProtocolError(f"malformed reply: {env}", request_id=rid)
            frames = self._reply_frames(env, [], rid)
        except BaseException:
            if asked:
                self._forget_fds(asked[0])
            raise
        return self._reply_body(env, expect, rid), frames

    def put(self, global_indexes, data: Mapping[str, Any], *, timeout: float | None = None) -> int:
        """Stores rows. `data` maps field name -> a numpy array or torch tensor
        `[n, ...]` (regular), a list of n arrays/tensors of any shapes, one
        dtype (nested), a nested torch tensor (nested), or a list of n
        str/bytes (values). Returns the number of rows stored (n).

        A put whose payload exceeds `max_message_bytes` is sent as several
        put requests, each a contiguous range of rows with all fields. Each
        message is all-or-nothing, the whole put is NOT: if a later message
        fails, earlier ones stay stored; the exception's `rows_stored` says
        how many leading rows were. Over tcp the next message is sent
        before the reply to the one before it arrives (stowd reads it while
        it stores that one), so the message after a failed one may be
        stored too; `rows_stored` does not count it."""
        put = _core.Put(global_indexes, data, self.max_message_bytes, self._segments is not None)
        if self._segments is not None:
            return self._put(put, timeout)
        # The usual call (a socket): `_core_put` written out, as in `get`.
        timeout = self.timeout if timeout is None else self._check_timeout(timeout)
        rid = next(self._ids)
        lock = self._lock
        lock.acquire()
        try:
            got = (self._core or self._connect()).put(rid, self._ids, put, timeout, None)
        except _CORE_FAILURES as e:
            failure = self._core_failure(e, "put", rid, timeout)
            failure.rows_stored = 0
            raise failure from None
        finally:
            lock.release()
        return got if type(got) is int else self._put(put, timeout, got)

    def _put(self, put, timeout, got=None) -> int:
        """Sends `put` (a `_core.Put`, read and checked): over the socket
        through the core, its messages two on the wire; same node, a lease
        the core fills and the put naming it (`_put.same_node`). `got`: what
        the core's put over the socket answered, not a count (read here)."""
        try:
            if got is not None:
                return self._put_result(got, timeout)
            if self._segments is None:
                return self._core_put(put, timeout)
            steps = _put.same_node(put, self._segments, self.SAME_NODE_INLINE_BELOW)
            reply = None
            while True:
                try:
                    op, arg = steps.send(reply)
                except StopIteration as done:
                    return done.value
                if op == "lease":
                    self._open_channel()
                    reply = self._core_lease(arg, timeout)
                else:
                    reply = self._core_put(put, timeout, arg)
        except StowageError as e:
            if e.rows_stored is None:
                e.rows_stored = 0
            raise

    def _core_put(self, put, timeout, segments=None) -> int:
        """`put` (a `_core.Put`) through the Rust core, its messages two on
        the wire (stowd reads the next while it handles one); with
        `segments`, the one message of a same-node put naming them."""
        got = self._core_call("put", None, timeout, _put_fast, self._ids, put, segments)[1]
        return got if type(got) is int else self._put_result(got, timeout)

    def _core_lease(self, body: dict, timeout) -> dict:
        """A lease through the core (same node): its lease_ok body, its
        descriptor kept. A stowd that no longer knows the channel
        (restarted) gets a new one, and the lease is asked again."""
        for again in (False, True):
            extras = self._segments.extras(get=False)

            def run(core, rid, t):
                self._expect_fds(rid)
                try:
                    got = core.call("lease", rid, body, t, extras)
                except BaseException:
                    self._forget_fds(rid)
                    raise
                return self._lease_reply(rid, got)
            try:
                return self._core_call("lease", None, timeout, run)[1]
            except BadRequest as e:
                if again or not self._stale_channel(extras, e):
                    raise
            self._segments.close()
            self._open_channel()
        raise AssertionError("unreachable")

    def get(self, global_indexes, fields, *, as_torch: bool | None = None, nested: str = "rows",
            timeout: float | None = None) -> dict:
        """Reads rows: a dict field -> a read-only numpy array `[n, ...]`
        (regular), a list of n read-only arrays (nested), or a list of n
        values, in the order of `global_indexes` (repeats allowed).
        `as_torch=True` gives torch tensors; `None` gives numpy except for
        the dtypes numpy has no type for (`stowage.BITS_DTYPES`: bfloat16,
        complex32, the float8s, float4_e2m1fn_x2), which are torch tensors of
        that dtype if torch is installed (and has it), else their bit
        patterns as unsigned ints of the same size (uint16 for bfloat16,
        uint32 for complex32, uint8 for the others) or, for the float8s with
        `ml_dtypes` installed, ml_dtypes arrays; `False` is numpy only
        (those same bits or ml_dtypes arrays).

        A write to a numpy array raises `ValueError` (same node: two gets of
        the same rows share one read-only mapping). torch tensors are
        writable (in-place ops work) and a write changes only that tensor:
        over tcp it writes this client's received buffer; same node, each get
        maps stowd's pages copy-on-write, privately, so a write copies the
        pages it touches and no other tensor, array, process or the store
        sees it; nor does another tensor of the same get (a row asked for
        twice is copied: two tensors of one get never share bytes).

        `nested="packed"` gives each nested field as a `stowage.Packed`
        instead of a list: one 1-D array (or tensor) of all its rows'
        elements back to back, and the rows' shapes, with no array per row
        (e.g. for `torch.nested.nested_tensor_from_jagged`); a view of the
        received bytes where they lie back to back, as over tcp."""
        opts = _USUAL_GET[0] if as_torch is None and nested == "rows" else None
        if opts is None:
            opts = self._get_options(as_torch, nested)
        shm = None
        if self._segments is not None:
            if self._channel_needed():  # (the first same-node call, or a channel that closed)
                return self._get_anew(global_indexes, fields, as_torch, opts, timeout)
            shm = self._segments.shm()
        # The usual call (no closure): `_core_call` written out, which
        # saves a 1-field get 0.7 µs of its 15 (same node too, its channel open).
        # No lambda in this function either: a name a lambda takes is a
        # cell for the whole call, made and freed on every call whichever
        # branch runs (six cells were 1,450 of a 1-field get's 19,300
        # client instructions, callgrind).
        timeout = self.timeout if timeout is None else self._check_timeout(timeout)
        rid, ranges = next(self._ids), self._ranges_ok
        lock = self._lock
        lock.acquire()
        try:
            got = (self._core or self._connect()).get_fast(rid, global_indexes, fields, timeout, opts, ranges, shm)
        except _CORE_FAILURES as e:
            raise self._core_failure(e, "get", rid, timeout) from None
        finally:
            lock.release()
        if got is not None:
            out, glue = got[1]
            if type(out) is dict and not glue:  # (numpy arrays and lists only: nothing to glue)
                return out
        if shm is None:
            return self._get_rest(rid, got, global_indexes, fields, as_torch, opts, timeout, None, ranges)
        try:
            return self._get_rest(rid, got, global_indexes, fields, as_torch, opts, timeout, shm, ranges)
        except BadRequest as e:
            if "no descriptor channel has token" not in str(e):
                raise
        # stowd no longer knows the channel (it restarted): asked again on a new one, as `_with_shm` does.
        self._segments.close_channel()
        return self._get_anew(global_indexes, fields, as_torch, opts, timeout)

    def _get_anew(self, global_indexes, fields, as_torch, opts, timeout) -> dict:
        """The get through `_with_shm`: its channel opened first (or again)."""
        return self._with_shm(lambda shm: self._get(global_indexes, fields, as_torch, opts, timeout, shm))

    def _get(self, global_indexes, fields, as_torch, opts, timeout, shm) -> dict:
        """A get through the core (`shm`: same node)."""
        # The usual get: the core reads the indexes and field names and
        # writes the request itself (None: not plainly indexes and distinct
        # names, nothing sent; the general path below checks and words).
        ranges = self._ranges_ok
        rid, got = self._core_call("get", None, timeout, _get_fast, global_indexes, fields, opts, ranges, shm)
        return self._get_rest(rid, got, global_indexes, fields, as_torch, opts, timeout, shm, ranges)

    def _get_rest(self, rid, got, global_indexes, fields, as_torch, opts, timeout, shm, ranges: bool) -> dict:
        """A get after `get_fast` answered `got`: its result, glued; or,
        for arguments it did not take (None) or a stowd that takes no
        ranges, the general path."""
        if got is not None:
            out, glue = got = got[1]
            if type(out) is dict and not glue:  # (numpy arrays and lists only: nothing to glue)
                return out
            try:
                return self._got(rid, got, as_torch)
            except BadRequest as e:
                if not (ranges and "global_indexes must be an array" in str(e)):
                    raise
                self._ranges_ok = False  # a stowd from before ranges: asked again below, as a list
        n, names, body = self._get_request(global_indexes, fields, self._ranges_ok)
        return self._ranged(body, lambda b: self._core_call("get", b, timeout, _run_get(names, n, opts, shm)),
                            lambda rid, got: self._got(rid, got, as_torch))

    def _ranged(self, body: dict, ask, finish):
        """`finish(*ask(body))` of a get, asked again with the indexes as a
        list of a stowd that does not take ranges."""
        try:
            return finish(*ask(body))
        except BadRequest as e:
            body = self._list_fallback(body, e)  # raises `e` unless stowd refused the ranges
        return finish(*ask(body))

    def _with_shm(self, run):
        """`run(shm)`, `shm` the core's same-node argument (the descriptor
        channel opened first) or None; asked again on a new channel if stowd
        did not know the one named (it restarted, or dropped it)."""
        if self._segments is None:
            return run(None)
        self._open_channel()
        try:
            return run(self._shm())
        except BadRequest as e:
            if "no descriptor channel has token" not in str(e):
                raise
        self._segments.close_channel()
        self._open_channel()
        return run(self._shm())

    def _core_call(self, op: str, body: dict | None, timeout, run, *args) -> tuple[int, Any]:
        """`run(core connection, frame 0 of the request, timeout, *args)`
        under the client's lock: (request id, its result); with `body` None,
        `run` gets the request id instead and writes frame 0 itself. A failure
        drops the core's connection (the next call connects anew), so
        nothing stale can follow."""
        # (Written for the fewest Python steps: after a round trip's two
        # context switches every step runs cold, and a 1-field get's
        # wrapping cost 2.2 µs against the core's 15.)
        timeout = self.timeout if timeout is None else self._check_timeout(timeout)
        rid = next(self._ids)
        frame0 = rid if body is None else _codec.envelope(op, rid, body)
        lock = self._lock
        lock.acquire()
        try:
            core = self._core
            if core is None:
                core = self._connect()
            return rid, run(core, frame0, timeout, *args)
        except _CORE_FAILURES as e:
            raise self._core_failure(e, op, rid, timeout) from None
        finally:
            lock.release()

    def _connect(self):
        """The core's connection, made now (under the lock; the client open)."""
        if self._closed:
            raise StowageError("the client is closed")
        self._core = _core.Connection(self.endpoint, self.spin_us, self._token, self._curve)
        return self._core

    def get_into(self, global_indexes, out: Mapping[str, Any], *, timeout: float | None = None) -> Mapping[str, Any]:
        """Reads regular fields into preallocated arrays or CPU tensors (e.g.
        pinned): out[field] must have shape `[n, ...]` and the field's dtype
        (a dtype of `stowage.BITS_DTYPES` also fills int arrays of its
        itemsize, e.g. uint8 for a float8). Every byte is copied once,
        from the received frames straight into `out`. Returns `out`."""
        if self._segments is None:  # (as `_with_shm` does, without a closure: see `get`)
            return self._get_into(global_indexes, out, timeout, None)
        return self._get_into_same_node(global_indexes, out, timeout)

    def _get_into_same_node(self, global_indexes, out, timeout):
        return self._with_shm(lambda shm: self._get_into(global_indexes, out, timeout, shm))

    def _get_into(self, global_indexes, out, timeout, shm):
        """A get_into through the core (`shm`: same node)."""
        # The usual get_into (numpy arrays or CPU tensors, contiguous or
        # strided): read and written by the core (False: not plainly that,
        # nothing sent; the general path below checks and words).
        ranges = self._ranges_ok
        rid, got = self._core_call("get", None, timeout, _get_into_fast, global_indexes, out, ranges, shm)
        if got is not False:
            try:
                self._core_got_into(rid, got)
                return out
            except BadRequest as e:
                if not (ranges and "global_indexes must be an array" in str(e)):
                    raise
                self._ranges_ok = False  # a stowd from before ranges: asked again below, as a list
        return self._get_into_general(global_indexes, out, timeout, shm)

    def _get_into_general(self, global_indexes, out, timeout, shm):
        """A get_into the core did not take as it is: asked as a request body."""
        n, targets, body = self._get_into_request(global_indexes, out, self._ranges_ok)
        # Each field's bytes go from the socket (or stowd's segments) straight
        # into its array (no buffer of the payload's size, the GIL released).
        run = _run_get_into(self._core_plan(targets), shm)
        self._ranged(body, lambda b: self._core_call("get", b, timeout, run), self._core_got_into)
        return out

    def clear(self, global_indexes, fields=None, *, timeout: float | None = None) -> int:
        """Drops the given fields (all fields if None) of the given indexes;
        returns how many (index, field) values were dropped."""
        rid, got = self._core_call("clear", None, timeout, _clear_fast, global_indexes, fields)
        if got is not None:
            return got if type(got) is int else self._core_refused(rid, got, "clear_ok")
        return self._cleared(self._ask("clear", self._clear_request(global_indexes, fields), timeout, "clear_ok"))

    def _ask(self, op: str, body: dict, timeout, expect: str) -> dict:
        """A call that moves no rows, through the core: the reply's body."""
        rid, got = self._core_call(op, None, timeout, _call, op, body)
        return self._core_answer(rid, got, expect)

    def checkpoint(self, dir: str, *, journal: bool = True, timeout: float | None = None) -> dict:
        """Writes a checkpoint of every row of every unit of this stowd to
        the directory `dir` on the stowd's machine (an absolute path; created
        0700 if missing) and waits for it: the rows as they were when the
        request arrived, while other requests go on. The directory then holds
        that one checkpoint (the one before is removed once this one is
        complete). Returns ``{"dir", "seq", "rows", "bytes", "files"}``.
        Large stores take a while: pass a `timeout` long enough for writing
        (and fsyncing) their bytes.

        With the default `journal=True`, stowd then journals every index
        put or cleared in `dir` (one small fsynced write per put or clear),
        and `restore` marks those lost (`DataLost`): nothing changed after
        the checkpoint is ever served its old value, which is what a crash
        recovery needs. `journal=False` writes a *snapshot*: no journal, and
        `restore` brings back every row as it was written, whatever changed
        since (TransferQueue's checkpoint semantics); restoring one stops
        the journals of earlier journaled checkpoints, which can then no
        longer be restored. A snapshot's directory may be moved."""
        return self._ask("checkpoint", self._checkpoint_body(dir, journal), timeout, "checkpoint_ok")

    def restore(self, dir: str, *, timeout: float | None = None) -> dict:
        """Replaces every unit's rows with the last checkpoint in `dir`
        (see `checkpoint`). Indexes written or cleared after that checkpoint
        are not restored: a get of one raises `DataLost` until it is put
        again. Returns ``{"dir", "seq", "rows", "lost"}``."""
        return self._ask("restore", {"dir": _abs_dir(dir)}, timeout, "restore_ok")

    def stats(self, *, timeout: float | None = None) -> dict:
        """The server's counters, as `docs/protocol-stowage1.md` lists them.

        Top-level values are ints: at least ``units``, ``keys``, ``rows``,
        ``bytes`` (``capacity`` if bounded), data-path and reload counters and
        ``missing_chain_entries``. Each live plugin is a dict under
        ``"plugin.<name>"``::

            {"version": "0.1.0", "capabilities": ["select"], "calls": 2,
             "entries": 1, "memo_hits": 0,
             "call_ns": 3410, "plans": 2, "faults": 0, "invalid_plans": 0, "fallbacks": 0,
             "rejections": 0, "disables": 0, "reenables": 0,
             "disabled": False}  # + "reenable_in_ms": int while disabled

        and each chain a dict under ``"chain.<pattern>"``::

            {"select": ["single-row", "runs"], "pack": ["coalesce"],
             "fail": "fallback", "max_faults": 10, "backoff_ms": 1000,
             "backoff_max_ms": 300000, "allow_missing": False,
             "missing_select": [], "missing_pack": []}
        """
        return self._ask("stats", {}, timeout, "stats_ok")


def _abs_dir(dir) -> str:
    """A checkpoint directory as stowd wants it: absolute (a relative one is
    taken relative to this process's working directory)."""
    if not isinstance(dir, (str, os.PathLike)):
        raise TypeError(f"dir must be a path, got {type(dir).__name__}")
    return os.path.abspath(os.fspath(dir))
