"""Fixtures: real `stowd` processes (started with the repository's harness,
tests/python/stowd_harness.py), and bare ZeroMQ peers that misbehave.

The package under test is the working tree's (clients/python is put first on
sys.path), whether or not `stowage` is also pip-installed.
"""

from __future__ import annotations

import importlib
import itertools
import os
import shutil
import sys
import threading
import types
from pathlib import Path

import pytest
import zmq

HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = HERE.parent  # clients/python
REPO = PACKAGE_ROOT.parents[1]
sys.path.insert(0, str(PACKAGE_ROOT))
sys.path.insert(1, str(REPO / "tests" / "python"))

from stowd_harness import run_stowd, stowd_binary  # noqa: E402

CAPACITY = 4096  # bytes per unit of the `small` server
SMALL_MAX_ROWS = 1000  # [limits] max_rows of the `small` server
SMALL_MAX_REQUEST = 1 << 20  # [limits] max_request_bytes of the `small` server


def plugin_dir() -> Path:
    """$STOWAGE_PLUGIN_DIR, else <repo>/target/plugins (as the Rust tests find them)."""
    env = os.environ.get("STOWAGE_PLUGIN_DIR")
    return Path(env) if env else REPO / "target" / "plugins"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A stowd with the default configuration (2 units, coalesce packing)."""
    stowd_binary()
    with run_stowd(tmp_path_factory.mktemp("client-default"), name="stowd-client-default") as s:
        yield s


@pytest.fixture(scope="session")
def endpoint(server) -> str:
    return server["native"]


@pytest.fixture(scope="session")
def small_server(tmp_path_factory):
    """Units of 4096 bytes each; at most 1000 global indexes and 1 MiB per request."""
    config = (
        f"[units]\nlocal = 2\ncapacity_bytes = {CAPACITY}\n"
        f"[limits]\nmax_rows = {SMALL_MAX_ROWS}\nmax_request_bytes = {SMALL_MAX_REQUEST}\n"
    )
    with run_stowd(tmp_path_factory.mktemp("client-small"), config=config, name="stowd-client-small") as s:
        s.capacity, s.max_rows = CAPACITY, SMALL_MAX_ROWS
        yield s


@pytest.fixture(scope="session")
def reject_server(tmp_path_factory):
    """Fields named rej* go through the hostile `drop-row` plugin (an invalid
    plan, i.e. a fault) with the `reject` fail strategy; other fields use the
    built-in policy."""
    src = plugin_dir() / "hostile" / "drop-row.wasm"
    if not src.is_file():
        pytest.fail(f"{src} not found: build the test plugins with `cargo xtask plugins --hostile`", pytrace=False)
    work = tmp_path_factory.mktemp("client-reject")
    plugins = work / "plugins"
    plugins.mkdir()
    shutil.copy(src, plugins / src.name)
    config = (
        f'[plugins]\ndir = "{plugins}"\n'
        '[[chain]]\npattern = "rej*"\nselect = ["drop-row"]\nfail = "reject"\nmax_faults = 0\n'
    )
    with run_stowd(work, config=config, name="stowd-client-reject") as s:
        yield s


@pytest.fixture
def silent_endpoint():
    """A bare ROUTER that accepts connections and requests and never answers."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"tcp://127.0.0.1:{port}", sock
    finally:
        sock.close(linger=0)


class FakeServer:
    """A ROUTER in a thread that answers each request with `handler(identity,
    frames) -> list of replies` (each a list of frames, sent in order)."""

    def __init__(self, handler):
        self.handler = handler
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.requests: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if not self.sock.poll(50, zmq.POLLIN):
                continue
            ident, *frames = self.sock.recv_multipart()
            self.requests.append((ident, frames))
            for reply in self.handler(ident, frames):
                self.sock.send_multipart([ident, *reply])

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)


@pytest.fixture
def fake_server():
    servers = []

    def make(handler):
        s = FakeServer(handler)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


_blocks = itertools.count(1)


def _fresh(n: int) -> list[int]:
    assert 0 < n <= 10**6
    base = next(_blocks) * 10**6
    return list(range(base, base + n))


@pytest.fixture
def fresh():
    """fresh(n): n consecutive global indexes no other test uses (blocks of
    10**6 starting at a multiple of 10**6, so index parity = row parity)."""
    return _fresh


def _drop_stowage_ray() -> None:
    for name in [m for m in sys.modules if m == "stowage.ray" or m.startswith("stowage.ray.")]:
        del sys.modules[name]


@pytest.fixture
def sray(monkeypatch):
    """`stowage.ray`, imported over a stub `ray` when Ray is not installed
    (the package and its modules are imported afresh, and dropped after)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        fake = types.ModuleType("ray")
        fake.remote = lambda cls: cls
        fake.is_initialized = lambda: False
        util = types.ModuleType("ray.util")
        strategies = types.ModuleType("ray.util.scheduling_strategies")
        strategies.NodeAffinitySchedulingStrategy = object
        fake.util = util
        util.scheduling_strategies = strategies
        monkeypatch.setitem(sys.modules, "ray", fake)
        monkeypatch.setitem(sys.modules, "ray.util", util)
        monkeypatch.setitem(sys.modules, "ray.util.scheduling_strategies", strategies)
    _drop_stowage_ray()
    mod = importlib.import_module("stowage.ray")
    yield mod
    _drop_stowage_ray()


@pytest.fixture
def segment_puts(monkeypatch):
    """Same node, every put that holds a byte goes through a leased segment
    (`SAME_NODE_INLINE_BELOW = 0`, for `Client` and `AsyncClient` alike): for
    tests of the segment path whose rows are small. A client given its own
    bound (an instance attribute) keeps it."""
    from stowage.client import _Ops
    monkeypatch.setattr(_Ops, "SAME_NODE_INLINE_BELOW", 0)
