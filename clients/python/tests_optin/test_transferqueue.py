"""Opt-in: TransferQueue 0.1.11 itself over a real stowd (needs torch, ~6 GB).

Run with the virtualenv that has transferqueue==0.1.11 (see README.md here):

    $TQ_VENV/bin/python -m pytest clients/python/tests_optin -q

Skipped where transfer_queue is not importable. No Ray cluster: as
TransferQueue's own tests do, the controller and SimpleStorageUnit classes
(Ray actor classes) are instantiated directly in this process, and the
client is TransferQueue's `TransferQueueClient`.

The TransferQueue-protocol mode of the "Stowage" backend (`protocol:
transferqueue`); the native mode has test_transferqueue_native.py. What runs:
- TransferQueue -> adapter ("Stowage" backend, protocol transferqueue) ->
  stowd's router -> stowd's units; and with `mode: units`, TransferQueue
  routing over stowd's units.
- TransferQueue -> stowd's router -> TransferQueue's own SimpleStorageUnits
  (`[router] units` lists them): stowd as a router in front of TransferQueue.
- The same batch through TransferQueue's own units, directly: the reference
  every stowd result is compared with (types, layouts, dtypes, values).
- tq's high-level KV API (kv_batch_put / kv_batch_get) with the client made
  by tq's own `_maybe_create_tq_client(conf)` from a config naming "Stowage"
  (the native mode, the default).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

tq = pytest.importorskip("transfer_queue", reason="transfer_queue not installed (opt-in suite)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import NonTensorStack, TensorDict  # noqa: E402

HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = HERE.parent  # clients/python
REPO = PACKAGE_ROOT.parents[1]
sys.path.insert(0, str(PACKAGE_ROOT))
sys.path.insert(1, str(REPO / "tests" / "python"))

import stowage  # noqa: E402
import stowage.transferqueue as stq  # noqa: E402
from transfer_queue import interface  # noqa: E402
from transfer_queue.client import TransferQueueClient  # noqa: E402
from transfer_queue.storage import StorageManagerFactory  # noqa: E402
from transfer_queue.storage.bootstrap import StorageBootstrapProvider  # noqa: E402
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType, ZMQServerInfo  # noqa: E402

N = 10  # rows per batch: 5 per unit with two units
FIELDS = ["x", "ids", "text", "label"]


def test_version():
    assert tq.__version__ == "0.1.11", f"this suite pins transferqueue 0.1.11, found {tq.__version__}"


# ------------------------------------------------------------------ fixtures (and conftest.py)


def _endpoint(info: ZMQServerInfo) -> str:
    return info.to_addr("put_get_socket")


class Clients:
    """TransferQueueClients made during a test, closed at its end."""

    def __init__(self, controller):
        self.controller = controller
        self.made: list[TransferQueueClient] = []

    def __call__(self, backend: str, section: dict) -> TransferQueueClient:
        c = TransferQueueClient(f"TransferQueueClient_{uuid.uuid4().hex[:8]}", self.controller.zmq_server_info)
        self.made.append(c)
        c.initialize_storage_manager(manager_type=backend, config=section)
        return c


@pytest.fixture
def clients(controller):
    cs = Clients(controller)
    yield cs
    for c in cs.made:
        c.close()


# ------------------------------------------------------------------ helpers


def make_batch(n: int = N, seed: int = 0) -> TensorDict:
    """A regular float32 [n, 3, 2], a jagged int64 field (row i has i % 4 + 1
    elements), strings, and a regular int64 [n] column."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 1000, (i % 4 + 1,), generator=g, dtype=torch.int64) for i in range(n)]
    return TensorDict(
        {
            "x": torch.randn(n, 3, 2, generator=g, dtype=torch.float32),
            "ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
            "text": NonTensorStack(*[f"sample {i} \u00e9" for i in range(n)]),
            "label": torch.arange(n, dtype=torch.int64) * 7,
        },
        batch_size=n,
    )


def rows_of(value) -> list:
    """A returned field as one Python/torch value per row."""
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    if isinstance(value, NonTensorStack):
        return list(value.tolist())
    return list(value)


def assert_rows_equal(got: TensorDict, batch: TensorDict, positions: list[int]):
    """Row k of `got` is row positions[k] of `batch`, in every field."""
    assert got.batch_size[0] == len(positions)
    for f in FIELDS:
        want, have = rows_of(batch[f]), rows_of(got[f])
        assert len(have) == len(positions), f
        for k, p in enumerate(positions):
            w, h = want[p], have[k]
            if isinstance(w, torch.Tensor):
                assert isinstance(h, torch.Tensor), (f, k, type(h))
                assert h.dtype == w.dtype and tuple(h.shape) == tuple(w.shape), (f, k, h.dtype, h.shape)
                assert torch.equal(h, w), (f, k)
            else:
                assert h == w, (f, k)


def describe(td: TensorDict) -> dict:
    """What TransferQueue hands back per field: container type, layout, dtype."""
    out = {}
    for f in td.keys():
        v = td[f]
        if isinstance(v, torch.Tensor):
            out[f] = ("tensor", v.is_nested, str(v.layout), v.dtype)
        else:
            out[f] = (type(v).__name__,)
    return out


def roundtrip(client: TransferQueueClient, partition: str, batch: TensorDict):
    """put (insert mode), then get_meta(fetch) + get_data of the whole batch,
    then get_data of a reversed subset; returns (full, subset, put positions)."""
    meta = client.put(batch, partition_id=partition)
    assert meta.size == batch.batch_size[0]
    pos_of = {g: i for i, g in enumerate(meta.global_indexes)}
    fetched = client.get_meta(
        data_fields=FIELDS, batch_size=batch.batch_size[0], partition_id=partition, mode="fetch", task_name="optin"
    )
    assert fetched.is_ready and sorted(fetched.global_indexes) == sorted(meta.global_indexes)
    full = client.get_data(fetched)
    assert_rows_equal(full, batch, [pos_of[g] for g in fetched.global_indexes])

    pick = [7, 2, 5, 0, 3]  # out of order, both parities
    sub_meta = fetched.select_samples(pick)
    sub = client.get_data(sub_meta)
    assert_rows_equal(sub, batch, [pos_of[g] for g in sub_meta.global_indexes])
    return full, sub, meta


def metrics(endpoint: str, unit_id: str) -> dict:
    """GET_METRICS to one unit, over a DEALER with a metrics-collector identity,
    encoded by TransferQueue's own ZMQMessage."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, f"metrics_collector_{uuid.uuid4().hex[:8]}".encode())
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        req = ZMQMessage.create(
            request_type=ZMQRequestType.GET_METRICS, sender_id="metrics_collector_optin", receiver_id=unit_id, body={}
        )
        s.send_multipart(req.serialize())
        assert s.poll(10_000), f"no METRICS_RESPONSE from {endpoint} in 10 s"
        reply = ZMQMessage.deserialize(s.recv_multipart())
    finally:
        s.close()
    assert reply.request_type == ZMQRequestType.METRICS_RESPONSE, reply.request_type
    return reply.body


def unit_keys(server) -> list[int]:
    return [metrics(u["endpoint"], u["id"])["active_keys"] for u in server["units"]]


def split_by_unit(global_indexes, n_units=2) -> list[int]:
    return [sum(1 for g in global_indexes if g % n_units == u) for u in range(n_units)]


# ------------------------------------------------------------------ the adapter itself


def test_registered_with_transferqueue():
    for name in ("Stowage", "StowageStorageManager"):
        assert StorageManagerFactory._registry[name] is stq.StowageStorageManager
        assert StorageBootstrapProvider.get_provider(name) is not None
    assert StorageManagerFactory._registry["StowageTQ"] is stq.StowageTQStorageManager
    # the native mode is TransferQueue's StorageManager interface on the stowage client;
    # the TransferQueue-protocol mode is TransferQueue's own per-row manager
    assert not issubclass(stq.StowageStorageManager, tq.storage.AsyncSimpleStorageManager)
    assert issubclass(stq.StowageTQStorageManager, tq.storage.AsyncSimpleStorageManager)
    stq.register()  # idempotent


def test_imports_without_transfer_queue():
    """Same interpreter with transfer_queue made unimportable."""
    code = (
        "import sys; sys.modules['transfer_queue'] = None\n"
        "import stowage.transferqueue as t\n"
        "assert t.BACKEND == 'Stowage'\n"
        "for f in (t.StowageStorageManager, t.register, lambda: t.storage_unit_infos(['tcp://h:1'])):\n"
        "    try:\n"
        "        f()\n"
        "    except ImportError as e:\n"
        "        assert 'transferqueue==0.1.11' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('no ImportError')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_storage_unit_infos(stowd):
    infos = stq.storage_unit_infos(stowd["units"])
    assert list(infos) == stowd.unit_ids  # order kept: TransferQueue routes g % N in this order
    for u, info in zip(stowd["units"], infos.values()):
        assert isinstance(info, ZMQServerInfo) and _endpoint(info) == u["endpoint"]
    (only,) = stq.storage_unit_infos(["tcp://[::1]:5555"]).values()
    assert only.ip == "::1" and only.ports == {"put_get_socket": 5555} and _endpoint(only) == "tcp://[::1]:5555"
    with pytest.raises(ValueError, match="tcp://"):
        stq.storage_unit_infos(["ipc:///tmp/x"])
    with pytest.raises(ValueError, match="twice"):
        stq.storage_unit_infos(["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"])
    with pytest.raises(ValueError, match="no stowd unit"):
        stq.storage_unit_infos([])


def test_config_errors(controller, tmp_path, monkeypatch):
    monkeypatch.delenv("STOWD_ENDPOINTS_FILE", raising=False)
    info = controller.zmq_server_info
    with pytest.raises(ValueError, match="endpoints_file"):
        stq.StowageStorageManager(info, {})
    with pytest.raises(FileNotFoundError, match="stowd serve --endpoints-file"):
        stq.StowageStorageManager(info, {"endpoints_file": str(tmp_path / "none.json"), "wait_secs": 0.2})
    (tmp_path / "e.json").write_text('{"units": [], "router": null, "native": null}')
    with pytest.raises(ValueError, match="no native endpoint"):
        stq.StowageStorageManager(info, {"endpoints_file": str(tmp_path / "e.json")})
    with pytest.raises(ValueError, match="protocol must be"):
        stq.StowageStorageManager(info, {"endpoints_file": str(tmp_path / "e.json"), "protocol": "zmq"})
    tqp = {"endpoints_file": str(tmp_path / "e.json"), "protocol": "transferqueue"}
    with pytest.raises(ValueError, match="no router"):
        stq.StowageStorageManager(info, tqp)
    with pytest.raises(ValueError, match="mode"):
        stq.StowageStorageManager(info, dict(tqp, mode="sideways"))


def test_resolution_order(stowd, monkeypatch):
    router = stowd["router"]
    assert list(stq.resolve_zmq_info({"endpoints_file": str(stowd.endpoints_path)})) == [router["id"]]
    assert list(stq.resolve_zmq_info({"endpoint": router["endpoint"]})) == [router["endpoint"]]
    monkeypatch.setenv("STOWD_ENDPOINTS_FILE", str(stowd.endpoints_path))
    assert list(stq.resolve_zmq_info({})) == [router["id"]]
    assert list(stq.resolve_zmq_info({"mode": "units"})) == stowd.unit_ids
    explicit = stq.storage_unit_infos([stowd["units"][1]])
    assert stq.resolve_zmq_info({"zmq_info": explicit, "endpoint": "tcp://x:1"}) == explicit


# ------------------------------------------------------------------ TransferQueue over stowd


@pytest.fixture(scope="module")
def reference(controller, tq_units):
    """The same round trip through TransferQueue's own units, directly: what
    stowd must match (per field: container type, layout, dtype)."""
    made = Clients(controller)
    try:
        c = made("SimpleStorage", {"zmq_info": {u.storage_unit_id: u.zmq_server_info for u in tq_units}})
        full, sub, meta = roundtrip(c, "ref", make_batch())
        assert [u.storage_data.active_key_count for u in tq_units] == split_by_unit(meta.global_indexes)
        c.clear_partition("ref")
        assert [u.storage_data.active_key_count for u in tq_units] == [0, 0]
        return describe(full), describe(sub)
    finally:
        for c in made.made:
            c.close()


def test_reference_shape(reference):
    """What TransferQueue 0.1.11 itself hands back (the rows are re-packed one
    by one): a regular [n, 3, 2] field as a jagged nested tensor, a [n] column
    (0-d rows) densely stacked, strings as tensordict's list view."""
    full, sub = reference
    assert full == sub
    assert full["x"] == ("tensor", True, "torch.jagged", torch.float32)
    assert full["ids"] == ("tensor", True, "torch.jagged", torch.int64)
    assert full["label"] == ("tensor", False, "torch.strided", torch.int64)
    assert full["text"] == ("LinkedList",)


def test_router_mode(clients, stowd, reference):
    """The adapter's default: TransferQueue sees ONE unit, stowd's router."""
    c = clients("Stowage", {"protocol": "transferqueue", "endpoints_file": str(stowd.endpoints_path)})
    assert list(c.storage_manager.storage_unit_infos) == [stowd["router"]["id"]]
    before = unit_keys(stowd)
    full, sub, meta = roundtrip(c, "router", make_batch(seed=1))
    assert (describe(full), describe(sub)) == reference
    # stowd's units hold the rows, split g % 2 by the router
    added = [a - b for a, b in zip(unit_keys(stowd), before)]
    assert added == split_by_unit(meta.global_indexes), added
    assert metrics(stowd["router"]["endpoint"], stowd["router"]["id"])["active_keys"] == sum(unit_keys(stowd))
    c.clear_partition("router")
    assert unit_keys(stowd) == before


def test_units_mode(clients, stowd, reference):
    """`mode: units`: TransferQueue routes over stowd's units itself."""
    c = clients("Stowage", {"protocol": "transferqueue", "endpoints_file": str(stowd.endpoints_path), "mode": "units"})
    assert list(c.storage_manager.storage_unit_infos) == stowd.unit_ids
    before = unit_keys(stowd)
    full, sub, meta = roundtrip(c, "units", make_batch(seed=2))
    assert (describe(full), describe(sub)) == reference
    added = [a - b for a, b in zip(unit_keys(stowd), before)]
    assert added == split_by_unit(meta.global_indexes), added
    c.clear_partition("units")
    assert unit_keys(stowd) == before


def test_router_over_transferqueue_units(clients, stowd_over_tq, tq_units, reference):
    """stowd's router in front of TransferQueue's own SimpleStorageUnits."""
    assert stowd_over_tq["units"] == []
    c = clients("Stowage", {"protocol": "transferqueue", "endpoint": stowd_over_tq["router"]["endpoint"]})
    before = [u.storage_data.active_key_count for u in tq_units]
    full, sub, meta = roundtrip(c, "over-tq", make_batch(seed=3))
    assert (describe(full), describe(sub)) == reference
    after = [u.storage_data.active_key_count for u in tq_units]
    assert [a - b for a, b in zip(after, before)] == split_by_unit(meta.global_indexes)
    # the TransferQueue units answer the same counts over the wire
    assert [metrics(_endpoint(u.zmq_server_info), u.storage_unit_id)["active_keys"] for u in tq_units] == after
    c.clear_partition("over-tq")
    assert [u.storage_data.active_key_count for u in tq_units] == before


def test_larger_batch(clients, stowd):
    """A bigger regular field (one 4 MiB frame in, 4096 row frames back) and
    long jagged rows, through the router."""
    n = 4096
    g = torch.Generator().manual_seed(4)
    batch = TensorDict(
        {
            "x": torch.randn(n, 256, generator=g),
            "ids": torch.nested.as_nested_tensor(
                [torch.arange(i % 97 + 1, dtype=torch.int64) + i for i in range(n)], layout=torch.jagged
            ),
            "text": NonTensorStack(*[str(i) for i in range(n)]),
            "label": torch.arange(n, dtype=torch.int64),
        },
        batch_size=n,
    )
    c = clients("Stowage", {"protocol": "transferqueue", "endpoints_file": str(stowd.endpoints_path)})
    meta = c.put(batch, partition_id="big")
    got = c.get_data(meta)
    assert_rows_equal(got, batch, list(range(n)))
    c.clear_partition("big")


def test_checkpoint_through_the_adapter(clients, stowd, tmp_path, monkeypatch):
    """The adapter inherits TransferQueue's storage checkpoints: its save
    and load go to stowd's router (router mode), which saves all its local
    units to one file and loads them back. The rows come back after
    stowd's units lost them; a relative path is refused by stowd, and
    TransferQueue raises with stowd's message."""
    c = clients("Stowage", {"protocol": "transferqueue", "endpoints_file": str(stowd.endpoints_path)})
    batch = make_batch(seed=11)
    meta = c.put(batch, partition_id="ckpt")
    pos = {g: i for i, g in enumerate(meta.global_indexes)}
    c.save_storage_checkpoint(str(tmp_path))
    with stowage.Client(stowd["native"], timeout=30) as s:
        s.clear(list(meta.global_indexes))
    c.load_storage_checkpoint(str(tmp_path))
    fetched = c.get_meta(data_fields=list(batch.keys()), batch_size=N, partition_id="ckpt",
                         mode="fetch", task_name="ckpt")
    assert_rows_equal(c.get_data(fetched), batch, [pos[g] for g in fetched.global_indexes])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="not absolute"):
        c.save_storage_checkpoint("relative-dir")
    c.clear_partition("ckpt")


def test_data_parser_refused(clients, stowd):
    """stowd does not run a TransferQueue data_parser: the put fails, and
    nothing is stored."""
    c = clients("Stowage", {"protocol": "transferqueue", "endpoints_file": str(stowd.endpoints_path)})
    before = unit_keys(stowd)
    with pytest.raises(RuntimeError, match="data_parser"):
        c.put(make_batch(), partition_id="parser", data_parser=lambda d: d)
    assert unit_keys(stowd) == before


def same_row(got, want) -> bool:
    """One returned row equals SimpleStorage's: types, dtypes, shapes, values."""
    if type(got) is not type(want):
        return False
    if isinstance(want, torch.Tensor):
        return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    if isinstance(want, np.ndarray):
        return got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same_row(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same_row(g, w) for g, w in zip(got, want))
    return got == want


@pytest.mark.parametrize(
    "name, value",
    [
        ("numpy_rows", NonTensorStack(*[np.arange(i + 1, dtype=np.int32) for i in range(N)])),
        ("dict_with_tensor", NonTensorStack(*[{"pixels": torch.ones(2) * i} for i in range(N)])),
        ("tensor_or_none", [torch.ones(2) * i if i % 2 else None for i in range(N)]),
    ],
)
def test_value_kinds_with_arrays_inside(clients, stowd, tq_units, name, value):
    """Per-row values that carry arrays (a numpy array per row: ext 5; a
    tensor inside a dict: ext 3 in a map; tensors mixed with None) through
    stowd's router come back as TransferQueue's own units return them."""
    ref = clients("SimpleStorage", {"zmq_info": {u.storage_unit_id: u.zmq_server_info for u in tq_units}})
    meta = ref.put(TensorDict({name: value}, batch_size=N), partition_id=f"kinds-ref-{name}")
    want = rows_of(ref.get_data(meta)[name])
    ref.clear_partition(f"kinds-ref-{name}")
    c = clients("Stowage", {"protocol": "transferqueue", "endpoints_file": str(stowd.endpoints_path)})
    meta = c.put(TensorDict({name: value}, batch_size=N), partition_id=f"kinds-{name}")
    got = rows_of(c.get_data(meta)[name])
    assert len(got) == N and all(same_row(g, w) for g, w in zip(got, want)), (got, want)
    c.clear_partition(f"kinds-{name}")


def test_tq_config_path_and_kv_api(controller, stowd):
    """The config a user writes, through tq's own start-up code
    (`_maybe_create_tq_storage` + `_maybe_create_tq_client`, what tq.init
    runs after making the controller), then tq's high-level KV API."""
    conf = OmegaConf.create(
        {
            "controller": {"zmq_info": controller.zmq_server_info},
            "backend": {"storage_backend": "Stowage", "Stowage": {"endpoints_file": str(stowd.endpoints_path)}},
        },
        flags={"allow_objects": True},
    )
    assert interface._TQ_CLIENT is None and interface._TQ_STORAGE is None
    try:
        interface._maybe_create_tq_storage(conf)
        assert interface._TQ_STORAGE == {"Stowage": {}}
        client = interface._maybe_create_tq_client(conf)
        assert isinstance(client.storage_manager, stq.StowageStorageManager)

        before = unit_keys(stowd)
        keys = [f"k{i}" for i in range(N)]
        batch = make_batch(seed=5)
        tq.kv_batch_put(keys=keys, partition_id="kv", fields=batch)
        assert sum(unit_keys(stowd)) - sum(before) == N
        got = tq.kv_batch_get(keys=keys[::-1], partition_id="kv")
        assert_rows_equal(got, batch, list(range(N))[::-1])
        tq.kv_clear(keys=keys, partition_id="kv")
        assert unit_keys(stowd) == before
    finally:
        tq.close()
