"""The Python client's CURVE (CurveZMQ, RFC 26) against an independent
server: a pyzmq ROUTER that is a libzmq CURVE server, its ZAP handler
(`zmq.auth.thread.ThreadAuthenticator`) allowing only the client keys a
test names, on 127.0.0.1.

The Rust core (`_core.Connection`) completes the handshake and carries
requests and replies through libzmq's MESSAGE commands, large frames and
several requests on one connection included; a wrong server key, a client
key the server does not allow and no keys at all are clear errors, not
hangs. A reply already opened counts as ready for an event loop
(`reply_ready`) once the socket itself has nothing left to read. The
client's pyzmq socket becomes a CURVE client for such a server, and the
keys are found as `stowage._auth` says (arguments, environment, stowd's
curve directory, with its files' ownership and modes checked).
"""

import os
import select
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.auth
import zmq.auth.thread

import stowage
from stowage import _auth, _core
from stowage.errors import ProtocolError
import stowd_harness


class _Allow:
    """A ZAP CURVE callback: allows `keys`, remembers every key it saw."""

    def __init__(self, keys):
        self.keys = set(keys)
        self.seen = []

    def callback(self, domain, key):
        self.seen.append(key)
        return key in self.keys


class CurveRouter:
    """A libzmq CURVE server: a ROUTER that answers every message with
    `answer(frames)` (default: the frames echoed)."""

    def __init__(self, allowed, answer=None):
        self.ctx = zmq.Context()
        self.public, self.secret = zmq.curve_keypair()
        self.auth = zmq.auth.thread.ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.allow = _Allow(allowed)
        self.auth.configure_curve_callback("*", self.allow)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.curve_secretkey = self.secret
        self.router.curve_publickey = self.public
        self.router.curve_server = True
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.answer = answer or (lambda frames: frames)
        self.received = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            ident, *frames = self.router.recv_multipart()
            self.received.append(frames)
            self.router.send_multipart([ident, *self.answer(frames)])

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.router.close(0)
        self.auth.stop()
        self.ctx.term()


@pytest.fixture
def client_keys():
    public, secret = zmq.curve_keypair()
    return public, secret


@pytest.fixture
def server(client_keys):
    s = CurveRouter([client_keys[0]])
    yield s
    s.close()


def keys_for(server, client_keys, server_key=None):
    public, secret = client_keys
    return ((server_key or server.public).decode(), public.decode(), secret.decode())


def test_the_core_completes_a_curve_handshake_and_exchanges_messages(server, client_keys):
    conn = _core.Connection(server.endpoint, 0.0, None, keys_for(server, client_keys))
    assert conn.send(b"first", [], 10.0) == [b"first"]
    assert conn.connected
    # More requests on the same connection (the nonces go on counting),
    # multi-frame ones, and one frame of pieces sent back to back.
    assert conn.send(b"second", [b"a" * 300, [b"b" * 10, memoryview(b"c" * 5)]], 10.0) == [
        b"second", b"a" * 300, b"b" * 10 + b"c" * 5]
    # Two on the wire: an echo is no stowage/1 reply, so it reads as an
    # error, and send_many stops after it and the one sent behind it.
    replies, failure = conn.send_many([(b"m%d" % i, [b"x" * i]) for i in range(1, 6)], 10.0)
    assert failure is None
    assert replies == [[b"m1", b"x"], [b"m2", b"xx"]]
    assert conn.send(b"after", [], 10.0) == [b"after"]
    assert server.allow.seen == [client_keys[0]]
    assert server.received[0] == [b"first"]


def test_large_frames_round_trip_intact(server, client_keys):
    conn = _core.Connection(server.endpoint, 0.0, None, keys_for(server, client_keys))
    rng = np.random.default_rng(7)
    big = rng.integers(0, 256, size=8 << 20, dtype=np.uint8)
    other = rng.integers(0, 256, size=(3 << 20) + 17, dtype=np.uint8)
    reply = conn.send(b"big", [big, other], 30.0)
    assert [len(f) for f in reply] == [3, big.nbytes, other.nbytes]
    assert reply[1] == big.tobytes() and reply[2] == other.tobytes()
    assert server.received[0][1] == big.tobytes()


def test_a_reply_already_opened_is_ready_though_the_socket_is_drained(client_keys):
    # Two replies to one request: the second stays opened in the client
    # after the first is read.
    server = CurveRouter([client_keys[0]], answer=lambda frames: frames)
    try:
        conn = _core.Connection(server.endpoint, 0.0, None, keys_for(server, client_keys))
        assert conn.send(b"warm", [], 10.0) == [b"warm"]
        put = _core.Put([0, 1], {"x": np.arange(8, dtype=np.float32).reshape(2, 4)}, 1 << 30)
        rows = conn.start_put(1, 10.0, put)
        assert rows == 2
        deadline = time.monotonic() + 10
        while not conn.reply_ready():
            assert time.monotonic() < deadline, "the echoed put never read as ready"
            select.select([conn.fileno()], [], [], 0.05)
        # reply_ready took the reply off the socket and opened it: the
        # socket has nothing more, and the reply still counts as ready.
        assert select.select([conn.fileno()], [], [], 0.2)[0] == []
        assert conn.reply_ready()
        got = conn.finish_put(1, 2, 10.0)
        # Not a put_ok (the server echoed the request): its frames.
        assert isinstance(got, list) and got == [bytes(f) for f in server.received[-1]]
    finally:
        server.close()


def test_a_wrong_server_key_is_a_clear_error_not_a_hang(server, client_keys):
    wrong, _ = zmq.curve_keypair()
    conn = _core.Connection(server.endpoint, 0.0, None, keys_for(server, client_keys, server_key=wrong))
    t = time.monotonic()
    with pytest.raises(ConnectionError, match="curve_server_key"):
        conn.send(b"hello", [], 20.0)
    assert time.monotonic() - t < 10
    assert server.received == []


def test_a_client_key_the_server_does_not_allow_is_refused_clearly(server):
    other = zmq.curve_keypair()
    conn = _core.Connection(server.endpoint, 0.0, None, keys_for(server, other))
    t = time.monotonic()
    with pytest.raises(_core.ProtocolViolation, match="refused the connection.*curve_public_key"):
        conn.send(b"hello", [], 20.0)
    assert time.monotonic() - t < 10
    assert server.allow.seen == [other[0]]
    assert server.received == []


def test_no_keys_for_a_curve_server_say_how_to_give_them(server):
    conn = _core.Connection(server.endpoint, 0.0, "some-token", None)
    with pytest.raises(_core.ProtocolViolation, match="stowd asks for CURVE.*curve_server_key"):
        conn.send(b"hello", [], 10.0)
    assert server.received == []


def test_keys_that_are_not_a_pair_or_not_z85_are_refused_at_once(client_keys):
    public, secret = client_keys
    other_public, _ = zmq.curve_keypair()
    with pytest.raises(ValueError, match="not the public key of curve_secret_key"):
        _core.Connection("tcp://127.0.0.1:1", 0.0, None, (public.decode(), other_public.decode(), secret.decode()))
    with pytest.raises(ValueError, match="curve_server_key"):
        _core.Connection("tcp://127.0.0.1:1", 0.0, None, ("short", public.decode(), secret.decode()))


def test_a_pyzmq_peer_speaks_curve_to_a_curve_server(server, client_keys, monkeypatch, tmp_path):
    """The harness's pyzmq credentials (for the tests' own ZeroMQ peers)
    make a CURVE client of a socket whose server's greeting says CURVE."""
    monkeypatch.delenv("STOWAGE_TOKEN", raising=False)
    monkeypatch.setenv("STOWAGE_TOKEN_FILE", str(tmp_path / "no-token"))
    assert stowd_harness.server_mechanism(server.endpoint) == "CURVE"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        stowd_harness.offer_token(sock, server.endpoint, None, keys_for(server, client_keys))
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        sock.connect(server.endpoint)
        sock.send_multipart([b"over pyzmq", b"y" * 1000])
        assert sock.poll(10_000), "no reply over the pyzmq CURVE socket"
        assert sock.recv_multipart() == [b"over pyzmq", b"y" * 1000]
    finally:
        sock.close(0)
        ctx.term()
    assert server.allow.seen == [client_keys[0]]


def _certificates(d: Path):
    d.mkdir(parents=True, exist_ok=True)
    server_public_file, _ = zmq.auth.create_certificates(str(d), "server")
    client_public_file, client_secret_file = zmq.auth.create_certificates(str(d), "client")
    os.chmod(client_secret_file, 0o600)
    server_public, _ = zmq.auth.load_certificate(server_public_file)
    client_public, client_secret = zmq.auth.load_certificate(client_secret_file)
    return server_public.decode(), client_public.decode(), client_secret.decode()


@pytest.fixture
def no_ambient_curve(monkeypatch, tmp_path):
    monkeypatch.delenv("STOWAGE_CURVE_SERVER_KEY", raising=False)
    monkeypatch.delenv("STOWAGE_CURVE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def test_keys_come_from_arguments_the_environment_or_stowds_curve_dir(no_ambient_curve, tmp_path, monkeypatch):
    assert _auth.curve_keys() is None
    # stowd's curve directory, under its state directory.
    default = _certificates(tmp_path / "state" / "stowd" / "curve")
    assert _auth.default_curve_dir() == str(tmp_path / "state" / "stowd" / "curve")
    assert _auth.curve_keys() == default
    # $STOWAGE_CURVE_DIR, and $STOWAGE_CURVE_SERVER_KEY over its server.key.
    elsewhere = _certificates(tmp_path / "elsewhere")
    monkeypatch.setenv("STOWAGE_CURVE_DIR", str(tmp_path / "elsewhere"))
    assert _auth.curve_keys() == elsewhere
    other_server, _ = zmq.curve_keypair()
    monkeypatch.setenv("STOWAGE_CURVE_SERVER_KEY", other_server.decode())
    assert _auth.curve_keys() == (other_server.decode(), *elsewhere[1:])
    # Arguments win; a key pair goes together.
    given = tuple(k.decode() for k in (zmq.curve_keypair()[0], *zmq.curve_keypair()))
    assert _auth.curve_keys(*given) == given
    with pytest.raises(ValueError, match="go together"):
        _auth.curve_keys(given[0], given[1], None)
    with pytest.raises(ValueError, match="Z85"):
        _auth.curve_keys("not a key")


def test_certificates_read_as_pyzmq_reads_them_and_broken_ones_are_not_taken(no_ambient_curve, tmp_path):
    """The client reads pyzmq's certificate files itself (pyzmq is no
    dependency of the client): the same keys as `zmq.auth.load_certificate`;
    a file without keys, with a key of the wrong length, or not text, is
    not taken."""
    for _ in range(20):  # Z85 keys hold '=', '#' and other characters a parser may trip on
        public, secret = zmq.auth.create_certificates(str(tmp_path), "c")
        os.chmod(secret, 0o600)
        want = tuple(k.decode() for k in zmq.auth.load_certificate(secret))
        assert _auth._load_pair(secret) == want
        assert _auth._load_public(public) == want[0]
    bad = tmp_path / "bad.key_secret"
    for text in (b"", b"# only a comment\n", b'curve\n    public-key = "short"\n    secret-key = "short"\n',
                 bytes(range(256)) * 8):
        bad.write_bytes(text)
        os.chmod(bad, 0o600)
        assert _auth._load_pair(str(bad)) is None and _auth._load_public(str(bad)) is None


def test_a_secret_readable_by_others_or_another_users_file_is_not_taken(no_ambient_curve, tmp_path, monkeypatch):
    d = tmp_path / "state" / "stowd" / "curve"
    keys = _certificates(d)
    assert _auth.curve_keys() == keys
    os.chmod(d / "client.key_secret", 0o644)
    assert _auth.curve_keys() is None
    os.chmod(d / "client.key_secret", 0o600)
    assert _auth.curve_keys() == keys
    # A file of another user's (as far as this process can tell: the
    # check compares the owner with this process's user).
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(d / "server.key").st_uid + 1)
    assert _auth.curve_keys() is None


def test_client_keys_reach_the_core(server, client_keys, no_ambient_curve):
    public, secret = client_keys
    with stowage.Client(server.endpoint, timeout=5, curve_server_key=server.public.decode(),
                        curve_public_key=public.decode(), curve_secret_key=secret.decode()) as c:
        assert c._curve == keys_for(server, client_keys)
        core = _core.Connection(c.endpoint, c.spin_us, c._token, c._curve)
        assert core.send(b"via the client's keys", [], 10.0) == [b"via the client's keys"]


# -- against stowd with [security] auth = "curve"


@pytest.fixture
def curve_stowd(tmp_path, no_ambient_curve, monkeypatch):
    """A stowd whose native endpoint is a CURVE server, its keys in a
    directory of the test's; clients find them by $STOWAGE_CURVE_DIR (no
    token anywhere)."""
    from stowd_harness import run_stowd

    monkeypatch.delenv("STOWAGE_TOKEN", raising=False)
    monkeypatch.setenv("STOWAGE_TOKEN_FILE", str(tmp_path / "no-token"))
    curve_dir = tmp_path / "curve"
    config = f'[security]\nauth = "curve"\ncurve_dir = "{curve_dir}"\n'
    with run_stowd(tmp_path / "stowd", config=config) as s:
        monkeypatch.setenv("STOWAGE_CURVE_DIR", str(curve_dir))
        yield s


def test_a_client_puts_and_gets_through_stowd_over_curve(curve_stowd):
    assert stowd_harness.server_mechanism(curve_stowd["native"]) == "CURVE"
    big = np.arange(3 << 20, dtype=np.float32).reshape(4, -1)  # 12 MiB: the core's bulk paths
    small = np.arange(32, dtype=np.int64).reshape(4, 8)
    with stowage.Client(curve_stowd["native"], timeout=30) as c:
        assert c._curve is not None and c._curve[0] == curve_stowd["curve_server_key"]
        c.put([0, 1, 2, 3], {"big": big, "small": small})
        got = c.get([3, 1], ["big", "small"])
        assert np.array_equal(got["big"], big[[3, 1]]) and np.array_equal(got["small"], small[[3, 1]])
        out = {"big": np.empty((4, big.shape[1]), np.float32)}
        c.get_into([0, 1, 2, 3], out)
        assert np.array_equal(out["big"], big)
        assert c._core is not None and c._core.connected
        assert c.stats()["rows"] >= 4


def test_an_async_client_puts_and_gets_through_stowd_over_curve(curve_stowd):
    import asyncio

    from stowage.aio import AsyncClient

    x = np.arange(1 << 19, dtype=np.float32).reshape(2, -1)  # 2 MiB: through the core

    async def run():
        async with AsyncClient(curve_stowd["native"], timeout=30) as c:
            await c.put([10, 11], {"x": x, "tag": [b"a", b"b"]})
            got = await c.get([11, 10], ["x"])
            assert np.array_equal(got["x"], x[[1, 0]])
            small = await c.get([10], ["tag"])  # a small call, its reply awaited by the loop
            assert list(small["tag"]) == [b"a"]
            return (await c.stats())["rows"]

    assert asyncio.run(run()) >= 2


def test_stowd_refuses_a_client_key_it_does_not_allow(curve_stowd):
    stranger_public, stranger_secret = zmq.curve_keypair()
    with stowage.Client(curve_stowd["native"], timeout=5, curve_public_key=stranger_public.decode(),
                        curve_secret_key=stranger_secret.decode()) as c:
        t = time.monotonic()
        with pytest.raises(ProtocolError, match="refused the connection.*client key not allowed.*curve_public_key"):
            c.put([0], {"x": np.zeros((1, 4), np.float32)})
        assert time.monotonic() - t < 5
    # stowd logs the refusal after sending it: wait for the line.
    deadline = time.monotonic() + 10
    while "client key not allowed" not in curve_stowd.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, "stowd did not log the refusal"
        time.sleep(0.02)
