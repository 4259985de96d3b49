"""`Client.stats()` against a real stowd: ints at the top, a dict per plugin
(ints, a version string, a capability list, a `disabled` bool) and a dict per
chain (lists of names, the fail strategy, missing entries)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import stowage

PLUGIN_INTS = ("calls", "entries", "memo_hits", "call_ns", "plans", "faults", "invalid_plans", "fallbacks", "rejections", "disables", "reenables")


def check_plugin_shape(name: str, p: dict) -> None:
    assert isinstance(p["version"], str), (name, p)
    assert isinstance(p["capabilities"], list) and all(c in ("select", "pack") for c in p["capabilities"]), (name, p)
    for key in PLUGIN_INTS:
        assert type(p[key]) is int and p[key] >= 0, (name, key, p)
    assert type(p["disabled"]) is bool, (name, p)
    assert ("reenable_in_ms" in p) <= p["disabled"], (name, p)


def test_stats_are_structured_after_calls(reject_server, fresh):
    idx = fresh(2)
    with stowage.Client(reject_server["native"], timeout=30) as c:
        before = c.stats()
        with pytest.raises(stowage.Rejected):
            c.put(idx, {"rej_x": np.ones((2, 2), np.float32)})
        c.put(idx, {"x": np.ones((2, 2), np.float32)})
        after = c.stats()
        c.clear(idx)

    for key, value in after.items():
        if key.startswith("plugin."):
            check_plugin_shape(key, value)
        elif not key.startswith("chain."):
            assert type(value) is int, (key, value)

    p0, p1 = before["plugin.drop-row"], after["plugin.drop-row"]
    assert p1["version"] == "0.1.0"
    assert p1["capabilities"] == ["select"]
    faults = p1["faults"] - p0["faults"]
    assert faults >= 1
    assert p1["calls"] - p0["calls"] == faults
    # drop-row (stowage:policy@0.2.0, not pure): entered at least once,
    # never answered from a memo.
    assert p1["entries"] > p0["entries"], (p0, p1)
    assert p1["memo_hits"] == p0["memo_hits"] == 0, (p0, p1)
    assert p1["call_ns"] > p0["call_ns"], "time in the plugin's calls was not counted"
    assert after["policy_ns"] > before["policy_ns"]
    assert p1["rejections"] - p0["rejections"] == faults
    assert p1["invalid_plans"] - p0["invalid_plans"] == faults
    assert p1["fallbacks"] == p0["fallbacks"] == 0
    assert p1["disabled"] is False  # max_faults = 0: never disabled

    assert after["chain.rej*"] == {
        "select": ["drop-row"],
        "pack": [],
        "fail": "reject",
        "max_faults": 0,
        "backoff_ms": 1000,
        "backoff_max_ms": 300000,
        "allow_missing": False,
        "missing_select": [],
        "missing_pack": [],
    }
    assert after["missing_chain_entries"] == 0


def test_async_stats_match(reject_server):
    async def main():
        async with stowage.AsyncClient(reject_server["native"], timeout=30) as c:
            return await c.stats()

    got = asyncio.run(main())
    assert got["chain.rej*"]["select"] == ["drop-row"]
    check_plugin_shape("plugin.drop-row", got["plugin.drop-row"])
