"""The stowd config `stowage.ray` writes (issue 18): TOML from `tomli_w`,
read back with `tomllib`, equals what was asked for, awkward strings
included (quotes, backslashes, newlines, non-ASCII); and a real `stowd`
started by `StowdNode` from such a file uses the awkward paths it names.

Ray is not needed: `stowage.ray` is imported over a stub `ray` (the `sray`
fixture in conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import numpy as np
import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

import stowage
from stowd_harness import stowd_binary

AWKWARD = [
    'say "hi"',
    "back\\slash \\n not a newline",
    "two\nlines\r\nand a tab\t",
    "Grüße, 東京, ünïcødé 🚀",
    "'single' and \"\"\"triple\"\"\" quotes",
    "[not.a.table]",
    "# not a comment",
    "",
    "\x01\x1f\x7f control",
]
# A directory name with all of it (a path component holds anything but "/" and NUL).
AWKWARD_DIR = 'dir "q" \\ é 東 \n x'


@pytest.fixture
def config_mod(sray):
    from stowage.ray import _config

    return _config


@pytest.mark.parametrize("s", AWKWARD)
def test_strings_round_trip_as_values_and_keys(config_mod, s):
    asked = {"section": {"value": s, s or "empty-key-stand-in": 1, "list": [s, s]}, "top": s}
    assert tomllib.loads(config_mod.dumps(asked)) == asked


def test_a_full_config_round_trips(config_mod):
    asked = {
        "server": {"host": "::1", "native_port": 5555},
        "units": {"local": 3, "port_base": 40000, "capacity_bytes": 1 << 40},
        "router": {"enabled": True, "port": 1, "units": ["local:0", "tcp://[::1]:2", "local:1"]},
        "plugins": {"cache_dir": "/tmp/" + AWKWARD_DIR, "dir": "C:\\plugins\\"},
        "shm": {"enabled": False},
        "limits": {"ratio": 0.25, "big": 2**63 - 1, "neg": -7},
        "empty": {},
        # arrays of tables: short ones (inline) and one too long for a line
        "chain": [
            {"pattern": "rej*", "select": ["drop-row"], "fail": "reject", "max_faults": 0},
            {"pattern": "x" * 120, "select": AWKWARD, "nested": {"deep": {"k": AWKWARD[0]}}},
        ],
        "dotted.key": {"a b": {"c\"d": "e"}},
    }
    text = config_mod.dumps(asked)
    assert tomllib.loads(text) == asked


def test_paths_and_tuples_are_written_as_strings_and_arrays(config_mod):
    asked = {"plugins": {"dir": Path("/x") / AWKWARD_DIR, "more": (PurePosixPath("/a"), "b")}}
    assert tomllib.loads(config_mod.dumps(asked)) == {
        "plugins": {"dir": "/x/" + AWKWARD_DIR, "more": ["/a", "b"]}
    }


def test_a_value_toml_cannot_hold_is_refused(config_mod):
    with pytest.raises(TypeError, match="cannot write the stowd config.*NoneType"):
        config_mod.dumps({"shm": {"dir": None}})
    with pytest.raises(TypeError, match="cannot write the stowd config.*object"):
        config_mod.dumps({"x": [object()]})


def test_launch_config_merges_over_what_launch_sets(config_mod):
    spec = {"units_per_node": 2, "capacity_bytes": 0, "shm": True, "shm_dir": AWKWARD_DIR,
            "config": {"limits": {"max_rows": 9}, "plugins": {"compile": AWKWARD[1]}}}
    got = config_mod.stowd_config(spec, "10.0.0.1", {"native": 1, "unit_base": 2, "router": 3},
                                  ["local:0", "tcp://10.0.0.2:7"], Path("/p") / AWKWARD_DIR, "/c",
                                  Path("/n") / "checkpoint")
    assert got == {
        "server": {"host": "10.0.0.1", "native_port": 1},
        "units": {"local": 2, "port_base": 2, "capacity_bytes": 0},
        "router": {"enabled": True, "port": 3, "units": ["local:0", "tcp://10.0.0.2:7"]},
        "plugins": {"cache_dir": "/c", "dir": "/p/" + AWKWARD_DIR, "compile": AWKWARD[1]},
        "shm": {"enabled": True, "dir": AWKWARD_DIR},
        "security": {"tq_endpoints": "open"},
        "limits": {"max_rows": 9},
        "checkpoint": {"roots": ["/n/checkpoint"]},
    }
    # Roots given in `config` join the node's checkpoint directory.
    spec["config"] = {"checkpoint": {"roots": ["/tq", "/n/checkpoint"], "max_journals": 2}}
    got = config_mod.stowd_config(spec, "h", {"native": 1, "unit_base": 2, "router": 3}, None, None, "/c",
                                  Path("/n") / "checkpoint")
    assert got["checkpoint"] == {"roots": ["/n/checkpoint", "/tq"], "max_journals": 2}
    with pytest.raises(ValueError, match=r"config\['shm'\]\['dir'\] is set by launch\(\): use shm_dir"):
        config_mod.check_reserved({"shm": {"dir": "/x"}})


def test_the_packaged_binary_is_looked_for_inside_the_stowage_package(sray):
    package = Path(stowage.__file__).resolve().parent
    assert sray.PACKAGED_STOWD == package / "_bin" / "stowd"
    assert sray.PACKAGED_PLUGINS == package / "plugins"


def test_a_real_stowd_reads_the_written_config(sray, tmp_path, monkeypatch):
    """StowdNode writes the config and starts the real stowd on it: the file
    reads back as what was asked for, and stowd serves shared memory from
    the awkward directory the file names (a same-node put and get go
    through it)."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    os.chmod(tmp_path, 0o700)
    workdir = tmp_path / ("work " + AWKWARD_DIR)
    shm_dir = tmp_path / ("shm " + AWKWARD_DIR)
    plugins = tmp_path / ("plugins " + AWKWARD_DIR)
    plugins.mkdir()  # empty: the built-in policy, nothing to compile
    spec = {
        "stowd_bin": str(stowd_binary()), "plugin_dir": str(plugins), "units_per_node": 2,
        "capacity_bytes": 0, "host": "127.0.0.1", "shm": True, "shm_dir": str(shm_dir),
        "config": {"limits": {"max_rows": 4096}}, "workdir": str(workdir), "start_timeout": 60.0,
    }
    node = sray.StowdNode("L-config", "n" * 40, "127.0.0.1", spec)
    try:
        node.prepare()
        info = node.start(None)
        ports = node.ports
        text = node.config_path.read_text(encoding="utf-8")
        assert text.startswith("# written by stowage.ray for launch L-config, node ")
        assert tomllib.loads(text) == {
            "server": {"host": "127.0.0.1", "native_port": ports["native"]},
            "units": {"local": 2, "port_base": ports["unit_base"], "capacity_bytes": 0},
            "router": {"enabled": True, "port": ports["router"], "units": []},
            "plugins": {"cache_dir": str(node.cache_dir), "dir": str(plugins.resolve())},
            "shm": {"enabled": True, "dir": str(shm_dir)},
            "security": {"tq_endpoints": "open"},
            "limits": {"max_rows": 4096},
            "checkpoint": {"roots": [str(node.checkpoint_dir)]},
        }
        assert AWKWARD_DIR in str(node.cache_dir)
        ep = info["endpoints"]
        assert ep["shm_dir"] == str(shm_dir)
        assert ep["native"] == f"tcp://127.0.0.1:{ports['native']}"
        x = np.arange(64, dtype=np.float32).reshape(4, 16)
        with stowage.Client(ep["native"], timeout=20, same_node=True) as c:
            assert c.put([0, 1, 2, 3], {"x": x}) == 4
            assert np.array_equal(c.get([3, 0], ["x"])["x"], x[[3, 0]])
        assert [p.name.startswith("stowd-") for p in shm_dir.iterdir()] == [True], \
            "stowd made no channel directory in the configured directory"
    finally:
        node.stop()
    assert not node.dir.exists()


def test_a_launch_token_is_taken_and_presented_by_every_node(config_mod):
    spec = {"units_per_node": 1, "capacity_bytes": 0, "shm": False, "cluster_token": "c" * 64}
    got = config_mod.stowd_config(spec, "10.0.0.1", {"native": 1, "unit_base": 2, "router": 3}, None, None, "/c")
    assert got["security"] == {"tq_endpoints": "open", "tokens": ["c" * 64], "peer_token": "c" * 64}
    del spec["cluster_token"]
    got = config_mod.stowd_config(spec, "10.0.0.1", {"native": 1, "unit_base": 2, "router": 3}, None, None, "/c")
    assert got["security"] == {"tq_endpoints": "open"}
