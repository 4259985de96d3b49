"""TransferQueue round trips through a unit endpoint and through the router
endpoint of the shared stowd."""

from __future__ import annotations

import pickle

import msgpack
import numpy as np

from stowd_harness import fresh_indexes
from tq_codec import (
    Raw,
    TensorRef,
    TQClient,
    assert_cells_equal,
    clear_frames,
    envelope,
    expected_rows,
    get_frames,
    put_frames,
)


class CreatesFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def batch_of_every_kind(tmp_path) -> dict:
    bf16 = np.array([[1.0, -2.0], [0.5, 3.0], [0.0, 1.0], [-1.0, 8.0]], np.float32)
    return {
        "f32": np.arange(12, dtype=np.float32).reshape(4, 3) / 7,
        "i64": np.array([-(2**62), -1, 0, 2**62], np.int64),  # shape [4]: rows are 0-d tensors
        "u8": np.arange(16, dtype=np.uint8).reshape(4, 2, 2),
        "flag": np.array([[True, False, True, True, False]] * 4, np.bool_) ^ np.eye(4, 5, dtype=np.bool_),
        "f16": (np.arange(16, dtype=np.float16).reshape(4, 4) - 3.5),
        "bf16": Raw("bfloat16", (4, 2), (bf16.view(np.uint32) >> 16).astype("<u2").tobytes()),
        "jag": [np.arange(n, dtype=np.int64) * 3 for n in (3, 0, 5, 1)],  # row of length 0
        "jag2d": [np.full((n, 2), n, np.float32) for n in (2, 1, 0, 4)],
        "txt": ["héllo", "世界", "", "🙂 emoji"],
        "blob": [b"\x00\xff", b"", b"bytes", b"\x80" * 300],
        "misc": [1, None, 2.5, [1, "a", {"k": False}]],
        # ext 1 (an opaque pickle): stored and returned byte for byte, never unpickled.
        "opaque": [msgpack.ExtType(1, pickle.dumps(CreatesFile(str(tmp_path / f"pwned{i}")), protocol=5))
                   for i in range(4)],
    }


def check_get(reply, batch: dict, put_indexes: list[int], get_indexes: list[int], sender: str) -> None:
    reply.check_envelope(sender)
    got = reply.values()
    assert list(got) == list(batch), f"fields {list(got)}"
    for name, value in batch.items():
        rows = expected_rows(value)
        assert len(got[name]) == len(get_indexes), name
        for g, cell in zip(get_indexes, got[name]):
            assert_cells_equal(cell, rows[put_indexes.index(g)], f"{name}@{g}")


def test_round_trip_every_kind(tq_target, tmp_path):
    endpoint, sender = tq_target
    idx = fresh_indexes(4)
    batch = batch_of_every_kind(tmp_path)
    with TQClient(endpoint) as c:
        r = c.put(idx, batch).expect("PUT_DATA_RESPONSE")
        r.check_envelope(sender)
        assert r.body == {}

        order = [idx[2], idx[0], idx[3], idx[1]]
        check_get(c.get(order, list(batch)), batch, idx, order, sender)

        # Repeats are allowed: the row comes back once per mention, each with its own frame.
        rep = [idx[1], idx[1], idx[0]]
        reply = c.get(rep, ["f32", "jag", "txt"])
        check_get(reply, {k: batch[k] for k in ("f32", "jag", "txt")}, idx, rep, sender)

        # Tensor rows go back as ext 3 with the row's shape and their own frame (1, 2, ... in order).
        refs = [cell for cells in reply.body["data"].values() for cell in cells if isinstance(cell, TensorRef)]
        assert [r.frame for r in refs] == list(range(1, len(refs) + 1))
        assert [r.shape for r in refs[:3]] == [(3,), (3,), (3,)]
        assert [r.shape for r in refs[3:]] == [(0,), (0,), (3,)]

    assert not any((tmp_path / f"pwned{i}").exists() for i in range(4)), "an ext 1 pickle was unpickled"


def test_overwrite(tq_target):
    endpoint, sender = tq_target
    idx = fresh_indexes(2)
    with TQClient(endpoint) as c:
        a = np.array([[1, 2], [3, 4]], np.float32)
        c.put(idx, {"x": a, "s": ["a0", "a1"]}).expect("PUT_DATA_RESPONSE")
        # Overwrite one index with a different dtype and shape.
        b = np.array([[7, 8, 9]], np.int64)
        c.put(idx[1:], {"x": b, "s": ["b1"]}).expect("PUT_DATA_RESPONSE")
        got = c.get(idx, ["x", "s"]).values()
        assert_cells_equal(got["x"][0], a[0], "x[0]")
        assert_cells_equal(got["x"][1], b[0], "x[1]")
        assert got["s"] == ["a0", "b1"]
        # The same PUT delivered twice (a client retry) is harmless.
        frames = put_frames(idx, {"x": a, "s": ["c0", "c1"]})
        c.request(frames).expect("PUT_DATA_RESPONSE")
        c.request(frames).expect("PUT_DATA_RESPONSE")
        got = c.get(idx, ["x", "s"]).values()
        assert_cells_equal(got["x"][1], a[1], "x[1]")
        assert got["s"] == ["c0", "c1"]


def test_clear_then_get(tq_target):
    endpoint, sender = tq_target
    idx = fresh_indexes(4)
    with TQClient(endpoint) as c:
        c.put(idx, {"x": np.arange(8, dtype=np.float32).reshape(4, 2), "t": list("abcd")}).expect("PUT_DATA_RESPONSE")
        r = c.clear(idx[:2]).expect("CLEAR_DATA_RESPONSE")
        r.check_envelope(sender)
        assert r.body == {"message": f"Clear data in storage unit id #{sender} successfully."}
        for g in idx[:2]:
            for f in ("x", "t"):
                c.get([g], [f]).expect("GET_ERROR", "[TQKeyNotFound] ").check_envelope(sender)
        # A GET naming a cleared index among present ones fails as a whole.
        c.get([idx[2], idx[0]], ["x"]).expect("GET_ERROR", "[TQKeyNotFound] ")
        got = c.get(idx[2:], ["x", "t"]).values()
        assert [v.tolist() for v in got["x"]] == [[4.0, 5.0], [6.0, 7.0]]
        assert got["t"] == ["c", "d"]
        # Clearing again (nothing there) still succeeds.
        c.clear(idx[:2]).expect("CLEAR_DATA_RESPONSE")


def test_pipelined_replies_in_order(tq_target):
    endpoint, sender = tq_target
    g = fresh_indexes(2)
    a = np.array([[1, 2, 3]], np.float32)
    b = np.array([[4, 5, 6]], np.float32)
    requests = [
        put_frames(g[:1], {"x": a}),
        get_frames(g[:1], ["x"]),
        put_frames(g[:1], {"x": b}),
        get_frames(g[:1], ["x"]),
        put_frames(g[1:], {"x": a * 10}),
        clear_frames(g[:1]),
        get_frames(g[:1], ["x"]),
        get_frames(g[1:], ["x"]),
    ]
    with TQClient(endpoint) as c:
        for frames in requests:  # all in flight before the first reply is read
            c.send(frames)
        replies = [c.recv() for _ in requests]
    types = [r.request_type for r in replies]
    assert types == [
        "PUT_DATA_RESPONSE", "GET_DATA_RESPONSE", "PUT_DATA_RESPONSE", "GET_DATA_RESPONSE",
        "PUT_DATA_RESPONSE", "CLEAR_DATA_RESPONSE", "GET_ERROR", "GET_DATA_RESPONSE",
    ], types
    assert replies[1].values()["x"][0].tolist() == [1, 2, 3]
    assert replies[3].values()["x"][0].tolist() == [4, 5, 6]
    assert replies[7].values()["x"][0].tolist() == [10, 20, 30]
    for r in replies:
        r.check_envelope(sender)
    assert len({r.env["request_id"] for r in replies}) == len(replies), "reply request ids are not fresh"


def test_large_batch_many_frames(tq_target):
    """5,000 rows: the GET reply has 10,001 frames (every tensor row its own frame)."""
    endpoint, sender = tq_target
    n = 5000
    idx = list(range(10_000_000, 10_000_000 + n))
    x = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
    jag = [np.arange(i % 3, dtype=np.int64) for i in range(n)]
    with TQClient(endpoint, timeout=30) as c:
        c.put(idx, {"x": x, "j": jag}).expect("PUT_DATA_RESPONSE")
        reply = c.get(idx[::-1], ["x", "j"])
        assert len(reply.frames) == 1 + 2 * n
        got = reply.values()
        assert np.array_equal(np.stack(got["x"]), x[::-1])
        assert all(np.array_equal(g, w) for g, w in zip(got["j"], jag[::-1]))
        c.clear(idx).expect("CLEAR_DATA_RESPONSE")
        c.get(idx[-1:], ["x"]).expect("GET_ERROR", "[TQKeyNotFound] ")


def test_nested_tensor_ext4(tq_target):
    """A nested tensor sent as one ext 4 ({"layout": "jagged", "tensors": [meta, ...]})
    comes back one ext 3 per row."""
    endpoint, sender = tq_target
    idx = fresh_indexes(3)
    rows = [np.arange(2, dtype=np.int64), np.zeros(0, np.int64), np.arange(4, dtype=np.int64) * 5]
    meta = {"layout": "jagged", "tensors": [("int64", r.shape, i + 1) for i, r in enumerate(rows)]}
    body = {"global_indexes": idx, "data": {"nt": msgpack.ExtType(4, pickle.dumps(meta, protocol=5))},
            "data_parser": None}
    with TQClient(endpoint) as c:
        c.request([envelope("PUT", body), *(r.tobytes() for r in rows)]).expect("PUT_DATA_RESPONSE")
        got = c.get(idx[::-1], ["nt"]).values()["nt"]
        for g, w in zip(got, rows[::-1]):
            assert_cells_equal(g, w, "nt")


def test_many_clients_at_once(tq_target):
    """Eight DEALERs, each with 10 put/get pairs in flight at once: every
    client gets its own replies, in its own request order."""
    endpoint, sender = tq_target
    clients = [TQClient(endpoint) for _ in range(8)]
    idx = [fresh_indexes(10) for _ in clients]
    try:
        for step in range(10):
            for k, c in enumerate(clients):
                g = idx[k][step]
                c.send(put_frames([g], {"v": np.array([[k, step, g]], np.int64)}))
                c.send(get_frames([g], ["v"]))
        for k, c in enumerate(clients):
            for step in range(10):
                c.recv().expect("PUT_DATA_RESPONSE")
                v = c.recv().values()["v"][0]
                assert v.tolist() == [k, step, idx[k][step]], (k, step, v)
    finally:
        for c in clients:
            c.close()
