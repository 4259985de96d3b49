"""The dtypes numpy has no type for (stowage.BITS_DTYPES: bfloat16, complex32,
the float8s, float4_e2m1fn_x2) through a real stowd, byte for byte: sent as
raw bits (stowage.Bits), torch tensors (when torch is installed) or ml_dtypes
arrays (when ml_dtypes is), and returned in the form the caller asked for."""

from __future__ import annotations

import numpy as np
import pytest

import stowage
from stowage import _codec, _core, _dtypes, _torch

# str(torch.X) without "torch." and torch.X.itemsize, from the torch 2.15
# that TransferQueue 0.1.11 installs.
TORCH_ITEMSIZE = {
    "bool": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
}
NEW = ["complex32", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
       "float8_e8m0fnu", "float4_e2m1fn_x2"]


def test_every_torch_dtype_name_and_itemsize():
    assert set(stowage.DTYPES) == set(TORCH_ITEMSIZE)
    for name, size in TORCH_ITEMSIZE.items():
        assert stowage.WIRE_DTYPES[name].itemsize == size, name
        assert _codec.canonical_dtype(name) == name
        assert _codec.canonical_dtype("torch." + name) == name
    assert stowage.BITS_DTYPES == {"bfloat16", *NEW}
    for bits in stowage.BITS_DTYPES:
        assert stowage.WIRE_DTYPES[bits].kind == "u", bits
    for alias, name in {"chalf": "complex32", "cfloat": "complex64", "cdouble": "complex128"}.items():
        assert _codec.canonical_dtype(alias) == name
    for unknown in ("qint8", "float8", "uint4", "bits8"):
        with pytest.raises(stowage.ProtocolError, match="unknown dtype"):
            _codec.canonical_dtype(unknown)


def test_the_client_table_is_stowds():
    """_dtypes.py holds the same dtypes as the dtype table stowd's codecs
    read (`_core.DTYPES`: name, itemsize, aliases per dtype, in table
    order): none gained, lost, reordered or resized, and the same aliases."""
    table = _core.DTYPES
    assert list(_dtypes.WIRE_DTYPES) == [name for name, _, _ in table]
    assert {n: dt.itemsize for n, dt in _dtypes.WIRE_DTYPES.items()} == {
        name: itemsize for name, itemsize, _ in table
    }
    assert _dtypes.DTYPE_ALIASES == {alias: name for name, _, aliases in table for alias in aliases}
    assert _dtypes.BITS_DTYPES <= set(_dtypes.WIRE_DTYPES)
    assert set(_dtypes.ML_DTYPES) <= _dtypes.BITS_DTYPES


def bits_of(name: str, shape, seed: int) -> np.ndarray:
    bits = stowage.WIRE_DTYPES[name]
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << (8 * bits.itemsize), size=shape, dtype=np.uint64).astype(bits)


def as_bits(v, name: str) -> np.ndarray:
    """A returned array (raw bits or ml_dtypes) or torch tensor -> its raw bits."""
    bits = stowage.WIRE_DTYPES[name]
    if _torch.is_tensor(v):
        v = _torch.to_numpy(v, "test")[1]
    return np.asarray(v).view(bits)


@pytest.mark.parametrize("name", NEW)
def test_bits_round_trip(endpoint, fresh, name):
    idx = fresh(4)
    x = bits_of(name, (4, 3, 2), 1)
    rows = [bits_of(name, (k,), 10 + k) for k in (2, 0, 5, 1)]
    with stowage.Client(endpoint, timeout=10) as c:
        assert c.put(idx, {"x": stowage.Bits(x, name), "n": stowage.Bits(rows, name)}) == 4
        order = [3, 0, 2]
        got = c.get([idx[i] for i in order], ["x", "n"], as_torch=False)
        assert got["x"].shape == (3, 3, 2) and got["x"].dtype.itemsize == x.dtype.itemsize
        assert as_bits(got["x"], name).tobytes() == x[order].tobytes()
        assert [as_bits(r, name).tobytes() for r in got["n"]] == [rows[i].tobytes() for i in order]
        ml = _dtypes.ml_dtype(name)
        assert got["x"].dtype == (ml if ml is not None else x.dtype)

        auto = c.get(idx, ["x"])["x"]  # as_torch=None
        if _torch.available() and _torch.torch_dtype(name) is not None:
            assert auto.dtype == _torch.torch_dtype(name) and tuple(auto.shape) == x.shape
        else:
            assert isinstance(auto, np.ndarray)
        assert as_bits(auto, name).tobytes() == x.tobytes()

        # get_into: the bits fill an int array of the dtype's itemsize.
        signed = np.dtype(f"int{8 * x.dtype.itemsize}")
        out = {"x": np.zeros(x.shape, signed)}
        c.get_into(idx, out)
        assert out["x"].tobytes() == x.tobytes()
        with pytest.raises(ValueError, match=f"field 'x' is {name}"):
            c.get_into(idx, {"x": np.zeros(x.shape, np.float32 if x.dtype.itemsize != 4 else np.float64)})
        c.clear(idx)


def test_bits_need_ints_of_the_itemsize(endpoint, fresh):
    with stowage.Client(endpoint, timeout=10) as c:
        with pytest.raises(TypeError, match=r"Bits\(\.\., 'float8_e5m2'\) needs a uint8 or int8"):
            c.put(fresh(1), {"x": stowage.Bits(np.zeros(1, np.uint16), "float8_e5m2")})
        with pytest.raises(TypeError, match=r"needs a uint32 or int32"):
            c.put(fresh(1), {"x": stowage.Bits(np.zeros(1, np.float32), "complex32")})
        with pytest.raises(ValueError, match="dtype must be one of"):
            stowage.Bits(np.zeros(1, np.uint8), "uint8")
        # a plain uint8 array is uint8, not a float8
        idx = fresh(2)
        c.put(idx, {"u": np.arange(2, dtype=np.uint8)})
        assert c.get(idx, ["u"])["u"].dtype == np.uint8
        c.clear(idx)


@pytest.mark.skipif(_dtypes.ml_dtype("float8_e4m3fn") is None, reason="ml_dtypes not installed")
@pytest.mark.parametrize("name", _dtypes.ML_DTYPES)
def test_ml_dtypes_arrays_round_trip(endpoint, fresh, name):
    import ml_dtypes

    idx = fresh(3)
    x = np.array([[0.5, -1.0], [2.0, 0.25], [4.0, 1.0]], np.float32).astype(getattr(ml_dtypes, name))
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx, {"x": x})
        got = c.get(idx, ["x"], as_torch=False)["x"]
        assert got.dtype == x.dtype and got.tobytes() == x.tobytes()
        c.clear(idx)


@pytest.mark.skipif(not _torch.available(), reason="torch not installed")
@pytest.mark.parametrize("name", ["bfloat16", *NEW])
def test_torch_tensors_round_trip(endpoint, fresh, name):
    import torch

    dt = _torch.torch_dtype(name)
    if dt is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    idx = fresh(4)
    x = torch.from_numpy(bits_of(name, (4, 5), 2).view(np.dtype(f"int{8 * dt.itemsize}"))).view(dt)
    rows = [x[i, : i + 1] for i in range(4)]
    jag = torch.nested.as_nested_tensor([r.view(torch.uint8).clone() for r in rows], layout=torch.jagged)
    with stowage.Client(endpoint, timeout=10) as c:
        c.put(idx, {"x": x, "n": rows, "j": jag})
        got = c.get(idx[::-1], ["x", "n", "j"], as_torch=True)
        assert got["x"].dtype == dt and got["x"].view(torch.uint8).equal(x.flip(0).view(torch.uint8))
        for k, r in enumerate(got["n"]):
            assert r.dtype == dt and r.view(torch.uint8).equal(rows[3 - k].view(torch.uint8))
        assert [r.dtype for r in got["j"]] == [torch.uint8] * 4
        auto = c.get(idx, ["x"])["x"]
        assert auto.dtype == dt
        bits = c.get(idx, ["x"], as_torch=False)["x"]
        assert as_bits(bits, name).tobytes() == x.view(torch.uint8).numpy().tobytes()
        c.clear(idx)


def test_without_torch_or_ml_dtypes(endpoint, fresh):
    """A fresh interpreter where neither torch nor ml_dtypes can be imported:
    every new dtype goes in as stowage.Bits and comes back as its raw bits
    (as_torch=None included), byte for byte; as_torch=True says torch is
    missing."""
    from test_imports import _python_without_torch

    out = _python_without_torch("""
        import json, sys
        sys.modules["ml_dtypes"] = None
        import numpy as np, stowage
        from stowage import _dtypes, _torch
        assert not _torch.available() and _dtypes.ml_dtype("float8_e4m3fn") is None
        ep, idx = sys.argv[1], json.loads(sys.argv[2])
        names = sorted(stowage.BITS_DTYPES)
        data = {}
        for k, name in enumerate(names):
            bits = stowage.WIRE_DTYPES[name]
            raw = np.arange(k, k + 3 * 4 * bits.itemsize, dtype=np.uint8) * 29
            data[name] = raw.view(bits).reshape(3, 4)
        with stowage.Client(ep, timeout=20) as c:
            assert c.put(idx, {n: stowage.Bits(a, n) for n, a in data.items()}) == 3
            got = c.get(idx[::-1], names)
            for n in names:
                assert type(got[n]) is np.ndarray and got[n].dtype == data[n].dtype, (n, got[n].dtype)
                assert got[n].tobytes() == data[n][::-1].tobytes(), n
            try:
                c.get(idx, names[:1], as_torch=True)
                raise SystemExit("as_torch=True worked without torch")
            except ImportError as e:
                assert "needs torch" in str(e)
            c.clear(idx)
        assert sys.modules["torch"] is None and sys.modules["ml_dtypes"] is None
        print("ok")
    """, endpoint, str(fresh(3)).replace(" ", ""))
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-3000:]
