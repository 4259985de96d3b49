"""Private working directories for `stowage.ray` (no Ray needed here, so
the path rules can be tested without it).

Each node's stowd config, endpoints file, state, log and plugin compile
cache live in a directory that only the user running the actor can write:
another local user who could write there could point stowd at their own
files or forge the endpoints the actor reads back.

The rules (the ones `stowd` applies to its compile cache, as `ssh` does for
its keys): the directory, symlinks resolved, is owned by this process's
effective uid and is not writable by group or others; every ancestor is
owned by root or by this uid and is not writable by group or others, except
a sticky directory such as /tmp, which is accepted as an ancestor only when
the directory itself is mode 0700. Missing directories are created 0700.

Where, per node:
- `launch(workdir=W)`: `W/<launch id>/<node id>`, compile cache `W/plugin-cache`;
  W must pass the rules (`InsecureDirectory` otherwise).
- else `$XDG_RUNTIME_DIR/stowage-ray/...` when that variable names a usable
  runtime directory (ours, mode 0700, writable): the same layout;
- else a fresh `tempfile.mkdtemp()` directory (0700), named
  `stowage-ray-<uid>-<launch id>-<node id>-XXXXXXXX` so that the actor,
  restarted by Ray, finds it again (only a directory that passes the rules
  is taken: another user cannot make one that does). The compile cache is
  then inside it, for this launch only.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

SUBDIR = "stowage-ray"
"""Name of the per-user directory under `$XDG_RUNTIME_DIR`."""


class InsecureDirectory(PermissionError):
    """A working directory that another user could change (the message says
    which path and why)."""


def check_private_dir(path: str | os.PathLike, uid: int | None = None) -> Path:
    """Raises `InsecureDirectory` unless `path` passes the rules of the module
    doc for effective uid `uid` (default: this process's); returns its real path."""
    uid = os.geteuid() if uid is None else uid
    real = Path(os.path.realpath(path))
    try:
        st = os.stat(real)
    except OSError as e:
        raise InsecureDirectory(f"cannot stat {real}: {e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise InsecureDirectory(f"{real} is not a directory")
    if st.st_uid != uid:
        raise InsecureDirectory(f"{real} is owned by uid {st.st_uid}, not by this process's uid {uid}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise InsecureDirectory(f"{real} is writable by group or others (mode {mode:04o}); it must be 0700")
    for anc in real.parents:
        a = os.stat(anc)
        if a.st_uid not in (0, uid):
            raise InsecureDirectory(
                f"ancestor {anc} of {real} is owned by uid {a.st_uid}, neither root nor this process's uid {uid}"
            )
        amode = stat.S_IMODE(a.st_mode)
        if amode & 0o022:
            if not amode & stat.S_ISVTX:
                raise InsecureDirectory(f"ancestor {anc} of {real} is writable by group or others (mode {amode:04o})")
            if mode & 0o077:
                raise InsecureDirectory(
                    f"{real} is under the world-writable sticky directory {anc}, so it must be mode 0700 "
                    f"(it is {mode:04o})"
                )
    return real


def ensure_private_dir(path: str | os.PathLike) -> Path:
    """Creates `path` and any missing parents (each 0700), then checks it
    (`check_private_dir`); returns its real path. A path someone else made
    first fails the check: it is never adopted."""
    path = Path(os.path.abspath(path))
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass  # made meanwhile, by us or not: the check below decides
    return check_private_dir(path)


def runtime_dir() -> Path | None:
    """`$XDG_RUNTIME_DIR` if it is set and usable: absolute, a directory
    owned by this uid with mode 0700, writable, and passing the rules."""
    value = os.environ.get("XDG_RUNTIME_DIR")
    if not value or not os.path.isabs(value):
        return None
    try:
        st = os.stat(value)
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
                or stat.S_IMODE(st.st_mode) != 0o700 or not os.access(value, os.W_OK | os.X_OK)):
            return None
        return check_private_dir(value)
    except (OSError, InsecureDirectory):
        return None


def _tmp_prefix(launch_id: str, node_id: str) -> str:
    return f"{SUBDIR}-{os.geteuid()}-{launch_id}-{node_id[:16]}-"


def node_dirs(workdir: str | os.PathLike | None, launch_id: str, node_id: str) -> tuple[Path, Path, Path | None]:
    """`(node dir, compile cache dir, launch dir)` for one node of a launch,
    created and checked (see the module doc). The launch dir is the parent
    to remove once empty at shutdown (None: nothing above the node dir is ours
    to remove). Raises `InsecureDirectory` for a `workdir` that fails."""
    base = None
    if workdir is not None:
        base = ensure_private_dir(workdir)
    else:
        xdg = runtime_dir()
        if xdg is not None:
            base = ensure_private_dir(xdg / SUBDIR)
    if base is not None:
        node = ensure_private_dir(base / launch_id / node_id)
        return node, base / "plugin-cache", node.parent
    tmp = Path(tempfile.gettempdir())
    prefix = _tmp_prefix(launch_id, node_id)
    for found in sorted(tmp.glob(prefix + "*")):  # a restarted actor: its earlier directory
        try:
            real = check_private_dir(found)
        except (InsecureDirectory, OSError):
            continue
        if stat.S_IMODE(os.stat(real).st_mode) == 0o700:
            return real, real / "plugin-cache", None
    node = check_private_dir(tempfile.mkdtemp(prefix=prefix, dir=tmp))
    return node, node / "plugin-cache", None
