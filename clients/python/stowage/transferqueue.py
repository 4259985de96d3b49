"""TransferQueue adapter: stowd as TransferQueue's storage (optional).

transferqueue 0.1.11 picks its client-side storage manager by name from
`StorageManagerFactory` (`backend.storage_backend`) and hands it the config
section of the same name (`backend.<name>`). Importing this module registers
the backend "Stowage" there. Everything above the storage manager stays
TransferQueue's own: the controller, metadata, samplers, the KV API,
consumption tracking and the dataloader. What a TransferQueue user changes:

    import stowage.transferqueue            # registers backend "Stowage"
    import transfer_queue as tq

    tq.init({"backend": {
        "storage_backend": "Stowage",       # was: SimpleStorage
        "Stowage": {"endpoints_file": "/run/stowd/endpoints.json"},
    }})

The backend has two modes, chosen by `backend.Stowage.protocol`:

- `protocol: stowage` (the default): **the native backend**,
  `StowageStorageManager`. It speaks stowage/1 to stowd's native endpoint
  through the `stowage` client and its Rust core: a put goes out as a few
  large messages (stowd routes the rows `g % N` over its units and its
  selection chains decide per unit, as for any native put), a get comes
  back as one buffer per field where the rows allow. Jagged tensors travel
  as values plus offsets. When stowd runs on this node (the endpoints file
  shows it), gets map stowd's memory and puts go through leased shared
  memory (`same_node`). What comes back is what TransferQueue's own
  SimpleStorage returns for the same input (`stowage._tqvalues` lists the
  rules and SimpleStorage's quirks it keeps). A `data_parser` on put runs
  here, in the client, before the put, with SimpleStorage's checks.
- `protocol: transferqueue`: **the TransferQueue-protocol backend**,
  `StowageTQStorageManager`: TransferQueue's own `AsyncSimpleStorageManager`
  (its per-row Python client) pointed at stowd's router (or its units),
  which speak TransferQueue's storage-unit protocol. For comparison and for
  setups that need TransferQueue's wire protocol; the native mode moves the
  same data several times faster. stowd runs no Python, so a `data_parser`
  is refused in this mode.

Data put in one mode is read back in the same mode (the two store non-tensor
values differently).

Config keys of `backend.Stowage`:
- `protocol`: `stowage` (default) or `transferqueue`, as above.
- `endpoints_file` (else `$STOWD_ENDPOINTS_FILE`): the JSON file `stowd
  serve --endpoints-file` writes; read in every process that creates a
  TransferQueue client, so with one stowd per node each process talks to the
  stowd on its own node. `wait_secs` (default 60): how long to wait for it.
- `endpoint`: the stowd endpoint itself, `tcp://host:port`: its `native`
  endpoint (protocol stowage) or its `router` (protocol transferqueue).
- `natives` (protocol stowage): `{ray node id: native endpoint}`; each
  process takes its own Ray node's (what `stowage.ray`'s
  `transferqueue_config()` writes; rows on other nodes come through stowd's
  peer units, `stowage://`).
- `same_node` (protocol stowage): `auto` (default: on when stowd's native
  endpoint is an address of this host and stowd serves shared memory),
  `true`, or `false` (tcp only).
- `timeout` (protocol stowage, default 300): seconds a put or get may take.
- protocol transferqueue only: `mode` (`router`, the default, or `units`:
  TransferQueue routes `g % N` over the units of the endpoints file itself),
  `units` (unit endpoints in routing order), `routers` (`{ray node id:
  router endpoint}`), `zmq_info` (a ready `{id: ZMQServerInfo}`).

SimpleStorage's own keys (`num_data_storage_units`, `total_storage_size`)
mean nothing here: stowd's own config sets them: `[units] local` (the unit
count), `capacity_bytes` (bytes per unit; by default the units share
`memory_percent`, 50%, of the memory stowd may use) and `spill_dir` (spill
the coldest rows to disk instead of refusing puts past that).

Every process that builds a TransferQueue client must have imported this
module (the factory registry is per process). Under Ray, add
`runtime_env={"worker_process_setup_hook": "stowage.transferqueue.register"}`
to `ray.init` (Hydra, e.g. verl:
`+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=stowage.transferqueue.register`).
A process that joins through a bare `tq.init()` also gets the backend
registered when it reads the config `tq.init()` stored with the controller:
`tq.init()` with this backend stores a marker there whose unpickling
imports this module. Without `tq.init` (no Ray), create the client directly:
`client.initialize_storage_manager("Stowage", {"endpoints_file": ...})`.

Checkpoints (`tq.save_checkpoint(dir)` / `load_checkpoint(dir)`): the native
mode makes stowd write its own checkpoint into `<dir>/stowage` (every row of
every unit of the stowd it talks to, on stowd's machine) and restore from
it; the TransferQueue-protocol mode writes SimpleStorage's layout
(`<dir>/simple_storage`, one file per unit, safetensors inside). Loading a
checkpoint written by another backend or mode fails with an error that
names the mode that wrote it.

`tq.close()` closes the client (its connections to stowd) and the backend
entry `tq.init()` made. stowd and the rows in it stay: TransferQueue did not
start stowd, so it does not stop it. transferqueue 0.1.11 stops storage in
`transfer_queue.interface.close()` with one branch per built-in backend
name and a warning for any other; so `register()` wraps `transfer_queue.close`
(and `transfer_queue.interface.close`) once: the wrapper takes this
backend's entry out of TransferQueue's storage table and calls
TransferQueue's own `close()` for the rest.

This module imports without transfer_queue installed; `StowageStorageManager`
and `register()` then raise ImportError.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit

from .aio import AsyncClient
from .client import Client
from .errors import KeyNotFound, StowageError

BACKEND = "Stowage"
"""The name this adapter registers with TransferQueue (`backend.storage_backend`)."""

ALIASES = ("StowageStorageManager",)
"""Other names registered for the same class (a config section must use the same name)."""

TQ_BACKEND = "StowageTQ"
"""The TransferQueue-protocol mode under a name of its own (the same as
`Stowage` with `protocol: transferqueue`)."""

PROTOCOLS = ("stowage", "transferqueue")

DEFAULT_WAIT_SECS = 60.0
DEFAULT_TIMEOUT = 300.0
#: Threads (each with its own stowage client and connection) that carry
#: the calls made where no event loop runs (the probes at start).
CLIENT_THREADS = 4
#: Seconds the same-node probe at start waits for stowd (then: tcp, with a warning).
PROBE_TIMEOUT = 10.0
#: The subdirectory of a TransferQueue checkpoint directory that holds stowd's checkpoint.
CHECKPOINT_SUBDIR = "stowage"
#: The key of the marker `tq.init()` leaves in this backend's config section (`_Registrar`).
_HOOK_KEY = "registered_by"

_log = logging.getLogger(__name__)

try:  # TransferQueue is optional: it pulls in torch and ray.
    import transfer_queue
    from transfer_queue import interface as _tq_interface
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
    from transfer_queue.storage.managers.base import StorageManager, StorageManagerFactory
    from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
    from transfer_queue.storage.simple_storage import KEY_NOT_FOUND_MARKER, StorageKeyNotFoundError
    from transfer_queue.utils.enum_utils import Role
    from transfer_queue.utils.zmq_utils import ZMQServerInfo
    from tensordict import TensorDict
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


def _own_endpoint(routers: Mapping[str, str], key: str = "routers") -> str:
    """The endpoint of this process's Ray node in `{node id: endpoint}`."""
    try:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
    except Exception as e:  # not in a Ray process
        raise ValueError(f"backend.{BACKEND}.{key} picks this process's Ray node's router, "
                         f"but the Ray node id is not available here ({type(e).__name__}: {e})") from e
    if node_id not in routers:
        raise ValueError(f"backend.{BACKEND}.{key} has no stowd endpoint for this Ray node {node_id} "
                         f"(it lists {sorted(routers)}; a node that joined after stowage.ray.launch() has none)")
    return routers[node_id]


def _endpoints_file(config: Mapping[str, Any], others: str) -> tuple[str, dict]:
    """(path, contents) of the endpoints file a config section names (or
    $STOWD_ENDPOINTS_FILE); `others` lists the keys that could stand instead."""
    path = config.get("endpoints_file") or os.environ.get("STOWD_ENDPOINTS_FILE")
    if not path:
        raise ValueError(
            f"backend.{BACKEND} needs one of: endpoints_file (the file `stowd serve --endpoints-file` "
            f"writes), {others}; or set $STOWD_ENDPOINTS_FILE"
        )
    wait = config.get("wait_secs")
    return path, read_endpoints_file(path, DEFAULT_WAIT_SECS if wait is None else wait)


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
        return storage_unit_infos([_own_endpoint(config["routers"])])
    path, data = _endpoints_file(config, "endpoint (stowd's router endpoint), units, routers, zmq_info")
    mode = config.get("mode") or "router"
    if mode == "router":
        if not data.get("router"):
            raise ValueError(f"{path}: stowd serves no router endpoint (enable [router] in its config)")
        return storage_unit_infos([data["router"]])
    if mode == "units":
        return storage_unit_infos(data.get("units") or [])
    raise ValueError(f"backend.{BACKEND}.mode must be 'router' or 'units', got {mode!r}")



def _protocol(config: Mapping[str, Any] | None) -> str:
    p = (config or {}).get("protocol") or "stowage"
    if p not in PROTOCOLS:
        raise ValueError(f"backend.{BACKEND}.protocol must be 'stowage' (native, the default) or "
                         f"'transferqueue' (TransferQueue's storage-unit protocol), got {p!r}")
    return p


def _is_local_host(host: str) -> bool:
    """Whether `host` is an address of this machine (loopback, or one a
    socket can bind here)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        ip = addr[0]
        try:
            if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
                return True
        except ValueError:
            continue
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((ip, 0))
            return True
        except OSError:
            continue
    return False


_NATIVE_KEYS = frozenset({"protocol", "endpoints_file", "endpoint", "natives", "same_node", "timeout", "wait_secs"})
_TQ_KEYS = frozenset({"mode", "units", "routers", "zmq_info"})
_SIMPLE_STORAGE_KEYS = frozenset({"num_data_storage_units", "total_storage_size", "storage_unit_infos",
                                  "required_node_resource", "ssd_offload"})


def _check_native_keys(config: Mapping[str, Any]) -> None:
    """Says which keys the native mode ignores, with a WARNING each (a
    section copied from SimpleStorage's, a framework's extra keys, or a
    typo), and refuses a bad `timeout`. Keys set to null are left unsaid."""
    keys = {str(k) for k, v in config.items() if v is not None} - _NATIVE_KEYS - {_HOOK_KEY}
    ignored = keys & _SIMPLE_STORAGE_KEYS
    if ignored:
        _log.warning("backend.%s: %s do nothing under Stowage: stowd's own config sets the units "
                     "([units] local) and their capacity ([units] capacity_bytes, memory_percent, spill_dir)",
                     BACKEND, ", ".join(sorted(ignored)))
    tq_only = keys & _TQ_KEYS
    if tq_only:
        _log.warning("backend.%s: %s ignored: they only apply to protocol: transferqueue (TransferQueue's own "
                     "client to stowd's router or units); the native mode (protocol: stowage, the default) reads "
                     "endpoints_file, endpoint or natives", BACKEND, ", ".join(sorted(tq_only)))
    unknown = keys - ignored - tq_only
    if unknown:
        _log.warning("backend.%s: unknown key(s) %s ignored; the native mode reads %s", BACKEND,
                     ", ".join(sorted(unknown)), ", ".join(sorted(_NATIVE_KEYS)))
    timeout = config.get("timeout", DEFAULT_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"backend.{BACKEND}.timeout must be a positive number of seconds, got {timeout!r}")


def resolve_native(config: Mapping[str, Any] | None) -> tuple[str, bool, str]:
    """(stowd's native endpoint, whether same-node mode is wanted, why) for
    a `backend.Stowage` section with protocol stowage (see the module doc)."""
    config = config or {}
    _check_native_keys(config)
    same = config.get("same_node", "auto")
    if isinstance(same, str):
        same = same.lower()
    if same not in ("auto", True, False, "true", "false"):
        raise ValueError(f"backend.{BACKEND}.same_node must be auto, true or false, got {same!r}")
    same = {"true": True, "false": False}.get(same, same)
    shm = None  # does that stowd serve shared memory? (None: unknown)
    if config.get("endpoint"):
        endpoint, where = config["endpoint"], f"backend.{BACKEND}.endpoint"
    elif config.get("natives"):
        endpoint, where = _own_endpoint(config["natives"], "natives"), f"backend.{BACKEND}.natives"
    else:
        path, data = _endpoints_file(config, "endpoint (stowd's native endpoint), natives")
        endpoint, where = data.get("native"), str(path)
        if not endpoint:
            raise ValueError(f"{path}: stowd serves no native endpoint (enable [server] native in its config)")
        shm = bool(data.get("shm_dir"))
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise ValueError(f"{where}: stowd's native endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    host, _ = _split_endpoint(endpoint)
    if same is False:
        return endpoint, False, "same_node: false"
    local = _is_local_host(host)
    if same is True:
        if not local:
            raise ValueError(f"backend.{BACKEND}.same_node is true, but stowd's endpoint {endpoint} is not "
                             "an address of this host")
        return endpoint, True, "same_node: true"
    if not local:
        return endpoint, False, f"{host} is not this host"
    if shm is False:
        return endpoint, False, "stowd serves no shared memory ([shm] off)"
    return endpoint, True, f"{host} is this host"


class _Clients:
    """What carries the backend's calls. A coroutine's call (`run`) goes
    through an `AsyncClient` of its event loop's own (one a loop, as
    TransferQueue keys its own sockets): a small put, get or clear is
    written and answered on the loop with no thread hop, anything larger
    moves its bytes in a worker thread while the loop waits (the Rust core
    releases the GIL), and concurrent calls overlap. Each call had taken a
    thread hop before: 90 µs of client CPU for a 4-row put against 20
    through the loop (docs/benchmarks.md, "Small calls"). A call from a
    thread with no loop running (`call`) runs on a pool of threads, each
    with its own `stowage.Client`."""

    def __init__(self, endpoint: str, same_node: bool, timeout: float):
        self.endpoint, self.same_node, self.timeout = endpoint, same_node, timeout
        self._local = threading.local()
        self._made: list = []
        self._lock = threading.Lock()
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=CLIENT_THREADS, thread_name_prefix="stowage-tq")
        # Each event loop's AsyncClient, closed when its loop is collected.
        self._loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _client(self):
        c = getattr(self._local, "client", None)
        if c is None:
            c = Client(self.endpoint, timeout=self.timeout, same_node=self.same_node)
            with self._lock:
                if self._closed:
                    c.close()
                    raise RuntimeError("the Stowage storage manager is closed")
                self._made.append(c)
            self._local.client = c
        return c

    async def run(self, method: str, *args, **kwargs):
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise RuntimeError("the Stowage storage manager is closed")
            c = self._loops.get(loop)
            if c is None:
                c = self._loops[loop] = AsyncClient(self.endpoint, timeout=self.timeout,
                                                    same_node=self.same_node)
                # (In a thread of its own: `close` waits for the client's
                # worker threads, and the collector may run in one of them.)
                weakref.finalize(loop, lambda c=c: threading.Thread(target=c.close, daemon=True).start())
        return await getattr(c, method)(*args, **kwargs)

    def call(self, method: str, *args, **kwargs):
        """The same, from a thread with no event loop running."""
        return self._pool.submit(lambda: getattr(self._client(), method)(*args, **kwargs)).result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            made, self._made = self._made, []
            made += list(self._loops.values())
            self._loops.clear()
        self._pool.shutdown(wait=True)
        for c in made:
            c.close()


if _TQ_IMPORT_ERROR is None:
    from . import _tqvalues

    class StowageStorageManager(StorageManager):
        """TransferQueue 0.1.11's storage-manager interface on stowd's native
        protocol (stowage/1) and the `stowage` client. Registered as
        "Stowage"; with `protocol: transferqueue` in its config section,
        creating it gives a `StowageTQStorageManager` instead."""

        def __new__(cls, controller_info=None, config=None, *args, **kwargs):
            if cls is StowageStorageManager and _protocol(config) == "transferqueue":
                return StowageTQStorageManager(controller_info, config, *args, **kwargs)
            return super().__new__(cls)

        def __init__(self, controller_info, config, zmq_context=None):
            # Resolve before the base class shakes hands with the controller,
            # so a bad config fails fast and leaves nothing open.
            _protocol(config)
            endpoint, same_node, why = resolve_native(config)
            timeout = float((config or {}).get("timeout", DEFAULT_TIMEOUT))
            self._clients = _Clients(endpoint, False, timeout)
            try:  # reachable, and speaking stowage/1
                self._clients.call("stats", timeout=min(timeout, PROBE_TIMEOUT))
            except StowageError as e:
                self._clients.close()
                raise ConnectionError(
                    f"Stowage backend: stowd at {endpoint} ({why}) did not answer a stowage/1 request: {e}. "
                    "Is stowd running, and is this its native endpoint (the endpoints file's 'native')? Its "
                    "router and unit endpoints speak TransferQueue's protocol: for those, set "
                    f"backend.{BACKEND}.protocol: transferqueue") from e
            if same_node:
                shared = _Clients(endpoint, True, timeout)
                try:
                    shared.call("_open_channel")
                except Exception as e:  # noqa: BLE001 - auto falls back to tcp, with why
                    shared.close()
                    if (config or {}).get("same_node", "auto") not in ("auto", None):
                        self._clients.close()
                        raise
                    _log.warning("Stowage backend: stowd at %s refused same-node mode (%s: %s); using tcp",
                                 endpoint, type(e).__name__, e)
                    same_node, why = False, f"same-node refused: {e}"
                else:  # the probed clients serve from now on
                    self._clients.close()
                    self._clients = shared
            self.endpoint, self.same_node = endpoint, same_node
            _log.info("Stowage backend: stowd at %s, %s (%s)", endpoint,
                      "same node (shared memory)" if same_node else "tcp", why)
            try:
                super().__init__(controller_info, config, zmq_context=zmq_context)
            except BaseException:
                self._clients.close()
                raise

        async def put_data(self, data, metadata, data_parser=None) -> None:
            """Stores `data` under `metadata.global_indexes` (one stowage/1
            put, split into messages of stowd's frame size), then notifies
            TransferQueue's controller as SimpleStorage does."""
            n = metadata.size
            if n == 0:
                return
            field_schema = _tqvalues.field_schema(data)
            fields = {name: data[name] for name in data.keys()}
            if data_parser is not None:
                fields = _tqvalues.apply_parser(data_parser, fields)
            wire = {name: _tqvalues.to_wire(name, v, n) for name, v in fields.items()}
            if wire:
                await self._clients.run("put", list(metadata.global_indexes), wire)
            await self.notify_data_update(metadata.partition_ids[0], metadata.global_indexes, field_schema)

        async def get_data(self, metadata):
            """The rows of `metadata` (its global indexes, its fields) as the
            TensorDict SimpleStorage returns for them."""
            n = metadata.size
            if n == 0:
                return TensorDict({}, batch_size=0)
            names = list(metadata.field_names)
            try:
                # The list as it is: the client's Rust core reads it in one
                # pass and sends its runs (TransferQueue's usual batches,
                # evenly spaced indexes) as ranges, not one entry per row.
                got = await self._clients.run("get", metadata.global_indexes, names, as_torch=True,
                                              nested="packed")
            except KeyNotFound as e:
                raise StorageKeyNotFoundError(f"[{KEY_NOT_FOUND_MARKER}] stowd at {self.endpoint}: {e}") from e
            return _tqvalues.tensordict_of({name: _tqvalues.from_wire(got[name], n) for name in names}, n)

        async def clear_data(self, metadata) -> None:
            """Drops every field of `metadata`'s global indexes. As
            SimpleStorage's, a failure is logged, not raised."""
            if metadata.size == 0:
                return
            try:
                await self._clients.run("clear", list(metadata.global_indexes))
            except Exception as e:  # noqa: BLE001 - SimpleStorage logs clear failures
                _log.error(f"[{self.storage_manager_id}]: Error clearing stowd at {self.endpoint}: {e}")

        async def save_checkpoint(self, checkpoint_dir: str) -> None:
            """stowd writes its own checkpoint of every row into
            `<checkpoint_dir>/stowage` (on stowd's machine), as a snapshot
            (no journal: a load brings back every row as saved, as
            SimpleStorage's does, and the directory may be renamed, as
            `tq.save_checkpoint` does)."""
            d = Path(checkpoint_dir).absolute() / CHECKPOINT_SUBDIR
            d.parent.mkdir(parents=True, exist_ok=True)
            got = await self._clients.run("checkpoint", str(d), journal=False)
            _log.info(f"[{self.storage_manager_id}]: stowd checkpoint in {d}: {got}")

        async def load_checkpoint(self, checkpoint_dir: str) -> None:
            """Replaces stowd's rows with the checkpoint in `<checkpoint_dir>/stowage`."""
            root = Path(checkpoint_dir).absolute()
            d = root / CHECKPOINT_SUBDIR
            if not d.is_dir():
                other = (root / "simple_storage").is_dir()
                raise FileNotFoundError(
                    f"no Stowage checkpoint in {d}" + (
                        f"; {root} holds a SimpleStorage-layout checkpoint (backend SimpleStorage, or "
                        f"{BACKEND} with protocol: transferqueue, wrote it): load it with that backend"
                        if other else ""))
            got = await self._clients.run("restore", str(d))
            _log.info(f"[{self.storage_manager_id}]: stowd restored {d}: {got}")

        def close(self) -> None:
            clients = getattr(self, "_clients", None)
            if clients is not None:
                clients.close()
            super().close()

    class StowageTQStorageManager(AsyncSimpleStorageManager):
        """The TransferQueue-protocol mode: TransferQueue's own
        `AsyncSimpleStorageManager` over stowd's TransferQueue endpoints, by
        default one storage unit, stowd's router. "Stowage" with
        `protocol: transferqueue`, or "StowageTQ"."""

        def __init__(self, controller_info, config, zmq_context=None):
            # Resolve before the base class shakes hands with the controller,
            # so a bad config fails fast and leaves nothing open.
            infos = resolve_zmq_info(config)
            if (config or {}).get("protocol") not in (None, "transferqueue"):
                raise ValueError(f"{TQ_BACKEND} speaks TransferQueue's protocol; its config has protocol "
                                 f"{config.get('protocol')!r}")
            section = {k: v for k, v in (config or {}).items()
                       if k not in ("zmq_info", "storage_unit_infos", "protocol", _HOOK_KEY)}
            section["zmq_info"] = infos
            super().__init__(controller_info, section, zmq_context=zmq_context)

        # save_checkpoint / load_checkpoint are TransferQueue's own: they send
        # SAVE_STORAGE_CHECKPOINT / LOAD_STORAGE_CHECKPOINT to each storage
        # unit this manager knows, which stowd's router (all its local units
        # in one file) and unit endpoints answer.

        # A data_parser goes to stowd with the put, as TransferQueue sends it,
        # and stowd refuses it (PUT_ERROR "... data_parser ... not supported
        # by stowd"): stowd runs no Python. The native mode applies it.

    def _bootstrap(conf) -> dict:
        """`tq.init()` asks a bootstrap provider to start the backend's storage.
        stowd is started outside TransferQueue (one per node), so there is
        nothing to start; each process resolves its endpoints when its client
        is created. It leaves a marker in the backend's config section: a
        process that unpickles the config `tq.init()` stores with the
        controller (a bare `tq.init()` in a Ray actor) imports this module
        and so registers the backend (`_Registrar`)."""
        try:
            for name in (BACKEND, *ALIASES, TQ_BACKEND):
                section = conf.backend.get(name) if "backend" in conf else None
                if section is not None and _HOOK_KEY not in section:
                    section[_HOOK_KEY] = _Registrar()
        except Exception as e:  # noqa: BLE001 - the hook is a convenience
            _log.debug("could not leave the registration marker in the config: %s", e)
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
        names = {n.lower() for n in (BACKEND, *ALIASES, TQ_BACKEND)}

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

    StowageTQStorageManager = StowageStorageManager  # type: ignore[misc]




class _Registrar:
    """A marker `tq.init()` leaves in this backend's config section (see
    `_bootstrap`): unpickling it registers the backend in that process."""

    def __reduce__(self):
        return (_registered_marker, ())

    def __repr__(self) -> str:
        return "stowage.transferqueue.register"


def _registered_marker() -> "_Registrar":
    try:
        register()
    except ImportError:
        pass
    return _Registrar()


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
    StorageManagerFactory.register(TQ_BACKEND)(StowageTQStorageManager)
    StorageBootstrapProvider.register_provider(TQ_BACKEND)(_bootstrap)
    _wrap_close()
    _registered = True


if _TQ_IMPORT_ERROR is None:
    register()

__all__ = [
    "ALIASES",
    "BACKEND",
    "PROTOCOLS",
    "StowageStorageManager",
    "StowageTQStorageManager",
    "TQ_BACKEND",
    "read_endpoints_file",
    "register",
    "resolve_native",
    "resolve_zmq_info",
    "storage_unit_infos",
]
