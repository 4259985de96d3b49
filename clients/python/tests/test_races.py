"""Gets racing overwrites and clears of the same rows, against a real stowd.

4 writers overwrite (and now and then clear) the same 8 global indexes while
4 readers get them, for STOWAGE_RACE_SECS seconds (default 20), once with
same-node readers and once with readers over tcp. Every row a reader gets
must be one complete value some writer put for that index (never a mix of
two puts, never another index's row), or the get fails with KeyNotFound
because a writer just cleared it. Any other error fails the test. A
same-node reader also checks, on its next get, that the arrays it got last
time still hold what they held: a mapping never changes under a reader.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import stowage
from stowd_harness import shm_stowd

SECS = float(os.environ.get("STOWAGE_RACE_SECS", "20"))
SLOTS = 8
ROW = 4096  # int64 elements per row: 32 KiB, several pages
WRITERS = 4
READERS = 4


@pytest.fixture(scope="module")
def race_server(tmp_path_factory):
    yield from shm_stowd(tmp_path_factory, "race")


def value(seq: int, writer: int, slot: int) -> int:
    return (seq << 16) | (writer << 8) | slot


def check_row(row: np.ndarray, slot: int) -> str | None:
    """None if `row` is one complete value written for `slot`."""
    first = int(row[0])
    if not (row == first).all():
        return f"slot {slot}: a torn row ({np.unique(row)[:4]}...)"
    if first & 0xFF != slot or (first >> 8) & 0xFF >= WRITERS:
        return f"slot {slot}: a row no writer put there ({first:#x})"
    return None


def run_race(server, base: int, same_node: bool) -> dict:
    idx = [base + s for s in range(SLOTS)]
    stop = threading.Event()
    errors: list[str] = []
    counts = {"puts": 0, "clears": 0, "gets": 0, "not_found": 0, "rows": 0}
    lock = threading.Lock()

    def fail(msg: str) -> None:
        with lock:
            errors.append(msg)
        stop.set()

    def writer(w: int) -> None:
        rng = np.random.default_rng(w)
        # Half the writers put through leased segments, half over tcp.
        opts = {"same_node": True} if w % 2 else {}
        seq = 0
        try:
            with stowage.Client(server["native"], **opts) as c:
                while not stop.is_set():
                    seq += 1
                    if w == 0 and seq % 16 == 0:
                        c.clear([int(i) for i in rng.choice(idx, size=3, replace=False)])
                        with lock:
                            counts["clears"] += 1
                        continue
                    pick = sorted(int(s) for s in rng.choice(SLOTS, size=int(rng.integers(1, SLOTS + 1)), replace=False))
                    rows = np.stack([np.full(ROW, value(seq, w, s), np.int64) for s in pick])
                    c.put([idx[s] for s in pick], {"x": rows})
                    with lock:
                        counts["puts"] += 1
        except Exception as e:  # noqa: BLE001 - any error is a finding
            fail(f"writer {w}: {type(e).__name__}: {e}")

    def reader(r: int) -> None:
        opts = {"same_node": True} if same_node else {}
        rng = np.random.default_rng(100 + r)
        kept: list[tuple[np.ndarray, list[int]]] = []
        try:
            with stowage.Client(server["native"], **opts) as c:
                while not stop.is_set():
                    pick = sorted(int(s) for s in rng.choice(SLOTS, size=int(rng.integers(1, SLOTS + 1)), replace=False))
                    try:
                        got = c.get([idx[s] for s in pick], ["x"])["x"]
                    except stowage.KeyNotFound:
                        with lock:
                            counts["not_found"] += 1
                        continue
                    for row, s in zip(got, pick):
                        bad = check_row(row, s)
                        if bad:
                            fail(f"reader {r}: {bad}")
                            return
                    # What this reader got before is unchanged.
                    for old, snapshot in kept:
                        if [int(v) for v in old[:, 0]] != snapshot or not (old == old[:, :1]).all():
                            fail(f"reader {r}: rows it held changed under it")
                            return
                    kept = [(got, [int(v) for v in got[:, 0]])] if same_node else []
                    with lock:
                        counts["gets"] += 1
                        counts["rows"] += len(pick)
        except Exception as e:  # noqa: BLE001
            fail(f"reader {r}: {type(e).__name__}: {e}")

    with stowage.Client(server["native"]) as c:  # every slot exists at the start
        c.put(idx, {"x": np.stack([np.full(ROW, value(0, 0, s), np.int64) for s in range(SLOTS)])})
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(READERS)]
    for t in threads:
        t.start()
    stop.wait(SECS)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors[:5]
    assert counts["gets"] > 0 and counts["puts"] > 0 and counts["clears"] > 0, counts
    return counts


def test_gets_racing_overwrites_and_clears_see_whole_rows(race_server):
    """The same-node race and the tcp race run at once, on different
    indexes, so the suite spends SECS seconds on both."""
    results: dict = {}

    def run(same_node: bool) -> None:
        try:
            results[same_node] = run_race(race_server, base=(1 << 40) + (0 if same_node else 1000), same_node=same_node)
        except AssertionError as e:
            results[same_node] = e

    threads = [threading.Thread(target=run, args=(mode,)) for mode in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for mode, label in ((True, "same-node"), (False, "tcp")):
        got = results.get(mode)
        assert not isinstance(got, AssertionError), f"{label}: {got}"
        assert got is not None, f"{label}: the race did not finish"
        print(f"\n{label} race, {SECS:g} s: {got}")
