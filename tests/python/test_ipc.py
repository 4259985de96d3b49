"""`ipc://` endpoints through the client's Rust core (a Unix stream socket,
the same ZMTP as over tcp), on Unix sockets in a temporary directory.

stowd binds tcp only, so real stowd traffic reaches the core over ipc
through `UnixRelay`: a Unix socket whose every connection is forwarded,
byte for byte, to stowd's native tcp endpoint. Through it a `Client` and an
`AsyncClient` put, get, get_into (contiguous and strided arrays), clear
and read stats, with results equal to the tcp path's, over the default
stowd (ZMTP PLAIN, its token), a CURVE stowd and a NULL one. Independent
ZeroMQ peers: pyzmq ROUTERs bound to `ipc://` (NULL, PLAIN and CURVE
servers, libzmq's handshakes) echo what the core sends, large frames
included, and an `ipc://@name` one in Linux's abstract namespace.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading

import numpy as np
import pytest
import zmq
import zmq.auth.thread

import stowage
from stowage import _auth, _core
from stowage.aio import AsyncClient
from stowd_harness import CallNames, fresh_indexes, run_stowd
import stowd_harness


class UnixRelay:
    """Accepts on a Unix socket (`endpoint`, `ipc://...`) and forwards each
    connection's bytes both ways to the tcp endpoint `target`, one thread a
    direction. `bytes_up` / `bytes_down` count what it forwarded."""

    def __init__(self, target: str):
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.dir = tempfile.mkdtemp(prefix="stw-ipc-")
        self.path = os.path.join(self.dir, "native.sock")
        self.endpoint = f"ipc://{self.path}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.bytes_up = self.bytes_down = 0
        self.accepted = 0
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            with self._lock:
                self.accepted += 1
                self._socks += [conn, up]
            threading.Thread(target=self._pump, args=(conn, up, "bytes_up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, "bytes_down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counter: str):
        buf = bytearray(1 << 20)
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                dst.sendall(memoryview(buf)[:n])
                with self._lock:
                    setattr(self, counter, getattr(self, counter) + n)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self):
        self.listener.close()
        with self._lock:
            for s in self._socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def relay(stowd):
    r = UnixRelay(stowd["native"])
    yield r
    r.close()


def _is_unix(fd: int) -> bool:
    s = socket.socket(fileno=os.dup(fd))
    try:
        return s.family == socket.AF_UNIX
    finally:
        s.close()


def _data(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "big": rng.standard_normal((n, 64 << 10), dtype=np.float32),  # 256 KiB a row: the bulk paths
        "small": rng.integers(0, 1 << 30, (n, 3), dtype=np.int64),
        "nested": [np.arange(k % 5, dtype=np.int16) + k for k in range(n)],
        "tag": [f"row {k}" for k in range(n)],
    }


def test_a_client_over_ipc_equals_the_tcp_path_through_the_core(stowd, relay):
    n = 24
    idx = fresh_indexes(n)
    data = _data(n)
    order = idx[::-1][:10] + idx[:2]  # reversed, two asked twice
    # The default stowd asks for its token: ZMTP PLAIN, through the relay too.
    assert stowd_harness.server_mechanism(relay.endpoint) == "PLAIN"
    with stowage.Client(relay.endpoint, timeout=30) as c, stowage.Client(stowd["native"], timeout=30) as t:
        assert c._token is not None
        c._core = CallNames(_core.Connection(relay.endpoint, c.spin_us, c._token, c._curve))
        c.put(idx, data)
        assert c._core.inner.connected and _is_unix(c._core.fileno())
        got, want = c.get(order, ["big", "small", "nested", "tag"]), t.get(order, ["big", "small", "nested", "tag"])
        for k in ("big", "small"):
            np.testing.assert_array_equal(got[k], want[k])
        assert [list(r) for r in got["nested"]] == [list(r) for r in want["nested"]]
        assert list(got["tag"]) == list(want["tag"])
        # get_into: contiguous, and strided (a column slice of a bigger array).
        out = {"big": np.empty((len(order), 64 << 10), np.float32), "small": np.empty((len(order), 3), np.int64)}
        wide = np.full((len(order), 2, 5), -1, np.int64)
        c.get_into(order, out)
        c.get_into(order, {"small": wide[:, 1, 1:4]})
        tout = {"big": np.empty_like(out["big"]), "small": np.empty_like(out["small"])}
        t.get_into(order, tout)
        np.testing.assert_array_equal(out["big"], tout["big"])
        np.testing.assert_array_equal(out["small"], tout["small"])
        np.testing.assert_array_equal(wide[:, 1, 1:4], tout["small"])
        assert (wide[:, 0] == -1).all() and (wide[:, 1, [0, 4]] == -1).all()
        assert {"put", "get_fast", "get_into_fast"} <= set(c._core.calls), c._core.calls
        # Errors keep their types over ipc too.
        with pytest.raises(stowage.KeyNotFound):
            c.get([10**15], ["big"])
        with pytest.raises(ValueError, match=r"has shape \[2, 4\], but field 'small' is \[2, 3\]"):
            c.get_into(idx[:2], {"small": np.zeros((2, 4), np.int64)})
        stats = c.stats()
        assert stats["rows"] >= n and stats == {**stats, "units": t.stats()["units"]}
        assert c.clear(idx) == 4 * n
        with pytest.raises(stowage.KeyNotFound):
            t.get(idx[:1], ["big"])
    assert relay.bytes_up > data["big"].nbytes and relay.bytes_down > 2 * data["big"].nbytes * len(order) // n


def test_an_async_client_over_ipc_goes_through_the_core(stowd, relay):
    n = 8
    idx = fresh_indexes(n)
    data = _data(n, seed=3)

    async def run():
        async with AsyncClient(relay.endpoint, timeout=30) as c:
            await c.put(idx, data)
            got = await c.get(idx[::-1], ["big", "tag"])
            np.testing.assert_array_equal(got["big"], data["big"][::-1])
            assert list(got["tag"]) == data["tag"][::-1]
            small = await c.get(idx[:1], ["small"])  # a small call, awaited by the loop
            np.testing.assert_array_equal(small["small"], data["small"][:1])
            out = np.zeros((n, 64 << 10), np.float32)
            await c.get_into(idx, {"big": out})
            np.testing.assert_array_equal(out, data["big"])
            assert await c.clear(idx) == 4 * n

    asyncio.run(run())
    assert relay.accepted >= 2


def test_a_null_stowd_over_ipc(tmp_path, monkeypatch):
    with run_stowd(tmp_path, config='[security]\nauth = "none"\n') as s:
        r = UnixRelay(s["native"])
        try:
            assert stowd_harness.server_mechanism(r.endpoint) == "NULL"
            with stowage.Client(r.endpoint, timeout=30) as c:
                x = np.arange(40, dtype=np.float64).reshape(4, 10)
                c.put([1, 2, 3, 4], {"x": x})
                out = np.zeros((10, 4))
                c.get_into([1, 2, 3, 4], {"x": out.T})  # transposed: every element a run
                np.testing.assert_array_equal(out.T, x)
                assert c._core.connected and _is_unix(c._core.fileno())
        finally:
            r.close()


def test_a_curve_stowd_over_ipc(tmp_path, monkeypatch):
    monkeypatch.delenv("STOWAGE_TOKEN", raising=False)
    monkeypatch.setenv("STOWAGE_TOKEN_FILE", str(tmp_path / "no-token"))
    curve_dir = tmp_path / "curve"
    with run_stowd(tmp_path / "stowd", config=f'[security]\nauth = "curve"\ncurve_dir = "{curve_dir}"\n') as s:
        monkeypatch.setenv("STOWAGE_CURVE_DIR", str(curve_dir))
        r = UnixRelay(s["native"])
        try:
            big = np.arange(3 << 20, dtype=np.float32).reshape(4, -1)  # 12 MiB
            with stowage.Client(r.endpoint, timeout=30) as c:
                assert c._curve is not None
                c.put([0, 1, 2, 3], {"big": big})
                got = c.get([3, 1], ["big"])
                np.testing.assert_array_equal(got["big"], big[[3, 1]])
                wide = np.zeros((4, 2 * big.shape[1]), np.float32)
                c.get_into([0, 1, 2, 3], {"big": wide[:, ::2]})
                np.testing.assert_array_equal(wide[:, ::2], big)
                assert not wide[:, 1::2].any()
                assert c._core.connected and _is_unix(c._core.fileno())
                assert c.stats()["rows"] >= 4
            # Without keys, the core's error says how to give them.
            monkeypatch.setenv("STOWAGE_CURVE_DIR", str(tmp_path / "none"))
            monkeypatch.setenv("STOWAGE_CURVE_SERVER_KEY", "")
            conn = _core.Connection(r.endpoint, 0.0, None, None)
            with pytest.raises(_core.ProtocolViolation, match="asks for CURVE"):
                conn.send(b"x", [], 5.0)
        finally:
            r.close()


class _Router:
    """An independent ZeroMQ peer: a pyzmq ROUTER bound to `endpoint`
    (NULL, or PLAIN / CURVE with a ZAP handler) echoing every message."""

    def __init__(self, endpoint: str, mechanism: str = "NULL", token: bytes = b"", client_public: bytes = b""):
        self.ctx = zmq.Context()
        self.auth = None
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        if mechanism != "NULL":
            self.auth = zmq.auth.thread.ThreadAuthenticator(self.ctx)
            self.auth.start()
        if mechanism == "PLAIN":
            self.auth.configure_plain(domain="*", passwords={"stowage": token.decode()})
            self.router.plain_server = True
        elif mechanism == "CURVE":
            self.public, secret = zmq.curve_keypair()
            self.auth.configure_curve_callback("*", _AllowOne(client_public))
            self.router.curve_secretkey = secret
            self.router.curve_publickey = self.public
            self.router.curve_server = True
        self.router.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            if self.router.poll(50):
                self.router.send_multipart(self.router.recv_multipart())

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.router.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class _AllowOne:
    def __init__(self, key):
        self.key = key

    def callback(self, domain, key):
        return key == self.key


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="stw-ipc-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _echo_checks(conn):
    assert conn.send(b"first", [], 10.0) == [b"first"]
    big = np.random.default_rng(7).integers(0, 256, size=(8 << 20) + 13, dtype=np.uint8)
    reply = conn.send(b"big", [big, [b"b" * 10, memoryview(b"c" * 5)]], 30.0)
    assert [len(f) for f in reply] == [3, big.nbytes, 15]
    assert reply[1] == big.tobytes() and reply[2] == b"b" * 10 + b"c" * 5
    replies, failure = conn.send_many([(b"m%d" % i, [b"x" * i]) for i in range(1, 4)], 10.0)
    assert failure is None and replies[0] == [b"m1", b"x"]
    assert conn.connected and _is_unix(conn.fileno())


@pytest.mark.parametrize("mechanism", ["NULL", "PLAIN", "CURVE"])
def test_the_core_speaks_zmtp_over_ipc_with_libzmq(sock_dir, mechanism):
    endpoint = f"ipc://{sock_dir}/peer.sock"
    token = b"a-token-for-the-ipc-peer"
    public, secret = zmq.curve_keypair()
    server = _Router(endpoint, mechanism, token, public)
    try:
        curve = None
        if mechanism == "CURVE":
            curve = (server.public.decode(), public.decode(), secret.decode())
        conn = _core.Connection(endpoint, 0.0, token.decode() if mechanism == "PLAIN" else None, curve)
        _echo_checks(conn)
        if mechanism == "PLAIN":
            wrong = _core.Connection(endpoint, 0.0, "not-the-token", None)
            with pytest.raises((_core.ProtocolViolation, ConnectionError, TimeoutError)):
                wrong.send(b"x", [], 3.0)
    finally:
        server.close()


def test_an_abstract_ipc_name_and_bad_endpoints(sock_dir):
    name = f"stowage-test-{os.getpid()}-{threading.get_ident()}"
    server = _Router(f"ipc://@{name}")
    try:
        _echo_checks(_core.Connection(f"ipc://@{name}", 0.0, None, None))
    finally:
        server.close()
    for bad in ("ipc://", "udp://x:1", "tcp://"):
        with pytest.raises(ValueError, match="speaks tcp:// and ipc:// only"):
            _core.Connection(bad, 0.0, None, None)
    missing = _core.Connection(f"ipc://{sock_dir}/nobody.sock", 0.0, None, None)
    with pytest.raises(ConnectionError, match="cannot connect to ipc://"):
        missing.send(b"x", [], 2.0)
