"""Opt-in: torch tensors on the client's fast paths (needs torch; see
README.md here):

    $TQ_VENV/bin/python -m pytest clients/python/tests_optin/test_fast_paths_torch.py -q

- A CPU tensor numpy can view (`.numpy()`) is read by the Rust core as the
  array it shares memory with: a put of such fields is written byte for
  byte as the general path writes it; one that needs the general path
  (bfloat16, requires_grad, not contiguous, a subclass) is left to it.
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


def _general(idx, data):
    n = len(idx)
    (m,) = list(_codec.put_messages(idx, {k: _codec.normalize_field(k, v, n) for k, v in data.items()}, 64 << 20))
    return _codec.envelope("put", 3, m.body), [bytes(memoryview(f).cast("B")) for f in m.frames]


def test_tensors_numpy_can_view_are_put_as_the_general_path_puts_them():
    idx = [10, 11, 12, 13]
    data = {str(dt): (torch.arange(4 * 3) % 2).reshape(4, 3).to(dt) for dt in NUMPY_DTYPES}
    for one in [{k: v} for k, v in data.items()] + [data]:
        got = _core.encode_put(3, idx, one, 64 << 20)
        assert got is not None, list(one)[:3]
        frame0, frames, rows = got
        assert (frame0, frames) == _general(idx, one) and rows == 4


def test_tensors_that_need_the_general_path_are_left_to_it():
    idx = [1, 2]
    base = torch.ones(2, 3)

    class Sub(torch.Tensor):
        pass

    for v in (base.to(torch.bfloat16), base.clone().requires_grad_(True), base.t().contiguous().t(),
              base.as_subclass(Sub), [torch.arange(k, dtype=torch.int32) for k in (1, 2)]):
        assert _core.encode_put(1, idx, {"x": v}, 64 << 20) is None, v


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


def test_tensors_round_trip_through_stowd_on_the_fast_paths(tmp_path):
    from stowd_harness import run_stowd

    with run_stowd(tmp_path, name="stowd-fast-torch") as s, stowage.Client(s["native"], timeout=30) as c:
        idx = torch.arange(100, 108)
        data = {"f": torch.randn(8, 5), "i": torch.arange(8 * 2, dtype=torch.int64).reshape(8, 2),
                "b": torch.ones(8, 1, dtype=torch.bfloat16)}  # (bfloat16: the general path, same put)
        assert c.put(idx, data) == 8
        got = c.get(idx, list(data), as_torch=True)
        for k, v in data.items():
            assert torch.equal(got[k], v), k
        out = {"f": torch.zeros(8, 5), "i": torch.zeros(8, 2, dtype=torch.int64)}
        assert c.get_into(idx.flip(0), out) is out
        assert torch.equal(out["f"], data["f"].flip(0)) and torch.equal(out["i"], data["i"].flip(0))
        np.testing.assert_array_equal(c.get(idx.numpy(), ["i"])["i"], data["i"].numpy())
        assert c.clear(idx) == 3 * 8
