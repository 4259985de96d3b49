"""Every error path: bad input caught before sending, each server error code
mapped to its exception, timeouts, stale and malformed replies."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import msgpack
import numpy as np
import pytest

import stowage
from stowage import _codec

CAPACITY = 4096  # conftest.small_server: bytes per unit
SMALL_MAX_ROWS = 1000  # conftest.small_server: [limits] max_rows


# ---------------------------------------------------------------- bad input, caught before sending


def test_empty_batches_are_refused_before_sending(silent_endpoint):
    """Against a peer that never answers: a ValueError at once, not a timeout."""
    ep, router = silent_endpoint
    x = np.zeros((0, 3), np.float32)
    t0 = time.monotonic()
    with stowage.Client(ep, timeout=5) as c:
        with pytest.raises(ValueError, match=r"put: empty batch: global_indexes is empty"):
            c.put([], {"x": x})
        with pytest.raises(ValueError, match=r"put: empty batch: global_indexes is empty"):
            c.put(np.array([], dtype=np.int64), {"x": x})
        with pytest.raises(ValueError, match=r"put: empty batch: data has no fields"):
            c.put([1], {})
        with pytest.raises(ValueError, match=r"get: empty batch: global_indexes is empty"):
            c.get([], ["x"])
        with pytest.raises(ValueError, match=r"get: empty batch: no fields requested"):
            c.get([1], [])
        with pytest.raises(ValueError, match=r"get_into: empty batch: global_indexes is empty"):
            c.get_into([], {"x": x})
        with pytest.raises(ValueError, match=r"get_into: empty batch: no fields requested"):
            c.get_into([1], {})
    assert time.monotonic() - t0 < 1.0
    assert router.poll(100, 1) == 0, "a refused call sent something"


BAD_PUTS = {
    # name: (global_indexes, data, exception, message regex)
    "row_count": ([1, 2], {"x": np.zeros((3, 2))}, ValueError, r"field 'x' has 3 rows but 2 global indexes"),
    "list_row_count": ([1, 2], {"t": ["a"]}, ValueError, r"field 't' has 1 rows but 2"),
    "zero_dim": ([1], {"x": np.float32(1.0)}, TypeError, r"field 'x': expected a numpy array"),
    "zero_dim_array": ([1], {"x": np.array(1.0)}, ValueError, r"needs a row axis"),
    "duplicate_index": ([1, 1], {"t": ["a", "b"]}, ValueError, r"duplicate global index 1"),
    "negative_index": ([-1], {"t": ["a"]}, ValueError, r"global index -1 is out of range"),
    "huge_index": ([2**64], {"t": ["a"]}, ValueError, r"out of range"),
    "float_index": ([1.5], {"t": ["a"]}, TypeError, r"global indexes must be ints, got 1.5"),
    "str_indexes": ("12", {"t": ["a"]}, TypeError, r"global_indexes must be a sequence"),
    "2d_index_array": (np.zeros((1, 1), np.int64), {"t": ["a"]}, TypeError, r"1-d integer array"),
    "object_array": ([1], {"x": np.array([object()])}, TypeError, r"numpy dtype object has no stowage/1"),
    "unicode_array": ([1, 2], {"x": np.array(["a", "b"])}, TypeError, r"numpy dtype <U1 has no stowage/1"),
    "datetime_array": ([1], {"x": np.array(["2020-01-01"], "datetime64[D]")}, TypeError, r"has no stowage/1"),
    "float128": ([1], {"x": np.zeros(1, np.longdouble)}, TypeError, r"has no stowage/1"),
    "mixed_list": ([1, 2], {"m": [np.zeros(2), "b"]}, TypeError, r"mixes arrays/tensors and plain values"),
    "nested_dtypes": ([1, 2], {"n": [np.zeros(2, np.float32), np.zeros(2, np.int64)]}, ValueError,
                      r"nested rows must share one dtype"),
    "unpackable_value": ([1], {"v": [object()]}, TypeError, r"field 'v' row 0: cannot send object"),
    "not_a_mapping": ([1], [("x", np.zeros(1))], TypeError, r"data must map field names"),
    "field_name": ([1], {3: ["a"]}, TypeError, r"field names must be str"),
    "scalar_field": ([1], {"x": 3}, TypeError, r"field 'x': expected a numpy array or torch tensor"),
    "bf16_bits_dtype": ([1], {"b": stowage.BFloat16Bits(np.zeros(1, np.float32))}, TypeError,
                        r"BFloat16Bits needs a uint16 or int16"),
    # ragged: a row that is a list among arrays, rows fewer than indexes
    "ragged_nested": ([1, 2], {"n": [np.zeros(2), [np.zeros(1)]]}, TypeError, r"field 'n' mixes arrays"),
    "ragged_rows": ([1, 2, 3], {"n": [np.zeros(2), np.zeros(1)]}, ValueError, r"field 'n' has 2 rows but 3"),
    "strided_row_count": ([1, 2], {"x": np.zeros((6, 3))[::2]}, ValueError, r"field 'x' has 3 rows but 2"),
    # mixed dtypes
    "nested_bits_dtypes": ([1, 2], {"b": stowage.BFloat16Bits([np.zeros(2, np.uint16), np.zeros(2, np.uint8)])},
                           TypeError, r"field 'b' row 1: BFloat16Bits needs a uint16 or int16 numpy array, "
                                      r"got ndarray uint8\[2\]"),
    "nested_byte_orders": ([1, 2], {"n": [np.zeros(2, "<f4"), np.zeros(2, ">f8")]}, ValueError,
                           r"must share one dtype, got \['float32', 'float64'\]"),
    "values_late_row": ([1, 2, 3], {"v": ["a", b"b", object()]}, TypeError, r"field 'v' row 2: cannot send object"),
    # absurd shapes
    "packed_overflow": ([1, 2], {"p": stowage.Packed(np.arange(3), [(2**62, 2**62), (3,)])}, ValueError,
                        r"the row shapes hold \d+ elements, values has 3"),
    "packed_dims": ([1], {"p": stowage.Packed(np.arange(1), [(1,) * 65])}, ValueError, r"more than 64 dimensions"),
    "packed_not_ints": ([1], {"p": stowage.Packed(np.arange(1), [("a",)])}, ValueError, r"invalid literal"),
    "packed_rows": ([1, 2, 3], {"p": stowage.Packed(np.arange(3), [(1,), (2,)])}, ValueError,
                    r"Packed.shapes must list 3 row shapes, got 2"),
}


@pytest.mark.parametrize("case", list(BAD_PUTS), ids=list(BAD_PUTS))
def test_bad_put_input(silent_endpoint, case):
    """Each refused at once, with the same words by the sync and asyncio
    clients and the same-node mode, and nothing sent."""
    ep, router = silent_endpoint
    idx, data, exc, pattern = BAD_PUTS[case]
    with stowage.Client(ep, timeout=5) as c:
        with pytest.raises(exc, match=pattern):
            c.put(idx, data)
    with stowage.Client(ep, timeout=5, same_node=True) as c:  # (no channel is asked for first)
        with pytest.raises(exc, match=pattern):
            c.put(idx, data)

    async def aio():
        async with stowage.AsyncClient(ep, timeout=5) as c:
            with pytest.raises(exc, match=pattern):
                await c.put(idx, data)

    asyncio.run(asyncio.wait_for(aio(), 30))
    assert router.poll(50, 1) == 0, "a refused put sent something"


def test_bad_get_and_clear_input(silent_endpoint):
    ep, router = silent_endpoint
    with stowage.Client(ep, timeout=5) as c:
        with pytest.raises(ValueError, match=r"a field is named twice"):
            c.get([1], ["x", "x"])
        with pytest.raises(TypeError, match=r"field names must be str"):
            c.get([1], [b"x"])
        with pytest.raises(ValueError, match=r"clear: fields is empty"):
            c.clear([1], [])
        with pytest.raises(TypeError, match=r"get_into: out must map"):
            c.get_into([1], [np.zeros(1)])
        with pytest.raises(TypeError, match=r"must be a numpy array or a torch tensor"):
            c.get_into([1], {"x": [0.0]})
        ro = np.zeros((1, 2), np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match=r"out\['x'\] is read-only"):
            c.get_into([1], {"x": ro})
        with pytest.raises(ValueError, match=r"has shape \[2, 2\], but 1 rows were requested"):
            c.get_into([1], {"x": np.zeros((2, 2))})
        with pytest.raises(ValueError, match=r"out\['x'\] is big-endian \(>f4\)"):
            c.get_into([1], {"x": np.zeros((1, 2), ">f4")})
    with pytest.raises(ValueError, match="timeout must be a positive"):
        stowage.Client(ep, timeout=0)
    with pytest.raises(ValueError, match="max_message_bytes"):
        stowage.Client(ep, max_message_bytes=0)
    with pytest.raises(ValueError, match="endpoint must be a ZeroMQ address"):
        stowage.Client("127.0.0.1:5")
    assert router.poll(50, 1) == 0


def test_get_into_mismatch_is_caught_before_writing(endpoint, fresh):
    idx = fresh(3)
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx, {"x": np.ones((3, 4), np.float32), "n": [np.ones(k) for k in range(3)], "t": ["a", "b", "c"]})
        cases = [
            ({"x": np.zeros((3, 4), np.float64)}, ValueError, r"out\['x'\] has dtype float64, but field 'x' is float32"),
            ({"x": np.zeros((3, 5), np.float32)}, ValueError, r"has shape \[3, 5\], but field 'x' is \[3, 4\]"),
            ({"n": np.zeros((3, 2))}, ValueError, r"requested rows of 'n' have different shapes"),
            ({"t": np.zeros((3, 1))}, TypeError, r"holds plain values, not tensors"),
        ]
        for out, exc, pattern in cases:
            guard = np.full((3, 4), 9, np.float32)
            with pytest.raises(exc, match=pattern):
                c.get_into(idx, {"x": guard, **out} if "x" not in out else out)
            assert (guard == 9).all(), "get_into wrote before checking every field"
        c.clear(idx)


# ---------------------------------------------------------------- server errors


def test_key_not_found(endpoint, fresh):
    idx = fresh(2)
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx[:1], {"x": np.ones((1, 2), np.float32)})
        for missing in ([idx[0], idx[1]], [idx[1]]):
            with pytest.raises(stowage.KeyNotFound) as ei:
                c.get(missing, ["x"])
            e = ei.value
            assert isinstance(e, stowage.StowageError) and isinstance(e, KeyError)
            assert e.code == "key_not_found" and e.request_id is not None
            assert str(e).startswith("key_not_found: ") and f"global_index={idx[1]}" in str(e)
        with pytest.raises(stowage.KeyNotFound, match="field=nope"):
            c.get(idx[:1], ["nope"])
        with pytest.raises(stowage.KeyNotFound):
            c.get_into(idx[:1], {"nope": np.zeros((1, 2), np.float32)})
        # The client still works after errors.
        assert c.get(idx[:1], ["x"])["x"].tolist() == [[1.0, 1.0]]
        c.clear(idx)


def test_capacity(small_server, fresh):
    assert (small_server.capacity, small_server.max_rows) == (CAPACITY, SMALL_MAX_ROWS)
    idx = fresh(2)
    with stowage.Client(small_server["native"], timeout=10) as c:
        with pytest.raises(stowage.CapacityError, match=r"^capacity: .*full") as ei:
            c.put(idx[:1], {"x": np.zeros((1, CAPACITY + 1), np.uint8)})
        assert ei.value.code == "capacity" and ei.value.rows_stored == 0
        with pytest.raises(stowage.KeyNotFound):
            c.get(idx[:1], ["x"])
        c.put(idx, {"x": np.zeros((2, 100), np.uint8)})  # smaller puts still fit
        assert c.get(idx, ["x"])["x"].shape == (2, 100)
        assert c.stats()["capacity"] >= CAPACITY
        assert c.clear(idx) == 2


def test_too_large(small_server, fresh):
    """More global indexes than the server's [limits] max_rows: `too_large`, a BadRequest."""
    n = SMALL_MAX_ROWS + 1
    idx = fresh(n)
    with stowage.Client(small_server["native"], timeout=10) as c:
        with pytest.raises(stowage.TooLarge, match=r"^too_large: ") as ei:
            c.put(idx, {"t": ["v"] * n})
        assert isinstance(ei.value, stowage.BadRequest)


def test_request_over_the_byte_limit(small_server, fresh):
    """A message bigger than the server's [limits] max_request_bytes (1 MiB):
    refused unread with `too_large`, the connection still usable."""
    idx = fresh(4)
    with stowage.Client(small_server["native"], timeout=10, max_message_bytes=64 << 20) as c:
        with pytest.raises(stowage.TooLarge, match=r"max_request_bytes") as ei:
            c.put(idx[:2], {"x": np.ones((2, 1 << 18), np.float32)})  # 2 MiB in one message
        assert "1048576" in str(ei.value)
        with pytest.raises(stowage.KeyNotFound):
            c.get(idx[:1], ["x"])
        c.put(idx[2:], {"x": np.zeros((2, 4), np.float32)})
        assert np.array_equal(np.asarray(c.get(idx[2:], ["x"])["x"]), np.zeros((2, 4), np.float32))
        assert c.clear(idx[2:]) == 2


def test_split_put_is_not_atomic(small_server, fresh):
    """A put split into several messages stores message by message: when a later
    one fails, the earlier ones stay, and the exception says how many rows."""
    idx = fresh(10)
    rows = np.arange(10, dtype=np.uint8)[:, None].repeat(1024, axis=1)  # 1 KiB rows, alternating units
    with stowage.Client(small_server["native"], timeout=10, max_message_bytes=2200) as c:  # 2 rows a message
        try:
            with pytest.raises(stowage.CapacityError) as ei:
                c.put(idx, {"x": rows})  # each unit holds 4 KiB: rows 0..7 fit, 8..9 do not
            assert ei.value.rows_stored == 8
            assert np.array_equal(c.get(idx[:8], ["x"])["x"], rows[:8])
            with pytest.raises(stowage.KeyNotFound):
                c.get(idx[8:9], ["x"])
        finally:
            c.clear(idx)


def test_split_put_is_not_atomic_async(small_server, fresh):
    """The same with the asyncio client (the one put loop both clients drive):
    rows_stored says how many leading rows the earlier messages stored."""
    idx = fresh(10)
    rows = np.arange(10, dtype=np.uint8)[:, None].repeat(1024, axis=1)

    async def main():
        async with stowage.AsyncClient(small_server["native"], timeout=10, max_message_bytes=2200) as c:
            try:
                with pytest.raises(stowage.CapacityError) as ei:
                    await c.put(idx, {"x": rows})
                assert ei.value.rows_stored == 8
                assert np.array_equal((await c.get(idx[:8], ["x"]))["x"], rows[:8])
                with pytest.raises(stowage.KeyNotFound):
                    await c.get(idx[8:9], ["x"])
            finally:
                await c.clear(idx)

    asyncio.run(main())


def test_bad_request_from_server(endpoint):
    """What the server refuses as malformed arrives as BadRequest (a frame
    0 the client's encoder would never write, sent on the client's own
    connection: the encoder refuses the misspelled key itself)."""
    body = {"global_indexes": [1], "feilds": ["x"]}
    with pytest.raises(TypeError, match="feilds"):
        _codec.envelope("clear", 1, body)
    # (built by hand: test data, not a codec)
    frame0 = msgpack.packb({"proto": "stowage/1", "op": "clear", "id": 7, "body": body})
    with stowage.Client(endpoint, timeout=10) as c:
        assert c.stats()["units"] == 2  # connected
        reply = c._core.send(frame0, [], 10.0)
        with pytest.raises(stowage.BadRequest, match=r"^bad_request: ") as ei:
            c._reply_body(_codec.decode_envelope(reply[0]), "clear_ok", 7)
        assert not isinstance(ei.value, stowage.TooLarge)
        assert c.stats()["units"] == 2


def test_unsupported(endpoint, fresh):
    """A field whose requested rows mix dtypes cannot be described in one reply."""
    idx = fresh(2)
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx[:1], {"m": np.zeros((1, 2), np.float32)})
        c.put(idx[1:], {"m": np.zeros((1, 2), np.int64)})
        with pytest.raises(stowage.Unsupported, match=r"^unsupported: "):
            c.get(idx, ["m"])
        assert c.get(idx[1:], ["m"])["m"].dtype == np.int64
        c.clear(idx)


def test_rejected(reject_server, fresh):
    idx = fresh(2)
    with stowage.Client(reject_server["native"], timeout=30) as c:
        with pytest.raises(stowage.Rejected, match=r'^rejected: plugin "drop-row"'):
            c.put(idx, {"rej_x": np.ones((2, 2), np.float32)})
        with pytest.raises(stowage.KeyNotFound):
            c.get(idx, ["rej_x"])
        c.put(idx, {"x": np.ones((2, 2), np.float32)})  # other fields are fine
        assert c.clear(idx) == 2


# ---------------------------------------------------------------- timeouts and odd replies


def test_timeout_against_a_silent_peer(silent_endpoint):
    ep, router = silent_endpoint
    with stowage.Client(ep, timeout=0.3) as c:
        for call in (lambda: c.stats(), lambda: c.get([1], ["x"]), lambda: c.put([1], {"x": np.ones((1, 4))}),
                     lambda: c.clear([1]), lambda: c.get_into([1], {"x": np.ones((1, 4))})):
            t0 = time.monotonic()
            with pytest.raises(stowage.StowageTimeout, match=r"no reply from .* within 0.3 s; the connection was reset") as ei:
                call()
            assert 0.25 < time.monotonic() - t0 < 2.0
            assert isinstance(ei.value, TimeoutError) and isinstance(ei.value, stowage.StowageError)
            assert not c._core.connected, "the connection was not dropped"
        # A per-call timeout overrides the client's.
        t0 = time.monotonic()
        with pytest.raises(stowage.StowageTimeout, match="within 0.1 s"):
            c.stats(timeout=0.1)
        assert time.monotonic() - t0 < 0.3
    assert router.poll(100, 1), "the requests never reached the peer"


def test_a_client_that_does_not_spin_ends_each_call_at_its_own_deadline(fake_server):
    """With spin_us=0 a reply is slept for in one blocking receive, bounded
    by the socket's receive timeout, which is set again only when the time
    left differs from it. On one kept connection, calls answered after a
    delay each end at their own deadline: a short one after a long one
    times out in its time (not the one set before), a long one after a
    short one waits for its reply."""
    delays = []

    def handler(ident, frames):
        time.sleep(delays.pop(0))
        return [_reply(frames[0], "stats_ok", {"who": "late"})]

    srv = fake_server(handler)
    with stowage.Client(srv.endpoint, timeout=2.0, spin_us=0) as c:
        # (the server's delay, the call's timeout, whether it is answered, bounds of its time)
        for delay, timeout, answered, low, high in ((0.01, 2.0, True, 0.0, 1.0), (0.4, 0.1, False, 0.08, 0.3),
                                                    (0.01, 2.0, True, 0.0, 1.0), (0.3, 1.0, True, 0.25, 0.9),
                                                    (0.3, 0.1, False, 0.08, 0.25)):
            delays.append(delay)
            t0 = time.monotonic()
            if answered:
                assert c.stats(timeout=timeout)["who"] == "late"
            else:
                with pytest.raises(stowage.StowageTimeout, match=f"within {timeout} s"):
                    c.stats(timeout=timeout)
                time.sleep(delay)  # (the late reply comes to the dropped connection)
            assert low <= time.monotonic() - t0 - (0 if answered else delay) < high, (delay, timeout)


class _Signalled(Exception):
    pass


@pytest.mark.parametrize("spin_us", [0, None])
def test_a_signal_handlers_exception_stops_a_call_waiting_for_its_reply(silent_endpoint, spin_us):
    """A signal that comes while a sync call waits for its reply runs
    Python's handler at once, and what the handler raises (KeyboardInterrupt
    on Ctrl-C; here an exception of the test's own) ends the call, long
    before its timeout: sleeping in the receive (spin_us=0) and in the poll
    after a spin. The client goes on serving calls (the connection the
    interrupted call used is dropped)."""
    ep, router = silent_endpoint

    def handler(signum, frame):
        raise _Signalled()

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        with stowage.Client(ep, timeout=20, spin_us=spin_us) as c:
            calls = {"get": lambda: c.get([1], ["x"]), "put": lambda: c.put([1], {"x": np.ones((1, 4))}),
                     "stats": lambda: c.stats(), "clear": lambda: c.clear([1])}
            for name, call in calls.items():
                timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
                t0 = time.monotonic()
                timer.start()
                with pytest.raises(_Signalled):
                    call()
                took = time.monotonic() - t0
                timer.join()
                assert 0.25 < took < 5, (name, took)
            # Still serving: the next call waits out its own timeout.
            t0 = time.monotonic()
            with pytest.raises(stowage.StowageTimeout, match="within 0.2 s"):
                c.stats(timeout=0.2)
            assert time.monotonic() - t0 < 2
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert router.poll(100, 1), "the requests never reached the peer"


def _reply(req_frame0: bytes, op: str, body: dict, id_delta: int = 0) -> list:
    env = msgpack.unpackb(req_frame0)
    return [msgpack.packb({"proto": "stowage/1", "op": op, "id": env["id"] + id_delta, "body": body})]


def test_late_reply_is_not_taken_for_the_next_one(fake_server):
    """The peer answers request 1 only after the client gave up on it, and
    sends a stray reply with a foreign id before each real one: the client
    returns only the reply whose id is its request's."""
    held = []

    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        if env["id"] == 1:
            held.append((ident, frames))  # no answer now
            return []
        late = [_reply(held[0][1][0], "stats_ok", {"who": "late reply to 1"})] if held else []
        stray = _reply(frames[0], "stats_ok", {"who": "stray"}, id_delta=1000)
        return [*late, stray, _reply(frames[0], "stats_ok", {"who": f"reply to {env['id']}"})]

    srv = fake_server(handler)
    with stowage.Client(srv.endpoint, timeout=0.3) as c:
        with pytest.raises(stowage.StowageTimeout):
            c.stats()
        # The peer sends the late reply to 1 and a stray one to the new socket, before
        # the real reply: the client skips both by id.
        assert c.stats(timeout=5) == {"who": "reply to 2"}
        assert c.stats(timeout=5) == {"who": "reply to 3"}
    assert len({ident for ident, _ in srv.requests}) == 2, "request 2 should come from a new socket"


def test_odd_replies(fake_server):
    def handler(ident, frames):
        env = msgpack.unpackb(frames[0])
        op = env["op"]
        if op == "stats":
            return [_reply(frames[0], "error", {"code": "brand_new_code", "message": "??"})]
        if op == "clear":
            return [_reply(frames[0], "get_ok", {"fields": {}})]  # wrong op
        if op == "get" and env["body"]["fields"] == ["shm"]:  # a same-node reply nobody asked for
            env = {"proto": "stowage/1", "op": "get_ok", "id": env["id"], "body": {"fields": {}},
                   "segments": [["stowd-1-0", 0, 8]]}
            return [[msgpack.packb(env)]]
        if op == "get" and env["body"]["fields"] == ["extra"]:
            env = {"proto": "stowage/1", "op": "get_ok", "id": env["id"], "body": {"fields": {}}, "extra": 1}
            return [[msgpack.packb(env)]]
        if op == "get":
            return [[b"\xc1 not msgpack"]]
        return [_reply(frames[0], "error", {"code": "internal", "message": "boom"}, id_delta=-env["id"])]  # id 0

    srv = fake_server(handler)
    with stowage.Client(srv.endpoint, timeout=2) as c:
        with pytest.raises(stowage.InternalError, match=r"brand_new_code \(unknown code\): \?\?"):
            c.stats()
        with pytest.raises(stowage.ProtocolError, match=r"expected a clear_ok reply"):
            c.clear([1])
        with pytest.raises(stowage.ProtocolError, match=r"malformed msgpack"):
            c.get([1], ["x"])
        with pytest.raises(stowage.ProtocolError, match=r"carries shared-memory segments, but this client did not ask"):
            c.get([1], ["shm"])
        with pytest.raises(stowage.ProtocolError, match=r'the envelope has an unexpected key "extra"'):
            c.get([1], ["extra"])
        with pytest.raises(stowage.InternalError, match=r"^internal: boom"):  # id 0: an error for the one request in flight
            c.put([1], {"t": ["a"]})


def test_malformed_get_ok_is_a_protocol_error(fake_server):
    """A get_ok whose descriptor points outside its frame, or leaves a frame
    unused, is refused (never read out of bounds)."""
    desc = {"kind": "regular", "dtype": "float32", "shape": [1, 2],
            "parts": [{"frame": 1, "offset": 4, "len": 8, "rows": 1}]}
    replies = iter([
        ([b"\0" * 8], r"outside frame 1"),
        ([b"\0" * 12, b"x"], r"referenced by no descriptor"),
        ([b"\0" * 12], None),
    ])
    current = {}

    def handler(ident, frames):
        data, _ = current["case"]
        return [_reply(frames[0], "get_ok", {"fields": {"x": desc}}) + data]

    srv = fake_server(handler)
    with stowage.Client(srv.endpoint, timeout=2) as c:
        for case in replies:
            current["case"] = case
            if case[1] is None:
                assert c.get([1], ["x"])["x"].tolist() == [[0.0, 0.0]]
            else:
                with pytest.raises(stowage.ProtocolError, match=case[1]):
                    c.get([1], ["x"])


def test_closed_client():
    c = stowage.Client("tcp://127.0.0.1:9", timeout=1)
    c.close()
    c.close()
    assert c.closed
    with pytest.raises(stowage.StowageError, match="closed"):
        c.stats()

