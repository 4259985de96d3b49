"""Fixtures: real `stowd` processes on 127.0.0.1 (see stowd_harness.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The client package of this tree (with its built Rust core,
# stowage/_core.abi3.so): the tests encode and decode stowage/1 with it.
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "clients" / "python"))

from stowd_harness import fixtures_dir, run_stowd, stowd_binary  # noqa: E402


@pytest.fixture(scope="session")
def stowd_bin() -> Path:
    return stowd_binary()


@pytest.fixture(scope="session")
def tq_fixtures() -> Path:
    return fixtures_dir()


@pytest.fixture(scope="session")
def stowd(stowd_bin, tmp_path_factory):
    """One stowd with the default configuration for the whole session:
    2 local units, a router endpoint over them, the native endpoint.
    Yields the parsed endpoints file (a dict; see stowd_harness.Stowd).
    Tests sharing it use disjoint global indexes (stowd_harness.fresh_indexes).
    Its units are unbounded (`memory_percent = 0`), as TransferQueue's are
    by default: the fixture comparisons expect a capacity of None."""
    with run_stowd(tmp_path_factory.mktemp("stowd-default"), config="[units]\nmemory_percent = 0\n",
                   name="stowd-default") as server:
        yield server


@pytest.fixture(scope="session")
def stowd_small(stowd_bin, tmp_path_factory):
    """A stowd whose units hold at most 4096 bytes each."""
    config = "[units]\nlocal = 2\ncapacity_bytes = 4096\n"
    with run_stowd(tmp_path_factory.mktemp("stowd-small"), config=config, name="stowd-small") as server:
        yield server


@pytest.fixture(scope="module")
def fresh_stowd(stowd_bin, tmp_path_factory):
    """A default stowd private to one test module (for exact counters), its
    units unbounded like `stowd`'s (the fixtures expect a capacity of None)."""
    with run_stowd(tmp_path_factory.mktemp("stowd-fresh"), config="[units]\nmemory_percent = 0\n",
                   name="stowd-fresh") as server:
        yield server


@pytest.fixture(params=["unit", "router"])
def tq_target(request, stowd):
    """(endpoint, sender id) of unit 0 or of the router of the shared stowd."""
    if request.param == "unit":
        return stowd["units"][0]["endpoint"], stowd["units"][0]["id"]
    return stowd["router"]["endpoint"], stowd["router"]["id"]
