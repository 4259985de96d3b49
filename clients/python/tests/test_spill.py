"""Spilled rows for same-node clients (issue 16): with `[units] spill_dir`, a
same-node put past the units' memory bound spills the coldest extents (here
the leased segments of earlier puts) to disk; same-node and tcp gets of
spilled rows read the same bytes, and get_into fills the caller's arrays."""

from __future__ import annotations

import numpy as np

import stowage
from stowd_harness import shm_stowd

MIB = 1 << 20


def test_same_node_puts_spill_and_read_back(tmp_path_factory):
    spill = tmp_path_factory.mktemp("spill") / "dir"
    config = f"[units]\nlocal = 2\ncapacity_bytes = {4 * MIB}\nspill_dir = \"{spill}\"\n"
    for s in shm_stowd(tmp_path_factory, "spill", "\n" + config):
        rows = {k: np.random.default_rng(k).standard_normal((8, 32768)).astype(np.float32) for k in range(12)}
        with stowage.Client(s["native"], same_node=True, timeout=60) as c:
            for k, x in rows.items():  # 12 puts of 1 MiB: 1.5x the 8 MiB bound
                c.put(list(range(8 * k, 8 * k + 8)), {"x": x})
            st = c.stats()
            assert st["spill_disk_bytes"] >= 4 * MIB and st["spill_memory_bytes"] <= 8 * MIB, st
            for k, x in rows.items():
                got = c.get(list(range(8 * k, 8 * k + 8)), ["x"])["x"]
                np.testing.assert_array_equal(got, x)
                out = np.empty_like(x)
                c.get_into(list(range(8 * k, 8 * k + 8)), {"x": out})
                np.testing.assert_array_equal(out, x)
        with stowage.Client(s["native"], timeout=60) as c:
            for k, x in rows.items():
                np.testing.assert_array_equal(c.get(list(range(8 * k, 8 * k + 8)), ["x"])["x"], x)
