"""`NodeClient`: a `stowage.Client` to one node's stowd that reports rows
lost to a stowd restart as `DataLost`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..client import Client
from .. import errors
from ..errors import InternalError, KeyNotFound, StowageTimeout

if TYPE_CHECKING:
    from ._cluster import NodeStowd, StowageCluster


class DataLost(errors.DataLost):
    """Rows a get asked for were lost to a stowd restart. Either the node
    holding them restarted its stowd since the handle was made or last
    refreshed and the new stowd started empty (the get found no rows, or
    timed out on the way to them): every row stored there before is lost.
    Or the new stowd restored the node's last checkpoint
    (`StowageCluster.checkpoint()`) and reported these rows `data_lost`:
    they were written or cleared after that checkpoint. `nodes` lists the
    nodes' ids, `checkpoints` maps node id -> the restored checkpoint
    ("<dir>#<seq>", the second case only); the message starts with the
    original error. (A `stowage.DataLost`, as is a stowd's own `data_lost`.)"""

    nodes: tuple[str, ...] = ()
    checkpoints: dict[str, str] = {}  # set per instance by StowageCluster._lost


class NodeClient(Client):
    """A `stowage.Client` to one node's stowd, from `StowageCluster.client()`:
    a get (or get_into) that raises `KeyNotFound` is checked against stowd
    restarts and raises `DataLost` when the rows' node restarted and started
    empty, or when its stowd restored a checkpoint and reports the rows
    `data_lost` (written or cleared after that checkpoint)."""

    def __init__(self, cluster: "StowageCluster", node: "NodeStowd", *, same_node: bool, **kwargs):
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
