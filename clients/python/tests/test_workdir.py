"""stowage.ray keeps each node's files in a private directory (issue 14,
finding 9): the default is no longer the shared /tmp/stowage-ray, and a
directory another user owns or can write is refused, not adopted.

Ray is not needed: the path rules live in `stowage._workdir`, and
`stowage.ray` is imported over a stub `ray` module when Ray is missing (the
`sray` fixture in conftest.py), so that `StowdNode` (a plain class) can run
here with a fake stowd.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

from stowage import _workdir
from stowage._workdir import InsecureDirectory, check_private_dir, ensure_private_dir, node_dirs

ROOT = os.geteuid() == 0
NOBODY = 65534


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def base(tmp_path):
    # pytest's tmp_path is 0700 under a 0700 per-user directory in /tmp.
    os.chmod(tmp_path, 0o700)
    return tmp_path


@pytest.fixture
def no_xdg(monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)


FAKE_STOWD = """#!/bin/sh
# A stand-in for `stowd serve --config C --endpoints-file F`: writes the
# endpoints file with its pid, then waits (exec keeps the pid).
ep="$5"
printf '{"pid": %s, "native": "tcp://127.0.0.1:1", "units": [], "router": null}' $$ > "$ep.tmp"
mv "$ep.tmp" "$ep"
exec sleep 60
"""


def spec(tmp_path, **kw) -> dict:
    stowd = tmp_path / "fake-stowd"
    stowd.write_text(FAKE_STOWD)
    stowd.chmod(0o755)
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    out = {
        "stowd_bin": str(stowd), "plugin_dir": str(plugins), "units_per_node": 1, "capacity_bytes": 0,
        "host": "127.0.0.1", "shm": False, "shm_dir": None, "config": {}, "workdir": None,
        "start_timeout": 20.0,
    }
    out.update(kw)
    return out


# ---------------------------------------------------------------- the rules


def test_a_missing_directory_is_created_0700_with_its_parents(base):
    d = ensure_private_dir(base / "a" / "b" / "c")
    assert d == (base / "a" / "b" / "c").resolve()
    for p in (base / "a", base / "a" / "b", d):
        assert mode(p) == 0o700, p


def test_a_directory_others_can_write_is_refused(base):
    d = base / "wd"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(InsecureDirectory, match=r"writable by group or others \(mode 0777\)"):
        ensure_private_dir(d)
    os.chmod(d, 0o700)
    ensure_private_dir(d)


def test_an_ancestor_others_can_write_is_refused_unless_sticky(base):
    up = base / "up"
    d = up / "wd"
    d.mkdir(parents=True)
    os.chmod(d, 0o700)
    os.chmod(up, 0o777)
    with pytest.raises(InsecureDirectory, match=r"ancestor .*up.* writable by group or others"):
        check_private_dir(d)
    os.chmod(up, 0o1777)  # sticky, like /tmp: fine above a 0700 directory ...
    check_private_dir(d)
    os.chmod(d, 0o755)  # ... but not above one others can read
    with pytest.raises(InsecureDirectory, match="sticky"):
        check_private_dir(d)


def test_a_directory_of_another_user_is_refused(base):
    d = base / "theirs"
    d.mkdir(mode=0o700)
    with pytest.raises(InsecureDirectory, match="owned by uid"):
        check_private_dir(d, uid=os.geteuid() + 1)
    if ROOT:
        os.chown(d, NOBODY, NOBODY)
        with pytest.raises(InsecureDirectory, match=f"owned by uid {NOBODY}"):
            ensure_private_dir(d)


def test_a_symlink_is_checked_where_it_points(base):
    target = base / "target"
    target.mkdir(mode=0o777)
    os.chmod(target, 0o777)
    link = base / "link"
    link.symlink_to(target)
    with pytest.raises(InsecureDirectory, match="target"):
        ensure_private_dir(link)


# ---------------------------------------------------------------- where stowage.ray puts things


def test_xdg_runtime_dir_is_used_when_usable(base, monkeypatch):
    xdg = base / "run-user"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    node, cache, launch = node_dirs(None, "L1", "n" * 40)
    assert node == xdg.resolve() / "stowage-ray" / "L1" / ("n" * 40)
    assert cache == xdg.resolve() / "stowage-ray" / "plugin-cache"
    assert launch == node.parent
    assert mode(node) == 0o700 and mode(xdg / "stowage-ray") == 0o700
    # Not usable: open to others, or relative. Then a temporary directory.
    os.chmod(xdg, 0o755)
    assert _workdir.runtime_dir() is None
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/dir")
    assert _workdir.runtime_dir() is None


def test_without_xdg_each_node_gets_a_fresh_private_temp_dir_found_again_after_a_restart(no_xdg):
    node_id = "ab" * 20
    node, cache, launch = node_dirs(None, "L2", node_id)
    try:
        assert node.parent == Path(tempfile.gettempdir()).resolve()
        assert node.name.startswith(f"stowage-ray-{os.geteuid()}-L2-{node_id[:16]}-")
        assert mode(node) == 0o700 and cache == node / "plugin-cache" and launch is None
        assert Path(tempfile.gettempdir()) / "stowage-ray" not in node.parents
        # The actor restarted by Ray finds the same directory.
        assert node_dirs(None, "L2", node_id)[0] == node
    finally:
        os.rmdir(node)


@pytest.mark.skipif(not ROOT, reason="needs root to make a directory owned by another user")
def test_a_planted_temp_dir_of_another_user_is_not_adopted(no_xdg):
    node_id = "cd" * 20
    planted = Path(tempfile.gettempdir()) / (_workdir._tmp_prefix("L3", node_id) + "planted")
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    try:
        node, _, _ = node_dirs(None, "L3", node_id)
        assert node != planted.resolve()
        os.rmdir(node)
    finally:
        os.rmdir(planted)


def test_an_explicit_workdir_others_can_write_is_refused(base):
    wd = base / "wd"
    wd.mkdir()
    os.chmod(wd, 0o777)
    with pytest.raises(InsecureDirectory, match="0777"):
        node_dirs(wd, "L4", "n1")
    assert not (wd / "L4").exists()


# ---------------------------------------------------------------- stowage.ray itself


def test_ray_has_no_shared_default_workdir(sray, tmp_path, no_xdg):
    assert not hasattr(sray, "DEFAULT_WORKDIR")
    node = sray.StowdNode("L5", "ef" * 20, "127.0.0.1", spec(tmp_path))
    try:
        assert mode(node.dir) == 0o700 and node.dir.stat().st_uid == os.geteuid()
        assert Path(tempfile.gettempdir()).resolve() / "stowage-ray" not in node.dir.parents
        node.prepare()
        info = node.start(None)
        assert info["endpoints"]["pid"] == node.proc.pid
        config = tomllib.loads(node.config_path.read_text())
        assert config["plugins"]["cache_dir"] == str(node.cache_dir)
        assert node.cache_dir.parent == node.dir
        for f in (node.config_path, node.endpoints_path, node.state_path, node.log_path):
            assert f.parent == node.dir
    finally:
        node.stop()
    assert not node.dir.exists()
    assert Path(tempfile.gettempdir()).exists()


def test_ray_refuses_a_workdir_another_user_can_write(sray, tmp_path):
    os.chmod(tmp_path, 0o700)
    wd = tmp_path / "wd"
    wd.mkdir()
    os.chmod(wd, 0o777)
    with pytest.raises(InsecureDirectory, match="writable by group or others"):
        sray.StowdNode("L6", "n1", "127.0.0.1", spec(tmp_path, workdir=str(wd)))
    if ROOT:
        os.chmod(wd, 0o700)
        os.chown(wd, NOBODY, NOBODY)
        with pytest.raises(InsecureDirectory, match=f"owned by uid {NOBODY}"):
            sray.StowdNode("L6", "n1", "127.0.0.1", spec(tmp_path, workdir=str(wd)))
