"""The PEP 517 backend of the `stowage` package: maturin's, with `stowd`
and the bundled policy plugins put into the package first, so that `pip
install ./clients/python` and a build from the sdist give the wheel that
`cargo xtask wheel` gives: the client, its Rust core, `stowage/_bin/stowd`
and `stowage/plugins/*.wasm`, and a `stowd` command on PATH.

- `build_wheel`: finds the Cargo workspace that holds stowd (the
  repository around `clients/python`, or `stowd-src/` inside the sdist),
  runs `cargo xtask wheel --stage <package>` there (it builds the plugins
  and release stowd and copies them into the package), then maturin's
  `build_wheel`, then removes the staged files. Needs Rust 1.95 with
  rustup (the plugins' `wasm32-wasip2` target is added if missing); the
  first build takes several minutes (wasmtime). Set `CARGO_TARGET_DIR` to
  reuse a build. `-C stowd=skip` (pip's `--config-settings`) builds the
  client alone.
- `build_sdist`: maturin's sdist (the client, its core and the crates the
  core uses) plus `stowd-src/`, the rest of the workspace's files (`git
  ls-files`, without docs, benches, fuzz corpora and the client's tests),
  so that the sdist builds the same wheel.
- everything else is maturin's.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import maturin
from maturin import (  # noqa: F401  (re-exported PEP 517 hooks)
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

SDIST_WORKSPACE = "stowd-src"
"""Where the sdist keeps the workspace stowd is built from."""

# Workspace paths the sdist leaves out: not needed to build the wheel.
_LEFT_OUT = ("docs/", "bench/", "fuzz/corpus/", "fuzz/regressions/", "clients/python/tests", ".ci/")
_SETTING = "stowd"


def _log(msg: str) -> None:
    sys.stderr.write(f"stowage_build: {msg}\n")
    sys.stderr.flush()


def _workspace() -> Path | None:
    """The Cargo workspace that builds stowd, from the source tree pip
    builds in (the current directory)."""
    here = Path.cwd()
    for root in (here / SDIST_WORKSPACE, here.parent.parent):
        manifest = root / "Cargo.toml"
        if manifest.is_file() and (root / "host" / "Cargo.toml").is_file() and "[workspace]" in manifest.read_text():
            return root
    return None


def _wants_stowd(config_settings) -> bool:
    value = (config_settings or {}).get(_SETTING, "build")
    if value not in ("build", "skip"):
        raise ValueError(f"config setting {_SETTING}={value!r}: expected 'build' or 'skip'")
    return value == "build"


def _maturin_settings(config_settings):
    return {k: v for k, v in (config_settings or {}).items() if k != _SETTING} or None


def _stage() -> list[Path]:
    """Builds stowd and the plugins and copies them into the package;
    returns what to remove afterwards."""
    root = _workspace()
    if root is None:
        raise RuntimeError(
            f"cannot find the Stowage workspace to build stowd from (looked at {Path.cwd() / SDIST_WORKSPACE} "
            f"and {Path.cwd().parent.parent}); build the client alone with `-C {_SETTING}=skip`"
        )
    cargo = shutil.which("cargo")
    if cargo is None:
        raise RuntimeError(
            "building stowd needs Rust 1.95 (cargo on PATH, from rustup); "
            f"or build the client alone with `-C {_SETTING}=skip`"
        )
    package = Path.cwd() / "stowage"
    _log(f"building stowd and the plugins in {root}")
    # stdout carries maturin's answer to pip: everything of ours goes to stderr.
    subprocess.run([cargo, "xtask", "wheel", "--stage", str(package)], cwd=root, check=True, stdout=sys.stderr)
    return [package / "_bin", package / "plugins"]


def _unstage(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    staged = _stage() if _wants_stowd(config_settings) else []
    try:
        return maturin.build_wheel(wheel_directory, _maturin_settings(config_settings), metadata_directory)
    finally:
        _unstage(staged)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    # An editable install runs the package from this tree: the staged files stay.
    if _wants_stowd(config_settings):
        _stage()
    return maturin.build_editable(wheel_directory, _maturin_settings(config_settings), metadata_directory)


def _workspace_files(root: Path) -> list[str]:
    if (root / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, stdout=subprocess.PIPE).stdout
        files = [f for f in out.decode().split("\0") if f]
    else:  # an sdist's own stowd-src/ (an sdist built from the sdist)
        files = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file()]
    return [f for f in files if not f.startswith(_LEFT_OUT) and (root / f).is_file()]


def build_sdist(sdist_directory, config_settings=None):
    name = maturin.build_sdist(sdist_directory, _maturin_settings(config_settings))
    root = _workspace()
    if root is None:
        raise RuntimeError("cannot find the Stowage workspace: the sdist would not build stowd")
    path = Path(sdist_directory) / name
    with tarfile.open(path, "r:gz") as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    top = members[0][0].name.split("/")[0]
    added = 0
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for m, data in members:
            tar.addfile(m, io.BytesIO(data) if data is not None else None)
        for f in _workspace_files(root):
            src = root / f
            info = tar.gettarinfo(str(src), arcname=f"{top}/{SDIST_WORKSPACE}/{f}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = members[0][0].mtime
            with open(src, "rb") as fh:
                tar.addfile(info, fh)
            added += 1
    _log(f"added {added} workspace files under {top}/{SDIST_WORKSPACE}/ to {name}")
    return name
