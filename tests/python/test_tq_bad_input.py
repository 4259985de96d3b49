"""Bad TransferQueue requests, one test per case, against a unit endpoint and
the router endpoint. Each test stores a known batch first, sends the bad
request, checks the error reply type and message prefix
(shared/protocols/transferqueue.md), then checks the server is alive, the
known batch is intact and the bad PUT stored nothing."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np
import pytest

from stowd_harness import fresh_indexes
from tq_codec import (
    TQClient,
    assert_cells_equal,
    envelope,
    expected_rows,
    get_frames,
    put_frames,
    tensor_ext,
)

UNDECODABLE = "undecodable request: "


def put_error_prefix(sender: str) -> str:
    return f"Failed to put data into storage unit id #{sender}, detail error message: "


def raw_put(indexes, data: dict, frames: list[bytes], **env) -> list[bytes]:
    """A PUT whose body `data` is given as is, followed by `frames`."""
    body = {"global_indexes": list(indexes), "data": data, "data_parser": None}
    return [envelope("PUT", body, **env), *frames]


class CreatesFile:
    """Unpickling this object creates (truncates) a file: open(path, "w")."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@dataclass
class Case:
    build: Callable  # (bad_indexes, tmp_path) -> frames
    reply: str
    prefix: Callable  # sender -> prefix
    stores_nothing: bool = True  # a GET of the bad indexes' field "x" must fail


def _env_without(key: str) -> Callable:
    def build(bad, tmp):
        env = {
            "request_type": "PUT",
            "sender_id": "TQ_STORAGE_pytest",
            "receiver_id": None,
            "request_id": "0badc0de",
            "timestamp": 1.5,
            "body": {"global_indexes": bad[:2], "data": {"x": tensor_ext("float32", (2, 2), 1)}, "data_parser": None},
        }
        del env[key]
        return [msgpack.packb(env), np.ones((2, 2), np.float32).tobytes()]

    return build


def _pickle_fallback(bad, tmp):
    target = tmp / "pwned-by-fallback"
    message = {"request_type": "PUT", "body": {"global_indexes": bad[:1], "payload": CreatesFile(str(target))}}
    return [b"\xc1\xfe\xed", pickle.dumps(message, protocol=5)]


def _tensor_case(dtype, shape, frame: bytes):
    return lambda bad, tmp: raw_put(bad[:2], {"x": tensor_ext(dtype, shape, 1)}, [frame])


CASES: dict[str, Case] = {
    "malformed_msgpack_truncated": Case(
        lambda bad, tmp: [envelope("PUT", {"global_indexes": bad[:2]})[:-7]], "PUT_GET_ERROR", lambda s: UNDECODABLE
    ),
    "malformed_msgpack_reserved_byte": Case(
        lambda bad, tmp: [b"\xc1\x00\x01\x02"], "PUT_GET_ERROR", lambda s: UNDECODABLE
    ),
    "envelope_missing_timestamp": Case(_env_without("timestamp"), "PUT_GET_ERROR", lambda s: UNDECODABLE),
    "envelope_missing_body": Case(_env_without("body"), "PUT_GET_ERROR", lambda s: UNDECODABLE),
    "missing_data_frame": Case(
        lambda bad, tmp: raw_put(bad[:2], {"x": tensor_ext("float32", (2, 2), 1)}, []),
        "PUT_GET_ERROR", lambda s: UNDECODABLE,
    ),
    "extra_unreferenced_frame": Case(
        lambda bad, tmp: put_frames(bad[:2], {"x": np.ones((2, 2), np.float32)}) + [b"unreferenced"],
        "PUT_GET_ERROR", lambda s: UNDECODABLE,
    ),
    "frame_index_zero": Case(
        lambda bad, tmp: [envelope("PUT", {"global_indexes": bad[:2], "data": {"x": tensor_ext("float32", (2, 2), 0)},
                                           "data_parser": None}), np.ones((2, 2), np.float32).tobytes()],
        "PUT_GET_ERROR", lambda s: UNDECODABLE,
    ),
    "frame_length_mismatch": Case(_tensor_case("float32", (2, 2), b"\x00" * 12), "PUT_GET_ERROR", lambda s: UNDECODABLE),
    "unknown_dtype": Case(_tensor_case("qint8", (2,), b"\x00" * 2), "PUT_GET_ERROR", lambda s: UNDECODABLE),
    "negative_shape": Case(_tensor_case("float32", (-1, 2), b"\x00" * 8), "PUT_GET_ERROR", lambda s: UNDECODABLE),
    "absurd_shape": Case(_tensor_case("float32", (2**40, 2**40), b"\x00" * 8), "PUT_GET_ERROR", lambda s: UNDECODABLE),
    "absurd_shape_int64_max": Case(
        _tensor_case("float64", (2, 2**62), b"\x00" * 16), "PUT_GET_ERROR", lambda s: UNDECODABLE
    ),
    "deeply_nested_msgpack": Case(
        lambda bad, tmp: [envelope("PUT", None)[:-1] + b"\x91" * 200_000 + b"\xc0"], "PUT_GET_ERROR",
        lambda s: UNDECODABLE,
    ),
    "huge_declared_array": Case(
        lambda bad, tmp: [envelope("PUT", None)[:-1] + b"\x81\xaeglobal_indexes\xdd\xff\xff\xff\xf0"],
        "PUT_GET_ERROR", lambda s: UNDECODABLE,
    ),
    "unknown_request_type": Case(
        lambda bad, tmp: [envelope("FROBNICATE", {"global_indexes": bad[:2]})], "PUT_GET_ERROR", lambda s: UNDECODABLE
    ),
    "duplicate_global_indexes": Case(
        lambda bad, tmp: put_frames([bad[0], bad[1], bad[0]], {"x": np.arange(6, dtype=np.float32).reshape(3, 2)}),
        "PUT_ERROR", put_error_prefix,
    ),
    "row_count_mismatch": Case(
        lambda bad, tmp: put_frames(bad[:2], {"x": np.zeros((3, 2), np.float32)}), "PUT_ERROR", put_error_prefix
    ),
    "data_parser_not_nil": Case(
        lambda bad, tmp: put_frames(bad[:2], {"x": np.zeros((2, 2), np.float32)},
                                    data_parser=msgpack.ExtType(2, b"\x80\x05cloudpickle-bytes\x94.")),
        "PUT_ERROR", put_error_prefix,
    ),
    "pickle_fallback": Case(_pickle_fallback, "PUT_GET_ERROR", lambda s: UNDECODABLE),
    "handshake": Case(
        lambda bad, tmp: [envelope("HANDSHAKE", {})], "PUT_GET_OPERATION_ERROR", lambda s: f"Storage unit id #{s} "
    ),
    "get_unknown_field": Case(
        lambda bad, tmp: get_frames(bad[:1], ["no_such_field"]), "GET_ERROR", lambda s: "[TQKeyNotFound] ",
        stores_nothing=False,
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_request(case, tq_target, stowd, tmp_path):
    c = CASES[case]
    endpoint, sender = tq_target
    good = fresh_indexes(4)
    bad = fresh_indexes(4)
    batch = {
        "x": np.arange(12, dtype=np.float32).reshape(4, 3),
        "jag": [np.arange(i, dtype=np.int64) for i in range(4)],
        "txt": ["a", "ß", "", "末"],
    }
    with TQClient(endpoint) as client:
        client.put(good, batch).expect("PUT_DATA_RESPONSE")

        reply = client.request(c.build(bad, tmp_path))
        reply.expect(c.reply, c.prefix(sender))
        reply.check_envelope(sender)
        assert list(reply.body) == ["message"], reply.body

        if case == "pickle_fallback":
            assert not (tmp_path / "pwned-by-fallback").exists(), "stowd unpickled the fallback message"
        if case == "handshake":
            assert "HANDSHAKE" in reply.message, reply.message

        # Still alive, the known batch intact, nothing stored by the bad request.
        assert stowd.alive(), stowd.log_tail()
        got = client.get(good, list(batch)).values()
        for name, value in batch.items():
            for i, (g, w) in enumerate(zip(got[name], expected_rows(value))):
                assert_cells_equal(g, w, f"{name}[{i}]")
        if c.stores_nothing:
            for g in bad:
                client.get([g], ["x"]).expect("GET_ERROR", "[TQKeyNotFound] ")


def test_pickle_fallback_payload_is_live(tmp_path):
    """Sanity check of the test itself: the fallback payload does create a
    file when unpickled (so the test above proves stowd never unpickles it)."""
    target = tmp_path / "created"
    f = pickle.loads(pickle.dumps(CreatesFile(str(target)), protocol=5))
    f.close()
    assert target.exists()
    os.remove(target)
