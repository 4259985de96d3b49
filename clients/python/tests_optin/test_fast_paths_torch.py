"""Opt-in: torch tensors on the client's fast paths (needs torch; see
README.md here):

    $TQ_VENV/bin/python -m pytest clients/python/tests_optin/test_fast_paths_torch.py -q

- A CPU tensor is read by the Rust core's put (`_core.Put`) as the array
  it shares memory with: written byte for byte as the same data given as
  numpy arrays, whether numpy can view it directly or Python hands it
  over (bfloat16 as its bits, requires_grad, not contiguous, a subclass,
  lists of tensors, jagged nested tensors as their values and offsets).
- Index inputs as tensors of every integer dtype read as their ints; a
  negative one gets the general path's error, nothing sent.
- Through a real stowd: tensors put on the fast path come back equal,
  as tensors, and a get_into fills CPU tensors in place.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (opt-in suite)")

HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = HERE.parent
REPO = PACKAGE_ROOT.parents[1]
sys.path.insert(0, str(PACKAGE_ROOT))
sys.path.insert(1, str(REPO / "tests" / "python"))

import stowage  # noqa: E402
from stowage import _codec, _core  # noqa: E402

NUMPY_DTYPES = [torch.float32, torch.float64, torch.float16, torch.int8, torch.uint8, torch.int16,
                torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]


def _encoded(idx, data):
    return _core.Put(idx, data, 64 << 20).encode(0, 3)


def _bytes(encoded):
    frame0, frames = encoded
    return frame0, [bytes(memoryview(f).cast("B")) for f in frames]


def test_tensors_are_put_as_the_numpy_arrays_they_share_memory_with():
    idx = [10, 11, 12, 13]
    data = {str(dt): (torch.arange(4 * 3) % 2).reshape(4, 3).to(dt) for dt in NUMPY_DTYPES}
    for one in [{k: v} for k, v in data.items()] + [data]:
        assert _bytes(_encoded(idx, one)) == _bytes(_encoded(idx, {k: v.numpy() for k, v in one.items()}))


def test_tensors_python_hands_over_are_put_the_same():
    idx = [1, 2]
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)

    class Sub(torch.Tensor):
        pass

    cases = [
        (base.to(torch.bfloat16), stowage.BFloat16Bits(base.to(torch.bfloat16).view(torch.int16).numpy())),
        (base.clone().requires_grad_(True), base.numpy()),
        (base.t().contiguous().t(), base.numpy()),  # not contiguous: sent as its blocks
        (base.as_subclass(Sub), base.numpy()),
        ([torch.arange(k, dtype=torch.int32) for k in (1, 2)], [np.arange(k, dtype=np.int32) for k in (1, 2)]),
        (torch.nested.nested_tensor([torch.arange(3.0), torch.arange(1.0)], layout=torch.jagged),
         stowage.Packed(np.array([0, 1, 2, 0], np.float32), [(3,), (1,)])),
    ]
    for v, same in cases:
        assert _bytes(_encoded(idx, {"x": v})) == _bytes(_encoded(idx, {"x": same})), v


@pytest.mark.parametrize("dt", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_index_tensors_read_as_their_ints(dt):
    vals = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    read = _core.read_index_list(torch.tensor(vals, dtype=dt))
    assert read is not None and read.tolist() == vals
    assert _core.read_index_list(torch.tensor(vals, dtype=dt)[::2]).tolist() == vals[::2]
    assert _core.read_index_list(torch.tensor([1.0, 2.0])) is None
    if dt.is_signed:
        assert _core.read_index_list(torch.tensor([1, -2], dtype=dt)) is None
        with pytest.raises(ValueError, match="global index -2 is out of range"):
            _codec.check_indexes(torch.tensor([1, -2], dtype=dt), "put", unique=True)


def test_tensors_round_trip_through_stowd(tmp_path):
    from stowd_harness import run_stowd

    with run_stowd(tmp_path, name="stowd-fast-torch") as s, stowage.Client(s["native"], timeout=30) as c:
        idx = torch.arange(100, 108)
        data = {"f": torch.randn(8, 5), "i": torch.arange(8 * 2, dtype=torch.int64).reshape(8, 2),
                "b": torch.ones(8, 1, dtype=torch.bfloat16)}  # (bfloat16: handed over as its bits)
        assert c.put(idx, data) == 8
        got = c.get(idx, list(data), as_torch=True)
        for k, v in data.items():
            assert torch.equal(got[k], v), k
        out = {"f": torch.zeros(8, 5), "i": torch.zeros(8, 2, dtype=torch.int64)}
        assert c.get_into(idx.flip(0), out) is out
        assert torch.equal(out["f"], data["f"].flip(0)) and torch.equal(out["i"], data["i"].flip(0))
        np.testing.assert_array_equal(c.get(idx.numpy(), ["i"])["i"], data["i"].numpy())
        assert c.clear(idx) == 3 * 8
