"""Starting and stopping a real `stowd` process for the Python tests.

`run_stowd(workdir, config=...)` is a context manager: it starts
`stowd serve --endpoints-file <workdir>/endpoints.json --config ...` (the
config given, and unless it has a `[checkpoint]` table, checkpoint roots at
the system's temporary directory, where the tests' checkpoints are), waits
for the endpoints file, yields a `Stowd` (the parsed endpoints file, a dict,
plus the process and its log), and on exit sends SIGTERM, waits and asserts a
clean exit (status 0). A server that hangs on shutdown is killed and the test
fails.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import zmq

REPO = Path(__file__).resolve().parents[2]

START_TIMEOUT_S = 120.0  # the first start may compile the plugins
STOP_TIMEOUT_S = 20.0


def stowd_binary() -> Path:
    """The binary under test: $STOWD_BIN, else <repo>/target/debug/stowd."""
    env = os.environ.get("STOWD_BIN")
    path = Path(env) if env else REPO / "target" / "debug" / "stowd"
    if not path.is_file() or not os.access(path, os.X_OK):
        pytest.fail(
            f"stowd binary not found or not executable at {path}. Build it with "
            "`cargo build -p stowage-host` (and the plugins with `cargo xtask plugins --hostile`), "
            "or point STOWD_BIN at a binary.",
            pytrace=False,
        )
    return path


def fixtures_dir() -> Path:
    """The TransferQueue 0.1.11 golden frames: $STOWAGE_FIXTURES, else <repo>/../shared/fixtures/..."""
    env = os.environ.get("STOWAGE_FIXTURES")
    path = Path(env) if env else REPO.parent / "shared" / "fixtures" / "transferqueue-0.1.11"
    if not (path / "put_req.frame0.bin").is_file():
        pytest.fail(
            f"TransferQueue fixtures not found in {path} (set STOWAGE_FIXTURES to the directory "
            "holding put_req.frame0.bin ...)",
            pytrace=False,
        )
    return path


class Stowd(dict):
    """The parsed endpoints file (keys pid, units, router, native, plugins),
    with the process, its log and a few conveniences as attributes."""

    proc: subprocess.Popen
    log_path: Path
    endpoints_path: Path

    @property
    def unit_endpoints(self) -> list[str]:
        return [u["endpoint"] for u in self["units"]]

    @property
    def unit_ids(self) -> list[str]:
        return [u["id"] for u in self["units"]]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def run_stowd(workdir: Path, config: str | None = None, name: str = "stowd", extra_args=()):
    """Runs one stowd in `workdir` (created if needed); see the module doc."""
    binary = stowd_binary()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    endpoints_path = workdir / f"{name}.endpoints.json"
    log_path = workdir / f"{name}.log"
    args = [str(binary), "serve", "--endpoints-file", str(endpoints_path)]
    if config is None or "[checkpoint]" not in config:
        # The tests' checkpoints live in their temporary directories.
        config = (config or "") + f"\n[checkpoint]\nroots = [{json.dumps(tempfile.gettempdir())}]\n"
    config_path = workdir / f"{name}.toml"
    config_path.write_text(config)
    args += ["--config", str(config_path)]
    args += list(extra_args)
    env = dict(os.environ)
    env.setdefault("RUST_LOG", "info")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        endpoints = None
        while time.monotonic() < deadline:
            if endpoints_path.is_file():
                try:
                    endpoints = json.loads(endpoints_path.read_text())
                    break
                except (json.JSONDecodeError, OSError):
                    pass  # written atomically, but be tolerant
            if proc.poll() is not None:
                pytest.fail(
                    f"{name} exited with status {proc.returncode} before writing {endpoints_path}:\n"
                    f"{_tail(log_path)}",
                    pytrace=False,
                )
            time.sleep(0.02)
        if endpoints is None:
            pytest.fail(
                f"{name} did not write {endpoints_path} within {START_TIMEOUT_S:.0f} s:\n{_tail(log_path)}",
                pytrace=False,
            )
        server = Stowd(endpoints)
        server.proc = proc
        server.log_path = log_path
        server.endpoints_path = endpoints_path
        assert server["pid"] == proc.pid, f"endpoints file pid {server['pid']} != process pid {proc.pid}"
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)
        raise

    try:
        yield server
    finally:
        _stop(proc, name, log_path, endpoints_path)


def shm_stowd(tmp_path_factory, tag: str, config: str = ""):
    """Yields a stowd with shared memory in a directory of its own
    (/dev/shm/stowage-test-<tag>-<pid>, removed after), every same-node
    get through segments (`inline_below = 0`: the tests that use it are of
    the segments); `config` is added after the `[shm]` table's keys, so
    bare keys there are `[shm]` keys.
    For module- or session-scoped fixtures: `yield from shm_stowd(...)`."""
    shm_dir = f"/dev/shm/stowage-test-{tag}-{os.getpid()}"
    shutil.rmtree(shm_dir, ignore_errors=True)
    with run_stowd(tmp_path_factory.mktemp(tag), config=f'[shm]\ndir = "{shm_dir}"\ninline_below = 0\n' + config,
                   name=f"stowd-{tag}") as s:
        assert s["shm_dir"] == shm_dir
        yield s
    shutil.rmtree(shm_dir, ignore_errors=True)


def kill(server) -> None:
    """SIGKILLs a stowd from `run_stowd` on purpose (a crash): its context
    then does not count the death as a failure."""
    server.proc.stowage_killed = True
    server.proc.kill()
    server.proc.wait(timeout=STOP_TIMEOUT_S)


def _stop(proc: subprocess.Popen, name: str, log_path: Path, endpoints_path: Path) -> None:
    if getattr(proc, "stowage_killed", False):
        endpoints_path.unlink(missing_ok=True)
        return
    if proc.poll() is not None:
        # It died during the tests: that is a failure in itself.
        pytest.fail(
            f"{name} (pid {proc.pid}) died during the tests with status {proc.returncode}:\n{_tail(log_path)}",
            pytrace=False,
        )
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)
        pytest.fail(
            f"{name} (pid {proc.pid}) did not exit within {STOP_TIMEOUT_S:.0f} s of SIGTERM (killed):\n"
            f"{_tail(log_path)}",
            pytrace=False,
        )
    assert rc == 0, f"{name} exited with status {rc} after SIGTERM (expected a clean 0):\n{_tail(log_path)}"
    log = log_path.read_text(errors="replace")
    assert "panicked" not in log, f"{name} logged a panic:\n" + "\n".join(
        line for line in log.splitlines() if "panicked" in line
    )
    assert not endpoints_path.exists(), f"{name} left its endpoints file {endpoints_path} behind after a clean stop"


# Global indexes for tests sharing a server: blocks of 100 starting at 1000,
# so every block starts at an even number (g % 2 == position % 2) and tests
# never collide. Indexes below 1000 are left for tests that need fixed ones.
_blocks = itertools.count(10)


def pause(pid: int, timeout: float = 10.0) -> None:
    """Stops process `pid` (SIGSTOP) and returns once every one of its
    threads is stopped. `kill` returns before that on a loaded machine, and
    a thread not yet stopped still answers: with both CPUs busy, stowd
    answered 14 gets of 40 sent right after its SIGSTOP."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except FileNotFoundError:  # (a thread that ended meanwhile)
                continue
            states.append(stat.rsplit(")", 1)[1].split()[0])
        if states and all(state in "Tt" for state in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped within {timeout} s: thread states {states}")
        time.sleep(0.001)


def fresh_indexes(n: int) -> list[int]:
    """n consecutive global indexes nobody else uses (n <= 100 per call)."""
    assert 0 < n <= 100
    base = next(_blocks) * 100
    return list(range(base, base + n))


def first_message(sock, timeout_ms: int = 8000):
    """Receives on `sock` in a thread, answering nothing (a handshake, and
    the request after it, are what such a test checks): the started thread
    and the list the message, if one came in time, is put in."""
    import threading

    got = []

    def serve():
        if sock.poll(timeout_ms):
            got.append(sock.recv_multipart())

    t = threading.Thread(target=serve)
    t.start()
    return t, got


class CallNames:
    """In front of a client's real Rust core connection (`client._core =
    CallNames(...)`): records the name of each method called on it in
    `calls`, and calls it (not a stand-in)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if callable(attr):
            self.calls.append(name)
        return attr


# -- pyzmq test peers as clients of stowd: the credentials the client's
# core offers, set on a pyzmq socket (the client itself needs no pyzmq).

#: The PLAIN username (stowd does not check it).
USERNAME = b"stowage"


def _dial(endpoint: str, timeout: float) -> socket.socket | None:
    """A plain socket to a tcp or ipc endpoint (None: another transport)."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        return socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout)
            s.connect("\0" + path[1:] if path.startswith("@") else path)
        except BaseException:
            s.close()
            raise
        return s
    return None


def server_mechanism(endpoint: str, timeout: float = 2.0) -> str | None:
    """The security mechanism a tcp or ipc endpoint's greeting names
    ("NULL", "PLAIN", "CURVE"), or None if it cannot be read (another
    transport, not reachable)."""
    try:
        sock = _dial(endpoint, timeout)
        if sock is None:
            return None
        with sock as s:
            # A ZMTP 3 signature and major version: libzmq sends the rest of
            # its greeting only after it has read them (stowd sends it all).
            s.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03")
            g = b""
            while len(g) < 33:
                chunk = s.recv(64 - len(g))
                if not chunk:
                    return None
                g += chunk
    except (OSError, ValueError):
        return None
    if g[0] != 0xFF or g[10] < 3:
        return None
    return g[12:32].rstrip(b"\0").decode("ascii", "replace")


def plain_for_zmq(endpoint: str, token: str | None) -> bool:
    """Whether a pyzmq socket to `endpoint` presents `token`: when the
    server's greeting says PLAIN, or cannot be read yet (stowd asks for a
    token by default)."""
    if token is None:
        return False
    return server_mechanism(endpoint) in (None, "PLAIN")


def offer_token(sock, endpoint: str, token: str | None = None,
                curve: tuple[str, str, str] | None = None) -> None:
    """Makes a pyzmq socket about to connect to `endpoint` a CURVE client
    with the keys `curve` if the server's greeting says CURVE, else present
    this user's token (`token`, `$STOWAGE_TOKEN` or the token file) if the
    server asks for one; otherwise leaves it NULL."""
    from stowage import _auth  # (the package under test: put on sys.path by the conftest)

    token = _auth.resolve(token)
    if curve is not None:
        mechanism = server_mechanism(endpoint)
        if mechanism == "CURVE":
            set_curve(sock, curve)
        elif token is not None and mechanism in (None, "PLAIN"):
            set_plain(sock, token)
        return
    if plain_for_zmq(endpoint, token):
        set_plain(sock, token)


def set_curve(sock, curve: tuple[str, str, str]) -> None:
    """Makes a pyzmq socket a CURVE client (before it connects): `curve` is
    (the server's public key, this client's public key, its secret key)."""
    server, public, secret = curve
    sock.setsockopt(zmq.CURVE_SERVERKEY, server.encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public.encode("ascii"))
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret.encode("ascii"))


def set_plain(sock, token: str) -> None:
    """Makes a pyzmq socket a PLAIN client presenting `token` (before it
    connects)."""
    sock.setsockopt(zmq.PLAIN_USERNAME, USERNAME)
    sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
