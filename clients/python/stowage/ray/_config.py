"""The stowd config a node's actor writes: which keys `launch()` sets
itself, how a caller's `config=` sections merge over them, and the TOML file
(written with `tomli_w`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import tomli_w

# Config keys launch() sets itself: (section, key) -> the launch() argument to use instead.
RESERVED = {
    ("server", "host"): "host",
    ("server", "native_port"): "(ports are chosen per node)",
    ("units", "local"): "units_per_node",
    ("units", "port_base"): "(ports are chosen per node)",
    ("units", "capacity_bytes"): "capacity_bytes",
    ("router", "enabled"): "(the router is always on)",
    ("router", "port"): "(ports are chosen per node)",
    ("router", "units"): "routing",
    ("shm", "enabled"): "shm",
    ("shm", "dir"): "shm_dir",
    ("plugins", "dir"): "plugin_dir",
}


def check_reserved(config: Mapping[str, Any] | None) -> None:
    """ValueError if `config` sets a key that launch() sets itself."""
    for (section, key), arg in RESERVED.items():
        if isinstance((config or {}).get(section), Mapping) and key in config[section]:
            raise ValueError(f"config[{section!r}][{key!r}] is set by launch(): use {arg}")


def stowd_config(spec: Mapping[str, Any], host: str, ports: Mapping[str, int], router_units: list[str] | None,
                 plugin_dir: str | os.PathLike | None, cache_dir: str | os.PathLike,
                 checkpoint_dir: str | os.PathLike | None = None) -> dict:
    """One node's stowd config: its ports, units, router (over `router_units`;
    None: its own units only), plugins, shared memory and, with
    `checkpoint_dir`, a checkpoint root (the node's checkpoint directory),
    with the launch's `config` sections merged over it (`[checkpoint]
    roots` given there are added to the node's, not put in its place)."""
    config = {
        "server": {"host": host, "native_port": ports["native"]},
        "units": {
            "local": int(spec["units_per_node"]),
            "port_base": ports["unit_base"],
            "capacity_bytes": int(spec["capacity_bytes"]),
        },
        "router": {"enabled": True, "port": ports["router"], "units": list(router_units or [])},
        "plugins": {"cache_dir": str(cache_dir)},
        "shm": {"enabled": bool(spec["shm"])},
        # Bound to the node's address for the job's other nodes: their
        # TransferQueue clients connect from there.
        "security": {"tq_endpoints": "open"},
    }
    if spec.get("cluster_token"):
        # Peers across nodes: each stowd takes the launch's token and
        # presents it (a node's own clients use the node's own token).
        config["security"].update(tokens=[spec["cluster_token"]], peer_token=spec["cluster_token"])
    if plugin_dir is not None:
        config["plugins"]["dir"] = str(plugin_dir)
    if spec.get("shm_dir"):
        config["shm"]["dir"] = str(spec["shm_dir"])
    extra = dict(spec.get("config") or {})
    if checkpoint_dir is not None:
        config["checkpoint"] = {"roots": [str(checkpoint_dir)]}
        given = extra.get("checkpoint")
        if isinstance(given, Mapping) and isinstance(given.get("roots"), (list, tuple)):
            roots = [str(checkpoint_dir), *(str(r) for r in given["roots"] if str(r) != str(checkpoint_dir))]
            extra["checkpoint"] = {**given, "roots": roots}
    return merge(config, extra)


def merge(base: dict, extra: Mapping[str, Any]) -> dict:
    """`extra` over `base`, table by table (a key of `extra` replaces a value)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def dumps(config: Mapping[str, Any]) -> str:
    """`config` as TOML. Paths (`os.PathLike`) are written as strings; a
    value TOML cannot hold (None, an object) raises TypeError naming it."""
    try:
        return tomli_w.dumps(_paths_to_str(config))
    except TypeError as e:
        raise TypeError(f"cannot write the stowd config: {e}") from None


def write_config(path: Path, config: Mapping[str, Any], comment: str) -> None:
    """Writes `config` to `path` as TOML, under a `# comment` line."""
    path.write_text(f"# {comment}\n" + dumps(config), encoding="utf-8")


def _paths_to_str(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _paths_to_str(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_paths_to_str(x) for x in v]
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    return v
