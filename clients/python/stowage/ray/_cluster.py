"""The driver's side: `launch()`, the `StowageCluster` handle it returns,
`NodeStowd` (one node's stowd as its actor reports it) and `shutdown()`."""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import socket
import time
import uuid
from typing import Any, Iterable, Mapping

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .. import errors
from ..client import DEFAULT_TIMEOUT, Client
from ..errors import KeyNotFound, StowageError
from ._actor import StowdNode
from ._client import DataLost, NodeClient
from ._config import check_reserved
from ._supervise import StowdStartError, _cmdline, _pid_alive

DEFAULT_MAX_RESTARTS = 10
DEFAULT_START_TIMEOUT = 120.0  # a first start compiles the plugins (seconds with a debug build)
DEFAULT_CHECKPOINT_TIMEOUT = 3600.0


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
    checkpoint_dir: str | None = None

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
            checkpoint_dir=info.get("checkpoint_dir"),
        )

    @property
    def restored(self) -> dict | None:
        """`{"dir", "seq"}` of the checkpoint this stowd restored when it
        started, or None (a first start, or no checkpoint to restore)."""
        current = [h for h in self.history if h.get("generation") == self.generation]
        return current[-1].get("restored") if current else None

    def restored_since(self, generation: int | None) -> bool:
        """True if every stowd of this node started after `generation`
        restored a checkpoint (so rows missing from it were never there, or
        stowd reports them `data_lost` itself); False if one started empty."""
        later = [h for h in self.history if generation is None or h.get("generation", 0) > generation]
        return bool(later) and all(h.get("restored") for h in later)

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
    - `checkpoint()`: each node's stowd writes a checkpoint that a restarted
      stowd restores (`routing="node"` only);
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

    def transferqueue_config(self, mode: str = "native") -> dict:
        """TransferQueue 0.1.11's `backend` config section for this launch
        (with `stowage.transferqueue` imported in every process that makes a
        TransferQueue client, e.g. through Ray's
        `worker_process_setup_hook="stowage.transferqueue.register"`):

            tq.init({"backend": stowd.transferqueue_config()})

        mode "native" (default): the native backend (protocol stowage).
        Each process talks to its own node's stowd's native endpoint
        (`natives`: node id -> endpoint; same-node shared memory where the
        stowd serves it), which routes g % N over every unit of every node,
        other nodes' through its peer units (`stowage://`); with more than
        one node that needs `routing="cluster"` (with "node" each stowd
        would see its own node's rows only).
        The TransferQueue-protocol modes (protocol transferqueue): "units":
        TransferQueue's client routes g % N over every unit of every node
        itself (`units`, the same list everywhere); "router": each process
        sends everything to its own node's router endpoint (`routers`: node
        id -> endpoint), which routes over every unit; needs
        `routing="cluster"`.
        """
        if mode == "native":
            if self.routing != "cluster" and len(self.nodes) > 1:
                raise ValueError('mode="native" on more than one node needs launch(routing="cluster"): with '
                                 'routing="node" each node\'s stowd holds and serves its own node\'s rows only')
            section = {"natives": {n.node_id: n.native for n in self.nodes}}
        elif mode == "units":
            section = {"protocol": "transferqueue", "units": list(self.units)}
        elif mode == "router":
            if self.routing != "cluster":
                raise ValueError('mode="router" needs launch(routing="cluster"): with routing="node" each '
                                 "router reaches its own node's units only")
            section = {"protocol": "transferqueue", "routers": {n.node_id: n.router for n in self.nodes}}
        else:
            raise ValueError(f'mode must be "native", "units" or "router", got {mode!r}')
        return {"storage_backend": "Stowage", "Stowage": section}

    # ---- checkpoints

    def checkpoint(self, timeout: float = DEFAULT_CHECKPOINT_TIMEOUT) -> dict[str, dict]:
        """Makes every node's stowd write a checkpoint of all its rows to
        its node's checkpoint directory (`NodeStowd.checkpoint_dir`,
        `<node dir>/checkpoint`: private to this user, removed by
        `shutdown()`), all nodes at once, and waits for them. Returns node id
        -> `{"dir", "seq", "rows", "bytes", "files"}` (`Client.checkpoint`).

        When Ray restarts a node's stowd, the new one restores that node's
        last checkpoint before serving: rows written or cleared after it
        raise `DataLost` (naming the node and the checkpoint), the others
        are served as they were at the checkpoint.

        Needs `launch(routing="node")`: with "cluster" routing each stowd
        routes over other nodes' units too, and stowd checkpoints and
        restores only units of its own (ValueError). A node that fails
        raises `CheckpointFailed` (after all have answered); its `results`
        holds the nodes that succeeded, `errors` the others' exceptions.
        """
        if self.routing != "node":
            raise ValueError(
                'checkpoint() needs launch(routing="node"): with routing="cluster" every stowd routes over '
                "the units of every node, and stowd checkpoints and restores only a stowd whose units are "
                "all its own (it refuses: remote unit)"
            )
        Client._check_timeout(timeout)
        results: dict[str, dict] = {}
        failed: dict[str, BaseException] = {}

        def one(node: NodeStowd) -> None:
            try:
                if not node.checkpoint_dir:
                    raise RuntimeError(f"node {node.node_id}'s actor reports no checkpoint directory")
                with Client(node.native, timeout=timeout) as c:
                    results[node.node_id] = c.checkpoint(node.checkpoint_dir, timeout=timeout)
            except BaseException as e:  # noqa: BLE001 - reported below, per node
                failed[node.node_id] = e

        threads = [threading.Thread(target=one, args=(n,), name=f"checkpoint-{n.node_id[:8]}", daemon=True)
                   for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise CheckpointFailed(
                "checkpoint failed on node(s) "
                + "; ".join(f"{nid}: {type(e).__name__}: {e}" for nid, e in failed.items())
                + (f" (written on {sorted(results)})" if results else ""),
                results=results, errors=failed,
            )
        return {n.node_id: results[n.node_id] for n in self.nodes}

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
        """The error a `NodeClient` get raises for `err`: `DataLost` when a
        node holding `indexes` lost rows to a stowd restart, else `err`.

        - A node that restarted since this handle's snapshot and started
          empty at least once: any of these errors may be lost rows
          (`DataLost`, naming the node, generations and how stowd ended).
        - A node whose every restart restored its checkpoint: stowd itself
          says which rows are lost (its `data_lost`, which becomes a
          `DataLost` naming the node and the checkpoint); a plain
          `KeyNotFound` stays one (those rows were not stored when the
          checkpoint was taken)."""
        try:
            owners = set(self.owners(indexes, via))
            now = {s.node_id: s for s in self.status(timeout=30) if s.node_id in owners}
        except Exception as e:  # the check itself failed: say so, keep the original error
            err.message = f"{err.message} (could not check for stowd restarts: {type(e).__name__}: {e})"
            err.args = (err.message,)
            return err
        restarted = {k: s for k, s in now.items() if s.generation != self._generations.get(k)}
        emptied = {k: s for k, s in restarted.items() if not s.restored_since(self._generations.get(k))}
        if emptied:
            parts = [
                f"node {s.node_id} ({s.ip}): generation {self._generations.get(s.node_id)} -> {s.generation}, "
                f"{s.last_exit()}" + (f"; {_restore_failure(s)}" if _restore_failure(s) else "")
                for s in emptied.values()
            ]
            lost = DataLost(
                f"{err.message}; the stowd holding these rows restarted since this handle was made: "
                + "; ".join(parts)
                + ". Rows stored there before the restart are lost (put them again; "
                "handle.refresh() acknowledges the restart)",
                code=KeyNotFound.code, request_id=err.request_id,
            )
            lost.nodes = tuple(emptied)
            lost.checkpoints = {}
            return lost
        if not isinstance(err, errors.DataLost):
            return err  # a restored node (or none restarted): not found is not found
        restored = {k: s for k, s in now.items() if s.restored}
        if not restored:
            return err
        parts = []
        for s in restored.values():
            ckpt = f"{s.restored['dir']}#{s.restored['seq']}"
            gen = self._generations.get(s.node_id)
            how = (f"generation {gen} -> {s.generation}, {s.last_exit()}" if s.node_id in restarted
                   else f"generation {s.generation}, acknowledged by refresh()")
            parts.append(f"node {s.node_id} ({s.ip}) restarted its stowd ({how}) and restored checkpoint {ckpt}")
        lost = DataLost(
            f"{err.message}; " + "; ".join(parts)
            + ". Rows written or cleared there after that checkpoint are lost (put them again)",
            code=errors.DataLost.code, request_id=err.request_id,
        )
        lost.nodes = tuple(restored)
        lost.checkpoints = {k: f"{s.restored['dir']}#{s.restored['seq']}" for k, s in restored.items()}
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


class CheckpointFailed(RuntimeError):
    """`StowageCluster.checkpoint()` failed on some node: `errors` maps
    those node ids to their exceptions, `results` the others to their
    checkpoints."""

    def __init__(self, message: str, *, results: dict, errors: dict):
        super().__init__(message)
        self.results, self.errors = results, errors


def _restore_failure(node: NodeStowd) -> str | None:
    """Why this node's current stowd started empty despite a checkpoint, if it did."""
    current = [h for h in node.history if h.get("generation") == node.generation]
    return current[-1].get("restore_error") if current else None


def _rebuild(launch_id, routing, actors, nodes, units, generations):
    h = StowageCluster(launch_id, routing, actors, nodes, units)
    h._generations = dict(generations)
    return h


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
    check_reserved(config)
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
        # The launch's token: every node's stowd takes it and presents it to
        # its peers (each also keeps its own, for its node's clients).
        "cluster_token": secrets.token_hex(32),
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
        # Another node's unit is routed to as a stowage/1 peer unit.
        peer_of = {u: p for nid in order for u, p in zip(prepared[nid]["units"], prepared[nid]["peers"])}
        starts = {}
        for nid, a in actors.items():
            router_units = None
            if routing == "cluster":
                own = prepared[nid]["units"]
                router_units = [f"local:{own.index(u)}" if u in own else peer_of[u] for u in units]
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
