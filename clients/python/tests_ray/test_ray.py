"""Stowage on a real one-node Ray cluster (127.0.0.1): launch, put from one
Ray task and get from another, SIGKILL the stowd child and watch Ray bring it
back on the same endpoints, see the lost rows reported as lost, shut down
with nothing left running."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import ray

import stowage
import stowage.ray as sray
from conftest import describe, live_children, stowage_wheel, stowd_bin, wait_gone

N = 64
WHEEL_START_SECS = 300  # a debug stowd compiling its plugins on a busy machine

# Ray workers cannot import this test module: send its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((N, 16), dtype=np.float32),
        "resp": [np.arange(i % 7, dtype=np.int64) + seed for i in range(N)],
        "text": [f"row {i} of batch {seed}" for i in range(N)],
    }


@ray.remote
def put_task(handle, indexes, seed):
    with handle.client() as c:
        stored = c.put(indexes, batch(seed))
        return {"node": ray.get_runtime_context().get_node_id(), "same_node": c.same_node,
                "stored": stored, "units": c.stats()["units"]}


@ray.remote
def get_task(handle, indexes):
    """The rows, or the error a get raised (type names, message)."""
    try:
        with handle.client() as c:
            got = c.get(indexes, ["obs", "resp", "text"])
            return {"node": ray.get_runtime_context().get_node_id(), "same_node": c.same_node,
                    "obs": np.array(got["obs"]), "resp": [np.array(r) for r in got["resp"]], "text": got["text"]}
    except stowage.StowageError as e:
        return {"error": [t.__name__ for t in type(e).__mro__], "message": str(e),
                "nodes": list(getattr(e, "nodes", ())), "checkpoints": dict(getattr(e, "checkpoints", {}))}


def head(seed: int, k: int) -> dict:
    """The first `k` rows of `batch(seed)`."""
    return {f: v[:k] for f, v in batch(seed).items()}


def check_rows(got: dict, indexes, seed: int):
    want = batch(seed)
    pos = list(indexes)
    np.testing.assert_array_equal(got["obs"], want["obs"][pos])
    for a, i in zip(got["resp"], pos):
        np.testing.assert_array_equal(a, want["resp"][i])
    assert got["text"] == [want["text"][i] for i in pos]


def stowd_children(actor_pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(actor_pid).children() if p.name() == "stowd"]


def test_binary_not_found_says_where_it_looked(local_ray, tmp_path):
    missing = tmp_path / "no-such" / "stowd"
    with pytest.raises(sray.StowdNotFound) as e:
        sray.launch(stowd_bin=missing, workdir=tmp_path / "wd", timeout=60)
    msg = str(e.value)
    assert str(missing) in msg and "cargo xtask wheel" in msg and "stowd_bin" in msg, msg
    # launch() cleaned up its actor.
    assert wait_gone([p.pid for p in live_children() if "StowdNode" in " ".join(p.cmdline())]) == []


def test_reserved_config_keys_are_refused(local_ray):
    with pytest.raises(ValueError, match="units_per_node"):
        sray.launch(config={"units": {"local": 4}})
    with pytest.raises(ValueError, match=r"config\['router'\]\['units'\].*routing"):
        sray.launch(config={"router": {"units": ["local:0"]}})


def test_launch_put_get_kill_restart_shutdown(local_ray, tmp_path):
    workdir = tmp_path / "wd"
    node_id = ray.get_runtime_context().get_node_id()

    # ---- launch: one stowd per node, as the child of a pinned actor
    t0 = time.monotonic()
    h = sray.launch(stowd_bin=stowd_bin(), workdir=workdir, units_per_node=2, config={"limits": {"max_rows": 100000}})
    launch_s = time.monotonic() - t0
    print(f"\nlaunch: {launch_s:.2f} s")
    try:
        assert [n.node_id for n in h.nodes] == [node_id]
        node = h.local()
        assert node.ip == "127.0.0.1"
        for ep in [node.native, node.router, *node.units]:
            assert ep.startswith("tcp://127.0.0.1:"), ep
        assert h.units == node.units and len(h.units) == 2
        assert stowd_children(node.actor_pid) == [node.stowd_pid], "stowd is not the actor's child"
        assert node.generation == 0 and node.shm_dir == "/dev/shm"
        config = (Path(node.dir) / "stowd.toml").read_text()
        assert "max_rows = 100000" in config and "[router]" in config
        if (stowd_bin().parent.parent / "plugins").is_dir():
            assert "coalesce@0.1.0" in node.plugins, node.plugins
        assert h.transferqueue_config() == {"storage_backend": "Stowage",
                                            "Stowage": {"natives": {node_id: node.native}}}
        assert h.transferqueue_config("units") == {
            "storage_backend": "Stowage", "Stowage": {"protocol": "transferqueue", "units": h.units}}
        assert h.transferqueue_config("router") == {
            "storage_backend": "Stowage", "Stowage": {"protocol": "transferqueue", "routers": {node_id: node.router}}}

        # ---- put from one task, get from another (same node: shared memory)
        idx = list(range(N))
        put = ray.get(put_task.remote(h, idx, seed=1), timeout=120)
        assert put == {"node": node_id, "same_node": True, "stored": N, "units": 2}
        order = idx[::-3]
        got = ray.get(get_task.remote(h, order), timeout=120)
        assert "error" not in got, got
        assert got["node"] == node_id and got["same_node"]
        check_rows(got, order, seed=1)

        # A driver client made before the kill: it must work again after the restart.
        early = h.client(same_node=False)
        assert early.stats()["keys"] == N * 3

        # ---- SIGKILL the stowd child: the actor exits, Ray restarts it, stowd comes back
        old = node
        t0 = time.monotonic()
        os.kill(old.stowd_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            now = h.status(timeout=120)[0]
            if now.generation == 1:
                break
            assert time.monotonic() < deadline, "stowd did not come back"
            time.sleep(0.05)
        restart_s = time.monotonic() - t0
        print(f"restart after SIGKILL: {restart_s:.2f} s")
        assert now.stowd_pid != old.stowd_pid and psutil.pid_exists(now.stowd_pid)
        assert now.actor_pid != old.actor_pid, "the actor process was not restarted"
        assert wait_gone([old.actor_pid, old.stowd_pid]) == []
        assert stowd_children(now.actor_pid) == [now.stowd_pid]
        # Same endpoints: clients and other nodes' routers reconnect by themselves.
        assert (now.native, now.router, now.units) == (old.native, old.router, old.units)
        assert now.history[0]["exit"] == "killed by SIGKILL" and now.history[0]["pid"] == old.stowd_pid
        assert now.history[1]["pid"] == now.stowd_pid and now.history[1]["ended"] is None

        # ---- the rows put before the kill are reported lost, clearly
        got = ray.get(get_task.remote(h, [0, 5]), timeout=120)
        assert "DataLost" in got["error"] and "KeyNotFound" in got["error"], got
        msg = got["message"]
        assert got["nodes"] == [node_id]
        for part in [node_id, "generation 0 -> 1", f"pid {old.stowd_pid}", "killed by SIGKILL", "lost"]:
            assert part in msg, (part, msg)
        # ... also through the old driver client's connection (plain stowage.Client: KeyNotFound)
        with pytest.raises(stowage.KeyNotFound):
            early.get([0], ["obs"])
        assert early.stats()["keys"] == 0

        # ---- the restarted stowd serves: put and get again from tasks
        put = ray.get(put_task.remote(h, idx, seed=2), timeout=120)
        assert put["stored"] == N
        got = ray.get(get_task.remote(h, idx), timeout=120)
        assert "error" not in got, got
        check_rows(got, idx, seed=2)
        # Once acknowledged, a missing row is a plain KeyNotFound again.
        h.refresh()
        got = ray.get(get_task.remote(h, [N + 1]), timeout=120)
        assert "KeyNotFound" in got["error"] and "DataLost" not in got["error"], got
        early.close()
    finally:
        pids = [p for n in h.status(timeout=60) for p in (n.actor_pid, n.stowd_pid)]
        t0 = time.monotonic()
        h.shutdown()
        print(f"shutdown: {time.monotonic() - t0:.2f} s")

    # ---- nothing left: no stowd, no actor process, no state directory
    assert wait_gone(pids) == [], f"still running: {describe(pids)}"
    left = [p for p in live_children() if p.name() == "stowd" or "StowdNode" in " ".join(p.cmdline())]
    assert left == [], describe(left)
    assert not any(p.name() == "stowd" and str(workdir) in " ".join(p.cmdline()) for p in psutil.process_iter())
    assert not (workdir / h.launch_id).exists()
    h.shutdown()  # idempotent


def kill_and_wait_restart(h, old, generation: int):
    """SIGKILLs `old`'s stowd child and waits for Ray to bring the node back at `generation`."""
    os.kill(old.stowd_pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        now = h.status(timeout=120)[0]
        if now.generation == generation:
            break
        assert now.generation < generation, now
        assert time.monotonic() < deadline, "stowd did not come back"
        time.sleep(0.05)
    h.wait_ready()
    assert wait_gone([old.actor_pid, old.stowd_pid]) == []
    return now


def test_checkpoint_needs_node_routing():
    h = sray.StowageCluster("no-launch", "cluster", {}, [], [])
    with pytest.raises(ValueError, match=r'routing="node".*remote unit'):
        h.checkpoint()


def test_checkpoint_restored_after_restart(local_ray, tmp_path):
    """routing="node": checkpoint, change rows, SIGKILL stowd: the restarted
    stowd restores the checkpoint; untouched rows read back, rows written or
    cleared after it raise DataLost naming the node and the checkpoint; a
    second kill restores it again (the journal went on); a corrupted
    checkpoint is set aside and the node starts empty (old behaviour)."""
    workdir = tmp_path / "wd"
    node_id = ray.get_runtime_context().get_node_id()
    h = sray.launch(stowd_bin=stowd_bin(), workdir=workdir, units_per_node=2, routing="node")
    try:
        node = h.local()
        ckpt = node.checkpoint_dir
        assert ckpt == str(Path(node.dir) / "checkpoint") and node.restored is None
        idx = list(range(N))
        assert ray.get(put_task.remote(h, idx, seed=1), timeout=120)["stored"] == N

        # ---- checkpoint every node (one here)
        t0 = time.monotonic()
        res = h.checkpoint(timeout=120)
        print(f"\ncheckpoint: {time.monotonic() - t0:.2f} s: {res}")
        assert list(res) == [node_id]
        assert res[node_id]["dir"] == ckpt and res[node_id]["seq"] == 1 and res[node_id]["rows"] == N * 3, res  # (index, field) rows
        assert (Path(ckpt) / "manifest.json").is_file()
        assert (os.stat(ckpt).st_mode & 0o777) == 0o700

        # ---- after the checkpoint: overwrite 0..7, clear 8..11, put new N..N+7
        with h.client() as c:
            c.put(list(range(8)), head(2, 8))
            assert c.clear(list(range(8, 12))) > 0
            c.put(list(range(N, N + 8)), head(3, 8))

        # ---- SIGKILL stowd: Ray restarts the actor, stowd restores the checkpoint
        t0 = time.monotonic()
        now = kill_and_wait_restart(h, node, 1)
        print(f"restart with restore: {time.monotonic() - t0:.2f} s")
        assert now.restored == {"dir": ckpt, "seq": 1}, now.history
        assert now.history[1]["restored"] == {"dir": ckpt, "seq": 1} and now.history[1]["restore_error"] is None
        assert now.history[0]["exit"] == "killed by SIGKILL"

        # Checkpointed rows nobody touched afterwards: as they were.
        untouched = list(range(12, N))
        got = ray.get(get_task.remote(h, untouched), timeout=120)
        assert "error" not in got, got
        check_rows(got, untouched, seed=1)
        # Overwritten, cleared or new after the checkpoint: DataLost naming the node and the checkpoint.
        for touched in ([0], [7], [9], [N + 1], [20, 3]):
            got = ray.get(get_task.remote(h, touched), timeout=120)
            assert "error" in got and got["error"][0] == "DataLost", (touched, got)
            assert "KeyNotFound" in got["error"] and "DataLost" in got["error"][1:], got  # stowage.DataLost too
            assert got["nodes"] == [node_id] and got["checkpoints"] == {node_id: f"{ckpt}#1"}, got
            for part in [node_id, f"{ckpt}#1", "generation 0 -> 1", "killed by SIGKILL", "put them again"]:
                assert part in got["message"], (part, got["message"])
        # Never stored: a plain KeyNotFound, not a lost row.
        got = ray.get(get_task.remote(h, [10 * N]), timeout=120)
        assert got["error"][0] == "KeyNotFound", got

        # ---- puts after the restart are served
        assert ray.get(put_task.remote(h, list(range(N, 2 * N)), seed=4), timeout=120)["stored"] == N
        got = ray.get(get_task.remote(h, list(range(N, 2 * N))), timeout=120)
        assert "error" not in got, got
        want = batch(4)
        np.testing.assert_array_equal(got["obs"], want["obs"])
        assert got["text"] == want["text"]
        with h.client() as c:
            c.put([0], head(5, 1))
            np.testing.assert_array_equal(np.array(c.get([0], ["obs"])["obs"]), batch(5)["obs"][:1])
        # Acknowledged: stowd's own data_lost still comes as DataLost naming the checkpoint.
        h.refresh()
        got = ray.get(get_task.remote(h, [9]), timeout=120)
        assert got["error"][0] == "DataLost" and f"{ckpt}#1" in got["message"], got
        assert "acknowledged" in got["message"], got

        # ---- a second kill: the same checkpoint again; what was put since is lost too (the journal went on)
        now = kill_and_wait_restart(h, now, 2)
        assert now.restored == {"dir": ckpt, "seq": 1}, now.history
        got = ray.get(get_task.remote(h, untouched), timeout=120)
        assert "error" not in got, got
        check_rows(got, untouched, seed=1)
        for touched in ([0], [N], [2 * N - 1]):
            got = ray.get(get_task.remote(h, touched), timeout=120)
            assert got["error"][0] == "DataLost" and got["checkpoints"] == {node_id: f"{ckpt}#1"}, got
            assert "generation 1 -> 2" in got["message"], got

        # ---- a checkpoint stowd refuses (a flipped byte): set aside, stowd starts empty, old DataLost
        h.refresh()
        unit_file = sorted(Path(ckpt).glob("unit-1-*.safetensors"))[0]
        data = bytearray(unit_file.read_bytes())
        data[-1] ^= 0xFF
        # A new file renamed over it: the running stowd maps the old one (never change that in place).
        flipped = unit_file.with_name(unit_file.name + ".flipped")
        flipped.write_bytes(bytes(data))
        os.chmod(flipped, 0o600)
        os.replace(flipped, unit_file)
        now = kill_and_wait_restart(h, now, 3)
        assert now.restored is None, now.history
        err = now.history[-1]["restore_error"]
        assert err and "cannot restore the checkpoint" in err and "checkpoint.unrestorable-3" in err, err
        # Set aside; stowd makes its checkpoint root again (empty, 0700) at start.
        assert (Path(node.dir) / "checkpoint.unrestorable-3").is_dir()
        assert not any(Path(ckpt).iterdir()), sorted(Path(ckpt).iterdir())
        got = ray.get(get_task.remote(h, [20]), timeout=120)
        assert got["error"][0] == "DataLost" and got["checkpoints"] == {}, got
        for part in ["generation 2 -> 3", "cannot restore the checkpoint", "before the restart are lost"]:
            assert part in got["message"], (part, got["message"])
        # ... and a new checkpoint works again.
        assert ray.get(put_task.remote(h, idx, seed=6), timeout=120)["stored"] == N
        assert h.checkpoint(timeout=120)[node_id]["rows"] == N * 3
    finally:
        h.shutdown()
    assert not (workdir / h.launch_id).exists()


def test_the_wheels_stowd_runs_on_its_defaults_and_under_launch(local_ray, tmp_path):
    """The wheel of `cargo xtask wheel`, unpacked as pip would: its stowd finds
    the wheel's plugins by itself, and launch() runs it."""
    import json
    import subprocess
    import zipfile

    site = tmp_path / "site"
    with zipfile.ZipFile(stowage_wheel()) as z:
        z.extractall(site)
        for info in z.infolist():  # zipfile drops the mode bits: restore them as pip does
            mode = info.external_attr >> 16
            if mode & 0o111:
                os.chmod(site / info.filename, mode & 0o777)
    binary = site / "stowage" / "_bin" / "stowd"
    shipped = sorted(p.stem for p in (site / "stowage" / "plugins").glob("*.wasm"))
    assert "coalesce" in shipped and not (site / "stowage" / "plugins" / "hostile").exists()

    ep = tmp_path / "ep.json"
    proc = subprocess.Popen([binary, "serve", "--endpoints-file", ep], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    # A debug build (`cargo xtask wheel --debug`) compiles the plugins slowly:
    # 98 s for the 7 on a loaded 2-core machine; a release build < 1 s each.
    try:
        t0 = time.monotonic()
        deadline = t0 + WHEEL_START_SECS
        while not ep.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the wheel's stowd did not start"
            time.sleep(0.05)
        print(f"\nthe wheel's stowd serving: {time.monotonic() - t0:.1f} s")
        loaded = sorted(p.split("@")[0] for p in json.loads(ep.read_text())["plugins"])
        assert loaded == shipped
    finally:
        proc.terminate()
        assert proc.wait(20) == 0

    t0 = time.monotonic()
    h = sray.launch(stowd_bin=binary, workdir=tmp_path / "wd", timeout=WHEEL_START_SECS)
    print(f"launch() of the wheel's stowd: {time.monotonic() - t0:.1f} s")
    try:
        node = h.local()
        assert node.stowd_bin == str(binary.resolve())
        assert node.plugin_dir == str((site / "stowage" / "plugins").resolve())
        assert sorted(p.split("@")[0] for p in node.plugins) == shipped
        assert ray.get(put_task.remote(h, list(range(N)), seed=7), timeout=120)["stored"] == N
        check_rows(ray.get(get_task.remote(h, list(range(N))), timeout=120), list(range(N)), seed=7)
    finally:
        h.shutdown()


def test_runtime_env_pip_installs_the_wheel_with_its_stowd_command(local_ray):
    """The README's Ray path: `runtime_env={"pip": [wheel]}` installs the wheel
    into the job's environment on the node; there `stowd` is on PATH and is
    the binary stowage.ray runs."""

    def probe():
        import shutil
        import subprocess

        import stowage as st
        import stowage.ray as sr

        command = shutil.which("stowd")
        version = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60).stdout
        return st.__file__, command, version.strip(), str(sr.find_stowd())

    # (PYTHONPATH emptied: conftest points the workers at this tree's package.)
    env = {"pip": [str(stowage_wheel())], "env_vars": {"PYTHONPATH": ""}}
    where, command, version, binary = ray.get(ray.remote(probe).options(runtime_env=env).remote(), timeout=600)
    env_dir = Path(command).parent.parent
    assert Path(where).is_relative_to(env_dir) and "runtime_resources" in where, where
    assert version.startswith("stowd "), version
    assert binary == str((Path(where).parent / "_bin" / "stowd").resolve())
