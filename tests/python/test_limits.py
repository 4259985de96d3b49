"""Receive limits with libzmq peers (pyzmq): a stowd with
`max_request_bytes = 1 MiB` and `max_request_frames = 64` answers bigger
requests with an error, keeps the connection usable, stores nothing of the
refused request and leaves what it stored intact. A client that stops
reading its replies holds up nobody else."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from native_codec import NativeClient
import native_codec as nc
from stowd_harness import fresh_indexes, run_stowd
from tq_codec import TQClient, get_frames

LIMIT = 1 << 20
CONFIG = f"[limits]\nmax_request_bytes = {LIMIT}\nmax_request_frames = 64\nwrite_timeout_secs = 3\n"


@pytest.fixture(scope="module")
def limited(stowd_bin, tmp_path_factory):
    with run_stowd(tmp_path_factory.mktemp("stowd-limits"), config=CONFIG, name="stowd-limits") as server:
        yield server


def test_tq_put_over_the_byte_limit(limited):
    ep, rid = limited["router"]["endpoint"], limited["router"]["id"]
    idx = fresh_indexes(8)
    kept = np.arange(8 * 256, dtype=np.float32).reshape(8, 256)
    with TQClient(ep) as c:
        c.put(idx, {"x": kept}).expect("PUT_DATA_RESPONSE")
        big_idx = fresh_indexes(2)
        big = np.ones((2, LIMIT // 4), np.float32)  # 2 MiB in one frame
        r = c.put(big_idx, {"x": big}).expect("PUT_ERROR", f"Failed to put data into storage unit id #{rid}")
        assert "max_request_bytes" in r.message and str(LIMIT) in r.message, r.message
        # The same socket goes on working; nothing of the refused put is stored.
        c.get(big_idx[:1], ["x"]).expect("GET_ERROR", "[TQKeyNotFound] ")
        got = c.get(idx, ["x"]).values()["x"]
        assert np.array_equal(np.stack(got), kept)
        c.clear(idx).expect("CLEAR_DATA_RESPONSE")
    assert limited.alive()


def test_tq_put_over_the_frame_limit(limited):
    ep = limited["router"]["endpoint"]
    idx = fresh_indexes(100)
    rows = [np.full(3, i, np.int32) for i in range(100)]  # one frame per row
    with TQClient(ep) as c:
        r = c.put(idx, {"n": rows}).expect("PUT_ERROR")
        assert "more than 64 frames" in r.message, r.message
        c.get(idx[:1], ["n"]).expect("GET_ERROR", "[TQKeyNotFound] ")
        c.put(idx[:10], {"n": rows[:10]}).expect("PUT_DATA_RESPONSE")
        c.clear(idx[:10]).expect("CLEAR_DATA_RESPONSE")


def test_raw_native_reply_carries_the_request_id(limited):
    idx = fresh_indexes(1)
    with NativeClient(limited["native"]) as c:
        i = c.next_id()
        r = c.request(nc.put_frames(i, idx, {"x": np.zeros((1, LIMIT), np.uint8)}))
        r.expect_error("too_large", i)


def test_a_reader_that_stops_reading_blocks_nobody(limited):
    ep, rid = limited["router"]["endpoint"], limited["router"]["id"]
    idx = fresh_indexes(64)
    rows = np.arange(64 * 2048, dtype=np.float32).reshape(64, 2048)  # 512 KiB
    ctx = zmq.Context.instance()
    stuck = ctx.socket(zmq.DEALER)
    stuck.setsockopt(zmq.IDENTITY, b"TQ_STORAGE_pytest_stuck")
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.LINGER, 0)
    try:
        with TQClient(ep) as c:
            c.put(idx, {"x": rows}).expect("PUT_DATA_RESPONSE")
            stuck.connect(ep)
            for _ in range(200):  # about 100 MiB of replies nobody reads
                stuck.send_multipart(get_frames(idx, ["x"]), copy=True)
            # Another client is served throughout, each get within the
            # client's reply timeout.
            for k in range(20):
                got = c.get(idx[k : k + 1], ["x"]).values()["x"]
                assert np.array_equal(got[0], rows[k])
            c.clear(idx).expect("CLEAR_DATA_RESPONSE")
    finally:
        stuck.close(0)
    assert limited.alive()
