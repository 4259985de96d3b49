"""A same-node reader that finds a segment named by the reply gone (its rows
overwritten or cleared, and held for less time than the reader took) asks
again, and gets the rows as they are then; after 3 more tries it gives up
with SegmentGone. Real stowd, real segments; the reader is slowed down by
removing the segment it is about to open, as stowd would after the hold."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest
from stowd_harness import shm_stowd

import stowage
from stowage import _shm


@pytest.fixture(scope="module")
def no_hold(tmp_path_factory):
    yield from shm_stowd(tmp_path_factory, "retry", "reply_hold_ms = 0\n")


def _vanish_first(monkeypatch, times: int) -> list:
    """The next `times` segment opens find the file gone."""
    real = _shm.Segments._open
    calls: list = []

    def flaky(self, name):
        calls.append(name)
        if len(calls) <= times:
            raise _shm.SegmentGone(name)
        return real(self, name)

    monkeypatch.setattr(_shm.Segments, "_open", flaky)
    return calls


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_gone_segment_is_asked_for_again(no_hold, fresh, monkeypatch, asynchronous):
    idx = fresh(8)
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    kw = {"same_node": True, "shm_dir": no_hold["shm_dir"], "timeout": 10}
    with stowage.Client(no_hold["native"], **kw) as c:
        c.put(idx, {"x": x})
    calls = _vanish_first(monkeypatch, 2)
    if asynchronous:
        async def main():
            async with stowage.AsyncClient(no_hold["native"], **kw) as c:
                return await c.get(idx, ["x"])
        got = asyncio.run(asyncio.wait_for(main(), 30))
    else:
        with stowage.Client(no_hold["native"], **kw) as c:
            got = c.get(idx, ["x"])
            np.testing.assert_array_equal(got["x"], x)
            assert len(calls) == 3
            del got  # no mapping of it is left to reuse
            gc.collect()
            out = np.empty_like(x)
            calls.clear()
            c.get_into(idx, {"x": out})  # get_into asks again too
            np.testing.assert_array_equal(out, x)
            assert len(calls) == 3
        return
    np.testing.assert_array_equal(got["x"], x)
    assert len(calls) == 3


def test_a_reader_gives_up_after_three_more_tries(no_hold, fresh, monkeypatch):
    idx = fresh(4)
    kw = {"same_node": True, "shm_dir": no_hold["shm_dir"], "timeout": 10}
    with stowage.Client(no_hold["native"], **kw) as c:
        c.put(idx, {"x": np.ones((4, 4), np.float32)})
        calls = _vanish_first(monkeypatch, 100)
        with pytest.raises(_shm.SegmentGone, match="cleared meanwhile"):
            c.get(idx, ["x"])
        assert len(calls) == 4
