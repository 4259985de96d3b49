"""Checkpoints from the Python client (issue 16): `Client.checkpoint(dir)`
and `Client.restore(dir)`, a stowd killed and started again with
`serve --restore DIR`, and `DataLost` for what changed after the checkpoint."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

import stowage
from stowd_harness import kill, run_stowd

CONFIG = "[units]\nlocal = 2\n"


def _batch():
    idx = list(range(10, 18))
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    ids = [np.arange(n, dtype=np.int64) for n in (3, 0, 5, 1, 2, 7, 4, 1)]
    tags = [f"tag-{i}" for i in idx]
    return idx, {"x": x, "ids": ids, "tag": tags}


def _check(got, want, rows):
    np.testing.assert_array_equal(got["x"], want["x"][rows])
    for g, k in zip(got["ids"], rows):
        np.testing.assert_array_equal(g, want["ids"][k])
    assert got["tag"] == [want["tag"][k] for k in rows]


def test_checkpoint_kill_restore_and_data_lost(tmp_path):
    ckpt = tmp_path / "ckpt"
    idx, data = _batch()
    with run_stowd(tmp_path / "a", config=CONFIG, name="stowd-ckpt-a") as s:
        with stowage.Client(s["native"], timeout=30) as c:
            c.put(idx, data)
            done = c.checkpoint(ckpt)
            assert done == {"dir": str(ckpt), "seq": 1, "rows": 24, "bytes": done["bytes"], "files": 2}
            assert done["bytes"] > 8 * 6 * 4
            assert oct(os.stat(ckpt).st_mode & 0o777) == "0o700"
            c.put([11], {"x": np.zeros((1, 6), np.float32), "ids": [np.zeros(1, np.int64)], "tag": ["new"]})
            c.clear([12])
        kill(s)
    with run_stowd(tmp_path / "b", config=CONFIG, name="stowd-ckpt-b", extra_args=["--restore", str(ckpt)]) as s:
        with stowage.Client(s["native"], timeout=30) as c:
            keep = [0, 3, 4, 5, 6, 7]
            _check(c.get([idx[k] for k in keep], ["x", "ids", "tag"]), data, keep)
            for g in (11, 12):
                with pytest.raises(stowage.DataLost) as e:
                    c.get([g], ["x"])
                assert isinstance(e.value, stowage.KeyNotFound) and e.value.code == "data_lost"
                assert f"{ckpt}#1" in str(e.value)
            with pytest.raises(stowage.KeyNotFound) as e:
                c.get([999], ["x"])
            assert not isinstance(e.value, stowage.DataLost)
            # Put again: served; restore again on the running stowd: the
            # rows of the checkpoint, 11 and 12 still lost.
            c.put([11], {"x": np.ones((1, 6), np.float32), "ids": [np.ones(2, np.int64)], "tag": ["again"]})
            assert c.get([11], ["tag"]) == {"tag": ["again"]}
            r = c.restore(ckpt)
            assert (r["seq"], r["rows"], r["lost"]) == (1, 18, 2)
            with pytest.raises(stowage.DataLost):
                c.get([11], ["tag"])


def test_async_client_and_bad_directories(tmp_path, monkeypatch):
    idx, data = _batch()
    with run_stowd(tmp_path / "s", config=CONFIG, name="stowd-ckpt-async") as s:
        async def go():
            async with stowage.AsyncClient(s["native"], timeout=30) as c:
                await c.put(idx, data)
                # A relative directory is this process's, made absolute.
                monkeypatch.chdir(tmp_path)
                done = await c.checkpoint("rel")
                assert done["dir"] == str(tmp_path / "rel") and done["files"] == 2
                await c.clear(idx)
                r = await c.restore(tmp_path / "rel")
                assert r["lost"] == len(idx) and r["rows"] == 0
                with pytest.raises(stowage.BadRequest, match="no such checkpoint directory"):
                    await c.restore(tmp_path / "missing")
                (tmp_path / "plain").write_text("x")
                with pytest.raises(stowage.BadRequest, match="not a directory"):
                    await c.checkpoint(tmp_path / "plain")
                with pytest.raises(TypeError):
                    await c.checkpoint(3)

        asyncio.run(go())


def test_a_snapshot_restores_what_changed_after_it(tmp_path):
    """`checkpoint(dir, journal=False)`: no journal; after an overwrite, a
    clear and a move of the directory, `restore` brings every row back as
    written (`lost` 0)."""
    snap, moved = tmp_path / "snap.tmp", tmp_path / "snap"
    idx, data = _batch()
    with run_stowd(tmp_path / "a", config=CONFIG, name="stowd-snapshot") as s:
        with stowage.Client(s["native"], timeout=30) as c:
            c.put(idx, data)
            done = c.checkpoint(snap, journal=False)
            assert done["rows"] == 24 and not [p for p in os.listdir(snap) if p.startswith("journal")]
            snap.rename(moved)
            c.put([11], {"x": np.zeros((1, 6), np.float32), "ids": [np.zeros(1, np.int64)], "tag": ["new"]})
            c.clear([12, 13])
            c.put([999], {"x": np.zeros((1, 6), np.float32)})
            got = c.restore(moved)
            assert got["lost"] == 0 and got["rows"] == 24
            _check(c.get(idx, ["x", "ids", "tag"]), data, list(range(8)))
            with pytest.raises(stowage.KeyNotFound) as e:
                c.get([999], ["x"])  # put after the snapshot: gone with the restore
            assert not isinstance(e.value, stowage.DataLost)
            with pytest.raises(TypeError, match="journal must be"):
                c.checkpoint(tmp_path / "x", journal="no")
