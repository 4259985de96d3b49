"""The codec on its own: the FrameSource seam (reply bytes from any buffer,
e.g. a read-only mapping of a shared-memory file), put splitting and
layout (the core's `_core.Put`), dtype names."""

from __future__ import annotations

import mmap
import os

import msgpack
import numpy as np
import pytest

import stowage
from stowage import _codec, _core


def checked(fields: dict) -> dict:
    """A get_ok body of these descriptors (built by hand, as stowd sends
    them) as stowd's decoder hands it to the client."""
    frame0 = msgpack.packb({"proto": "stowage/1", "op": "get_ok", "id": 1, "body": {"fields": fields}})
    return _codec.decode_envelope(frame0)["body"]


def test_frames_from_a_read_only_file_mapping(tmp_path):
    """What the same-node mode will do: data frame k is a range of a mapped file
    (the envelope's `segments`); the decoder reads it like a socket frame, and
    the arrays are zero-copy views that cannot be written."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    seg = tmp_path / "stowd-1-0"
    seg.write_bytes(b"\0" * 8 + x.tobytes() + np.arange(3, dtype=np.int16).tobytes())
    with open(seg, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    segments = [["stowd-1-0", 8, x.nbytes], ["stowd-1-0", 8 + x.nbytes, 6], ["", 0, 0]]
    views = [memoryview(mapping)[o:o + n] if name else memoryview(b"") for name, o, n in segments]
    body = checked({
        "x": {"kind": "regular", "dtype": "float32", "shape": [3, 4],
              "parts": [{"frame": 1, "offset": 0, "len": 16, "rows": 1},
                        {"frame": 1, "offset": 16, "len": 32, "rows": 2}]},  # follow on: merged
        "n": {"kind": "nested", "dtype": "int16", "rows": [{"shape": [3], "frame": 2, "offset": 0, "len": 6},
                                                            {"shape": [0], "frame": 3, "offset": 0, "len": 0},
                                                            {"shape": [], "frame": 2, "offset": 0, "len": 2}]},
    })
    got = _codec.decode_get_fields(body, ["x", "n"], 3, _codec.FrameSource(views))
    assert len(got["x"].parts) == 1, "parts that follow on directly are one part"
    a = _codec.to_numpy(got["x"])
    assert np.array_equal(a, x) and not a.flags.writeable
    assert np.shares_memory(a, np.frombuffer(mapping, np.uint8)), "copied instead of mapped"
    n = _codec.to_numpy(got["n"])
    assert [r.tolist() for r in n] == [[0, 1, 2], [], 0]
    with pytest.raises(ValueError):
        a[0, 0] = 1
    out = np.zeros_like(x)
    _codec.copy_into(got["x"], out)
    assert np.array_equal(out, x)
    del a, n, got, views
    mapping.close()


def test_frame_source_checks_ranges():
    frames = _codec.FrameSource([memoryview(b"abcd")])
    assert bytes(frames.view(1, 1, 2)) == b"bc"
    for k, off, ln, msg in ((0, 0, 1, "frame 0 does not exist"), (2, 0, 1, "frame 2 does not exist"),
                            (True, 0, 1, "frame True"), (1, 3, 2, "outside frame 1")):
        with pytest.raises(stowage.ProtocolError, match=msg):
            frames.view(k, off, ln)
    _codec.FrameSource([memoryview(b"x")]).view(1, 0, 1)
    with pytest.raises(stowage.ProtocolError, match=r"data frames \[2\] are referenced by no descriptor"):
        s = _codec.FrameSource([memoryview(b"x"), memoryview(b"y")])
        s.view(1, 0, 1)
        s.finish()


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
    big = frames[desc["b"]["rows"][0]["frame"] - 1]
    assert type(big).__name__ == "Frame" and np.shares_memory(np.frombuffer(big, np.uint8), rows[1]), \
        "a frame of its own is handed over as a view of the caller's array"


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
    """A reply of many parts (the numpy-checked path) with one bad part is a
    ProtocolError naming the fault, not garbage rows."""
    x = np.arange(40 * 2, dtype=np.int32).reshape(40, 2)
    parts = [{"frame": 1, "offset": 8 * i, "len": 8, "rows": 1} for i in range(39, -1, -1)]
    parts[17] = {**parts[17], **bad}
    x_desc = {"kind": "regular", "dtype": "int32", "shape": [40, 2], "parts": parts}
    with pytest.raises(stowage.ProtocolError, match=error):
        f = _codec.decode_get_fields(checked({"x": x_desc}), ["x"], 40, _codec.FrameSource([memoryview(x.tobytes())]))
        _codec.to_numpy(f["x"])
    good = [dict(p) for p in parts]
    good[17] = {"frame": 1, "offset": 8 * 22, "len": 8, "rows": 1}
    f = _codec.decode_get_fields(checked({"x": {**x_desc, "parts": good}}), ["x"], 40,
                                 _codec.FrameSource([memoryview(x.tobytes())]))
    np.testing.assert_array_equal(_codec.to_numpy(f["x"]), x[::-1])


def test_private_arrays_over_segments_are_copy_on_write_and_never_overlap(tmp_path):
    """What a same-node get hands torch: writable arrays over a private
    copy-on-write mapping of the segment file (not the read-only mapping
    numpy arrays share); a write reaches neither the file, nor the shared
    mapping, nor another array. Rows whose bytes overlap (a row asked for
    twice, two fields over the same bytes) come back as separate copies."""
    from stowage import _shm
    x = np.arange(6 * 1024, dtype=np.int32).reshape(6, 1024)  # 4 KiB rows
    raw = x.tobytes()
    (tmp_path / "seg").write_bytes(raw)

    def fds() -> dict:  # the descriptors that come with a reply (read-only), taken over by frames()
        return {"seg": os.open(tmp_path / "seg", os.O_RDONLY)}

    segs = _shm.Segments()
    views, bases, where, cow = segs.frames([["seg", 0, len(raw)], ["", 0, 0]], fds())
    frames = _codec.FrameSource(views, bases, where, cow)
    row = 4096
    body = {"fields": {
        "x": {"kind": "regular", "dtype": "int32", "shape": [2, 1024],
              "parts": [{"frame": 1, "offset": 2 * row, "len": 2 * row, "rows": 2}]},  # rows 2, 3
        "n": {"kind": "nested", "dtype": "int32", "rows": [
            {"shape": [1024], "frame": 1, "offset": 5 * row, "len": row},   # row 5
            {"shape": [0], "frame": 2, "offset": 0, "len": 0},              # empty
            {"shape": [1024], "frame": 1, "offset": 5 * row, "len": row},   # row 5 again
            {"shape": [512], "frame": 1, "offset": 3 * row, "len": row // 2},  # inside field x
            {"shape": [1024], "frame": 1, "offset": 0, "len": row}]},       # row 0
    }}
    # (fields of different row counts: decoded one by one)
    body = {"fields": {name: checked({name: d})["fields"][name] for name, d in body["fields"].items()}}
    got = {"x": _codec._decode_field("x", body["fields"]["x"], 2, frames),
           "n": _codec._decode_field("n", body["fields"]["n"], 5, frames)}
    shared = np.frombuffer(bases[0], np.uint8)
    out = _codec.to_private_numpy(got, frames)
    a, rows = out["x"], out["n"]
    assert np.array_equal(a, x[2:4]) and a.flags.writeable
    assert [r.tolist() for r in rows] == [x[5].tolist(), [], x[5].tolist(), x[3, :512].tolist(), x[0].tolist()]
    everything = [a, *rows]
    for i, p in enumerate(everything):
        assert p.flags.writeable
        assert not np.shares_memory(p, shared), "a private array is a view of the shared read-only mapping"
        for q in everything[i + 1:]:
            assert not np.shares_memory(p, q), "two arrays of one get share bytes"
    a += 1
    for r in rows:
        r[...] = -1
    assert np.array_equal(np.frombuffer(shared, np.int32).reshape(6, 1024), x), "the shared mapping changed"
    assert (tmp_path / "seg").read_bytes() == raw, "the file changed"
    assert np.array_equal(a, x[2:4] + 1)
    # Another reply's private mapping is its own.
    views2, bases2, where2, cow2 = segs.frames([["seg", 0, len(raw)]], fds())
    f2 = _codec.FrameSource(views2, bases2, where2, cow2)
    again = _codec.to_private_numpy({"x": _codec._decode_field("x", body["fields"]["x"], 2, f2)}, f2)["x"]
    assert np.array_equal(again, x[2:4])
    # A range that starts inside a page: the private mapping starts at that page.
    desc = {"kind": "regular", "dtype": "int32", "shape": [1, 100],
            "parts": [{"frame": 1, "offset": 4096 + 400, "len": 400, "rows": 1}]}
    desc = checked({"x": desc})["fields"]["x"]
    views3, bases3, where3, cow3 = segs.frames([["seg", 0, len(raw)]], fds())
    f3 = _codec.FrameSource(views3, bases3, where3, cow3)
    odd = _codec.to_private_numpy({"x": _codec._decode_field("x", desc, 1, f3)}, f3)["x"]
    assert np.array_equal(odd, x[1:2, 100:200])
    odd[0, 0] = -5
    assert (tmp_path / "seg").read_bytes() == raw


def test_a_segment_named_without_its_descriptor_is_refused(tmp_path):
    """A reply that names a segment whose descriptor did not come with it, or
    a range past its end, is a protocol error (nothing is opened by name)."""
    from stowage import _shm
    (tmp_path / "seg").write_bytes(b"x" * 4096)
    segs = _shm.Segments()
    with pytest.raises(stowage.ProtocolError, match="without its descriptor"):
        segs.frames([["seg", 0, 16]], {})
    with pytest.raises(stowage.ProtocolError, match="outside segment"):
        segs.frames([["seg", 4000, 200]], {"seg": os.open(tmp_path / "seg", os.O_RDONLY)})
    views, *_ = segs.frames([["seg", 0, 4]], {"seg": os.open(tmp_path / "seg", os.O_RDONLY)})
    assert bytes(views[0]) == b"xxxx"




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
