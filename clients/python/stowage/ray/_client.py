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
    """A get failed (rows not found, or a timeout on the way to them) and
    the node holding them restarted its stowd since the handle was made or
    last refreshed: those rows are lost. `nodes` lists the restarted nodes'
    ids; the message starts with the original error. (A `stowage.DataLost`,
    as is a stowd's own `data_lost` after restoring a checkpoint.)"""

    nodes: tuple[str, ...] = ()


class NodeClient(Client):
    """A `stowage.Client` to one node's stowd, from `StowageCluster.client()`:
    a get (or get_into) that raises `KeyNotFound` is checked against stowd
    restarts and raises `DataLost` when the rows' node restarted."""

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
