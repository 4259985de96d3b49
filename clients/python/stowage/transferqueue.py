"""TransferQueue adapter: use `stowd` as TransferQueue's storage (optional).

transferqueue 0.1.11 picks its client-side storage manager by name from
`StorageManagerFactory` (`backend.storage_backend`) and hands it the config
section of the same name (`backend.<name>`). Importing this module registers
`StowageStorageManager` there under the name "Stowage". It is TransferQueue's
own `AsyncSimpleStorageManager` pointed at ONE storage unit, stowd's router
endpoint, so stowd does the `g % N` routing and the row selection (its
policy chains) and TransferQueue's controller, metadata and samplers are
unchanged. What a TransferQueue user changes:

    import stowage.transferqueue            # registers backend "Stowage"
    import transfer_queue as tq

    tq.init({"backend": {
        "storage_backend": "Stowage",       # was: SimpleStorage
        "Stowage": {"endpoints_file": "/run/stowd/endpoints.json"},
    }})

or in YAML (OmegaConf):

    backend:
      storage_backend: Stowage
      Stowage:
        endpoints_file: /run/stowd/endpoints.json  # written by `stowd serve --endpoints-file`
        # endpoint: tcp://10.0.0.5:7100           # or the router endpoint itself
        # mode: units                              # TransferQueue routes over stowd's units itself
        # wait_secs: 60                            # wait this long for the endpoints file

Config keys of `backend.Stowage`. Where the units are, first one given wins:
- `zmq_info`: a ready `{id: ZMQServerInfo}` (see `storage_unit_infos`), used as is.
- `endpoint`: stowd's router endpoint, `tcp://host:port`.
- `units`: a list of unit endpoints (`tcp://host:port`), in routing order:
  TransferQueue's client routes `g % N` over them (what
  `stowage.ray.StowageCluster.transferqueue_config()` writes).
- `routers`: `{ray node id: router endpoint}`; each process takes its own
  Ray node's (`stowage.ray`, `transferqueue_config(mode="router")`).
- `endpoints_file` (else `$STOWD_ENDPOINTS_FILE`): the JSON file `stowd serve
  --endpoints-file` writes. It is read in every process that creates a
  TransferQueue client, so with one stowd per node each process talks to the
  stowd on its own node (give every stowd the same `[router] units` list, in
  the same order).
And with `endpoints_file`:
- `mode`: `router` (default) uses its `router` endpoint; `units` lists its
  `units` and lets TransferQueue's client do the `g % N` routing.
- `wait_secs` (default 60): how long to wait for the file to appear.

Every process that builds a TransferQueue client must have imported this
module (the factory registry is per process): under Ray, add
`runtime_env={"worker_process_setup_hook": "stowage.transferqueue.register"}`
to `ray.init`. Without `tq.init` (no Ray), create the client directly:
`client.initialize_storage_manager("Stowage", {"endpoints_file": ...})`.

TransferQueue's storage checkpoints (`tq.save_checkpoint` /
`load_checkpoint`, the client's `save_storage_checkpoint`) work as with its
own units: the adapter keeps `AsyncSimpleStorageManager`'s, which sends
SAVE_ / LOAD_STORAGE_CHECKPOINT to each storage unit, and stowd's router
(every local unit in one safetensors file; refused if it routes to a remote
unit) and unit endpoints answer them. Not served: a
`data_parser` on put, and per-row values that carry arrays other than one
tensor per row: a numpy array per row, tensors inside a dict or list, tensors
mixed with None (stowd answers PUT_ERROR "... not supported by stowd" and
stores nothing; TransferQueue raises RuntimeError).

`tq.close()` closes the client (its sockets to stowd) and the backend
entry `tq.init()` made, as for TransferQueue's own backends. stowd and the
rows in it stay: TransferQueue did not start stowd, so it does not stop it
(`stowage.ray`'s `stowd.shutdown()`, or however stowd was started, does).
transferqueue 0.1.11 stops storage in `transfer_queue.interface.close()`
with one branch per built-in backend name and a warning for any other
("close for _TQ_STORAGE with key Stowage is not supported for now"); it has
no registry for it. So `register()` wraps `transfer_queue.close` (and
`transfer_queue.interface.close`) once: the wrapper takes this backend's
entry out of TransferQueue's storage table, closes it (`_close_backend`) and
calls TransferQueue's own `close()` for the rest.

This module imports without transfer_queue installed; `StowageStorageManager`
and `register()` then raise ImportError.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Iterable
from urllib.parse import urlsplit

BACKEND = "Stowage"
"""The name this adapter registers with TransferQueue (`backend.storage_backend`)."""

ALIASES = ("StowageStorageManager",)
"""Other names registered for the same class (a config section must use the same name)."""

DEFAULT_WAIT_SECS = 60.0

_log = logging.getLogger(__name__)

try:  # TransferQueue is optional: it pulls in torch and ray.
    import transfer_queue
    from transfer_queue import interface as _tq_interface
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
    from transfer_queue.storage.managers.base import StorageManagerFactory
    from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
    from transfer_queue.utils.enum_utils import Role
    from transfer_queue.utils.zmq_utils import ZMQServerInfo
except ImportError as _e:  # pragma: no cover - exercised only without transfer_queue
    _TQ_IMPORT_ERROR: ImportError | None = _e
else:
    _TQ_IMPORT_ERROR = None


def _require_tq() -> None:
    if _TQ_IMPORT_ERROR is not None:
        raise ImportError(
            "stowage.transferqueue needs TransferQueue: pip install transferqueue==0.1.11 "
            f"(import failed: {_TQ_IMPORT_ERROR})"
        ) from _TQ_IMPORT_ERROR


# ---------------------------------------------------------------- endpoints


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    """`tcp://host:port` -> (host, port); IPv6 hosts come back without brackets."""
    if not isinstance(endpoint, str):
        raise TypeError(f"a stowd endpoint is a string like 'tcp://127.0.0.1:7100', got {endpoint!r}")
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp":
        raise ValueError(
            f"TransferQueue reaches storage units over tcp:// only; stowd endpoint {endpoint!r} is not one"
        )
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise ValueError(f"bad stowd endpoint {endpoint!r}: {e}") from None
    if not host or port is None or host == "*":
        raise ValueError(f"bad stowd endpoint {endpoint!r}: expected tcp://HOST:PORT")
    return host, port


def read_endpoints_file(path: str | os.PathLike, wait_secs: float = DEFAULT_WAIT_SECS) -> dict:
    """The JSON object `stowd serve --endpoints-file PATH` writes (keys `units`,
    `router`, `native`, `pid`, ...), waiting up to `wait_secs` for it to appear."""
    deadline = time.monotonic() + float(wait_secs)
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
            return data
        except (FileNotFoundError, json.JSONDecodeError) as e:
            if time.monotonic() >= deadline:
                raise FileNotFoundError(
                    f"stowd endpoints file {path} not readable after {wait_secs:g} s ({e}); "
                    "start `stowd serve --endpoints-file` with this path"
                ) from e
            time.sleep(0.1)


def storage_unit_infos(endpoints: Iterable[str | Mapping[str, str]]) -> dict[str, Any]:
    """TransferQueue's `{unit id: ZMQServerInfo}` for stowd unit endpoints, in
    the order given (TransferQueue sends global index g to unit g % N in this order).

    Items are `tcp://host:port` strings (the id is then the endpoint itself)
    or mappings with `endpoint` and optionally `id`, e.g. the `units` list of
    an endpoints file, or its `router` alone: `storage_unit_infos([ep["router"]])`.
    Put the result under `backend.<name>.zmq_info` (the adapter's
    `backend.Stowage`, or TransferQueue's own `backend.SimpleStorage` when you
    start no SimpleStorageUnits yourself).
    """
    _require_tq()
    if isinstance(endpoints, (str, Mapping)):
        endpoints = [endpoints]
    infos: dict[str, Any] = {}
    for item in endpoints:
        if isinstance(item, Mapping):
            if "endpoint" not in item:
                raise ValueError(f"stowd unit entry {dict(item)!r} has no 'endpoint'")
            endpoint, unit_id = item["endpoint"], item.get("id") or item["endpoint"]
        else:
            endpoint = unit_id = item
        host, port = _split_endpoint(endpoint)
        unit_id = str(unit_id)
        if unit_id in infos:
            raise ValueError(f"stowd unit {unit_id!r} listed twice")
        infos[unit_id] = ZMQServerInfo(role=Role.STORAGE, id=unit_id, ip=host, ports={"put_get_socket": port})
    if not infos:
        raise ValueError("no stowd unit endpoints given")
    return infos


def _own_router(routers: Mapping[str, str]) -> str:
    """The router endpoint of this process's Ray node in `{node id: endpoint}`."""
    try:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
    except Exception as e:  # not in a Ray process
        raise ValueError(f"backend.{BACKEND}.routers picks this process's Ray node's router, "
                         f"but the Ray node id is not available here ({type(e).__name__}: {e})") from e
    if node_id not in routers:
        raise ValueError(f"backend.{BACKEND}.routers has no stowd router for this Ray node {node_id} "
                         f"(it lists {sorted(routers)}; a node that joined after stowage.ray.launch() has none)")
    return routers[node_id]


def resolve_zmq_info(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `{id: ZMQServerInfo}` a `backend.Stowage` config section points at
    (see the module doc for the keys)."""
    _require_tq()
    config = config or {}
    zmq_info = config.get("zmq_info")
    if zmq_info:
        if isinstance(zmq_info, ZMQServerInfo):
            return {zmq_info.id: zmq_info}
        return dict(zmq_info)
    if config.get("endpoint"):
        return storage_unit_infos([config["endpoint"]])
    if config.get("units"):
        return storage_unit_infos(list(config["units"]))
    if config.get("routers"):
        return storage_unit_infos([_own_router(config["routers"])])
    path = config.get("endpoints_file") or os.environ.get("STOWD_ENDPOINTS_FILE")
    if not path:
        raise ValueError(
            f"backend.{BACKEND} needs one of: endpoints_file (the file `stowd serve --endpoints-file` "
            "writes), endpoint (stowd's router endpoint), units, routers, zmq_info; or set $STOWD_ENDPOINTS_FILE"
        )
    wait = config.get("wait_secs")
    data = read_endpoints_file(path, DEFAULT_WAIT_SECS if wait is None else wait)
    mode = config.get("mode") or "router"
    if mode == "router":
        if not data.get("router"):
            raise ValueError(f"{path}: stowd serves no router endpoint (enable [router] in its config)")
        return storage_unit_infos([data["router"]])
    if mode == "units":
        return storage_unit_infos(data.get("units") or [])
    raise ValueError(f"backend.{BACKEND}.mode must be 'router' or 'units', got {mode!r}")


# ---------------------------------------------------------------- the manager

if _TQ_IMPORT_ERROR is None:

    class StowageStorageManager(AsyncSimpleStorageManager):
        """TransferQueue's `AsyncSimpleStorageManager` over stowd: by default one
        storage unit, stowd's router endpoint. Registered as "Stowage"."""

        def __init__(self, controller_info, config, zmq_context=None):
            # Resolve before the base class shakes hands with the controller,
            # so a bad config fails fast and leaves nothing open.
            infos = resolve_zmq_info(config)
            section = {k: v for k, v in (config or {}).items() if k not in ("zmq_info", "storage_unit_infos")}
            section["zmq_info"] = infos
            super().__init__(controller_info, section, zmq_context=zmq_context)

        # save_checkpoint / load_checkpoint are TransferQueue's own: they send
        # SAVE_STORAGE_CHECKPOINT / LOAD_STORAGE_CHECKPOINT to each storage
        # unit this manager knows, which stowd's router (all its local units
        # in one file) and unit endpoints answer.

    def _bootstrap(conf) -> dict:
        """`tq.init()` asks a bootstrap provider to start the backend's storage.
        stowd is started outside TransferQueue (one per node), so there is
        nothing to start; each process resolves its endpoints when its client
        is created."""
        return {}

    def _close_backend(name: str, resources) -> None:
        """`tq.close()` for this backend's entry: `_bootstrap` started
        nothing, so there is nothing to stop (the client's sockets to stowd
        are closed by TransferQueue's client close)."""
        _log.debug("tq.close(): backend %s: nothing to stop (stowd runs outside TransferQueue): %r",
                   name, resources)

    def _wrap_close() -> None:
        """Makes `transfer_queue.close` (and `transfer_queue.interface.close`)
        close this backend's storage entry first, then run TransferQueue's
        own `close()`. Idempotent."""
        original = _tq_interface.close
        if getattr(original, "_stowage_wrapped", False):
            return
        names = {n.lower() for n in (BACKEND, *ALIASES)}

        @functools.wraps(original)
        def close():
            storage = _tq_interface._TQ_STORAGE
            if storage:
                for key in [k for k in storage if str(k).lower() in names]:
                    _close_backend(key, storage.pop(key))
            return original()

        close._stowage_wrapped = True  # type: ignore[attr-defined]
        _tq_interface.close = close
        if getattr(transfer_queue, "close", None) is original:
            transfer_queue.close = close

else:  # pragma: no cover - exercised only without transfer_queue

    class StowageStorageManager:  # type: ignore[no-redef]
        """Placeholder: transfer_queue is not installed."""

        def __init__(self, *args, **kwargs):
            _require_tq()


_registered = False


def register() -> None:
    """Register the adapter with TransferQueue (idempotent; done on import when
    transfer_queue is installed), and make `tq.close()` close its backend
    (see the module doc). Usable as Ray's `worker_process_setup_hook`."""
    global _registered
    _require_tq()
    if _registered:
        return
    for name in (BACKEND, *ALIASES):
        StorageManagerFactory.register(name)(StowageStorageManager)
        StorageBootstrapProvider.register_provider(name)(_bootstrap)
    _wrap_close()
    _registered = True


if _TQ_IMPORT_ERROR is None:
    register()

__all__ = [
    "ALIASES",
    "BACKEND",
    "StowageStorageManager",
    "read_endpoints_file",
    "register",
    "resolve_zmq_info",
    "storage_unit_infos",
]
