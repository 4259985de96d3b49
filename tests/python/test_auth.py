"""Who may talk to stowd: `[security] auth = "token"` against the real stowd,
the real Python client (its Rust core and its pyzmq path) and libzmq
through pyzmq, on 127.0.0.1.

The native endpoint takes a client only with stowd's token (ZMTP PLAIN, the
token as the password); a client without it, or with a wrong one, is refused
at the handshake with a clear error on both sides, and stowd's log names the
peer's address, never a token. The token file and the endpoints file are
mode 0600, and the JSON line on standard output carries no token. pyzmq
speaks PLAIN with stowd in both directions: as a client of stowd, and as a
peer unit stowd connects to (with a ZAP handler checking stowd's
credentials). A peer stowd presents `[security] peer_token`, and is refused
by a stowd that does not list it. A local user other than stowd's cannot
read the token file, and so cannot read a row.
"""

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.auth.thread

import stowage
from stowage._codec import decode_envelope
from stowage.errors import StowageError
from stowd_harness import first_message, run_stowd

import native_codec as nc

REPO = Path(__file__).resolve().parents[2]


def token_config(workdir: Path, extra: str = "") -> str:
    return f'[security]\nauth = "token"\ntoken_file = "{workdir / "state" / "token"}"\n' + extra


@pytest.fixture
def no_ambient_token(monkeypatch, tmp_path):
    """No token from the environment or this user's own token file."""
    monkeypatch.delenv("STOWAGE_TOKEN", raising=False)
    monkeypatch.setenv("STOWAGE_TOKEN_FILE", str(tmp_path / "no-such-token"))


@pytest.fixture
def secured(tmp_path, no_ambient_token):
    with run_stowd(tmp_path, config=token_config(tmp_path)) as s:
        yield s


def rows(n=4, seed=0):
    return np.arange(n * 8, dtype=np.float32).reshape(n, 8) + seed


def test_the_token_is_made_private_and_written_to_the_endpoints_file_only(secured, tmp_path):
    token_file = tmp_path / "state" / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    token = token_file.read_text().strip()
    assert len(token) == 64 and int(token, 16) >= 0
    assert secured["token"] == token
    assert stat.S_IMODE(secured.endpoints_path.stat().st_mode) == 0o600
    # The JSON line on standard output (here in the log) has no token.
    log = secured.log_path.read_text()
    first = next(line for line in log.splitlines() if line.startswith("{"))
    assert "token" not in json.loads(first)
    assert token not in log


def test_a_client_with_the_token_reads_and_writes_over_both_paths(secured):
    token = secured["token"]
    with stowage.Client(secured["native"], token=token, timeout=10) as c:
        c.put([0, 1, 2, 3], {"x": rows()})
        got = c.get([3, 1], ["x"])  # the Rust core
        np.testing.assert_array_equal(got["x"], rows()[[3, 1]])
        stats = c.stats()  # pyzmq's socket, PLAIN too
        assert stats["rows"] == 4


def test_the_token_from_the_environment_and_from_the_token_file(secured, tmp_path, monkeypatch):
    monkeypatch.setenv("STOWAGE_TOKEN", secured["token"])
    with stowage.Client(secured["native"], timeout=10) as c:
        c.put([10], {"x": rows(1)})
    monkeypatch.delenv("STOWAGE_TOKEN")
    monkeypatch.setenv("STOWAGE_TOKEN_FILE", str(tmp_path / "state" / "token"))
    with stowage.Client(secured["native"], timeout=10) as c:
        np.testing.assert_array_equal(c.get([10], ["x"])["x"], rows(1))
        assert c.stats()["rows"] == 1


def test_no_token_or_a_wrong_one_is_refused_clearly_on_both_sides(secured):
    with stowage.Client(secured["native"], timeout=3) as c:
        with pytest.raises(StowageError, match="requires its token"):
            c.put([0], {"x": rows(1)})
    with stowage.Client(secured["native"], token="not-the-token", timeout=3) as c:
        with pytest.raises(StowageError, match="refused the connection: wrong or missing token"):
            c.get([0], ["x"])
    time.sleep(0.2)
    log = secured.log_path.read_text()
    refused = [line for line in log.splitlines() if "connection refused at the handshake" in line]
    assert len(refused) >= 1, log[-2000:]  # the wrong token (a client without one stops at the greeting)
    assert all("127.0.0.1" in line for line in refused)
    assert not any("not-the-token" in line or secured["token"] in line for line in log.splitlines())
    # Nothing was stored, and stowd serves on.
    with stowage.Client(secured["native"], token=secured["token"], timeout=10) as c:
        assert c.stats()["rows"] == 0


def test_pyzmq_plain_client_interoperates_and_a_null_one_gets_nothing(secured):
    ctx = zmq.Context.instance()
    ok = ctx.socket(zmq.DEALER)
    ok.setsockopt(zmq.LINGER, 0)
    ok.plain_username = b"anyone"
    ok.plain_password = secured["token"].encode()
    ok.connect(secured["native"])
    ok.send_multipart(nc.stats_frames(7))
    assert ok.poll(10_000), "libzmq's PLAIN client got no reply"
    env = decode_envelope(ok.recv_multipart()[0])
    assert env["op"] == "stats_ok" and env["id"] == 7
    ok.close()
    for creds in (None, b"wrong"):
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        if creds is not None:
            bad.plain_username = b"stowage"
            bad.plain_password = creds
        # Bounded: a DEALER's send waits for a connection to queue on, and
        # once stowd has refused the handshake libzmq may have dropped it
        # (a send without a timeout hung here until killed). A request
        # that cannot even be queued is not answered either.
        bad.setsockopt(zmq.SNDTIMEO, 2000)
        bad.connect(secured["native"])
        try:
            bad.send_multipart(nc.stats_frames(8))
        except zmq.Again:
            pass
        assert not bad.poll(1500), "a client without the token was answered"
        bad.close()
    assert secured.alive()


def start_plain_router(token: bytes):
    """A pyzmq ROUTER that is a PLAIN server, its ZAP handler taking
    username `stowage` with `token`; returns (socket, endpoint,
    authenticator)."""
    ctx = zmq.Context.instance()
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_plain(domain="*", passwords={"stowage": token.decode()})
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.plain_server = True
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"tcp://127.0.0.1:{port}", auth


@pytest.mark.parametrize("right", [True, False])
def test_stowd_presents_its_peer_token_to_a_libzmq_plain_server(tmp_path, no_ambient_token, right):
    router, endpoint, auth = start_plain_router(b"peer-secret")
    try:
        peer_token = "peer-secret" if right else "peer-wrong"
        config = (
            f'[units]\nlocal = 0\n[router]\nunits = ["stowage://{endpoint[len("tcp://"):]}/0"]\n'
            f'timeout_secs = 3\n[security]\npeer_token = "{peer_token}"\n'
        )
        with run_stowd(tmp_path, config=config) as s:
            t, got = first_message(router)
            with stowage.Client(s["native"], token=s["token"], timeout=10) as c:
                with pytest.raises(StowageError):
                    c.put([0], {"x": rows(1)})
            t.join()
            if right:
                assert got, "the PLAIN server never got stowd's request"
                assert got[0][0].startswith(b"TQ_STORAGE_")  # stowd's DEALER identity
            else:
                assert not got, "stowd's request got past a ZAP handler with a wrong password"
    finally:
        router.close()
        auth.stop()


def test_a_peer_stowd_needs_a_token_its_peer_takes(tmp_path, no_ambient_token):
    peer_dir = tmp_path / "peer"
    with run_stowd(peer_dir, config=token_config(peer_dir, 'tokens = ["cluster-token"]\n'), name="peer") as peer:
        address = peer["native"][len("tcp://"):]
        for token, ok in (("cluster-token", True), ("other-token", False)):
            front = tmp_path / f"front-{token}"
            config = (
                f'[units]\nlocal = 0\n[router]\nunits = ["stowage://{address}/0"]\ntimeout_secs = 3\n'
                f'[security]\npeer_token = "{token}"\n'
            )
            with run_stowd(front, config=config, name="front") as s:
                with stowage.Client(s["native"], token=s["token"], timeout=10) as c:
                    if ok:
                        c.put([5, 6], {"x": rows(2)})
                        np.testing.assert_array_equal(c.get([6, 5], ["x"])["x"], rows(2)[[1, 0]])
                    else:
                        with pytest.raises(StowageError, match="wrong or missing token"):
                            c.put([7], {"x": rows(1)})
        with stowage.Client(peer["native"], token="cluster-token", timeout=10) as c:
            assert c.stats()["rows"] == 2


OTHER_USER_CLIENT = r"""
import socket, sys
token_file, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    open(token_file).read()
    print("READ TOKEN"); sys.exit(3)
except PermissionError:
    print("TOKEN FILE UNREADABLE")

def greeting(mechanism):
    g = bytearray(64); g[0] = 0xFF; g[9] = 0x7F; g[10] = 3
    g[12:12 + len(mechanism)] = mechanism
    return bytes(g)

def command(name, data=b""):
    body = bytes([len(name)]) + name + data
    return bytes([0x04, len(body)]) + body

def read_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c: return b
        b += c
    return b

# NULL: no credentials at all; then PLAIN with a guessed token.
for mech, first in ((b"NULL", command(b"READY", b"\x0bSocket-Type\x00\x00\x00\x06DEALER")),
                    (b"PLAIN", command(b"HELLO", b"\x07stowage\x05guess"))):
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(greeting(mech) + first)
    read_exact(s, 64)
    head = read_exact(s, 2)
    body = read_exact(s, head[1]) if len(head) == 2 else b""
    name = body[1:1 + body[0]] if body else b""
    print(mech.decode(), name.decode(), body[2 + body[0]:].decode(errors="replace") if body else "")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another local user")
def test_another_local_user_cannot_read_a_row_over_loopback(secured, tmp_path):
    """As the user `nobody`, with the standard library only (the test's own
    interpreter and packages may sit where nobody can read): the token file
    cannot be read, and without the token stowd answers the handshake with
    ERROR, never a row."""
    with stowage.Client(secured["native"], token=secured["token"], timeout=10) as c:
        c.put([0], {"x": rows(1)})
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    host, _, port = secured["native"][len("tcp://"):].rpartition(":")
    r = subprocess.run(
        [python, "-I", "-c", OTHER_USER_CLIENT, str(tmp_path / "state" / "token"), host, port],
        capture_output=True,
        text=True,
        timeout=60,
        user=65534,
        group=65534,
        extra_groups=[],
        cwd="/",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "TOKEN FILE UNREADABLE"
    assert lines[1].startswith("NULL ERROR this endpoint requires credentials"), lines
    assert lines[2].startswith("PLAIN ERROR wrong or missing token"), lines
    with stowage.Client(secured["native"], token=secured["token"], timeout=10) as c:
        np.testing.assert_array_equal(c.get([0], ["x"])["x"], rows(1))
