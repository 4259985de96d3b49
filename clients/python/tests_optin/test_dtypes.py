"""Opt-in: every torch dtype TransferQueue 0.1.11 sends by its bytes, through
a real stowd, byte for byte (needs torch; see README.md here):

    $TQ_VENV/bin/python -m pytest clients/python/tests_optin/test_dtypes.py -q

- TransferQueue's own storage manager ("SimpleStorage", its
  AsyncSimpleStorageManager) pointed at stowd's units puts a batch with a
  field of every dtype and gets it back; the same batch through
  TransferQueue's own SimpleStorageUnits is the reference (types, layouts,
  dtypes), and every row must be byte-equal to what was put.
- The Stowage adapter (router mode), the same; and stowd's router in front
  of TransferQueue's own units.
- The Stowage Python client reads over stowage/1 the rows TransferQueue put
  into stowd's units (as torch tensors of the same dtype), and puts and gets
  the same tensors itself: byte-equal.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

tq = pytest.importorskip("transfer_queue", reason="transfer_queue not installed (opt-in suite)")

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = HERE.parent
REPO = PACKAGE_ROOT.parents[1]
sys.path.insert(0, str(PACKAGE_ROOT))
sys.path.insert(1, str(REPO / "tests" / "python"))

import stowage  # noqa: E402
import stowage.transferqueue as stq  # noqa: E402
from transfer_queue.client import TransferQueueClient  # noqa: E402

# Every dtype of issue 15 (str(torch.X) without "torch."), and float4_e2m1fn_x2.
DTYPES = [
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
]
N = 8


@pytest.fixture
def clients(controller):
    made = []

    def make(backend: str, section: dict) -> TransferQueueClient:
        c = TransferQueueClient(f"TransferQueueClient_{uuid.uuid4().hex[:8]}", controller.zmq_server_info)
        made.append(c)
        c.initialize_storage_manager(manager_type=backend, config=section)
        return c

    yield make
    for c in made:
        c.close()


def tensor_of(name: str, shape: tuple, g: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as `name` (bool: 0 or 1), so every bit pattern
    is stored, NaNs and all."""
    dt = getattr(torch, name)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dt.itemsize), generator=g, dtype=torch.uint8)
    if dt == torch.bool:
        raw &= 1
    return raw.view(dt)


def make_batch(seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({f"x_{d}": tensor_of(d, (N, 3), g) for d in DTYPES}, batch_size=N)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def rows_of(v) -> list:
    return list(v.unbind(0))


def assert_rows_equal(got: TensorDict, batch: TensorDict, positions: list[int]):
    for d in DTYPES:
        f = f"x_{d}"
        want, have = rows_of(batch[f]), rows_of(got[f])
        assert len(have) == len(positions), f
        for k, p in enumerate(positions):
            assert have[k].dtype == want[p].dtype, (f, k, have[k].dtype)
            assert tuple(have[k].shape) == tuple(want[p].shape), (f, k)
            assert raw(have[k]) == raw(want[p]), (f, k)


def describe(td: TensorDict) -> dict:
    return {f: (td[f].is_nested, str(td[f].layout), td[f].dtype) for f in td.keys()}


def roundtrip(client, partition: str, batch: TensorDict):
    meta = client.put(batch, partition_id=partition)
    pos = {g: i for i, g in enumerate(meta.global_indexes)}
    fetched = client.get_meta(data_fields=[f"x_{d}" for d in DTYPES], batch_size=N, partition_id=partition,
                              mode="fetch", task_name="dtypes")
    full = client.get_data(fetched)
    assert_rows_equal(full, batch, [pos[g] for g in fetched.global_indexes])
    sub_meta = fetched.select_samples([6, 1, 3])
    sub = client.get_data(sub_meta)
    assert_rows_equal(sub, batch, [pos[g] for g in sub_meta.global_indexes])
    return describe(full), meta


@pytest.fixture(scope="module")
def reference(controller, tq_units):
    """The batch through TransferQueue's own units: what stowd must match."""
    c = TransferQueueClient("TransferQueueClient_ref", controller.zmq_server_info)
    try:
        c.initialize_storage_manager(
            manager_type="SimpleStorage", config={"zmq_info": {u.storage_unit_id: u.zmq_server_info for u in tq_units}}
        )
        shape, _ = roundtrip(c, "dtypes-ref", make_batch(0))
        c.clear_partition("dtypes-ref")
        return shape
    finally:
        c.close()


def test_torch_has_every_dtype():
    for d in DTYPES:
        assert str(getattr(torch, d)) == f"torch.{d}"
    assert set(DTYPES) == set(stowage.DTYPES)


def test_transferqueue_storage_manager_over_stowd_units(clients, stowd, reference):
    """TransferQueue's own SimpleStorage manager, with stowd's units as its
    storage units (it routes g % 2 itself)."""
    c = clients("SimpleStorage", {"zmq_info": stq.storage_unit_infos(stowd["units"])})
    shape, meta = roundtrip(c, "dtypes-units", make_batch(1))
    assert shape == reference
    c.clear_partition("dtypes-units")


def test_stowage_adapter_router_mode(clients, stowd, reference):
    c = clients("Stowage", {"endpoints_file": str(stowd.endpoints_path)})
    shape, _ = roundtrip(c, "dtypes-router", make_batch(2))
    assert shape == reference
    c.clear_partition("dtypes-router")


def test_stowd_router_over_transferqueue_units(clients, stowd_over_tq, reference):
    """stowd's router decodes every dtype and forwards it to TransferQueue's
    own SimpleStorageUnits, which store and return it through stowd."""
    c = clients("Stowage", {"protocol": "transferqueue", "endpoint": stowd_over_tq["router"]["endpoint"]})
    shape, _ = roundtrip(c, "dtypes-over-tq", make_batch(4))
    assert shape == reference
    c.clear_partition("dtypes-over-tq")


def test_stowage_client_reads_and_writes_what_transferqueue_stores(clients, stowd):
    """TransferQueue puts into stowd's units; the Stowage client reads those
    rows over stowage/1 as torch tensors of the same dtype, byte-equal. It
    then puts the same tensors itself under new indexes and gets them back
    as torch tensors and as raw bits. (TransferQueue cannot read rows its
    controller did not record, so that direction is the client's alone.)"""
    c = clients("SimpleStorage", {"zmq_info": stq.storage_unit_infos(stowd["units"])})
    batch = make_batch(3)
    meta = c.put(batch, partition_id="dtypes-cross")
    names = [f"x_{d}" for d in DTYPES]
    order = list(meta.global_indexes)[::-1]
    with stowage.Client(stowd["native"], timeout=30) as s:
        got = s.get(order, names, as_torch=True)
        for d in DTYPES:
            f = f"x_{d}"
            t = got[f]
            assert t.dtype == getattr(torch, d) and tuple(t.shape) == (N, 3), (f, t.dtype, t.shape)
            assert raw(t) == raw(batch[f].flip(0)), f
        # the same tensors, put by the Stowage client, read back as bits and as torch
        fresh = [10_000 + i for i in range(N)]
        s.put(fresh, {f: batch[f] for f in names})
        again = s.get(fresh, names, as_torch=True)
        bits = s.get(fresh, names, as_torch=False)
        for f in names:
            assert again[f].dtype == batch[f].dtype and raw(again[f]) == raw(batch[f]), f
            assert bits[f].tobytes() == raw(batch[f]), f
        s.clear(fresh)
    c.clear_partition("dtypes-cross")


def test_transferqueue_storage_checkpoint_over_stowd_units(clients, stowd, tmp_path):
    """TransferQueue's own SimpleStorage manager checkpoints stowd's units
    (SAVE_STORAGE_CHECKPOINT / LOAD_STORAGE_CHECKPOINT, issue 16): it writes
    one file per unit where it says and its own manifest beside them; after
    stowd's units lost the rows, a load brings every dtype back byte for
    byte, and the files are safetensors files that safetensors' own torch
    loader reads."""
    c = clients("SimpleStorage", {"zmq_info": stq.storage_unit_infos(stowd["units"])})
    batch = make_batch(7)
    meta = c.put(batch, partition_id="dtypes-ckpt")
    pos = {g: i for i, g in enumerate(meta.global_indexes)}
    fields = [f"x_{d}" for d in DTYPES]
    c.save_storage_checkpoint(str(tmp_path))
    su = tmp_path / "simple_storage"  # TransferQueue 0.1.11's layout
    files = sorted(p.name for p in su.iterdir())
    assert sum(f.endswith(".pkl") for f in files) == 2 and len(files) == 3, files

    def fetch(task: str):
        fetched = c.get_meta(data_fields=fields, batch_size=N, partition_id="dtypes-ckpt",
                             mode="fetch", task_name=task)
        return fetched, c.get_data(fetched)

    # stowd's units lose the rows (cleared over stowage/1: TransferQueue's
    # controller still lists them), so TransferQueue cannot read them...
    with stowage.Client(stowd["native"], timeout=30) as s:
        s.clear(list(meta.global_indexes))
    with pytest.raises(Exception, match="not found|TQKeyNotFound"):
        fetch("ckpt-before-load")
    # ... until it loads its checkpoint.
    c.load_storage_checkpoint(str(tmp_path))
    fetched, full = fetch("ckpt-after-load")
    assert_rows_equal(full, batch, [pos[g] for g in fetched.global_indexes])

    # The unit files are safetensors: torch reads every tensor (numpy has no
    # bfloat16 to read them all); each is a run of stored rows whose global
    # indexes the "stowage" metadata lists.
    import json as _json

    from safetensors import safe_open
    rows = 0
    for f in files:
        if not f.endswith(".pkl"):
            continue
        with safe_open(str(su / f), "pt") as fh:
            entries = _json.loads(fh.metadata()["stowage"])["entries"]
            for i, (field, kind, dtype, shape, indexes) in enumerate(entries):
                t = fh.get_tensor(str(i))
                if kind == "rows":
                    assert shape[0] == len(indexes)
                    # Its own dtype and shape, or bytes where safetensors has no such dtype.
                    assert list(t.shape) == shape or (t.dtype == torch.uint8 and t.dim() == 1)
                rows += len(indexes)
    assert rows == N * len(DTYPES)
    c.clear_partition("dtypes-ckpt")
