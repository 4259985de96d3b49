"""Run Stowage on a Ray cluster: one `stowd` per node (optional; needs Ray).

    pip install './clients/python[ray]'

    import ray, stowage.ray
    ray.init()
    stowd = stowage.ray.launch()                  # one stowd per alive node
    with stowd.client() as c:                     # the stowd on this node, same-node shared memory
        c.put([0, 1], {"x": np.ones((2, 4), np.float32)})
    stowd.units                                   # every unit endpoint, in routing order (g % N)
    stowd.transferqueue_config()                  # TransferQueue's `backend` section
    stowd.shutdown()                              # or stowage.ray.shutdown(): every launch of this process

What `launch()` does, per node (Ray's alive nodes, or `nodes=`): it creates
a small actor pinned to the node (`NodeAffinitySchedulingStrategy`, hard;
`num_cpus=0`, so it takes no CPU slot), with `max_restarts`. The actor
finds the `stowd` binary on its node, reserves ports, writes a config file
and runs `stowd serve --config ... --endpoints-file ...` as its child
process, and waits for the endpoints file. A monitor thread waits on the
child: if `stowd` dies, the actor records how and exits its own process, so
Ray restarts the actor, which starts a new `stowd` on the same ports with
the same config (clients reconnect by themselves; ZeroMQ redials). The
child gets SIGTERM if the actor process dies first (PR_SET_PDEATHSIG).

Routing (`routing=`):
- "cluster" (default): every node's stowd routes over ALL units of all
  nodes, in one order (`[router] units`: its own as `local:<i>`, the
  others' as `tcp://`), so any node's native and router endpoints see the
  same rows: global index g lives on unit `units[g % N]`.
- "node": each stowd routes over its own units only (stowd's default); a
  client sees the rows put through the same node's stowd. The full unit list
  (`units`) still lets TransferQueue route across nodes itself.

A restarted stowd starts empty. Rows stored on its units before are lost,
and `StowageCluster.client()` says so: a get that finds no rows where a
restarted node holds them raises `DataLost` (a `KeyNotFound`) naming the
node, the generation and how the old stowd ended, instead of a bare
"key not found". `refresh()` acknowledges restarts.

Where the binary comes from, first found wins (resolved on each node):
1. `launch(stowd_bin=PATH)`;
2. `$STOWD_BIN` on that node;
3. the binary inside this package, `stowage/_bin/stowd` (the wheel built by
   `cargo xtask wheel` ships it, and its plugins in `stowage/plugins`).
Policy plugins: `launch(plugin_dir=...)`, else `$STOWD_PLUGIN_DIR`, else the
`plugins` folder next to the binary's folder (`stowage/plugins` for the
packaged binary, `target/plugins` for `target/*/stowd`); none found: the
built-in policy alone (a warning in the actor's log). The compile cache goes
to `<workdir>/plugin-cache` (inside the node's own directory with the
temporary-directory default), so a read-only site-packages is fine.

Where each node keeps its files (config, endpoints file, state, log, compile
cache): a directory only this user can write, since whoever can write there
can point stowd at other files or forge its endpoints. `launch(workdir=W)`
uses `W/<launch id>/<node id>/` (W is created 0700 if missing, and refused
with `InsecureDirectory` if another user owns it or can write it or a
directory above it); by default `$XDG_RUNTIME_DIR/stowage-ray/` when that is
set and usable, else a fresh 0700 `tempfile.mkdtemp()` directory per node
and launch (see `stowage._workdir`). stowd itself checks the compile cache
directory again and trusts only entries it tagged (README, "Plugins").
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "stowage.ray needs Ray: pip install 'stowage[ray]' (or pip install ray); "
        f"import failed: {_e}"
    ) from _e

from ._workdir import InsecureDirectory, node_dirs
from .client import DEFAULT_TIMEOUT, Client
from .errors import InternalError, KeyNotFound, StowageError, StowageTimeout

PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGED_STOWD = PACKAGE_DIR / "_bin" / "stowd"
"""Where the wheel built by `cargo xtask wheel` puts the binary."""
PACKAGED_PLUGINS = PACKAGE_DIR / "plugins"
"""... and its policy plugins (`<binary dir>/../plugins`: where stowd looks by default)."""

DEFAULT_MAX_RESTARTS = 10
DEFAULT_START_TIMEOUT = 120.0  # a first start compiles the plugins (seconds with a debug build)

# Config keys launch() sets itself: (section, key) -> the launch() argument to use instead.
_RESERVED = {
    ("server", "host"): "host",
    ("server", "native_port"): "(ports are chosen per node)",
    ("units", "local"): "units_per_node",
    ("units", "port_base"): "(ports are chosen per node)",
    ("units", "capacity_bytes"): "capacity_bytes",
    ("router", "enabled"): "(the router is always on)",
    ("router", "port"): "(ports are chosen per node)",
    ("router", "units"): "routing",
    ("shm", "enabled"): "shm",
    ("shm", "dir"): "shm_dir",
    ("plugins", "dir"): "plugin_dir",
}


class StowdNotFound(FileNotFoundError):
    """No `stowd` binary where `launch()` looked (the message lists where)."""


class StowdStartError(RuntimeError):
    """`stowd` exited or did not write its endpoints file in time (the message has its log tail)."""


class DataLost(KeyNotFound):
    """A get failed (rows not found, or a timeout on the way to them) and
    the node holding them restarted its stowd since the handle was made or
    last refreshed: those rows are lost. `nodes` lists the restarted nodes'
    ids; the message starts with the original error."""

    nodes: tuple[str, ...] = ()


# ---------------------------------------------------------------- on each node


def find_stowd(stowd_bin: str | os.PathLike | None = None) -> Path:
    """The binary this process would run: `stowd_bin`, else `$STOWD_BIN`,
    else the packaged `stowage/_bin/stowd`. Raises `StowdNotFound` saying
    where it looked and how to get one."""
    looked = []
    if stowd_bin is not None:
        candidates = [("stowd_bin argument", Path(stowd_bin))]
    else:
        candidates = []
        if os.environ.get("STOWD_BIN"):
            candidates.append(("$STOWD_BIN", Path(os.environ["STOWD_BIN"])))
        candidates.append(("packaged binary", PACKAGED_STOWD))
    for what, path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path.resolve()
        state = "not executable" if path.is_file() else "missing"
        looked.append(f"{what} {path} ({state})")
    raise StowdNotFound(
        f"no stowd binary on host {socket.gethostname()}: looked at " + "; ".join(looked) + ". "
        "Build a wheel that ships it (`cargo xtask wheel`, then pip install target/wheels/stowage-*.whl "
        "on every node), or build it (`cargo build --release -p stowage-host --bin stowd`, plugins with "
        "`cargo xtask plugins`) and pass launch(stowd_bin='/path/to/stowd') or set $STOWD_BIN; "
        "the path must exist on every node."
    )


def find_plugin_dir(binary: Path, plugin_dir: str | os.PathLike | None = None) -> Path | None:
    """`plugin_dir`, else `$STOWD_PLUGIN_DIR`, else `<binary dir>/../plugins`
    if it exists (what stowd itself does), else None (built-in policy only)."""
    if plugin_dir is not None:
        p = Path(plugin_dir)
        if not p.is_dir():
            raise FileNotFoundError(f"plugin_dir {p} is not a directory on host {socket.gethostname()}")
        return p.resolve()
    if os.environ.get("STOWD_PLUGIN_DIR"):
        return Path(os.environ["STOWD_PLUGIN_DIR"]).resolve()
    bundled = binary.parent.parent / "plugins"
    return bundled.resolve() if bundled.is_dir() else None


def _bind(host: str, port: int) -> socket.socket | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def _reserve_ports(host: str, units: int) -> tuple[dict, list[socket.socket]]:
    """Free ports on `host`: native, router and `units` consecutive ones
    (stowd binds unit i to port_base + i). The sockets stay bound until the
    caller closes them, just before stowd starts."""
    for _ in range(200):
        first = _bind(host, 0)
        if first is None:
            raise OSError(f"cannot bind a socket on {host!r} (is it an address of this node?)")
        base = first.getsockname()[1]
        held = [first]
        for i in range(1, units):
            s = _bind(host, base + i) if base + i < 65536 else None
            if s is None:
                break
            held.append(s)
        if len(held) == units:
            native, router = _bind(host, 0), _bind(host, 0)
            held += [native, router]
            ports = {"native": native.getsockname()[1], "router": router.getsockname()[1], "unit_base": base}
            return ports, held
        for s in held:
            s.close()
    raise OSError(f"no {units} consecutive free ports on {host}")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (str, os.PathLike)):
        return json.dumps(os.fspath(v))  # JSON string escapes are valid TOML basic strings
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} to a stowd config")


def _toml(table: Mapping[str, Any], prefix: str = "") -> str:
    """A small TOML writer: scalars, lists of scalars, tables, arrays of tables."""
    lines, subs, arrays = [], [], []
    for k, v in table.items():
        key = k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)
        if isinstance(v, Mapping):
            subs.append((key, v))
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, Mapping) for x in v):
            arrays.append((key, v))
        else:
            lines.append(f"{key} = {_toml_value(v)}")
    out = "\n".join(lines) + ("\n" if lines else "")
    for key, v in subs:
        name = f"{prefix}{key}"
        out += f"\n[{name}]\n" + _toml(v, name + ".")
    for key, items in arrays:
        for item in items:
            out += f"\n[[{prefix}{key}]]\n" + _toml(item, f"{prefix}{key}.")
    return out


def _merge(base: dict, extra: Mapping[str, Any]) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None


def _child_setup(parent_pid: int):
    def setup():
        # SIGTERM to stowd when the thread that started it (the actor's
        # monitor thread, which lives as long as the child) or its process dies.
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl
            os._exit(1)
    return setup


class StowdNode:
    """The per-node actor (as a plain class; `launch()` wraps it with
    `ray.remote`). Its state lives in a private directory (`<workdir>/<launch
    id>/<node id>/`, or see the module doc for the default):
    the config, the endpoints file, `state.json` (generation, history) and
    `stowd.log`. Ray re-runs `__init__` with the same arguments after a
    restart; finding `state.json` there, it starts stowd again at once."""

    def __init__(self, launch_id: str, node_id: str, ip: str, spec: Mapping[str, Any]):
        self.launch_id, self.node_id, self.ip = launch_id, node_id, ip
        self.spec = dict(spec)
        self.host = self.spec.get("host") or ip
        self.dir, self.cache_dir, self._launch_dir = node_dirs(self.spec.get("workdir"), launch_id, node_id)
        self.config_path = self.dir / "stowd.toml"
        self.endpoints_path = self.dir / "endpoints.json"
        self.state_path = self.dir / "state.json"
        self.log_path = self.dir / "stowd.log"
        self.proc: subprocess.Popen | None = None
        self.endpoints: dict | None = None
        self._held: list[socket.socket] = []
        self._ready = False
        self._stopping = False
        self._lock = threading.Lock()
        try:
            self.state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            self.state = None
        if self.state is not None:  # restarted by Ray: bring stowd back on the same ports
            self._restart()

    # ---- first start: two phases, so every node's config can list every node's units

    def prepare(self) -> dict:
        """Finds the binary and plugins on this node and reserves ports."""
        binary = find_stowd(self.spec.get("stowd_bin"))
        plugins = find_plugin_dir(binary, self.spec.get("plugin_dir"))
        if self.state is not None:
            raise RuntimeError(f"stowd on node {self.node_id} is already set up ({self.dir})")
        ports, self._held = _reserve_ports(self.host, int(self.spec["units_per_node"]))
        self.binary, self.plugin_dir, self.ports = binary, plugins, ports
        n = int(self.spec["units_per_node"])
        return {
            "node_id": self.node_id,
            "ip": self.ip,
            "host": self.host,
            "hostname": socket.gethostname(),
            "units": [f"tcp://{self._host_for_url()}:{ports['unit_base'] + i}" for i in range(n)],
        }

    def start(self, router_units: list[str] | None) -> dict:
        """Writes the config (router over `router_units`, None: own units
        only), starts stowd and waits for its endpoints file."""
        spec, ports = self.spec, self.ports
        cache = self.cache_dir
        config = {
            "server": {"host": self.host, "native_port": ports["native"]},
            "units": {
                "local": int(spec["units_per_node"]),
                "port_base": ports["unit_base"],
                "capacity_bytes": int(spec["capacity_bytes"]),
            },
            "router": {"enabled": True, "port": ports["router"], "units": list(router_units or [])},
            "plugins": {"cache_dir": str(cache)},
            "shm": {"enabled": bool(spec["shm"])},
        }
        if self.plugin_dir is not None:
            config["plugins"]["dir"] = str(self.plugin_dir)
        if spec.get("shm_dir"):
            config["shm"]["dir"] = str(spec["shm_dir"])
        config = _merge(config, spec.get("config") or {})
        self.config_path.write_text(
            f"# written by stowage.ray for launch {self.launch_id}, node {self.node_id}\n" + _toml(config)
        )
        self.state = {
            "generation": 0,
            "stowd_bin": str(self.binary),
            "plugin_dir": str(self.plugin_dir) if self.plugin_dir else None,
            "history": [],
        }
        return self._start()

    def _host_for_url(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    # ---- running stowd

    def _restart(self) -> None:
        state = self.state
        prev = state.get("stowd_pid")
        if state["history"] and state["history"][-1].get("ended") is None:
            # The monitor did not record an exit: the actor process itself died.
            state["history"][-1].update(ended=time.time(), exit="the actor process died (stowd got SIGTERM with it)")
        if prev and _pid_alive(prev) and str(self.config_path) in _cmdline(prev):
            os.kill(prev, signal.SIGKILL)  # the old stowd still holds the ports
            deadline = time.monotonic() + 10
            while _pid_alive(prev) and time.monotonic() < deadline:
                time.sleep(0.02)
        self.binary = Path(state["stowd_bin"])
        self.plugin_dir = Path(state["plugin_dir"]) if state.get("plugin_dir") else None
        state["generation"] += 1
        # The ports may take a moment to be free again: retry the start a few times.
        deadline = time.monotonic() + 15
        while True:
            try:
                self._start()
                return
            except StowdStartError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    def _start(self) -> dict:
        try:
            self.endpoints_path.unlink()
        except FileNotFoundError:
            pass
        log = open(self.log_path, "ab")
        log.write(f"\n--- stowage.ray: generation {self.state['generation']}, actor pid {os.getpid()}\n".encode())
        log.flush()
        cmd = [str(self.binary), "serve", "--config", str(self.config_path),
               "--endpoints-file", str(self.endpoints_path)]
        started = threading.Event()
        box: dict[str, Any] = {}

        def monitor():
            # This thread starts stowd and lives as long as it does: the
            # child's PR_SET_PDEATHSIG follows the thread that forked it.
            for s in self._held:
                s.close()
            self._held = []
            try:
                box["proc"] = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=self.dir,
                    preexec_fn=_child_setup(os.getpid()), close_fds=True,
                )
            except OSError as e:
                box["error"] = e
                started.set()
                return
            finally:
                log.close()
            started.set()
            code = box["proc"].wait()
            self._on_exit(box["proc"], code)

        threading.Thread(target=monitor, name="stowd-monitor", daemon=True).start()
        started.wait()
        if "error" in box:
            raise StowdStartError(f"cannot run {cmd[0]} on node {self.node_id}: {box['error']}")
        self.proc = proc = box["proc"]
        deadline = time.monotonic() + float(self.spec["start_timeout"])
        while True:
            code = proc.poll()
            if code is not None:
                raise StowdStartError(
                    f"stowd on node {self.node_id} {_describe_exit(code)} at start; "
                    f"config {self.config_path}; log tail:\n{self._log_tail()}"
                )
            try:
                ep = json.loads(self.endpoints_path.read_text())
                if ep.get("pid") == proc.pid:
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() >= deadline:
                proc.kill()
                raise StowdStartError(
                    f"stowd on node {self.node_id} wrote no endpoints file within "
                    f"{self.spec['start_timeout']:g} s; log tail:\n{self._log_tail()}"
                )
            time.sleep(0.02)
        with self._lock:
            self.endpoints = ep
            self.state["stowd_pid"] = proc.pid
            self.state["history"].append(
                {"generation": self.state["generation"], "pid": proc.pid, "actor_pid": os.getpid(),
                 "started": time.time(), "ended": None, "exit": None}
            )
            _write_json(self.state_path, self.state)
            self._ready = True
        if proc.poll() is not None:  # died between writing its endpoints and now: the monitor skipped it
            self._on_exit(proc, proc.returncode)
        return self.info()

    def _on_exit(self, proc: subprocess.Popen, code: int) -> None:
        with self._lock:
            if self._stopping or proc is not self.proc or not self._ready:
                return  # a stop, or a failed start (start() reports it)
            self.state["history"][-1].update(ended=time.time(), exit=_describe_exit(code))
            _write_json(self.state_path, self.state)
        print(
            f"stowage.ray: stowd (pid {proc.pid}) on node {self.node_id} {_describe_exit(code)}; "
            "exiting the actor so that Ray restarts it",
            file=sys.stderr, flush=True,
        )
        os._exit(1)

    def _log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # ---- queries

    def info(self) -> dict:
        with self._lock:
            return {
                "node_id": self.node_id,
                "ip": self.ip,
                "host": self.host,
                "hostname": socket.gethostname(),
                "actor_pid": os.getpid(),
                "generation": self.state["generation"] if self.state else None,
                "stowd_pid": self.proc.pid if self.proc else None,
                "stowd_bin": self.state.get("stowd_bin") if self.state else None,
                "plugin_dir": self.state.get("plugin_dir") if self.state else None,
                "endpoints": self.endpoints,
                "history": list(self.state["history"]) if self.state else [],
                "dir": str(self.dir),
                "log": str(self.log_path),
            }

    def log_tail(self, n: int = 50) -> str:
        return self._log_tail(n)

    def stop(self, timeout: float = 20.0) -> dict:
        """Stops stowd (SIGTERM, SIGKILL after `timeout`) and removes this
        node's state directory. The actor itself is then killed by the caller."""
        with self._lock:
            self._stopping = True
            proc = self.proc
        for s in self._held:
            s.close()
        out = {"node_id": self.node_id, "actor_pid": os.getpid(), "stowd_pid": proc.pid if proc else None}
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                out["exit"] = _describe_exit(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                out["exit"] = _describe_exit(proc.wait())
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._launch_dir is not None:
            try:
                self._launch_dir.rmdir()  # the launch's directory, once every node has gone
            except OSError:
                pass
        return out


_StowdActor = ray.remote(StowdNode)


# ---------------------------------------------------------------- the driver's handle


@dataclasses.dataclass
class NodeStowd:
    """One node's stowd, as its actor reported it."""

    node_id: str
    ip: str
    native: str
    router: str
    units: list[str]
    shm_dir: str | None
    generation: int
    stowd_pid: int
    actor_pid: int
    hostname: str
    stowd_bin: str
    plugin_dir: str | None
    plugins: list[str]
    history: list[dict]
    dir: str

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> "NodeStowd":
        ep = info["endpoints"] or {}
        return cls(
            node_id=info["node_id"], ip=info["ip"], native=ep.get("native"),
            router=(ep.get("router") or {}).get("endpoint"),
            units=[u["endpoint"] for u in ep.get("units") or []], shm_dir=ep.get("shm_dir"),
            generation=info["generation"], stowd_pid=info["stowd_pid"], actor_pid=info["actor_pid"],
            hostname=info["hostname"], stowd_bin=info["stowd_bin"], plugin_dir=info["plugin_dir"],
            plugins=list(ep.get("plugins") or []), history=list(info["history"]), dir=info["dir"],
        )

    def last_exit(self) -> str:
        """How the previous stowd of this node ended, if it did."""
        ended = [h for h in self.history if h.get("ended")]
        if not ended:
            return "no earlier stowd"
        h = ended[-1]
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(h["ended"]))
        return f"the previous stowd (pid {h['pid']}, generation {h['generation']}) {h['exit']} at {when}"


_LAUNCHED: dict[str, "StowageCluster"] = {}


class StowageCluster:
    """What `launch()` returns. Picklable: pass it to Ray tasks and actors.

    - `nodes`: `NodeStowd` per node (native, router and unit endpoints, shm dir, pids);
    - `units`: every unit endpoint, in routing order (g % N);
    - `local()`: this process's node's stowd; `client()`: a `Client` to it;
    - `transferqueue_config()`: TransferQueue's `backend` section;
    - `status()` / `refresh()` / `wait_ready()`; `shutdown()`.
    """

    def __init__(self, launch_id: str, routing: str, actors: dict, nodes: list[NodeStowd], units: list[str]):
        self.launch_id = launch_id
        self.routing = routing
        self._actors = actors  # node id -> actor handle
        self.nodes = nodes
        self.units = units
        self._generations = {n.node_id: n.generation for n in nodes}

    def __repr__(self) -> str:
        return f"<StowageCluster {self.launch_id}: {len(self.nodes)} node(s), {len(self.units)} units, {self.routing} routing>"

    def __reduce__(self):
        # Plain data plus actor handles; the generation snapshot travels along.
        return (_rebuild, (self.launch_id, self.routing, self._actors, self.nodes, self.units, self._generations))

    # ---- finding a sidecar

    def node(self, node_id: str) -> NodeStowd:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise LookupError(
            f"no stowd on node {node_id}: launch {self.launch_id} runs on "
            f"{[n.node_id for n in self.nodes]} (a node that joined after launch() has none)"
        )

    def local(self) -> NodeStowd:
        """The stowd on this process's Ray node."""
        return self.node(ray.get_runtime_context().get_node_id())

    def client(self, *, same_node: bool | None = None, node_id: str | None = None,
               timeout: float = DEFAULT_TIMEOUT, **kwargs) -> "NodeClient":
        """A `stowage.Client` to this node's stowd (or `node_id`'s). Same-node
        shared memory is on by default when the stowd serves it and runs on
        this host; `same_node=False` uses tcp only. Gets that miss rows held by
        a restarted node raise `DataLost`."""
        node = self.node(node_id) if node_id else self.local()
        if same_node is None:
            same_node = node.shm_dir is not None and node.hostname == socket.gethostname()
        if same_node and node.shm_dir is None:
            raise ValueError(f"stowd on node {node.node_id} serves no shared memory (launch(shm=False))")
        return NodeClient(self, node, same_node=same_node, timeout=timeout, **kwargs)

    def owners(self, global_indexes: Iterable[int], via: NodeStowd) -> list[str]:
        """The node ids holding these indexes when put through `via`'s stowd."""
        if self.routing == "node":
            return [via.node_id]
        by_unit = {u: n.node_id for n in self.nodes for u in n.units}
        n_units = len(self.units)
        return sorted({by_unit[self.units[int(g) % n_units]] for g in global_indexes})

    # ---- TransferQueue

    def transferqueue_config(self, mode: str = "units") -> dict:
        """TransferQueue 0.1.11's `backend` config section for these units
        (with `stowage.transferqueue` imported in every process that makes a
        TransferQueue client):

            tq.init({"backend": stowd.transferqueue_config()})

        mode "units" (default): TransferQueue's client routes g % N over
        every unit of every node itself (`units`, the same list everywhere).
        mode "router": each process sends everything to its own node's
        router endpoint (`routers`: node id -> endpoint), which routes over
        every unit; needs `routing="cluster"`.
        """
        if mode == "units":
            section = {"units": list(self.units)}
        elif mode == "router":
            if self.routing != "cluster":
                raise ValueError('mode="router" needs launch(routing="cluster"): with routing="node" each '
                                 "router reaches its own node's units only")
            section = {"routers": {n.node_id: n.router for n in self.nodes}}
        else:
            raise ValueError(f'mode must be "units" or "router", got {mode!r}')
        return {"storage_backend": "Stowage", "Stowage": section}

    # ---- state

    def status(self, timeout: float = 60.0) -> list[NodeStowd]:
        """Each node's stowd as its actor reports it now (waits for an actor
        that Ray is restarting)."""
        refs = [self._actors[n.node_id].info.remote() for n in self.nodes]
        return [NodeStowd.from_info(i) for i in ray.get(refs, timeout=timeout)]

    def restarted(self, timeout: float = 60.0) -> dict[str, NodeStowd]:
        """Nodes whose stowd restarted since this handle was made or refreshed."""
        return {s.node_id: s for s in self.status(timeout)
                if s.generation != self._generations.get(s.node_id)}

    def refresh(self, timeout: float = 60.0) -> "StowageCluster":
        """Re-reads every node (pids, generations) and acknowledges restarts:
        `DataLost` is then raised only for restarts after this call."""
        self.nodes = self.status(timeout)
        self._generations = {n.node_id: n.generation for n in self.nodes}
        return self

    def wait_ready(self, timeout: float = 60.0) -> list[NodeStowd]:
        """Waits until every node's stowd is serving (e.g. after a restart)."""
        return self.status(timeout)

    def log_tail(self, node_id: str, n: int = 50) -> str:
        return ray.get(self._actors[node_id].log_tail.remote(n), timeout=30)

    def _lost(self, err: StowageError, indexes, via: NodeStowd) -> StowageError:
        try:
            owners = set(self.owners(indexes, via))
            restarted = {k: v for k, v in self.restarted(timeout=30).items() if k in owners}
        except Exception as e:  # the check itself failed: say so, keep the original error
            err.message = f"{err.message} (could not check for stowd restarts: {type(e).__name__}: {e})"
            err.args = (err.message,)
            return err
        if not restarted:
            return err
        parts = [
            f"node {s.node_id} ({s.ip}): generation {self._generations.get(s.node_id)} -> {s.generation}, "
            f"{s.last_exit()}"
            for s in restarted.values()
        ]
        lost = DataLost(
            f"{err.message}; the stowd holding these rows restarted since this handle was made: "
            + "; ".join(parts)
            + ". Rows stored there before the restart are lost (put them again; "
            "handle.refresh() acknowledges the restart)",
            code=KeyNotFound.code, request_id=err.request_id,
        )
        lost.nodes = tuple(restarted)
        return lost

    # ---- stopping

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops every stowd (SIGTERM), kills the actors (no restart) and
        waits for the actor processes on this host to exit. Idempotent."""
        actors, self._actors = self._actors, {}
        if not actors:
            return
        refs = {nid: a.stop.remote() for nid, a in actors.items()}
        stopped = []
        for nid, ref in refs.items():
            try:
                stopped.append(ray.get(ref, timeout=timeout))
            except Exception:  # a dead or hung actor: killed below all the same
                pass
        for a in actors.values():
            ray.kill(a, no_restart=True)
        # Ray kills actor processes asynchronously; wait for ours on this host.
        local_pids = [n.actor_pid for n in self.nodes if n.hostname == socket.gethostname()]
        local_pids += [s["actor_pid"] for s in stopped]
        deadline = time.monotonic() + timeout
        for pid in set(local_pids):
            while _pid_alive(pid) and "StowdNode" in _cmdline(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        _LAUNCHED.pop(self.launch_id, None)

    def __enter__(self) -> "StowageCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _rebuild(launch_id, routing, actors, nodes, units, generations):
    h = StowageCluster(launch_id, routing, actors, nodes, units)
    h._generations = dict(generations)
    return h


class NodeClient(Client):
    """A `stowage.Client` to one node's stowd, from `StowageCluster.client()`:
    a get (or get_into) that raises `KeyNotFound` is checked against stowd
    restarts and raises `DataLost` when the rows' node restarted."""

    def __init__(self, cluster: StowageCluster, node: NodeStowd, *, same_node: bool, **kwargs):
        super().__init__(node.native, same_node=same_node, shm_dir=node.shm_dir, **kwargs)
        self.cluster, self.node = cluster, node

    def get(self, global_indexes, fields, **kwargs) -> dict:
        try:
            return super().get(global_indexes, fields, **kwargs)
        except _CHECKED as e:
            lost = self.cluster._lost(e, list(global_indexes), self.node)
            if lost is e:
                raise
            raise lost from e

    def get_into(self, global_indexes, out, **kwargs):
        try:
            return super().get_into(global_indexes, out, **kwargs)
        except _CHECKED as e:
            lost = self.cluster._lost(e, list(global_indexes), self.node)
            if lost is e:
                raise
            raise lost from e


# Errors of a get checked against restarts: not found; and what a get
# through a router meets on its first request to a unit that restarted
# (stowd's connection to the old process times out: `internal`), or a
# client whose own stowd is down (`StowageTimeout`).
_CHECKED = (KeyNotFound, InternalError, StowageTimeout)


# ---------------------------------------------------------------- launch / shutdown


def _alive_nodes() -> list[tuple[str, str]]:
    return sorted((n["NodeID"], n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive"))


def launch(
    *,
    stowd_bin: str | os.PathLike | None = None,
    plugin_dir: str | os.PathLike | None = None,
    units_per_node: int = 2,
    capacity_bytes: int = 0,
    routing: str = "cluster",
    host: str | None = None,
    shm: bool = True,
    shm_dir: str | None = None,
    config: Mapping[str, Any] | None = None,
    nodes: Iterable[str] | None = None,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    workdir: str | os.PathLike | None = None,
    timeout: float = DEFAULT_START_TIMEOUT,
) -> StowageCluster:
    """Starts one stowd per Ray node and returns a `StowageCluster` once
    every one has written its endpoints file (Ray must be initialized).

    - `stowd_bin`: path of the binary on every node (default: `$STOWD_BIN`,
      else the binary packaged in the wheel); `plugin_dir` likewise.
    - `units_per_node`, `capacity_bytes`: `[units] local` and `capacity_bytes`.
    - `routing`: "cluster" (every stowd routes over every node's units) or
      "node" (each over its own).
    - `host`: address to bind (default: each node's Ray address).
    - `shm`, `shm_dir`: same-node shared memory (`[shm]`).
    - `config`: further stowd config sections, e.g. `{"limits": {...},
      "chain": [...]}` (not the keys above).
    - `nodes`: node ids (default: every alive node).
    - `max_restarts`: how often Ray restarts a node's actor (-1: always).
    - `workdir`: where each node keeps configs, endpoints files, logs and
      the compile cache; it must be private to this user (created 0700 if
      missing; `InsecureDirectory` if another user owns or can write it or a
      directory above it). Default: `$XDG_RUNTIME_DIR/stowage-ray` when
      usable, else a fresh 0700 temporary directory per node and launch.
    - `timeout`: seconds to wait for each start.
    """
    if not ray.is_initialized():
        raise RuntimeError("stowage.ray.launch() needs Ray: call ray.init() first")
    if routing not in ("cluster", "node"):
        raise ValueError(f'routing must be "cluster" or "node", got {routing!r}')
    if not isinstance(units_per_node, int) or units_per_node < 1:
        raise ValueError(f"units_per_node must be a positive int, got {units_per_node!r}")
    for (section, key), arg in _RESERVED.items():
        if isinstance((config or {}).get(section), Mapping) and key in config[section]:
            raise ValueError(f"config[{section!r}][{key!r}] is set by launch(): use {arg}")
    alive = dict(_alive_nodes())
    if nodes is None:
        node_ids = sorted(alive)
    else:
        node_ids = list(dict.fromkeys(nodes))
        missing = [n for n in node_ids if n not in alive]
        if missing:
            raise ValueError(f"not alive Ray nodes: {missing} (alive: {sorted(alive)})")
    if not node_ids:
        raise RuntimeError("no alive Ray nodes")
    launch_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
    spec = {
        "stowd_bin": os.fspath(stowd_bin) if stowd_bin is not None else None,
        "plugin_dir": os.fspath(plugin_dir) if plugin_dir is not None else None,
        "units_per_node": units_per_node,
        "capacity_bytes": int(capacity_bytes),
        "host": host,
        "shm": bool(shm),
        "shm_dir": shm_dir,
        "config": dict(config or {}),
        "workdir": os.fspath(workdir) if workdir is not None else None,
        "start_timeout": float(timeout),
    }
    actors = {}
    for nid in node_ids:
        actors[nid] = _StowdActor.options(
            name=f"stowd-{launch_id}-{nid[:12]}",
            num_cpus=0,
            max_restarts=max_restarts,
            max_task_retries=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nid, soft=False),
        ).remote(launch_id, nid, alive[nid], spec)
    handle = StowageCluster(launch_id, routing, actors, [], [])
    try:
        prepared = _gather(actors, {nid: a.prepare.remote() for nid, a in actors.items()}, timeout, "prepare")
        order = sorted(node_ids, key=lambda nid: (prepared[nid]["ip"], nid))
        units = [u for nid in order for u in prepared[nid]["units"]]
        starts = {}
        for nid, a in actors.items():
            router_units = None
            if routing == "cluster":
                own = prepared[nid]["units"]
                router_units = [f"local:{own.index(u)}" if u in own else u for u in units]
            starts[nid] = a.start.remote(router_units)
        infos = _gather(actors, starts, timeout, "start")
    except BaseException:
        handle.shutdown(timeout=10)
        raise
    handle.nodes = [NodeStowd.from_info(infos[nid]) for nid in order]
    handle.units = units
    handle._generations = {n.node_id: n.generation for n in handle.nodes}
    got = [u for n in handle.nodes for u in n.units]
    if got != units:  # stowd bound other ports than the ones reserved
        handle.shutdown(timeout=10)
        raise StowdStartError(f"stowd units {got} are not the reserved {units}")
    _LAUNCHED[launch_id] = handle
    return handle


def _gather(actors: dict, refs: dict, timeout: float, what: str) -> dict:
    ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    if pending:
        late = [nid for nid, r in refs.items() if r in pending]
        raise TimeoutError(f"stowage.ray: {what} did not finish within {timeout:g} s on node(s) {late}")
    return {nid: ray.get(r) for nid, r in refs.items()}


def shutdown(timeout: float = 30.0) -> None:
    """Stops every launch made from this process."""
    for h in list(_LAUNCHED.values()):
        h.shutdown(timeout)


__all__ = [
    "DataLost",
    "InsecureDirectory",
    "NodeClient",
    "NodeStowd",
    "PACKAGED_PLUGINS",
    "PACKAGED_STOWD",
    "StowageCluster",
    "StowdNode",
    "StowdNotFound",
    "StowdStartError",
    "find_plugin_dir",
    "find_stowd",
    "launch",
    "shutdown",
]
