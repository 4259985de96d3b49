"""stowd with `[security] auth = "curve"` against libzmq through pyzmq, on
127.0.0.1, in both directions:

- stowd makes its keys in pyzmq's certificate format: `zmq.auth.
  load_certificate` reads them, and a pyzmq CURVE client holding stowd's
  client key is answered; one holding another key, or speaking NULL or
  PLAIN, is not, and stowd goes on serving;
- stowd takes keys pyzmq made (`zmq.auth.create_certificates`) as its own,
  and as a peer unit's client it completes a CURVE handshake with a pyzmq
  ROUTER whose ZAP handler allows its client key, and gets nothing through
  one whose handler does not.
"""

import threading
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.auth
import zmq.auth.thread

from stowage._codec import decode_envelope
from stowd_harness import run_stowd

import native_codec as nc


def curve_config(curve_dir: Path, extra: str = "") -> str:
    return f'[security]\nauth = "curve"\ncurve_dir = "{curve_dir}"\n' + extra


def curve_dealer(endpoint: str, server_public: bytes, public: bytes, secret: bytes):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_serverkey = server_public
    s.curve_publickey = public
    s.curve_secretkey = secret
    s.connect(endpoint)
    return s


def test_pyzmq_curve_clients_with_stowds_client_key_are_answered_and_others_are_not(tmp_path):
    curve_dir = tmp_path / "curve"
    with run_stowd(tmp_path, config=curve_config(curve_dir)) as s:
        server_public, server_secret = zmq.auth.load_certificate(str(curve_dir / "server.key_secret"))
        assert server_secret is not None
        assert zmq.auth.load_certificate(str(curve_dir / "server.key"))[0] == server_public
        assert s["curve_server_key"] == server_public.decode()
        public, secret = zmq.auth.load_certificate(str(curve_dir / "client.key_secret"))
        assert (curve_dir / "client.key_secret").stat().st_mode & 0o777 == 0o600

        ok = curve_dealer(s["native"], server_public, public, secret)
        x = np.arange(64, dtype=np.float32).reshape(4, 16) + 1000.0
        ok.send_multipart(nc.put_frames(3, [0, 1, 2, 3], {"x": x}))
        assert ok.poll(10_000), "libzmq's CURVE client got no reply"
        assert decode_envelope(ok.recv_multipart()[0])["op"] == "put_ok"
        ok.send_multipart(nc.get_frames(4, [2, 0], ["x"]))
        assert ok.poll(10_000)
        reply = ok.recv_multipart()
        assert decode_envelope(reply[0])["op"] == "get_ok"
        assert x[[2, 0]].tobytes() in b"".join(reply[1:])
        ok.close()

        stranger_public, stranger_secret = zmq.curve_keypair()
        for make in (
            lambda: curve_dealer(s["native"], server_public, stranger_public, stranger_secret),
            lambda: curve_dealer(s["native"], zmq.curve_keypair()[0], public, secret),
        ):
            bad = make()
            bad.send_multipart(nc.stats_frames(8))
            assert not bad.poll(1500), "a client without an allowed key, or with the wrong server key, was answered"
            bad.close()
        for plain in (False, True):
            bad = zmq.Context.instance().socket(zmq.DEALER)
            bad.setsockopt(zmq.LINGER, 0)
            if plain:
                bad.plain_username = b"stowage"
                bad.plain_password = b"a-token"
            bad.connect(s["native"])
            bad.send_multipart(nc.stats_frames(9))
            assert not bad.poll(1500), "a NULL or PLAIN client of a CURVE endpoint was answered"
            bad.close()
        log = s.log_path.read_text(errors="replace")
        assert "connection refused at the handshake" in log
        assert "client key not allowed" in log
        assert secret.decode() not in log and server_secret.decode() not in log
        assert s.alive()


@pytest.mark.parametrize("allowed", [True, False])
def test_stowd_speaks_curve_to_a_libzmq_curve_server_with_keys_pyzmq_made(tmp_path, allowed):
    # stowd's keys, made by pyzmq: stowd reads them as its own.
    curve_dir = tmp_path / "curve"
    curve_dir.mkdir(mode=0o700)
    for name in ("server", "client"):
        zmq.auth.create_certificates(str(curve_dir), name)
    for f in curve_dir.glob("*.key_secret"):
        f.chmod(0o600)
    peer_dir = tmp_path / "peer-keys"
    peer_dir.mkdir()
    peer_public_file, peer_secret_file = zmq.auth.create_certificates(str(peer_dir), "peer")
    peer_public, peer_secret = zmq.auth.load_certificate(peer_secret_file)
    allowed_dir = tmp_path / "allowed"
    allowed_dir.mkdir()
    if allowed:
        (allowed_dir / "stowd.key").write_text((curve_dir / "client.key").read_text())

    ctx = zmq.Context.instance()
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(allowed_dir))
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.curve_server = True
    router.curve_publickey = peer_public
    router.curve_secretkey = peer_secret
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = curve_config(
            curve_dir,
            f'peer_curve_server_key = "{peer_public.decode()}"\n'
            f'[units]\nlocal = 0\n[router]\nunits = ["stowage://127.0.0.1:{port}/0"]\ntimeout_secs = 3\n',
        )
        with run_stowd(tmp_path, config=config) as s:
            assert s["curve_server_key"] == zmq.auth.load_certificate(str(curve_dir / "server.key"))[0].decode()
            got = []

            def serve():
                # Answer nothing: the handshake, and the request's bytes
                # after it, are what is tested.
                if router.poll(8000):
                    got.append(router.recv_multipart())

            t = threading.Thread(target=serve)
            t.start()
            public, secret = zmq.auth.load_certificate(str(curve_dir / "client.key_secret"))
            server_public = zmq.auth.load_certificate(str(curve_dir / "server.key"))[0]
            client = curve_dealer(s["native"], server_public, public, secret)
            client.send_multipart(nc.put_frames(1, [0], {"x": np.ones((1, 4), np.float32)}))
            assert client.poll(15_000), "stowd did not answer its own client"
            env = decode_envelope(client.recv_multipart()[0])
            assert env["op"] == "error", env
            client.close()
            t.join()
            if allowed:
                assert got, "the CURVE server never got stowd's request"
                assert got[0][0].startswith(b"TQ_STORAGE_")  # stowd's DEALER identity
                assert nc.PROTO.encode() in got[0][1]  # a stowage/1 request, decrypted by libzmq
            else:
                assert not got, "stowd's request got past a ZAP handler that does not allow its key"
    finally:
        router.close()
        auth.stop()
