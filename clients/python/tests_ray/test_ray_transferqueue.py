"""TransferQueue 0.1.11 on Ray with Stowage as its storage, wired by
`StowageCluster.transferqueue_config()` (the native backend): tq.init() in
the driver (its controller is a Ray actor), kv_batch_put from one Ray task,
kv_batch_get from another, put/get_data from a Ray actor, the rows in
stowd's units; TransferQueue's save_checkpoint/load_checkpoint. The workers
join through a bare `tq.init()`, and Ray is started WITHOUT the
`worker_process_setup_hook`: the marker `tq.init()` leaves in the config it
stores with the controller registers the backend in each worker. Needs
transferqueue==0.1.11 (and torch) in the interpreter: skipped otherwise (run
it with the TransferQueue venv of ../tests_optin, see README.md here)."""

from __future__ import annotations

import logging
import sys
import time

import numpy as np
import pytest
import ray

tq = pytest.importorskip("transfer_queue", reason="transfer_queue not installed (TransferQueue venv needed)")

import stowage.ray as sray  # noqa: E402
import stowage.transferqueue  # noqa: E402,F401  (registers the "Stowage" backend in this process)
from conftest import OBJECT_STORE_BYTES, describe, live_children, ray_dir, stowd_bin, wait_gone  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 12


@pytest.fixture(scope="module")
def tq_ray(ray_temp_dir):
    assert not live_children(), f"processes left from before: {describe(live_children())}"
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        num_cpus=1,  # TransferQueue's controller takes it; the tasks below ask for none
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        _temp_dir=ray_dir(ray_temp_dir),
        # No worker_process_setup_hook: a bare tq.init() in a worker registers
        # the backend from the config it reads (stowage.transferqueue._Registrar).
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        left = wait_gone([p.pid for p in live_children()], timeout=20)
        assert not left, f"processes left after ray.shutdown(): {describe(left)}"


def make_fields(seed: int):
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    return TensorDict({"x": torch.randn(N, 3, generator=g), "ids": torch.arange(N) * 10 + seed}, batch_size=N)


@ray.remote(num_cpus=0)
def producer(keys):
    import transfer_queue as tq

    tq.init()  # attaches to the driver's controller; storage from its config
    tq.kv_batch_put(keys=keys, partition_id="rollout", fields=make_fields(seed=3))
    return type(tq.get_client().storage_manager).__name__


@ray.remote(num_cpus=0)
class Trainer:
    """A Ray actor that joins through a bare tq.init() and uses the client API."""

    def __init__(self):
        import transfer_queue as tq

        tq.init()

    def roundtrip(self, partition):
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict

        client = tq.get_client()
        batch = TensorDict({"x": torch.arange(N * 2, dtype=torch.float32).reshape(N, 2),
                            "ids": torch.nested.as_nested_tensor([torch.arange(i + 1) for i in range(N)],
                                                                 layout=torch.jagged)}, batch_size=N)
        meta = client.put(batch, partition_id=partition)
        got = client.get_data(meta)
        ok = all(torch.equal(a, b) for f in ("x", "ids") for a, b in zip(got[f].unbind(), batch[f].unbind()))
        return type(client.storage_manager).__name__, client.storage_manager.same_node, ok


@ray.remote(num_cpus=0)
def consumer(keys):
    import transfer_queue as tq

    tq.init()
    got = tq.kv_batch_get(keys=keys, partition_id="rollout", select_fields=["x", "ids"])
    # Row by row: TransferQueue may hand a field back as a nested (jagged) tensor.
    return np.stack([r.numpy() for r in got["x"]]), np.stack([r.numpy() for r in got["ids"]])


def test_transferqueue_on_ray_uses_the_launched_units(tq_ray, tmp_path):
    # TransferQueue's checkpoint below goes under tmp_path: a root of its own
    # (stowd writes checkpoints only under [checkpoint] roots).
    h = sray.launch(stowd_bin=stowd_bin(), workdir=tmp_path / "wd",
                    config={"checkpoint": {"roots": [str(tmp_path)]}})
    try:
        # What a TransferQueue user adds: the backend section from the handle.
        conf = tq.init({"backend": h.transferqueue_config()})
        assert conf.backend.storage_backend == "Stowage"
        assert dict(conf.backend.Stowage.natives) == {h.local().node_id: h.local().native}
        keys = [f"sample-{i}" for i in range(N)]
        t0 = time.monotonic()
        manager = ray.get(producer.remote(keys), timeout=300)
        assert manager == "StowageStorageManager"
        x, ids = ray.get(consumer.remote(keys[::-1]), timeout=300)
        trainer = Trainer.remote()
        assert ray.get(trainer.roundtrip.remote("actor"), timeout=300) == ("StowageStorageManager", True, True)
        ray.kill(trainer)
        # TransferQueue's own checkpoints: stowd's checkpoint under <dir>/stowage
        tq.save_checkpoint(str(tmp_path / "ckpt"))
        assert (tmp_path / "ckpt" / "stowage").is_dir()
        tq.load_checkpoint(str(tmp_path / "ckpt"))
        x2, _ = ray.get(consumer.remote(keys[::-1]), timeout=300)
        np.testing.assert_array_equal(x2, x)
        print(f"\nTransferQueue put + get from two Ray tasks: {time.monotonic() - t0:.2f} s")
        want = make_fields(seed=3)
        np.testing.assert_array_equal(x, want["x"].numpy()[::-1])
        np.testing.assert_array_equal(ids, want["ids"].numpy()[::-1])
        # The rows are in stowd's units: N rows x 2 fields (+ the actor's), spread g % 2.
        with h.client(same_node=False) as c:
            assert c.stats()["keys"] == 4 * N
        # mode="router": each process resolves its own node's router endpoint.
        infos = stowage.transferqueue.resolve_zmq_info(h.transferqueue_config("router")["Stowage"])
        (info,) = infos.values()
        assert f"tcp://{info.ip}:{info.ports['put_get_socket']}" == h.local().router

        # tq.close() closes the Stowage backend as TransferQueue's own: no
        # "not supported" warning, its storage table and client gone; stowd
        # (started outside TransferQueue) keeps serving the rows.
        from transfer_queue import interface

        assert interface._TQ_STORAGE == {"Stowage": {}}
        records: list[logging.LogRecord] = []
        handler = logging.Handler(logging.DEBUG)
        handler.emit = records.append  # type: ignore[method-assign]
        tq_log = logging.getLogger("transfer_queue.interface")
        tq_log.addHandler(handler)
        try:
            tq.close()
        finally:
            tq_log.removeHandler(handler)
        said = [r.getMessage() for r in records]
        assert not [m for m in said if "not supported" in m or "Stowage" in m], said
        assert interface._TQ_STORAGE is None and interface._TQ_CLIENT is None
        assert interface._TQ_CONTROLLER is None
        with h.client(same_node=False) as c:
            assert c.stats()["keys"] == 4 * N
    finally:
        tq.close()  # idempotent
        h.shutdown()
