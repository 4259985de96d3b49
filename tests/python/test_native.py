"""The native `stowage/1` protocol (docs/protocol-stowage1.md) against the
shared stowd's native endpoint."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

import native_codec as nc
from stowage import _core
from native_codec import NativeClient, Values
from stowd_harness import fresh_indexes


def hexbytes(text: str) -> bytes:
    return bytes.fromhex("".join(text.split()))


# The examples of the protocol page, byte for byte.
DOC_PUT_FRAME0 = hexbytes("""
84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a3 70 75 74 a2 69 64 01 a4 62 6f 64 79
82 ae 67 6c 6f 62 61 6c 5f 69 6e 64 65 78 65 73 92 00 01 a6 66 69 65 6c 64 73 82 a1 78 84
a4 6b 69 6e 64 a7 72 65 67 75 6c 61 72 a5 64 74 79 70 65 a7 66 6c 6f 61 74 33 32
a5 73 68 61 70 65 92 02 02 a5 70 61 72 74 73 91
84 a5 66 72 61 6d 65 01 a6 6f 66 66 73 65 74 00 a3 6c 65 6e 10 a4 72 6f 77 73 02
a3 74 61 67 82 a4 6b 69 6e 64 a6 76 61 6c 75 65 73 a6 76 61 6c 75 65 73 92 a1 61 a1 62
""")
DOC_PUT_FRAME1 = hexbytes("00 00 80 3f 00 00 00 40 00 00 40 40 00 00 80 40")
DOC_PUT_REPLY = hexbytes("""
84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a6 70 75 74 5f 6f 6b
a2 69 64 01 a4 62 6f 64 79 81 a4 72 6f 77 73 02
""")
DOC_GET_FRAME0 = hexbytes("""
84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a3 67 65 74 a2 69 64 02
a4 62 6f 64 79 82 ae 67 6c 6f 62 61 6c 5f 69 6e 64 65 78 65 73 92 01 00
a6 66 69 65 6c 64 73 91 a1 78
""")
DOC_GET_REPLY = [
    hexbytes("""
  84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a6 67 65 74 5f 6f 6b
  a2 69 64 02 a4 62 6f 64 79 81 a6 66 69 65 6c 64 73 81 a1 78 84 a4 6b 69 6e 64
  a7 72 65 67 75 6c 61 72 a5 64 74 79 70 65 a7 66 6c 6f 61 74 33 32 a5 73 68 61
  70 65 92 02 02 a5 70 61 72 74 73 92 84 a5 66 72 61 6d 65 01 a6 6f 66 66 73 65
  74 00 a3 6c 65 6e 08 a4 72 6f 77 73 01 84 a5 66 72 61 6d 65 02 a6 6f 66 66 73
  65 74 00 a3 6c 65 6e 08 a4 72 6f 77 73 01
"""),
    hexbytes("00 00 40 40 00 00 80 40"),
    hexbytes("00 00 80 3f 00 00 00 40"),
]


def test_doc_examples_through_stowds_codec():
    """The protocol page's frames (golden bytes) are what stowd's codec, as
    the client's core exposes it, writes, and read back as what they say."""
    x = np.array([[1, 2], [3, 4]], np.float32)
    assert nc.put_frames(1, [0, 1], {"x": x, "tag": Values(["a", "b"])}) == [DOC_PUT_FRAME0, DOC_PUT_FRAME1]
    assert nc.get_frames(2, [1, 0], ["x"]) == [DOC_GET_FRAME0]
    assert _core.decode_reply(DOC_PUT_REPLY) == {"proto": "stowage/1", "op": "put_ok", "id": 1, "body": {"rows": 2}}
    get_ok = nc.NReply(DOC_GET_REPLY)
    assert (get_ok.op, get_ok.id) == ("get_ok", 2)
    assert get_ok.body == {"fields": {"x": ("regular", "float32", (2, 2), [(1, 0, 8, 1), (2, 0, 8, 1)])}}
    assert get_ok.fields()["x"].tolist() == [[3, 4], [1, 2]]
    # One byte short is refused with the decoder's reason.
    with pytest.raises(_core.ProtocolViolation, match="malformed msgpack"):
        _core.decode_reply(DOC_GET_REPLY[0][:-1])


def test_doc_examples_byte_for_byte(stowd):
    """Indexes 0 and 1 are reserved for this test on the shared server."""
    x = np.array([[1, 2], [3, 4]], np.float32)
    put = nc.put_frames(1, [0, 1], {"x": x, "tag": Values(["a", "b"])})
    assert put == [DOC_PUT_FRAME0, DOC_PUT_FRAME1], "the test encoder disagrees with the protocol page"
    get = nc.get_frames(2, [1, 0], ["x"])
    assert get == [DOC_GET_FRAME0]
    with NativeClient(stowd["native"]) as c:
        c.send(put)
        assert c.sock.recv_multipart() == [DOC_PUT_REPLY]
        c.send(get)
        # Either layout the page shows: one frame per row, or (a packing
        # policy coalescing) one 16-byte frame and one part.
        packed = [
            msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": 2, "body": {"fields": {"x": {
                "kind": "regular", "dtype": "float32", "shape": [2, 2],
                "parts": [{"frame": 1, "offset": 0, "len": 16, "rows": 2}]}}}}),
            DOC_GET_REPLY[1] + DOC_GET_REPLY[2],
        ]
        got = c.sock.recv_multipart()
        assert got in (DOC_GET_REPLY, packed), f"get reply matches neither documented layout: {got!r}"


def test_round_trip_every_kind(stowd):
    idx = fresh_indexes(4)
    fields = {
        "reg": np.arange(12, dtype=np.float32).reshape(4, 3) - 5.25,
        "vec": np.array([-(2**40), 0, 1, 2**40], np.int64),
        "u16": np.arange(8, dtype=np.uint16).reshape(4, 2) * 1000,
        "nest": [np.arange(3, dtype=np.float64), np.zeros(0, np.float64), np.array(2.5), np.ones((2, 2))],
        "vals": Values(["héllo 🙂", b"\x00\xffbin", 42, None]),
        "deep": Values([[1, [2, [3]]], {"k": [True, 1.5]}, -7, ""]),
    }
    with NativeClient(stowd["native"]) as c:
        before = c.stats()
        r = c.put(idx, fields)
        assert r.body == {"rows": 4}
        after = c.stats()
        assert after["keys"] - before["keys"] == 4 * len(fields), (before, after)
        tensor_bytes = sum(v.nbytes for v in fields.values() if isinstance(v, np.ndarray))
        tensor_bytes += sum(a.nbytes for a in fields["nest"])
        assert after["bytes"] - before["bytes"] >= tensor_bytes, (before, after)
        assert after["units"] == 2

        order = [idx[3], idx[0], idx[0], idx[2]]  # repeats are allowed in a get
        pos = [3, 0, 0, 2]
        reply = c.get(order, list(fields))
        descs = reply.body["fields"]
        assert list(descs) == list(fields), "fields not in request order"
        # (descriptors as stowd's decoder gives them: (kind, dtype, shape, parts), ...)
        assert descs["reg"][:3] == ("regular", "float32", (4, 3))
        assert descs["vec"][:3] == ("regular", "int64", (4,))
        assert descs["nest"][:2] == ("nested", "float64")
        assert descs["vals"][0] == "values"
        got = reply.fields()
        for name in ("reg", "vec", "u16"):
            assert got[name].dtype == fields[name].dtype, name
            assert np.array_equal(got[name], fields[name][pos]), name
        for g, p in zip(got["nest"], pos):
            w = fields["nest"][p]
            assert g.shape == w.shape and np.array_equal(g, w), (g, w)
        assert got["vals"] == [fields["vals"].values[p] for p in pos]
        assert got["deep"] == [fields["deep"].values[p] for p in pos]

        # A nested field whose requested rows share one shape comes back regular.
        same = c.get([idx[0], idx[0]], ["nest"])
        assert same.body["fields"]["nest"][:3] == ("regular", "float64", (2, 3))

        # Clear one field of two indexes, then everything.
        assert c.clear(idx[:2], ["vals"]).body == {"cleared": 2}
        c.get(idx[:1], ["vals"]).expect_error("key_not_found")
        assert np.array_equal(c.get(idx[:2], ["reg"]).fields()["reg"], fields["reg"][:2])
        assert c.clear(idx).body == {"cleared": 4 * len(fields) - 2}
        assert c.clear(idx).body == {"cleared": 0}  # a retried clear drops nothing
        assert c.clear([]).body == {"cleared": 0}
        c.get(idx[2:3], ["reg"]).expect_error("key_not_found")
        assert c.stats()["keys"] == before["keys"]


def test_frames_shared_between_fields(stowd):
    """The page's example: a nested and a regular field in one frame, with padding."""
    idx = fresh_indexes(2)
    x = np.array([[1, 2], [3, 4]], np.float32)
    frame = bytes([7, 8, 9]) + bytes([5]) + b"\0" * 4 + x.tobytes()
    body = {"global_indexes": idx, "fields": {
        "x": ("regular", "float32", [2, 2], [(1, 8, 16, 2)]),
        "n": ("nested", "uint8", [([3], 1, 0, 3), ([], 1, 3, 1)])}}
    with NativeClient(stowd["native"]) as c:
        c.request([nc.envelope("put", 5, body), frame]).expect("put_ok", 5)
        got = c.get(idx, ["x", "n"]).fields()
        assert np.array_equal(got["x"], x)
        assert got["n"][0].tolist() == [7, 8, 9] and got["n"][1].shape == () and int(got["n"][1]) == 5
        # Several parts spread over frames, out of order.
        body2 = {"global_indexes": idx, "fields": {"x": ("regular", "float32", [2, 2], [(2, 0, 8, 1), (1, 4, 8, 1)])}}
        c.request([nc.envelope("put", 6, body2), b"\0" * 4 + x[1].tobytes(), x[0].tobytes()]).expect("put_ok", 6)
        assert np.array_equal(c.get(idx, ["x"]).fields()["x"], x)
        c.clear(idx)


def test_get_of_mixed_rows_is_unsupported(stowd):
    """A field whose requested rows mix dtypes, or tensors and values, cannot
    be described by one descriptor: `unsupported` (and nothing breaks)."""
    idx = fresh_indexes(3)
    with NativeClient(stowd["native"]) as c:
        c.put(idx[:1], {"m": np.zeros((1, 2), np.float32)})
        c.put(idx[1:2], {"m": np.zeros((1, 2), np.int64)})
        c.put(idx[2:3], {"m": Values(["text"])})
        for pair in (idx[:2], idx[1:]):
            i = c.next_id()
            c.request(nc.get_frames(i, pair, ["m"])).expect_error("unsupported", i)
        assert c.get(idx[2:], ["m"]).fields()["m"] == ["text"]
        assert c.get(idx[:1], ["m"]).fields()["m"].dtype == np.float32
        c.clear(idx)


def test_pipelined_requests_echo_ids(stowd):
    idx = fresh_indexes(2)
    x = np.arange(4, dtype=np.int32).reshape(2, 2)
    with NativeClient(stowd["native"]) as c:
        c.send(nc.put_frames(101, idx, {"x": x}))
        c.send(nc.get_frames(102, idx[::-1], ["x"]))
        c.send(nc.stats_frames(103))
        replies = {r.id: r for r in (c.recv() for _ in range(3))}
        assert set(replies) == {101, 102, 103}
        replies[101].expect("put_ok")
        assert np.array_equal(replies[102].expect("get_ok").fields()["x"], x[::-1])
        replies[103].expect("stats_ok")
        c.clear(idx)


def test_get_results_are_read_only_zero_copy(stowd):
    """Arrays decoded from a get_ok received with copy=False are views of the
    received frames (no copy) and cannot be written."""
    idx = fresh_indexes(3)
    x = np.arange(30, dtype=np.float32).reshape(3, 10)
    with NativeClient(stowd["native"]) as c:
        c.put(idx, {"x": x, "n": [np.arange(k + 1, dtype=np.int16) for k in range(3)]})
        reply = c.get(idx, ["x", "n"], copy=False)
        assert all(isinstance(f, zmq.Frame) for f in reply.frames)
        descs = reply.body["fields"]
        got = reply.fields()
        assert np.array_equal(got["x"], x)
        parts = descs["x"][3]  # (frame, offset, len, rows) each
        views = [(got["x"], parts[0][0])] if len(parts) == 1 else []
        views += [(nc.decode_field(("regular", "float32", (p[3], 10), [p]), reply.frames), p[0]) for p in parts]
        views += [(a, r[1]) for a, r in zip(got["n"], descs["n"][2])]  # (shape, frame, offset, len) each
        for a, frame in views:
            assert np.shares_memory(a, np.frombuffer(reply.frames[frame].buffer, np.uint8)), "a get result was copied"
            assert not a.flags.writeable, "a get result is writable"
            with pytest.raises(ValueError):
                a[...] = 0
        c.clear(idx)


# ---------------------------------------------------------------- errors


@pytest.fixture
def native_known(stowd):
    """A known batch on the native endpoint; after the test it must be intact."""
    idx = fresh_indexes(2)
    x = np.array([[1.5, 2.5], [3.5, 4.5]], np.float64)
    with NativeClient(stowd["native"]) as c:
        c.put(idx, {"x": x, "t": Values(["p", "q"])})
        yield c, idx
        assert stowd.alive(), stowd.log_tail()
        got = c.get(idx, ["x", "t"]).fields()
        assert np.array_equal(got["x"], x) and got["t"] == ["p", "q"], "the known batch changed"
        c.clear(idx)


def _put_body(idx, fields):
    return {"global_indexes": idx, "fields": fields}


# Descriptors in the protocol's dict form, for `nc.hand_envelope` (test data).
F32_2x2 = {"kind": "regular", "dtype": "float32", "shape": [2, 2],
           "parts": [{"frame": 1, "offset": 0, "len": 16, "rows": 2}]}

BAD = {
    # name: (frames builder (id, bad indexes) -> frames, code, reply id is the request's, message prefix)
    "malformed_msgpack": (lambda i, b: [b"\xc1\x01\x02"], "bad_request", False, None),
    "truncated_envelope": (lambda i, b: [nc.hand_envelope("get", i, {"global_indexes": b, "fields": ["x"]})[:-3]],
                           "bad_request", True, None),  # the id precedes the cut: it is readable
    "trailing_bytes": (lambda i, b: [nc.hand_envelope("stats", i, {}) + b"\x00"], "bad_request", None, None),
    "empty_put": (lambda i, b: [nc.hand_envelope("put", i, _put_body([], {}))], "bad_request", True, "empty batch:"),
    "put_without_fields": (lambda i, b: [nc.hand_envelope("put", i, _put_body(b[:2], {}))], "bad_request", True,
                           "empty batch:"),
    "get_without_indexes": (lambda i, b: nc.get_frames(i, [], ["x"]), "bad_request", True, "empty batch:"),
    "get_without_fields": (lambda i, b: nc.get_frames(i, b[:1], []), "bad_request", True, "empty batch:"),
    "unknown_op": (lambda i, b: [nc.hand_envelope("frobnicate", i, {})], "unsupported", True, None),
    "reply_op_as_request": (lambda i, b: [nc.hand_envelope("put_ok", i, {"rows": 1})], "unsupported", True, None),
    "other_proto": (lambda i, b: [nc.hand_envelope("put", i, {"anything": 1}, proto="stowage/2")], "unsupported", True,
                    None),
    "unknown_body_key": (lambda i, b: [nc.hand_envelope("clear", i, {"global_indexes": b, "feilds": ["x"]})],
                         "bad_request", True, None),
    "unknown_envelope_key": (lambda i, b: [msgpack.packb({"proto": "stowage/1", "op": "stats", "id": i, "body": {},
                                                           "extra": 1})], "bad_request", True, None),
    "negative_index": (lambda i, b: [nc.hand_envelope("get", i, {"global_indexes": [-1], "fields": ["x"]})], "bad_request", True, None),
    "duplicate_index": (lambda i, b: [nc.hand_envelope("put", i, _put_body([b[0], b[0]], {"x": F32_2x2})), b"\0" * 16],
                        "bad_request", True, None),
    "unreferenced_frame": (lambda i, b: [nc.hand_envelope("put", i, _put_body(b[:2], {"x": F32_2x2})), b"\0" * 16, b"x"],
                           "bad_request", True, None),
    "missing_frame": (lambda i, b: [nc.hand_envelope("put", i, _put_body(b[:2], {"x": F32_2x2}))], "bad_request", True,
                      None),
    "range_outside_frame": (lambda i, b: [nc.hand_envelope("put", i, _put_body(b[:2], {"x": F32_2x2})), b"\0" * 12],
                            "bad_request", True, None),
    "len_mismatch": (lambda i, b: [nc.hand_envelope("put", i, _put_body(b[:2], {"x": dict(
        F32_2x2, parts=[{"frame": 1, "offset": 0, "len": 12, "rows": 2}])})), b"\0" * 16], "bad_request", True, None),
    "unknown_dtype": (lambda i, b: [nc.hand_envelope("put", i, _put_body(b[:2], {"x": dict(F32_2x2, dtype="float8")})),
                                    b"\0" * 16], "bad_request", True, None),
    "absurd_shape": (lambda i, b: [nc.hand_envelope("put", i, _put_body(b[:2], {"x": dict(
        F32_2x2, shape=[2, 2**62, 2**62])})), b"\0" * 16], "bad_request", True, None),
    "row_count_mismatch": (lambda i, b: [nc.hand_envelope("put", i, _put_body(b[:3], {"x": F32_2x2})), b"\0" * 16],
                           "bad_request", True, None),
    "range_of_0_indexes": (lambda i, b: [nc.hand_envelope("get", i, {"global_indexes": {"ranges": [[b[0], 0, 1]]},
                                                                  "fields": ["x"]})], "bad_request", True, None),
    "range_with_step_0": (lambda i, b: [nc.hand_envelope("get", i, {"global_indexes": {"ranges": [[b[0], 5, 0]]},
                                                                 "fields": ["x"]})], "bad_request", True, None),
    "range_past_2_64": (lambda i, b: [nc.hand_envelope("get", i, {"global_indexes": {"ranges": [[2**64 - 2, 3, 1]]},
                                                               "fields": ["x"]})], "bad_request", True, None),
    "ranges_over_max_rows": (lambda i, b: [nc.hand_envelope("get", i, {"global_indexes": {"ranges": [[0, 2**40, 1]]},
                                                                    "fields": ["x"]})], "too_large", True, None),
    "range_in_a_put": (lambda i, b: [nc.hand_envelope("put", i, _put_body({"ranges": [[b[0], 2, 1]]}, {"x": F32_2x2})),
                                     b"\0" * 16], "bad_request", True, None),
    "range_in_a_clear": (lambda i, b: [nc.hand_envelope("clear", i, {"global_indexes": {"ranges": [[b[0], 2, 1]]}})],
                         "bad_request", True, None),
    "unknown_kind": (lambda i, b: [nc.hand_envelope("put", i, _put_body(b[:2], {"x": dict(F32_2x2, kind="sparse")})),
                                   b"\0" * 16], "bad_request", True, None),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_error_replies(case, native_known):
    c, known = native_known
    build, code, echoes_id, prefix = BAD[case]
    bad = fresh_indexes(4)
    rid = 4242
    reply = c.request(build(rid, bad))
    reply.expect_error(code, prefix=prefix)
    if echoes_id is True:
        assert reply.id == rid, f"error reply id {reply.id}, expected the request's {rid}"
    elif echoes_id is False:
        assert reply.id == 0, f"error reply to an unreadable request has id {reply.id}, expected 0"
    else:
        assert reply.id in (0, rid)
    # Nothing of the bad request was stored.
    for g in bad:
        c.get([g], ["x"]).expect_error("key_not_found")


def test_key_not_found_echoes_id(native_known):
    c, known = native_known
    i = c.next_id()
    c.request(nc.get_frames(i, [known[0], 999_999_999], ["x"])).expect_error("key_not_found", i)
    i = c.next_id()
    c.request(nc.get_frames(i, known, ["nope"])).expect_error("key_not_found", i)


def test_rows_read_back_in_put_order_come_back_as_one_frame(stowd):
    """Rows stored from one received frame and read back in that order are
    one part in one data frame, a slice of the stored frame (no per-row parts
    for the packing policy to copy together); any other order is still
    answered row by row, with the right bytes."""
    idx = fresh_indexes(32)
    # 128 KiB rows: above the small-piece size, so row by row they would be one frame each
    x = np.arange(32 * 32768, dtype=np.float32).reshape(32, 32768)
    with NativeClient(stowd["native"]) as c:
        c.put(idx, {"x": x})
        r = c.get(idx, ["x"])
        parts = r.body["fields"]["x"][3]
        assert len(r.frames) == 2 and parts == [(1, 0, x.nbytes, 32)], parts
        np.testing.assert_array_equal(r.fields()["x"], x)
        # a run inside the put, then rows out of order, then a repeat
        order = idx[10:20] + [idx[3], idx[1]] + idx[10:12]
        r = c.get(order, ["x"])
        got = r.fields()["x"]
        np.testing.assert_array_equal(got, x[[*range(10, 20), 3, 1, 10, 11]])
        c.clear(idx)
