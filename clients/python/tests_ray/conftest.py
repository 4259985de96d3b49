"""Opt-in: Stowage on a real local Ray cluster (see README.md here).

Ray is configured before it is imported: its node address stays on the
loopback interface (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`; otherwise Ray
replaces 127.0.0.1 by the machine's address), no auth token file, no usage
stats. Each module starts its own cluster and shuts it down.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = HERE.parent  # clients/python
REPO = PACKAGE_ROOT.parents[1]

ray = pytest.importorskip("ray", reason="ray not installed (opt-in suite: see clients/python/tests_ray/README.md)")
psutil = pytest.importorskip("psutil", reason="psutil not installed (pip install psutil)")

# The working tree's `stowage`, here and in Ray's workers (they inherit the
# environment of the raylet that ray.init() starts from this process).
sys.path.insert(0, str(PACKAGE_ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))

import stowage  # noqa: E402

assert Path(stowage.__file__).resolve().parent == PACKAGE_ROOT / "stowage", stowage.__file__

RAY_CPUS = 1
OBJECT_STORE_BYTES = 200 * 2**20


def target_dir() -> Path:
    """Cargo's target directory: $CARGO_TARGET_DIR (relative to the repository
    root, where the README runs cargo), else <repo>/target."""
    return REPO / os.environ.get("CARGO_TARGET_DIR", "target")


def stowd_bin() -> Path:
    """$STOWD_BIN, else <target>/debug/stowd."""
    path = Path(os.environ.get("STOWD_BIN") or target_dir() / "debug" / "stowd")
    if not path.is_file():
        pytest.fail(f"stowd not found at {path}: cargo build -p stowage-host --bin stowd (and cargo xtask plugins), "
                    "or set STOWD_BIN", pytrace=False)
    return path


def stowage_wheel() -> Path:
    """$STOWAGE_WHEEL, else the newest stowage-*-manylinux_*.whl in
    <target>/wheels (what `cargo xtask wheel` writes, stowd inside). A
    missing wheel fails the test: the README's steps build it."""
    explicit = os.environ.get("STOWAGE_WHEEL")
    wheels = [Path(explicit)] if explicit else sorted((target_dir() / "wheels").glob("stowage-*-manylinux_*.whl"),
                                                      key=lambda p: p.stat().st_mtime)
    if not wheels or not wheels[-1].is_file():
        where = explicit or target_dir() / "wheels"
        pytest.fail(f"no stowage wheel at {where}: run `cargo xtask wheel --debug` first "
                    "(see clients/python/tests_ray/README.md), or set STOWAGE_WHEEL", pytrace=False)
    return wheels[-1]


def live_children() -> list:
    """Descendants of this test process that are still running (zombies excluded)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def describe(procs) -> list[str]:
    out = []
    for p in procs:
        try:
            p = p if isinstance(p, psutil.Process) else psutil.Process(p)
            out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids, timeout: float = 15.0) -> list[int]:
    """Waits for these pids to exit; returns those still running."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


@pytest.fixture(scope="module")
def ray_temp_dir():
    """A fresh directory for all of the module's Ray files, as `RAY_TMPDIR`
    too. Ray 2.60 writes some files under its default directory,
    `$RAY_TMPDIR/ray` (`/tmp/ray` when unset), whatever `temp_dir` a node was
    given: `Cluster` writes `ray_current_cluster` there, which fails on a
    machine without `/tmp/ray`. With `RAY_TMPDIR` set, the default directory
    is `<this>/ray`, so pass that as the nodes' `temp_dir` (see `ray_dir`)."""
    # Short: Ray's unix socket paths must fit in 107 bytes.
    d = tempfile.mkdtemp(prefix="strt-", dir="/tmp")
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = d
    try:
        yield d
    finally:
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(d, ignore_errors=True)


def ray_dir(temp: str) -> str:
    """Ray's default directory under `ray_temp_dir`: the `temp_dir` to give every node."""
    return os.path.join(temp, "ray")


@pytest.fixture(scope="module")
def local_ray(ray_temp_dir):
    """A fresh one-node Ray cluster on 127.0.0.1 (never an existing one)."""
    assert not live_children(), f"processes left from before: {describe(live_children())}"
    t0 = time.monotonic()
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        num_cpus=RAY_CPUS,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        _temp_dir=ray_dir(ray_temp_dir),
        log_to_driver=True,
    )
    print(f"\nray.init: {time.monotonic() - t0:.1f} s")
    try:
        yield ray
    finally:
        ray.shutdown()
        left = wait_gone([p.pid for p in live_children()], timeout=20)
        assert not left, f"processes left after ray.shutdown(): {describe(left)}"
