"""pytest plugin (`-p tqwheel_plugin`): TransferQueue 0.1.11's own wheel tests
against stowd. Loaded before the wheel's test modules are imported; changes
how storage starts, never what a test asserts.

- Mode `units` (`TQWHEEL_BACKEND=units`, the default): every
  `SimpleStorageUnit` TransferQueue or a test creates is a
  `stowd_unit.StowdStorageUnitActor`: a real stowd with one local unit, same
  constructor, `zmq_server_info`, `get_zmq_server_info()` and `shutdown()`.
  The name is replaced where TransferQueue and the tests look it up
  (`transfer_queue.storage`, `transfer_queue.storage.simple_storage`, the
  SimpleStorage bootstrap). TransferQueue's client and storage manager are
  its own (`AsyncSimpleStorageManager`), speaking its storage-unit protocol
  to stowd's units.
- Mode `native` (`TQWHEEL_BACKEND=native`): the SimpleStorage bootstrap that
  `transfer_queue.init()` runs starts one stowd (`StowdServerActor`, as many
  local units as `num_data_storage_units`) and switches the config to the
  Stowage backend (`clients/python/stowage/transferqueue.py`, the
  `stowage/1` adapter): `backend.storage_backend = NATIVE_BACKEND` with
  the section `native_section(endpoints_file)`. Tests that create units
  themselves (not through `init()`) get stowd units as in mode `units`.

Either way `ray.init()` without an address gets `num_cpus=$TQWHEEL_NUM_CPUS`
(default 4) unless the caller gave one: TransferQueue's tests need at least
3 logical CPUs and this machine may have fewer cores.

Excluded tests are skipped with their reason (`EXCLUDED`); `run.py` picks the
files (`FILES`).
"""

from __future__ import annotations

import os

import pytest

MODE = os.environ.get("TQWHEEL_BACKEND", "units")

# --- the native mode's hook: the adapter's backend name and config section.
NATIVE_BACKEND = "Stowage"


def native_section(endpoints_file: str) -> dict:
    """`backend.Stowage` for the native (stowage/1) adapter."""
    return {"endpoints_file": endpoints_file, "protocol": "stowage"}


# --- which of the wheel's tests go through a storage unit (paths relative
# to the wheel's `tests/` folder).
FILES = {
    "units": [
        "test_simple_storage_unit.py",
        "e2e/test_e2e_lifecycle_consistency.py",
        "e2e/test_checkpoint_e2e.py",
        "e2e/test_kv_interface_e2e.py",
        "e2e/test_ssd_offload_e2e.py",
    ],
    # Only tests that pick their storage through transfer_queue.init()'s
    # config can switch backend.
    "native": [
        "e2e/test_e2e_lifecycle_consistency.py",
        "e2e/test_checkpoint_e2e.py",
        "e2e/test_kv_interface_e2e.py",
        "e2e/test_ssd_offload_e2e.py",
    ],
}

_DATA_PARSER = ("data_parser on TransferQueue's storage-unit protocol: stowd runs no Python, so a PUT "
                "carrying a callable is refused by design (PUT_ERROR 'data_parser must be nil: stowd does "
                "not run Python callables'); the native Stowage backend runs it in the client instead")
_INTERNAL = ("unit-internal: tests SimpleStorageUnit's Python storage classes directly "
             "(StorageUnitData / HybridStorageUnitData / SSDFileStore), never a storage unit's socket")
_SSD = ("unit-internal: SimpleStorageUnit's SSD offload (HybridStorageUnitData) and the files it "
        "writes under backend.SimpleStorage.ssd_offload.path; stowd spills with [units] spill_dir")

EXCLUDED = {
    "test_simple_storage_unit.py::test_storage_unit_data_parser": _DATA_PARSER,
    "test_simple_storage_unit.py::test_storage_unit_data_parser_callable_types": _DATA_PARSER,
    "test_simple_storage_unit.py::test_storage_unit_data_parser_validation": _DATA_PARSER,
    "test_simple_storage_unit.py::test_storage_unit_data_direct": _INTERNAL,
    "test_simple_storage_unit.py::test_storage_unit_data_capacity_uses_active_keys": _INTERNAL,
    "test_simple_storage_unit.py::test_hybrid_storage_routes_each_sample_by_payload_size_and_clears": _INTERNAL,
    "test_simple_storage_unit.py::test_hybrid_storage_cleans_completed_ssd_writes_after_batch_failure": _INTERNAL,
    "test_simple_storage_unit.py::test_failed_ssd_overwrite_preserves_old_value": _INTERNAL,
    "test_simple_storage_unit.py::test_hybrid_storage_requires_positive_threshold": _INTERNAL,
    "test_simple_storage_unit.py::test_hybrid_checkpoint_copies_ssd_values_without_materializing": _INTERNAL,
    "test_simple_storage_unit.py::test_hybrid_checkpoint_load_failure_preserves_existing_state": _INTERNAL,
    "test_simple_storage_unit.py::test_hybrid_storage_loads_legacy_logical_checkpoint": _INTERNAL,
    "test_simple_storage_unit.py::test_hybrid_storage_round_trips_supported_codecs": _INTERNAL,
    "test_simple_storage_unit.py::test_ssd_file_store_creates_missing_parent_directories": _INTERNAL,
    "e2e/test_ssd_offload_e2e.py": _SSD,
}


_SS_LAYOUT = ("SimpleStorage-internal: asserts SimpleStorage's own checkpoint files (<dir>/simple_storage/, "
              "storage_unit_info.json, which it then edits; include_storage=False forced to True only for "
              "AsyncSimpleStorageManager); the Stowage backend writes stowd's snapshot in <dir>/stowage, and "
              "the other checkpoint tests run its save/load round trips")

# Only in mode native (mode units runs them: there the files are SimpleStorage's).
EXCLUDED_NATIVE = {
    "e2e/test_checkpoint_e2e.py::TestCheckpointRoundtrip::test_tensor_fields": _SS_LAYOUT,
    "e2e/test_checkpoint_e2e.py::TestIncludeStorageFalse::test_storage_saved_is_true": _SS_LAYOUT,
    "e2e/test_checkpoint_e2e.py::TestCheckpointErrors::test_load_raises_on_storage_unit_count_mismatch": _SS_LAYOUT,
}


def _excluded(nodeid: str) -> str | None:
    path, _, rest = nodeid.partition("::")
    # The wheel's tests live in .../site-packages/tests/: ids relative to it.
    rel = path.split("tests/", 1)[-1] if "tests/" in path else path
    name = rest.split("[", 1)[0]
    table = dict(EXCLUDED, **EXCLUDED_NATIVE) if MODE == "native" else EXCLUDED
    return table.get(f"{rel}::{name}") or table.get(rel)


def _patch_ray_init() -> None:
    import ray

    original = ray.init
    if getattr(original, "_tqwheel", False):
        return

    def init(*args, **kwargs):
        if not args and kwargs.get("address") is None and "num_cpus" not in kwargs:
            kwargs["num_cpus"] = int(os.environ.get("TQWHEEL_NUM_CPUS", "4"))
        return original(*args, **kwargs)

    init._tqwheel = True
    ray.init = init


def _patch_units() -> None:
    import transfer_queue.storage as storage
    import transfer_queue.storage.bootstrap.simple_storage_bootstrap as bootstrap
    import transfer_queue.storage.simple_storage as simple
    from stowd_unit import StowdStorageUnitActor

    for module in (storage, simple, bootstrap):
        module.SimpleStorageUnit = StowdStorageUnitActor


def _patch_native_bootstrap() -> None:
    import ray
    import stowage.transferqueue  # noqa: F401  registers backend "Stowage"
    from stowd_unit import StowdServerActor
    from transfer_queue.storage.bootstrap import StorageBootstrapProvider

    @StorageBootstrapProvider.register_provider("SimpleStorage")
    def native_bootstrap(conf):
        units = int(conf.backend.SimpleStorage.get("num_data_storage_units", 2) or 2)
        server = StowdServerActor.remote(units)
        endpoints_file = ray.get(server.get_endpoints_file.remote())
        conf.backend.storage_backend = NATIVE_BACKEND
        conf.backend[NATIVE_BACKEND] = native_section(endpoints_file)
        # What init() would have run for that backend (the adapter's own
        # bootstrap leaves the marker that registers it in Ray workers).
        adapter_bootstrap = StorageBootstrapProvider.get_provider(NATIVE_BACKEND)
        if adapter_bootstrap is not None:
            adapter_bootstrap(conf)
        # Kept under "SimpleStorage" in transfer_queue's own bookkeeping, so
        # transfer_queue.close() shuts the server down as it would its units.
        return {"stowd": server}


_patch_ray_init()
_patch_units()
if MODE == "native":
    _patch_native_bootstrap()
elif MODE != "units":
    raise pytest.UsageError(f"TQWHEEL_BACKEND must be 'units' or 'native', got {MODE!r}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = _excluded(item.nodeid)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"excluded: {reason}"))


def pytest_report_header(config):
    return f"tqwheel: backend={MODE} (SimpleStorageUnit -> stowd)"
