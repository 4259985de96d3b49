"""get_into strided arrays through the Rust core: a view with strides
(rows apart in a bigger buffer, a column slice, every other element, a
transposed or reversed array, Fortran order, a strided CPU torch tensor
when torch is importable) is filled by the core, byte for byte as the
pure-Python path fills it, and nothing outside the view is written. Runs
of at least `VECTORED_RUN` bytes are read straight into place, shorter ones
through a scratch buffer: both are covered, with rows spread over
several units' frames and indexes asked twice. Mismatches and read-only
targets are refused as clearly as for contiguous arrays, before anything is
written."""

from __future__ import annotations

import types

import numpy as np
import pytest

import stowage
from stowage import _core

from core_spy import CoreSpy


class _Calls(CoreSpy):
    """A CoreSpy that also counts the core's get_into calls (and what they returned)."""

    def __init__(self, inner):
        super().__init__(inner, lambda *a: None)
        self.calls = []

    def get_into_fast(self, *args, **kw):
        got = self._inner.get_into_fast(*args, **kw)
        self.calls.append(("get_into_fast", got is not False))
        return got

    def get_into(self, *args, **kw):
        self.calls.append(("get_into", True))
        return self._inner.get_into(*args, **kw)


def _views(n: int, cols: int, dtype):
    """(name, the view, its base filled with a sentinel) for n rows of `cols` items."""
    s = np.array(-7).astype(dtype)
    yield "rows apart (long runs)", (b := np.full((n, 3, cols), s, dtype))[:, 1], b
    yield "column slice", (b := np.full((n, cols + 9), s, dtype))[:, 4:4 + cols], b
    yield "every other element", (b := np.full((n, 2 * cols), s, dtype))[:, ::2], b
    yield "transposed", (b := np.full((cols, n), s, dtype)).T, b
    yield "Fortran order", (b := np.asfortranarray(np.full((n, cols), s, dtype))), b
    yield "reversed rows and items", (b := np.full((n, cols), s, dtype))[::-1, ::-1], b
    yield "every third row", (b := np.full((3 * n, cols), s, dtype))[::3], b


@pytest.mark.parametrize("dtype,cols", [(np.float32, 2048), (np.int16, 12), (np.float64, 700),
                                        (np.complex128, 4), (np.uint8, 5000)])
def test_strided_targets_are_filled_by_the_core(endpoint, fresh, monkeypatch, dtype, cols):
    n = 40
    idx = fresh(n)
    rng = np.random.default_rng(cols)
    x = (rng.standard_normal((n, cols)) * 1000).astype(dtype)
    order = idx[::-1] + idx[3:6]  # reversed, three asked twice
    rows = [idx.index(g) for g in order]
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(idx, {"x": x})
        c._core = _Calls(_core.Connection(endpoint, c.spin_us, c._token, c._curve))
        for name, view, base in _views(len(order), cols, dtype):
            outside = base.copy()
            assert not view.flags.c_contiguous, name
            c._core.calls.clear()
            c.get_into(order, {"x": view})
            assert c._core.calls and c._core.calls[0] == ("get_into_fast", True), (name, c._core.calls)
            np.testing.assert_array_equal(view, x[rows], err_msg=name)
            # Nothing outside the view was written.
            view[...] = np.array(-7).astype(dtype)
            np.testing.assert_array_equal(base, outside, err_msg=name)
            # The general path (the fast one reads a dict only) too.
            c._core.calls.clear()
            c.get_into(order, types.MappingProxyType({"x": view}))
            assert ("get_into", True) in c._core.calls, (name, c._core.calls)
            np.testing.assert_array_equal(view, x[rows], err_msg=name)
            # As a get returns them.
            np.testing.assert_array_equal(view, c.get(order, ["x"])["x"], err_msg=name)
        c.clear(idx)


def test_a_strided_target_with_several_fields_and_bits(endpoint, fresh):
    n = 16
    idx = fresh(n)
    a = np.arange(n * 64, dtype=np.float32).reshape(n, 64)
    b = np.arange(n * 3, dtype=np.uint16).reshape(n, 3)
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(idx, {"a": a, "b": stowage.BFloat16Bits(b)})
        big = np.zeros((n, 200), np.float32)
        bb = np.zeros((3, n), np.uint16)  # raw bits into ints of their size, transposed
        c.get_into(idx, {"a": big[:, 10:74], "b": bb.T})
        np.testing.assert_array_equal(big[:, 10:74], a)
        np.testing.assert_array_equal(bb.T, b)
        assert not big[:, :10].any() and not big[:, 74:].any()
        c.clear(idx)


def test_strided_mismatches_are_refused_before_anything_is_written(endpoint, fresh):
    n = 6
    idx = fresh(n)
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(idx, {"x": np.ones((n, 8), np.float32), "y": np.ones((n, 4), np.int32), "t": ["v"] * n})
        ok = np.full((n, 2, 4), 5, np.int32)
        base = np.zeros((n, 20), np.float32)
        with pytest.raises(ValueError, match=r"out\['x'\] has shape \[6, 10\], but field 'x' is \[6, 8\]"):
            c.get_into(idx, {"y": ok[:, 0], "x": base[:, ::2]})
        with pytest.raises(ValueError, match=r"out\['x'\] has dtype float64, but field 'x' is float32"):
            c.get_into(idx, {"y": ok[:, 0], "x": np.zeros((n, 16))[:, ::2]})
        with pytest.raises(TypeError, match="holds plain values"):
            c.get_into(idx, {"y": ok[:, 0], "t": np.zeros((n, 2))[:, ::2]})
        assert (ok == 5).all() and not base.any()
        ro = np.zeros((n, 16), np.float32)[:, ::2]
        ro.flags.writeable = False
        with pytest.raises(ValueError, match=r"out\['x'\] is read-only"):
            c.get_into(idx, {"x": ro})
        with pytest.raises(ValueError, match=r"has shape \[5, 8\], but 6 rows were requested"):
            c.get_into(idx, {"x": np.zeros((5, 16), np.float32)[:, ::2]})
        c.clear(idx)


def test_a_strided_torch_tensor_when_torch_is_importable(endpoint, fresh):
    """Without torch, the same through a numpy view of the same strides (the
    core sees only the buffer either way)."""
    n = 10
    idx = fresh(n)
    x = np.arange(n * 32, dtype=np.float32).reshape(n, 32)
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(idx, {"x": x})
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            t = torch.zeros(32, n * 2)
            c.get_into(idx, {"x": t.T[::2]})
            np.testing.assert_array_equal(t.T[::2].numpy(), x)
            assert not t.T[1::2].any()
        else:
            a = np.zeros((32, n * 2), np.float32)
            c.get_into(idx, {"x": a.T[::2]})
            np.testing.assert_array_equal(a.T[::2], x)
            assert not a.T[1::2].any()
        c.clear(idx)


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_long_runs_go_straight_into_place_with_no_buffer_of_the_payloads_size(endpoint, fresh):
    rows, cols = 4096, 4096  # 64 MiB of float32, 16 KiB rows, into every other row of a bigger array
    idx = fresh(rows)
    x = np.ones((rows, cols), np.float32)
    with stowage.Client(endpoint, timeout=120) as c:
        c.put(idx, {"x": x})
        wide = np.zeros((rows, 2, cols), np.float32)
        wide.fill(0)  # its pages faulted in now
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        base = _peak_rss()
        c.get_into(idx, {"x": wide[:, 1]})
        grew = _peak_rss() - base
        assert (wide[:, 1] == 1).all() and not wide[:, 0].any()
        assert grew < 16 << 20, f"a row-strided get_into grew by {grew >> 20} MiB for {x.nbytes >> 20} MiB"
        c.clear(idx)
