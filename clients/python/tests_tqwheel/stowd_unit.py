"""stowd-backed stand-ins for TransferQueue 0.1.11's `SimpleStorageUnit`.

`StowdStorageUnit(config)` has the surface TransferQueue and its tests use of
`SimpleStorageUnit`: the constructor's `config` (the `backend.SimpleStorage`
section), `storage_unit_id`, `zmq_server_info` / `get_zmq_server_info()`
(role STORAGE, the unit's id, ip and `put_get_socket` port) and `shutdown()`;
`start_metrics()` answers as a unit without a metrics exporter would not be
asked (stowd serves its own /metrics). Behind it runs a real `stowd serve`
with one local unit (`[units] local = 1`) on 127.0.0.1, under a small
watcher process that stops it when the process that started it is gone, so
a Ray actor killed with `ray.kill` takes its stowd with it.

`StowdStorageUnitActor` is the class decorated as TransferQueue decorates
`SimpleStorageUnit` (`@ray.remote(num_cpus=1)`), so
`.options(...).remote(config=...)` and `__ray_metadata__.modified_class`
work as they do on the original.

`StowdServer(num_units)` starts one stowd with `num_units` local units, its
router and its native (stowage/1) endpoint, for the `--backend native` mode.

Where the binary is: `$STOWD_BIN`, else `<repo>/target/debug/stowd` (plugins:
stowd's default, `target/plugins`). Logs and endpoints files go under
`$TQWHEEL_WORKDIR` (run.py sets it), else a temporary directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0

# The watcher: starts stowd (argv[2:]), forwards SIGTERM to it, and stops it
# when its parent (argv[1], the process that called start_stowd) is gone.
_WATCH = r"""
import os, signal, subprocess, sys, time
parent = int(sys.argv[1])
child = subprocess.Popen(sys.argv[2:])
signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
while child.poll() is None:
    if os.getppid() != parent:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(20)
        except subprocess.TimeoutExpired:
            child.kill()
        break
    time.sleep(0.2)
sys.exit(child.wait())
"""


def stowd_binary() -> Path:
    env = os.environ.get("STOWD_BIN")
    path = Path(env) if env else REPO / "target" / "debug" / "stowd"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise RuntimeError(f"stowd binary not found at {path}: `cargo build -p stowage-host` or set STOWD_BIN")
    return path


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)


def _workdir() -> Path:
    base = os.environ.get("TQWHEEL_WORKDIR")
    root = Path(base) if base else Path(tempfile.gettempdir()) / "tqwheel"
    d = root / f"stowd-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def start_stowd(config: str, name: str = "stowd") -> tuple[subprocess.Popen, dict, Path]:
    """Starts `stowd serve` with `config`; returns (process, endpoints, endpoints file).
    TransferQueue's tests save checkpoints into their temporary directories:
    unless `config` has a `[checkpoint]` table, that is stowd's checkpoint root."""
    if "[checkpoint]" not in config:
        config += f"\n[checkpoint]\nroots = [{json.dumps(tempfile.gettempdir())}]\n"
    workdir = _workdir()
    (workdir / f"{name}.toml").write_text(config)
    endpoints_path = workdir / f"{name}.endpoints.json"
    log_path = workdir / f"{name}.log"
    args = [sys.executable, "-c", _WATCH, str(os.getpid()), str(stowd_binary()), "serve", "--endpoints-file", str(endpoints_path),
            "--config", str(workdir / f"{name}.toml")]
    env = dict(os.environ)
    env.setdefault("RUST_LOG", "warn")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if endpoints_path.is_file():
            try:
                return proc, json.loads(endpoints_path.read_text()), endpoints_path
            except (json.JSONDecodeError, OSError):
                pass
        if proc.poll() is not None:
            raise RuntimeError(f"stowd exited with status {proc.returncode}; log {log_path}:\n"
                               + log_path.read_text(errors="replace")[-4000:])
        time.sleep(0.02)
    _stop(proc)
    raise RuntimeError(f"stowd did not write {endpoints_path} within {START_TIMEOUT_S:.0f} s; log {log_path}")


def _split(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host.strip("[]"), int(port)


class StowdStorageUnit:
    """One stowd unit in place of one SimpleStorageUnit (see the module doc)."""

    def __init__(self, config: dict | None = None):
        from transfer_queue.utils.enum_utils import Role
        from transfer_queue.utils.zmq_utils import ZMQServerInfo

        self.config = dict(config or {})
        self._proc, endpoints, self.endpoints_path = start_stowd(
            "[units]\nlocal = 1\n[router]\nenabled = false\n", name="unit")
        unit = endpoints["units"][0]
        self.storage_unit_id = unit["id"]
        ip, port = _split(unit["endpoint"])
        self._node_ip = ip
        self.zmq_server_info = ZMQServerInfo(role=Role.STORAGE, id=str(self.storage_unit_id), ip=ip,
                                             ports={"put_get_socket": port})
        self._finalizer = weakref.finalize(self, _stop, self._proc)

    def get_zmq_server_info(self):
        return self.zmq_server_info

    def shutdown(self) -> None:
        if self._finalizer.alive:
            self._finalizer()

    def start_metrics(self, port: int = 0) -> str:
        # SimpleStorageUnit starts a Prometheus exporter here; stowd serves
        # its own /metrics ([metrics] in its config), so nothing to start.
        return ""


class StowdServer:
    """One stowd with `num_units` local units, its router and its native
    endpoint (the `--backend native` mode's storage)."""

    def __init__(self, num_units: int = 2):
        self._proc, self.endpoints, self.endpoints_path = start_stowd(
            f"[units]\nlocal = {max(1, int(num_units))}\n", name="server")
        self._finalizer = weakref.finalize(self, _stop, self._proc)

    def get_endpoints_file(self) -> str:
        return str(self.endpoints_path)

    def get_zmq_server_info(self):
        # TransferQueue's close() and metrics code ask storage handles for this.
        return None

    def shutdown(self) -> None:
        if self._finalizer.alive:
            self._finalizer()


def _ray_classes():
    import ray

    return ray.remote(num_cpus=1)(StowdStorageUnit), ray.remote(num_cpus=1)(StowdServer)


StowdStorageUnitActor, StowdServerActor = _ray_classes()
