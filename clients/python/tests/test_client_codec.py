"""The codec on its own: a get_ok's descriptors checked against its frames
by the core's decoder (`_core.decode_get`), put splitting and layout (the
core's `_core.Put`), dtype names."""

from __future__ import annotations

import os
import re

import msgpack
import numpy as np
import pytest

import stowage
from stowage import _codec, _core


NUMPY = _core.GetOptions(_codec.WIRE_DTYPES, [], None)


def decoded(fields: dict, frames: list) -> dict:
    """A get_ok of these descriptors (built by hand, as stowd sends them)
    and data frames, as the core makes its results."""
    frame0 = msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": 1, "body": {"fields": fields}})
    out, why = _core.decode_get([frame0, *frames], NUMPY)
    assert type(out) is dict, why
    return out


def test_results_are_read_only_views_of_the_frames():
    """Parts that follow on directly in one frame are one view of it (no
    copy); nested rows are views too, the empty frame an empty row; none
    can be written."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    data = bytearray(b"\0" * 8 + x.tobytes() + np.arange(3, dtype=np.int16).tobytes())
    got = decoded({
        "x": {"kind": "regular", "dtype": "float32", "shape": [3, 4],
              "parts": [{"frame": 1, "offset": 8, "len": 16, "rows": 1},
                        {"frame": 1, "offset": 24, "len": 32, "rows": 2}]},  # follow on: one view
        "n": {"kind": "nested", "dtype": "int16", "rows": [{"shape": [3], "frame": 1, "offset": 56, "len": 6},
                                                            {"shape": [0], "frame": 2, "offset": 0, "len": 0},
                                                            {"shape": [], "frame": 1, "offset": 56, "len": 2}]},
    }, [data, b""])
    a = got["x"]
    assert np.array_equal(a, x) and not a.flags.writeable
    assert np.shares_memory(a, np.frombuffer(data, np.uint8)), "copied instead of viewed"
    assert [r.tolist() for r in got["n"]] == [[0, 1, 2], [], 0]
    with pytest.raises(ValueError):
        a[0, 0] = 1


def refusal(fields: dict, frames: list) -> str:
    """Why the core refuses a get_ok of these descriptors and frames: its
    decoder's reason (frame 0 in itself), or the check against the frames."""
    frame0 = msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": 1, "body": {"fields": fields}})
    try:
        out, why = _core.decode_get([frame0, *frames], NUMPY)
    except _core.ProtocolViolation as e:
        return str(e)
    assert type(out) is not dict, "taken"
    return why


def test_the_decoder_checks_ranges_against_the_frames():
    desc = {"kind": "regular", "dtype": "uint8", "shape": [1, 2], "parts": [{"frame": 1, "offset": 1, "len": 2, "rows": 1}]}
    assert decoded({"x": desc}, [b"abcd"])["x"].tobytes() == b"bc"
    for part, frames, msg in (({"frame": 0}, [b"abcd"], "frame"), ({"frame": 2}, [b"abcd"], "frame 2 does not exist"),
                              ({"offset": 3}, [b"abcd"], "outside frame 1"),
                              ({}, [b"abcd", b"y"], r"data frames \[2\] are referenced by no descriptor")):
        bad = {**desc, "parts": [{**desc["parts"][0], **part}]}
        assert re.search(msg, refusal({"x": bad}, frames))


def _sent(frame0: bytes) -> dict:
    """The body of a put message as it goes on the wire (frame 0 decoded)."""
    return msgpack.unpackb(frame0)["body"]


def test_a_put_is_split_into_messages_of_whole_rows():
    x = np.zeros((10, 100), np.uint8)
    idx = list(range(100, 110))
    # Each row costs 100 bytes + 32 of overhead.
    assert _core.Put(idx, {"x": x}, 10_000).messages == 1
    p = _core.Put(idx, {"x": x}, 400)
    assert [p.message_rows(k) for k in range(p.messages)] == [3, 3, 3, 1]
    bodies = [_sent(p.encode(k, k + 1)[0]) for k in range(p.messages)]
    assert bodies[-1]["global_indexes"] == [109]
    assert [b["fields"]["x"]["shape"] for b in bodies] == [[3, 100], [3, 100], [3, 100], [1, 100]]
    p = _core.Put(idx, {"x": x}, 1)  # a row too big goes alone
    assert [p.message_rows(k) for k in range(p.messages)] == [1] * 10
    # Values count by their length (non-ASCII text 4 bytes a character, anything else 64).
    p = _core.Put([1, 2, 3], {"t": ["a" * 100, "é" * 30, 7]}, 16 * 2 * 2 + 100 + 120)
    assert [p.message_rows(k) for k in range(p.messages)] == [2, 1]


def test_small_pieces_share_frames_and_big_ones_go_alone():
    rows = [np.full(3, 1, np.float64), np.full(70_000, 2, np.uint8), np.full(1, 3, np.float64)]
    p = _core.Put([1, 2], {"n": [rows[0], rows[2]], "b": [rows[1], rows[1][:5]]}, 1 << 30)
    frame0, frames = p.encode(0, 1)
    desc = _sent(frame0)["fields"]
    assert len(frames) == 2  # one shared frame for the small pieces, one for the 70,000-byte row
    n0, n1 = desc["n"]["rows"]
    assert n0["frame"] == n1["frame"] and n1["offset"] % 8 == 0  # aligned to the itemsize
    assert desc["b"]["rows"][0]["frame"] != n0["frame"] and desc["b"]["rows"][0]["offset"] == 0
    assert frames[desc["b"]["rows"][0]["frame"] - 1] == rows[1].tobytes()


def test_dtype_names():
    assert stowage.DTYPES == tuple(_codec.WIRE_DTYPES)
    assert _codec.canonical_dtype("torch.half") == "float16" and _codec.canonical_dtype("long") == "int64"
    with pytest.raises(stowage.ProtocolError, match="unknown dtype 'float8'"):
        _codec.canonical_dtype("float8")
    assert _codec.WIRE_DTYPES["bfloat16"] == np.dtype("<u2")


@pytest.mark.parametrize("bad, error", [
    ({"extra": 1}, 'unexpected key "extra"'),         # a fifth key on one part
    ({"rows": True}, "rows must be"),                 # a bool is not a row count
    ({"offset": 1.0}, "offset must be"),              # nor is a float an offset
    ({"len": 3}, "range of 3 bytes"),                 # len that is not rows x row bytes
    ({"frame": 9}, "frame 9 does not exist"),         # no such frame
])
def test_a_bad_part_among_many_is_refused(bad, error):
    """A reply of many parts with one bad part is refused, naming the
    fault, not garbage rows; the good one gathers the parts in order."""
    x = np.arange(40 * 2, dtype=np.int32).reshape(40, 2)
    parts = [{"frame": 1, "offset": 8 * i, "len": 8, "rows": 1} for i in range(39, -1, -1)]
    parts[17] = {**parts[17], **bad}
    x_desc = {"kind": "regular", "dtype": "int32", "shape": [40, 2], "parts": parts}
    assert re.search(error, refusal({"x": x_desc}, [x.tobytes()]))
    good = [dict(p) for p in parts]
    good[17] = {"frame": 1, "offset": 8 * 22, "len": 8, "rows": 1}
    np.testing.assert_array_equal(decoded({"x": {**x_desc, "parts": good}}, [x.tobytes()])["x"], x[::-1])


def test_a_lease_fill_of_more_pieces_than_one_pwritev_takes():
    """A same-node put of 3,000 nested rows of about 600 bytes (two shared
    frames of some 1,700 pieces each, more than one pwritev takes) and a
    regular field of a frame of its own: each frame written at a multiple
    of 64, byte for byte what the socket would carry; the descriptor is
    closed (stowd could not seal the segment otherwise)."""
    rows = [np.full(600 + k % 7, k % 251, np.uint8) for k in range(3000)]
    x = np.arange(3000 * 12, dtype=np.float32).reshape(3000, 12)  # [:, ::2]: 72,000 bytes
    p = _core.Put(list(range(3000)), {"n": rows, "x": x[:, ::2]}, 1 << 20, same_node=True)
    assert p.messages == 1
    _, frames = p.encode(0, 1)
    lens = [memoryview(f).nbytes for f in frames]
    assert len(lens) == 3
    size = p.lease_bytes
    fd = os.memfd_create("lease")
    os.ftruncate(fd, size)
    handed = os.dup(fd)
    out = p.fill("s1", handed)
    at, want = 0, []
    for n in lens:
        at = -(-at // 64) * 64
        want.append(("s1", at, n))
        at += n
    assert out == want and at == size
    for (_, off, n), f in zip(out, frames):
        assert os.pread(fd, n, off) == bytes(f)
    with pytest.raises(OSError):
        os.fstat(handed)
    os.close(fd)
