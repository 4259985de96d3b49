"""Fixtures both opt-in modules use: a stowd on its defaults, TransferQueue's
controller and two of its SimpleStorageUnits built without Ray, and a stowd
whose router fans out to those units. Each module skips itself when
transfer_queue is not installed; these fixtures import it only when used."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = HERE.parent  # clients/python
REPO = PACKAGE_ROOT.parents[1]
sys.path.insert(0, str(PACKAGE_ROOT))
sys.path.insert(1, str(REPO / "tests" / "python"))

from stowd_harness import run_stowd, stowd_binary  # noqa: E402


def direct(actor_cls):
    """The plain class behind a @ray.remote class (how to build one without Ray)."""
    return actor_cls.__ray_metadata__.modified_class


@pytest.fixture(scope="module")
def controller():
    from transfer_queue.controller import TransferQueueController

    return direct(TransferQueueController)()


@pytest.fixture(scope="module")
def stowd(tmp_path_factory, request):
    """stowd on its defaults: two local units and a router over them."""
    stowd_binary()
    tag = request.module.__name__.rsplit(".", 1)[-1]
    with run_stowd(tmp_path_factory.mktemp(f"optin-{tag}"), name=f"stowd-{tag}") as s:
        yield s


@pytest.fixture(scope="module")
def tq_units():
    """Two TransferQueue SimpleStorageUnits, in this process."""
    from transfer_queue.storage import SimpleStorageUnit

    units = [direct(SimpleStorageUnit)(config={"num_data_storage_units": 2}) for _ in range(2)]
    yield units
    for u in units:
        u.shutdown()


@pytest.fixture(scope="module")
def stowd_over_tq(tmp_path_factory, tq_units, request):
    """stowd with no local units whose router fans out to TransferQueue's own units."""
    eps = [u.zmq_server_info.to_addr("put_get_socket") for u in tq_units]
    config = "[units]\nlocal = 0\n[router]\nunits = [" + ", ".join(f'"{e}"' for e in eps) + "]\n"
    tag = request.module.__name__.rsplit(".", 1)[-1]
    with run_stowd(tmp_path_factory.mktemp(f"optin-{tag}-router"), config=config,
                   name=f"stowd-{tag}-over-tq") as s:
        yield s
