"""Finding and supervising `stowd` on one node: the binary and plugin
lookup, port reservation, and the helpers the actor uses to run stowd as its
child (exit descriptions, /proc checks, PR_SET_PDEATHSIG). No Ray here."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

from .._stowd import BINARY as PACKAGED_STOWD
from .._stowd import PLUGINS as PACKAGED_PLUGINS


class StowdNotFound(FileNotFoundError):
    """No `stowd` binary where `launch()` looked (the message lists where)."""


class StowdStartError(RuntimeError):
    """`stowd` exited or did not write its endpoints file in time (the message has its log tail)."""


def find_stowd(stowd_bin: str | os.PathLike | None = None) -> Path:
    """The binary this process would run: `stowd_bin`, else `$STOWD_BIN`,
    else the packaged `stowage/_bin/stowd`. Raises `StowdNotFound` saying
    where it looked and how to get one."""
    looked = []
    if stowd_bin is not None:
        candidates = [("stowd_bin argument", Path(stowd_bin))]
    else:
        candidates = []
        if os.environ.get("STOWD_BIN"):
            candidates.append(("$STOWD_BIN", Path(os.environ["STOWD_BIN"])))
        candidates.append(("packaged binary", PACKAGED_STOWD))
    for what, path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path.resolve()
        state = "not executable" if path.is_file() else "missing"
        looked.append(f"{what} {path} ({state})")
    raise StowdNotFound(
        f"no stowd binary on host {socket.gethostname()}: looked at " + "; ".join(looked) + ". "
        "Build a wheel that ships it (`cargo xtask wheel`, then pip install target/wheels/stowage-*.whl "
        "on every node), or build it (`cargo build --release -p stowage-host --bin stowd`, plugins with "
        "`cargo xtask plugins`) and pass launch(stowd_bin='/path/to/stowd') or set $STOWD_BIN; "
        "the path must exist on every node."
    )


def find_plugin_dir(binary: Path, plugin_dir: str | os.PathLike | None = None) -> Path | None:
    """`plugin_dir`, else `$STOWD_PLUGIN_DIR`, else `<binary dir>/../plugins`
    if it exists (what stowd itself does), else None (built-in policy only)."""
    if plugin_dir is not None:
        p = Path(plugin_dir)
        if not p.is_dir():
            raise FileNotFoundError(f"plugin_dir {p} is not a directory on host {socket.gethostname()}")
        return p.resolve()
    if os.environ.get("STOWD_PLUGIN_DIR"):
        return Path(os.environ["STOWD_PLUGIN_DIR"]).resolve()
    bundled = binary.parent.parent / "plugins"
    return bundled.resolve() if bundled.is_dir() else None


def _bind(host: str, port: int) -> socket.socket | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def _reserve_ports(host: str, units: int) -> tuple[dict, list[socket.socket]]:
    """Free ports on `host`: native, router and `units` consecutive ones
    (stowd binds unit i to port_base + i). The sockets stay bound until the
    caller closes them, just before stowd starts."""
    for _ in range(200):
        first = _bind(host, 0)
        if first is None:
            raise OSError(f"cannot bind a socket on {host!r} (is it an address of this node?)")
        base = first.getsockname()[1]
        held = [first]
        for i in range(1, units):
            s = _bind(host, base + i) if base + i < 65536 else None
            if s is None:
                break
            held.append(s)
        if len(held) == units:
            native, router = _bind(host, 0), _bind(host, 0)
            held += [native, router]
            ports = {"native": native.getsockname()[1], "router": router.getsockname()[1], "unit_base": base}
            return ports, held
        for s in held:
            s.close()
    raise OSError(f"no {units} consecutive free ports on {host}")


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None


def _child_setup(parent_pid: int):
    def setup():
        # SIGTERM to stowd when the thread that started it (the actor's
        # monitor thread, which lives as long as the child) or its process dies.
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl
            os._exit(1)
    return setup

