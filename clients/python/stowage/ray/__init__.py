"""Run Stowage on a Ray cluster: one `stowd` per node (optional; needs Ray).

    pip install './clients/python[ray]'

    import ray, stowage.ray
    ray.init()                                    # Ray 2.60: also turns on its token auth (~/.ray/auth_token)
    stowd = stowage.ray.launch()                  # one stowd per alive node
    with stowd.client() as c:                     # the stowd on this node, same-node shared memory
        c.put([0, 1], {"x": np.ones((2, 4), np.float32)})
    stowd.units                                   # every unit endpoint, in routing order (g % N)
    stowd.transferqueue_config()                  # TransferQueue's `backend` section
    stowd.checkpoint()                            # launch(routing="node"): each node's rows, restored
                                                  # when Ray restarts that node's stowd
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
  others' as `stowage://host:native_port/<i>`, spoken to in stowage/1 with
  the node's read cache: K ranks on a node getting the same remote rows
  move them across the network once), so any node's native and router
  endpoints see the same rows: global index g lives on unit `units[g % N]`.
- "node": each stowd routes over its own units only (stowd's default); a
  client sees the rows put through the same node's stowd. The full unit list
  (`units`) still lets TransferQueue route across nodes itself.

A restarted stowd starts empty, unless its node has a checkpoint. Rows
stored on its units before are lost, and `StowageCluster.client()` says so:
a get that finds no rows where a restarted node holds them raises
`DataLost` (a `KeyNotFound`) naming the node, the generation and how the
old stowd ended, instead of a bare "key not found". `refresh()`
acknowledges restarts.

Checkpoints (`routing="node"` only): `StowageCluster.checkpoint()` makes
every node's stowd write all its rows to its node's checkpoint directory
(`<node dir>/checkpoint`, private like the rest of the node's files, one
checkpoint kept, removed by `shutdown()`) and returns node id ->
`{"dir", "seq", "rows", "bytes", "files"}`. When Ray restarts a node whose
directory holds one, the actor runs `stowd serve --restore <it>`: the new
stowd serves the rows as they were at that checkpoint, and a get of an
index written or cleared after it raises `DataLost` naming the node and
the checkpoint (`"<dir>#<seq>"`, also in `DataLost.checkpoints`), until it
is put again; an index never stored is a plain `KeyNotFound`. stowd goes on
journaling into that directory, so a second restart restores just as
correctly. `NodeStowd.restored` says which checkpoint the current stowd
restored (`history` has it per generation). A checkpoint stowd refuses to
restore (e.g. a file whose SHA-256 differs) is moved aside to
`<node dir>/checkpoint.unrestorable-<generation>` and stowd starts empty:
the old behaviour, the `DataLost` message saying why. With
`routing="cluster"` `checkpoint()` raises ValueError: each stowd routes
over other nodes' units too, and stowd checkpoints and restores only a
stowd whose units are all its own.

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
directory again and trusts only entries it tagged (docs/operating.md, "Plugins").

The package, by concern (imports point down the list, never up):

| module | what |
| --- | --- |
| `_cluster` | `launch()`, `StowageCluster`, `NodeStowd`, `shutdown()` (the driver's side; imports Ray) |
| `_client` | `NodeClient`, `DataLost` (a get that meets a restarted node, or rows lost since its checkpoint) |
| `_actor` | `StowdNode`, the per-node actor as a plain class |
| `_config` | the stowd config: reserved keys, merging, the TOML file (`tomli_w`) |
| `_supervise` | finding the binary and plugins, reserving ports, running stowd as a child |
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: F401
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "stowage.ray needs Ray: pip install 'stowage[ray]' (or pip install ray); "
        f"import failed: {_e}"
    ) from _e

from .._workdir import InsecureDirectory
from ._actor import StowdNode
from ._client import DataLost, NodeClient
from ._cluster import (
    DEFAULT_CHECKPOINT_TIMEOUT,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_START_TIMEOUT,
    CheckpointFailed,
    NodeStowd,
    StowageCluster,
    launch,
    shutdown,
)
from ._supervise import (
    PACKAGED_PLUGINS,
    PACKAGED_STOWD,
    StowdNotFound,
    StowdStartError,
    find_plugin_dir,
    find_stowd,
)

__all__ = [
    "CheckpointFailed",
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
