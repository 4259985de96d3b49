"""The default memory bound (issue 16): with no `[units] capacity_bytes`, the
units of one stowd together hold at most `memory_percent` (50) of the memory
it may use. Here that memory is set small (`memory_bytes`), so the bound is
4 MiB over 2 units: puts past it are refused with a capacity error, stowd
keeps serving, and every row stored before reads back."""

from __future__ import annotations

import numpy as np
import pytest

import stowage
from stowd_harness import run_stowd

MIB = 1 << 20


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    config = f"[units]\nlocal = 2\nmemory_bytes = {8 * MIB}\n"
    with run_stowd(tmp_path_factory.mktemp("bounded"), config=config, name="stowd-bounded") as s:
        yield s


def test_puts_past_the_default_bound_are_refused_and_earlier_rows_stay(bounded):
    stored = {}
    with stowage.Client(bounded["native"], timeout=30) as c:
        assert c.stats()["capacity"] == 4 * MIB  # 50% of 8 MiB, 2 MiB per unit
        refused = None
        for k in range(16):  # 512 KiB a put, 256 KiB to each unit
            idx = list(range(8 * k, 8 * k + 8))
            x = np.full((8, 16384), k, np.float32)
            try:
                c.put(idx, {"x": x})
            except stowage.CapacityError as e:
                refused = e
                break
            stored[k] = (idx, x)
        assert refused is not None, "nothing was refused past the bound"
        assert "memory_percent" in str(refused) and refused.code == "capacity"
        assert 6 <= len(stored) <= 8, f"{len(stored)} puts of 512 KiB fitted in 4 MiB"
        for k, (idx, x) in stored.items():
            np.testing.assert_array_equal(c.get(idx, ["x"])["x"], x)
        # Clearing makes room again.
        c.clear(stored[0][0])
        c.put(list(range(1000, 1008)), {"x": np.ones((8, 16384), np.float32)})
    assert bounded.alive()


def test_memory_percent_0_is_unlimited_and_over_100_is_refused(tmp_path):
    with run_stowd(tmp_path / "unbounded", config=f"[units]\nmemory_bytes = {MIB}\nmemory_percent = 0\n") as s:
        with stowage.Client(s["native"], timeout=30) as c:
            assert "capacity" not in c.stats()
            c.put(list(range(8)), {"x": np.ones((8, 65536), np.float32)})  # 2 MiB over a "1 MiB" machine
    with pytest.raises(BaseException, match="memory_percent is 150, it must be at most 100"):
        with run_stowd(tmp_path / "bad", config="[units]\nmemory_percent = 150\n"):
            pass
