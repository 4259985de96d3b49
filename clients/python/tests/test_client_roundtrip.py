"""Round trips through a real stowd: every field kind and dtype, nested rows
of length 0, unicode values, input layouts, read-only zero-copy results."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import stowage
from stowage import _torch

DTYPES = ["float32", "float16", "int64", "int8", "uint8", "bool",
          "float64", "int16", "uint16", "int32", "uint32", "uint64", "complex64", "complex128"]


def sample(dtype: str, shape, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return (rng.standard_normal(shape) * 1000).astype(dt)


@pytest.mark.parametrize("dtype", DTYPES)
def test_regular_round_trip_every_dtype(endpoint, fresh, dtype):
    idx = fresh(5)
    x = sample(dtype, (5, 3, 2))
    v = sample(dtype, (5,), seed=1)  # shape [n]
    with stowage.Client(endpoint, timeout=10) as c:
        assert c.put(idx, {"x": x, "v": v}) == 5
        got = c.get(idx[::-1], ["x", "v"])
        assert list(got) == ["x", "v"]
        for name, want in (("x", x[::-1]), ("v", v[::-1])):
            a = got[name]
            assert isinstance(a, np.ndarray) and a.dtype == np.dtype(dtype) and a.shape == want.shape, (name, a)
            assert a.tobytes() == want.tobytes(), name  # bit-exact (NaN-safe)
            assert not a.flags.writeable
        assert c.clear(idx) == 10


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8", "bool", "float16"])
def test_nested_round_trip_with_empty_and_scalar_rows(endpoint, fresh, dtype):
    idx = fresh(6)
    rows = [sample(dtype, (3,)), sample(dtype, (0,)), sample(dtype, ()), sample(dtype, (2, 4)),
            sample(dtype, (0, 5)), sample(dtype, (70_000,))]  # the last one goes alone as a big frame
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx, {"n": rows})
        order = [4, 0, 1, 5, 2, 3, 1]
        got = c.get([idx[i] for i in order], ["n"])["n"]
        assert isinstance(got, list) and len(got) == len(order)
        for g, i in zip(got, order):
            assert g.dtype == np.dtype(dtype) and g.shape == rows[i].shape, (i, g.shape)
            assert g.tobytes() == rows[i].tobytes()
            assert not g.flags.writeable
        # The reply's kind follows the rows asked for: rows of one shape come back regular.
        same = c.get([idx[0], idx[0]], ["n"])["n"]
        assert isinstance(same, np.ndarray) and same.shape == (2, 3)
        c.clear(idx)


def test_nested_rows_all_of_length_zero(endpoint, fresh):
    idx = fresh(3)
    rows = [np.zeros((0,), np.float32), np.zeros((0, 4), np.float32), np.zeros((2, 0), np.float32)]
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx, {"e": rows, "z": np.zeros((3, 0), np.int8)})
        got = c.get(idx, ["e", "z"])
        assert [g.shape for g in got["e"]] == [(0,), (0, 4), (2, 0)]
        assert got["z"].shape == (3, 0) and got["z"].dtype == np.int8
        c.clear(idx)


def test_values_unicode_and_bytes(endpoint, fresh):
    values = ["héllo 🙂", "日本語テキスト", "e\u0301", "", "\x00nul\x00", b"\x00\xff\xfebin", b"", "a" * 100_000]
    idx = fresh(len(values))
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx, {"t": values, "b": [bytearray(b"ba"), memoryview(b"mv")] + [b"x"] * (len(values) - 2)})
        got = c.get(idx[::-1] + idx[:1], ["t", "b"])
        assert got["t"] == values[::-1] + values[:1]
        assert [type(v) for v in got["t"]] == [type(v) for v in values[::-1] + values[:1]]
        assert got["b"][-3:] == [b"mv", b"ba", b"ba"]
        assert c.get(idx[:2], ["b"])["b"] == [b"ba", b"mv"]
        # numpy strings (e.g. from iterating a str array) are values too.
        c.put(idx[:2], {"np": list(np.array(["uno", "dós"]))})
        assert c.get(idx[:2], ["np"])["np"] == ["uno", "dós"]
        c.clear(idx)


def test_all_kinds_in_one_put_and_repeated_indexes(endpoint, fresh):
    idx = fresh(4)
    data = {
        "obs": np.arange(4 * 8, dtype=np.float32).reshape(4, 8),
        "resp": [np.arange(k + 1, dtype=np.int64) for k in range(4)],
        "prompt": ["p0", "p1", "p2", "p3"],
    }
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(np.array(idx, dtype=np.uint64), data)  # numpy indexes are fine too
        order = [idx[2], idx[2], idx[0]]
        got = c.get(order, ["prompt", "obs", "resp"])
        assert list(got) == ["prompt", "obs", "resp"]
        assert got["prompt"] == ["p2", "p2", "p0"]
        assert np.array_equal(got["obs"], data["obs"][[2, 2, 0]])
        assert [r.tolist() for r in got["resp"]] == [[0, 1, 2], [0, 1, 2], [0]]
        assert c.get(idx[3:], "obs")["obs"].shape == (1, 8)  # one field name as a str
        # Overwrite, clear one field, then everything.
        c.put(idx[:1], {"obs": np.full((1, 8), 7, np.float32)})
        assert c.get(idx[:1], ["obs"])["obs"].tolist() == [[7.0] * 8]
        assert c.clear(idx[:2], ["prompt"]) == 2
        with pytest.raises(stowage.KeyNotFound):
            c.get(idx[:1], ["prompt"])
        assert c.clear(idx) == 4 * 3 - 2
        assert c.clear(idx) == 0
        assert c.clear([]) == 0


def test_non_contiguous_and_big_endian_input(endpoint, fresh):
    idx = fresh(4)
    base = np.arange(4 * 6, dtype=np.float64).reshape(4, 6)
    strided = base[:, ::2]  # not contiguous
    transposed = np.arange(16, dtype=np.int32).reshape(4, 4).T
    big_endian = np.arange(8, dtype=">f4").reshape(4, 2)
    assert not strided.flags.c_contiguous and not transposed.flags.c_contiguous
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx, {"s": strided, "t": transposed, "be": big_endian,
                    "nest": [base[i, ::3] for i in range(4)]})
        got = c.get(idx, ["s", "t", "be", "nest"])
        assert np.array_equal(got["s"], strided) and np.array_equal(got["t"], transposed)
        assert got["be"].dtype == np.float32 and np.array_equal(got["be"], big_endian)
        assert all(np.array_equal(g, base[i, ::3]) for i, g in enumerate(got["nest"]))
        c.clear(idx)


def test_bfloat16_bits_round_trip(endpoint, fresh):
    """bfloat16 without torch: bit patterns in a uint16 array, sent with dtype
    bfloat16 (stowage.BFloat16Bits) and returned as uint16 (as_torch=False, or
    as_torch=None when torch is not installed; with torch, a bfloat16 tensor)."""
    idx = fresh(3)
    f32 = np.array([[1.0, -2.5], [3.140625, 0.0], [-0.0, 65280.0]], np.float32)
    bits = (f32.view(np.uint32) >> 16).astype(np.uint16)  # exact: every value fits bfloat16
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx, {"bf": stowage.BFloat16Bits(bits), "bfn": stowage.BFloat16Bits([bits[0], bits[1, :1], bits[2]])})
        got = c.get(idx, ["bf", "bfn"], as_torch=False)
        assert got["bf"].dtype == np.uint16 and np.array_equal(got["bf"], bits)
        back = (got["bf"].astype(np.uint32) << 16).view(np.float32)
        assert np.array_equal(back, f32)
        assert [g.tolist() for g in got["bfn"]] == [bits[0].tolist(), bits[1, :1].tolist(), bits[2].tolist()]
        auto = c.get(idx, ["bf"])["bf"]
        if _torch.available():
            import torch

            assert auto.dtype == torch.bfloat16 and torch.equal(auto.float(), torch.from_numpy(f32))
        else:
            assert isinstance(auto, np.ndarray) and auto.dtype == np.uint16 and np.array_equal(auto, bits)
        # get_into: bfloat16 fills a uint16 (or int16) array.
        out = {"bf": np.zeros((3, 2), np.int16)}
        c.get_into(idx, out)
        assert np.array_equal(out["bf"].view(np.uint16), bits)
        c.clear(idx)


def test_as_torch(endpoint, fresh):
    """as_torch=True gives torch tensors, or a clear ImportError without torch
    (raised before anything is sent)."""
    idx = fresh(2)
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx, {"x": np.ones((2, 3), np.float32), "n": [np.ones(1, np.int8), np.ones(2, np.int8)]})
        if _torch.available():
            import torch

            got = c.get(idx, ["x", "n"], as_torch=True)
            assert isinstance(got["x"], torch.Tensor) and got["x"].shape == (2, 3)
            assert all(isinstance(r, torch.Tensor) for r in got["n"])
        else:
            with pytest.raises(ImportError, match="needs torch"):
                c.get(idx, ["x"], as_torch=True)
        with pytest.raises(TypeError, match="as_torch"):
            c.get(idx, ["x"], as_torch="yes")
        c.clear(idx)


class _Made:
    """What the fake `from_numpy` below makes: the array it was given."""

    def __init__(self, a):
        self.a = a


def _core_get(c, idx, names, opts):
    """(result, glue) of the core's get with `opts`, over tcp."""
    rid, got = c._core_call("get", None, 10, lambda core, rid, t: core.get_fast(rid, idx, names, t, opts, True, None))
    return got[1]


@pytest.mark.parametrize("packed", [False, True])
def test_tensors_made_by_the_core_equal_the_glued_ones(endpoint, fresh, packed):
    """Given `from_numpy` (as `get(as_torch=True)` gives torch's), the core
    makes a tensor field's tensors itself: of the very arrays the glue
    would get, every field kind (a one-part regular field, a gathered one,
    nested rows with an empty one, packed), now writable, and lists for the
    glue only the raw-bits dtypes and values. Checked with a stand-in for
    torch: writing through the arrays changes neither the store nor
    another get."""
    from stowage import _codec, _core
    idx = fresh(4)
    x = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)  # one part
    big = np.arange(4 * 40000, dtype=np.int32).reshape(4, 40000)  # a frame a row: gathered
    rows = [np.arange(k * 3, dtype=np.int64) for k in range(4)]  # row 0 empty
    bf = np.arange(8, dtype=np.uint16).reshape(4, 2)
    names = ["x", "big", "n", "bf", "v"]
    pk = _codec.Packed if packed else None
    glued = _core.GetOptions(_codec.WIRE_DTYPES, list(_codec.WIRE_DTYPES), pk)
    given = []

    def from_numpy(a):
        given.append(a)
        return _Made(a)

    direct = _core.GetOptions(_codec.WIRE_DTYPES, list(_codec.WIRE_DTYPES), pk, from_numpy)
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx, {"x": x, "big": big, "n": rows, "bf": stowage.Bits(bf, "bfloat16"), "v": ["a", 1, None, 2.5]})
        want, want_glue = _core_get(c, idx, names, glued)
        got, glue = _core_get(c, idx, names, direct)
        assert sorted(want_glue) == [("bf", "bfloat16"), ("big", "int32"), ("n", "int64"), ("x", "float32")]
        assert glue == [("bf", "bfloat16")], "tensors the core made were listed for the glue too"
        assert got["v"] == want["v"] == ["a", 1, None, 2.5]
        np.testing.assert_array_equal(got["bf"], want["bf"])
        assert isinstance(got["x"], _Made) and isinstance(got["big"], _Made)
        for name in ("x", "big"):
            assert got[name].a.dtype == want[name].dtype and got[name].a.flags.writeable
            np.testing.assert_array_equal(got[name].a, want[name])
        if packed:
            assert isinstance(got["n"], _codec.Packed) and isinstance(got["n"].values, _Made)
            assert got["n"].shapes == want["n"].shapes == [(k * 3,) for k in range(4)]
            np.testing.assert_array_equal(got["n"].values.a, want["n"].values)
            made = [got["x"].a, got["big"].a, got["n"].values.a]
        else:
            assert [type(r) for r in got["n"]] == [_Made] * 4
            for r, w in zip(got["n"], want["n"]):
                assert r.a.dtype == w.dtype and r.a.shape == w.shape and np.array_equal(r.a, w)
            made = [got["x"].a, got["big"].a, *(r.a for r in got["n"])]
        assert [id(a) for a in given] == [id(a) for a in made], "from_numpy not given each array once"
        for a in made:
            assert a.flags.writeable
            a[...] = 7
        # The glued result, another get, and the store are untouched.
        np.testing.assert_array_equal(want["x"], x)
        again = c.get(idx, ["x", "big", "n"])
        np.testing.assert_array_equal(again["x"], x)
        np.testing.assert_array_equal(again["big"], big)
        assert all(np.array_equal(a, b) for a, b in zip(again["n"], rows))
        with pytest.raises(TypeError, match="from_numpy must be callable"):
            _core.GetOptions(_codec.WIRE_DTYPES, [], None, 3)
        c.clear(idx)


def test_results_are_read_only(endpoint, fresh):
    """Every array a get returns is read-only, whether it is a view of a frame
    (one part), a concatenation (several parts) or a nested row."""
    idx = fresh(4)
    small = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)  # coalesced: one part
    big = np.arange(4 * 32768, dtype=np.float32).reshape(4, 32768)  # 128 KiB rows: one frame per row
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx, {"small": small, "big": big, "n": [np.arange(k + 1, dtype=np.int16) for k in range(4)]})
        got = c.get(idx, ["small", "big", "n"])
        assert np.array_equal(got["small"], small) and np.array_equal(got["big"], big)
        for a in [got["small"], got["big"], *got["n"]]:
            assert not a.flags.writeable
            with pytest.raises(ValueError):
                a[...] = 0
            with pytest.raises(ValueError):
                a.reshape(-1)[0] = 1
        # The arrays are the client's: np.array() gives a writable copy.
        w = np.array(got["small"])
        w[0, 0] = -1
        assert c.get(idx[:1], ["small"])["small"][0, 0] == 0
        c.clear(idx)


def test_get_of_one_part_is_zero_copy(endpoint, fresh):
    """A field that arrives as one part is a view of the received frame: no
    allocation the size of the result."""
    n = 4096
    idx = fresh(n)
    x = np.random.default_rng(3).standard_normal((n, 1024)).astype(np.float32)  # 16 MiB, 4 KiB rows
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(idx, {"x": x})
        tracemalloc.start()
        try:
            got = c.get(idx, ["x"])["x"]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert np.array_equal(got, x)
        assert not got.flags.owndata and not got.flags.writeable
        assert peak < x.nbytes // 10, f"get allocated {peak} bytes for a {x.nbytes}-byte field"
        c.clear(idx)


def test_put_sends_contiguous_arrays_without_copy(endpoint, fresh):
    """A C-contiguous array goes to the socket as is, and a strided one as
    the blocks it is made of (copied item by item into the core's small
    write buffer as it is written): neither put has numpy copy the field
    (tracemalloc sees numpy's allocations), and both read back."""
    n = 4096
    idx = fresh(n)
    x = np.ones((n, 4096), np.uint8)  # 16 MiB
    strided = np.ones((n, 8192), np.uint8)[:, ::2]
    with stowage.Client(endpoint, timeout=30) as c:
        tracemalloc.start()
        try:
            c.put(idx, {"x": x})
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            c.put(idx, {"x": strided})
            _, peak_strided = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < x.nbytes // 10, f"put allocated {peak} bytes for a {x.nbytes}-byte field"
        assert peak_strided < x.nbytes // 10, f"a strided put allocated {peak_strided} bytes"
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], strided)
        c.clear(idx)
