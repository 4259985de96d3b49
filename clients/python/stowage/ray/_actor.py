"""`StowdNode`: the per-node actor, as a plain class (`launch()` wraps it
with `ray.remote`), that runs and supervises one `stowd`. No Ray here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from .._workdir import node_dirs
from ._config import stowd_config, write_config
from ._supervise import (
    StowdStartError,
    _child_setup,
    _cmdline,
    _describe_exit,
    _pid_alive,
    _reserve_ports,
    _write_json,
    find_plugin_dir,
    find_stowd,
)


class StowdNode:
    """The per-node actor (as a plain class; `launch()` wraps it with
    `ray.remote`). Its state lives in a private directory (`<workdir>/<launch
    id>/<node id>/`, or see the `stowage.ray` package doc for the default):
    the config, the endpoints file, `state.json` (generation, history),
    `stowd.log` and `checkpoint/` (the node's checkpoints, written by
    `StowageCluster.checkpoint()`). Ray re-runs `__init__` with the same
    arguments after a restart; finding `state.json` there, it starts stowd
    again at once, restoring the last checkpoint in `checkpoint/` if there
    is one (`stowd serve --restore`)."""

    def __init__(self, launch_id: str, node_id: str, ip: str, spec: Mapping[str, Any]):
        self.launch_id, self.node_id, self.ip = launch_id, node_id, ip
        self.spec = dict(spec)
        self.host = self.spec.get("host") or ip
        self.dir, self.cache_dir, self._launch_dir = node_dirs(self.spec.get("workdir"), launch_id, node_id)
        self.config_path = self.dir / "stowd.toml"
        self.endpoints_path = self.dir / "endpoints.json"
        self.state_path = self.dir / "state.json"
        self.log_path = self.dir / "stowd.log"
        self.checkpoint_dir = self.dir / "checkpoint"
        self.proc: subprocess.Popen | None = None
        self.endpoints: dict | None = None
        self._held: list[socket.socket] = []
        self._ready = False
        self._stopping = False
        self._lock = threading.Lock()
        try:
            self.state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            self.state = None
        if self.state is not None:  # restarted by Ray: bring stowd back on the same ports
            self._restart()

    # ---- first start: two phases, so every node's config can list every node's units

    def prepare(self) -> dict:
        """Finds the binary and plugins on this node and reserves ports."""
        binary = find_stowd(self.spec.get("stowd_bin"))
        plugins = find_plugin_dir(binary, self.spec.get("plugin_dir"))
        if self.state is not None:
            raise RuntimeError(f"stowd on node {self.node_id} is already set up ({self.dir})")
        ports, self._held = _reserve_ports(self.host, int(self.spec["units_per_node"]))
        self.binary, self.plugin_dir, self.ports = binary, plugins, ports
        n = int(self.spec["units_per_node"])
        return {
            "node_id": self.node_id,
            "ip": self.ip,
            "host": self.host,
            "hostname": socket.gethostname(),
            "units": [f"tcp://{self._host_for_url()}:{ports['unit_base'] + i}" for i in range(n)],
            # The same units as other stowds route to them: in stowage/1,
            # through this stowd's native port (rows in a few large frames,
            # and the routing stowd's read cache).
            "peers": [f"stowage://{self._host_for_url()}:{ports['native']}/{i}" for i in range(n)],
        }

    def start(self, router_units: list[str] | None) -> dict:
        """Writes the config (router over `router_units`, None: own units
        only), starts stowd and waits for its endpoints file."""
        config = stowd_config(self.spec, self.host, self.ports, router_units, self.plugin_dir, self.cache_dir,
                              self.checkpoint_dir)
        write_config(self.config_path, config,
                     f"written by stowage.ray for launch {self.launch_id}, node {self.node_id}")
        self.state = {
            "generation": 0,
            "stowd_bin": str(self.binary),
            "plugin_dir": str(self.plugin_dir) if self.plugin_dir else None,
            "history": [],
        }
        return self._start()

    def _host_for_url(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    # ---- running stowd

    def _restart(self) -> None:
        state = self.state
        prev = state.get("stowd_pid")
        if state["history"] and state["history"][-1].get("ended") is None:
            # The monitor did not record an exit: the actor process itself died.
            state["history"][-1].update(ended=time.time(), exit="the actor process died (stowd got SIGTERM with it)")
        if prev and _pid_alive(prev) and str(self.config_path) in _cmdline(prev):
            os.kill(prev, signal.SIGKILL)  # the old stowd still holds the ports
            deadline = time.monotonic() + 10
            while _pid_alive(prev) and time.monotonic() < deadline:
                time.sleep(0.02)
        self.binary = Path(state["stowd_bin"])
        self.plugin_dir = Path(state["plugin_dir"]) if state.get("plugin_dir") else None
        state["generation"] += 1
        restore, restore_error = self._checkpoint_to_restore(), None
        # The ports may take a moment to be free again: retry the start a few times.
        deadline = time.monotonic() + 15
        while True:
            try:
                self._start(restore, restore_error)
                return
            except StowdStartError as e:
                this_start = str(e).rsplit("--- stowage.ray: generation", 1)[-1]  # not an earlier one's log
                if restore is not None and f"cannot restore the checkpoint in {restore['dir']}" in this_start:
                    # Start empty rather than not at all, and set the checkpoint
                    # aside: a later restart must not restore it either (the
                    # rows put meanwhile are in no journal of it).
                    aside = self.dir / f"checkpoint.unrestorable-{state['generation']}"
                    os.replace(self.checkpoint_dir, aside)
                    restore_error = f"{_last_error_line(str(e))} (the checkpoint was moved to {aside})"
                    print(f"stowage.ray: stowd on node {self.node_id}: {restore_error}; starting it empty",
                          file=sys.stderr, flush=True)
                    restore = None
                    continue
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    def _checkpoint_to_restore(self) -> dict | None:
        """`{"dir", "seq"}` of the checkpoint a restarted stowd restores:
        the node's checkpoint directory, if it holds a `manifest.json` (seq
        None if stowd is to find the manifest unreadable: it says why)."""
        try:
            text = (self.checkpoint_dir / "manifest.json").read_text()
        except FileNotFoundError:
            return None
        except OSError:
            text = ""
        try:
            seq = json.loads(text).get("seq")
        except (ValueError, AttributeError):
            seq = None
        return {"dir": str(self.checkpoint_dir), "seq": seq if isinstance(seq, int) else None}

    def _start(self, restore: dict | None = None, restore_error: str | None = None) -> dict:
        try:
            self.endpoints_path.unlink()
        except FileNotFoundError:
            pass
        log = open(self.log_path, "ab")
        log.write(f"\n--- stowage.ray: generation {self.state['generation']}, actor pid {os.getpid()}\n".encode())
        log.flush()
        cmd = [str(self.binary), "serve", "--config", str(self.config_path),
               "--endpoints-file", str(self.endpoints_path)]
        if restore is not None:
            cmd += ["--restore", restore["dir"]]
        started = threading.Event()
        box: dict[str, Any] = {}

        def monitor():
            # This thread starts stowd and lives as long as it does: the
            # child's PR_SET_PDEATHSIG follows the thread that forked it.
            for s in self._held:
                s.close()
            self._held = []
            try:
                box["proc"] = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=self.dir,
                    preexec_fn=_child_setup(os.getpid()), close_fds=True,
                )
            except OSError as e:
                box["error"] = e
                started.set()
                return
            finally:
                log.close()
            started.set()
            code = box["proc"].wait()
            self._on_exit(box["proc"], code)

        threading.Thread(target=monitor, name="stowd-monitor", daemon=True).start()
        started.wait()
        if "error" in box:
            raise StowdStartError(f"cannot run {cmd[0]} on node {self.node_id}: {box['error']}")
        self.proc = proc = box["proc"]
        deadline = time.monotonic() + float(self.spec["start_timeout"])
        while True:
            code = proc.poll()
            if code is not None:
                raise StowdStartError(
                    f"stowd on node {self.node_id} {_describe_exit(code)} at start; "
                    f"config {self.config_path}; log tail:\n{self._log_tail()}"
                )
            try:
                ep = json.loads(self.endpoints_path.read_text())
                if ep.get("pid") == proc.pid:
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() >= deadline:
                proc.kill()
                raise StowdStartError(
                    f"stowd on node {self.node_id} wrote no endpoints file within "
                    f"{self.spec['start_timeout']:g} s; log tail:\n{self._log_tail()}"
                )
            time.sleep(0.02)
        with self._lock:
            self.endpoints = ep
            self.state["stowd_pid"] = proc.pid
            self.state["history"].append(
                {"generation": self.state["generation"], "pid": proc.pid, "actor_pid": os.getpid(),
                 "started": time.time(), "ended": None, "exit": None,
                 "restored": restore, "restore_error": restore_error}
            )
            _write_json(self.state_path, self.state)
            self._ready = True
        if proc.poll() is not None:  # died between writing its endpoints and now: the monitor skipped it
            self._on_exit(proc, proc.returncode)
        return self.info()

    def _on_exit(self, proc: subprocess.Popen, code: int) -> None:
        with self._lock:
            if self._stopping or proc is not self.proc or not self._ready:
                return  # a stop, or a failed start (start() reports it)
            self.state["history"][-1].update(ended=time.time(), exit=_describe_exit(code))
            _write_json(self.state_path, self.state)
        print(
            f"stowage.ray: stowd (pid {proc.pid}) on node {self.node_id} {_describe_exit(code)}; "
            "exiting the actor so that Ray restarts it",
            file=sys.stderr, flush=True,
        )
        os._exit(1)

    def _log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # ---- queries

    def info(self) -> dict:
        with self._lock:
            return {
                "node_id": self.node_id,
                "ip": self.ip,
                "host": self.host,
                "hostname": socket.gethostname(),
                "actor_pid": os.getpid(),
                "generation": self.state["generation"] if self.state else None,
                "stowd_pid": self.proc.pid if self.proc else None,
                "stowd_bin": self.state.get("stowd_bin") if self.state else None,
                "plugin_dir": self.state.get("plugin_dir") if self.state else None,
                "endpoints": self.endpoints,
                "history": list(self.state["history"]) if self.state else [],
                "dir": str(self.dir),
                "log": str(self.log_path),
                "checkpoint_dir": str(self.checkpoint_dir),
            }

    def log_tail(self, n: int = 50) -> str:
        return self._log_tail(n)

    def stop(self, timeout: float = 20.0) -> dict:
        """Stops stowd (SIGTERM, SIGKILL after `timeout`) and removes this
        node's state directory. The actor itself is then killed by the caller."""
        with self._lock:
            self._stopping = True
            proc = self.proc
        for s in self._held:
            s.close()
        out = {"node_id": self.node_id, "actor_pid": os.getpid(), "stowd_pid": proc.pid if proc else None}
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                out["exit"] = _describe_exit(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                out["exit"] = _describe_exit(proc.wait())
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._launch_dir is not None:
            try:
                self._launch_dir.rmdir()  # the launch's directory, once every node has gone
            except OSError:
                pass
        return out


def _last_error_line(message: str) -> str:
    """The line of a start error that says why the restore failed."""
    for line in reversed(message.splitlines()):
        if "cannot restore the checkpoint" in line:
            return line.strip()
    return message.splitlines()[0] if message else message
