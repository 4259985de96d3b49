"""stowd's token: where a client finds it, and whether a server asks for it.

stowd with `[security] auth = "token"` takes a client at its native endpoint
only with its token, presented at the ZMTP handshake (the PLAIN mechanism,
the token as its password, the username `stowage`). A client finds it, in
this order: the `token=` it was given; `$STOWAGE_TOKEN`; the token file of
this user's stowd (`$STOWAGE_TOKEN_FILE`, else `token` in stowd's state
directory: `$XDG_STATE_HOME/stowd`, else `~/.local/state/stowd`). So a
client run by stowd's own user needs no configuration; another user needs
the token given to them (`[security] tokens` lists more).

The Rust core offers the token only to a server that asks for one (its
greeting says PLAIN); pyzmq's sockets, which cannot choose at the
handshake, are told by `server_mechanism`, which reads the server's
greeting on a connection of its own before each socket connects (a server
not reachable yet is taken to ask, as stowd does by default).
"""

from __future__ import annotations

import os
import socket
import stat

import zmq

#: The PLAIN username (stowd does not check it).
USERNAME = b"stowage"


def default_token_file() -> str | None:
    """Where this user's stowd keeps its token (None: no home to look in)."""
    if os.environ.get("STOWAGE_TOKEN_FILE"):
        return os.environ["STOWAGE_TOKEN_FILE"]
    state = os.environ.get("XDG_STATE_HOME")
    if state and os.path.isabs(state):
        return os.path.join(state, "stowd", "token")
    home = os.environ.get("HOME")
    if home and os.path.isabs(home):
        return os.path.join(home, ".local", "state", "stowd", "token")
    if os.geteuid() == 0:
        return "/var/lib/stowd/token"
    return None


def resolve(token: str | None) -> str | None:
    """The token to present: `token`, else `$STOWAGE_TOKEN`, else the one in
    this user's token file (None: none found)."""
    if token is not None:
        if not isinstance(token, str) or not token or len(token.encode()) > 255 or any(c.isspace() for c in token):
            raise ValueError("token must be a non-empty str of at most 255 bytes without whitespace")
        return token
    env = os.environ.get("STOWAGE_TOKEN")
    if env:
        return resolve(env)
    path = default_token_file()
    if path is None:
        return None
    try:
        st = os.stat(path)
        # stowd's own file: this user's, readable by no one else.
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        with open(path, encoding="ascii") as f:
            found = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return found or None


def server_mechanism(endpoint: str, timeout: float = 2.0) -> str | None:
    """The security mechanism a tcp endpoint's greeting names ("NULL",
    "PLAIN"), or None if it cannot be read (not tcp, not reachable)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
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


def offer_token(sock, endpoint: str, token: str | None = None) -> None:
    """Makes a pyzmq socket about to connect to `endpoint` present this
    user's token (`token`, `$STOWAGE_TOKEN` or the token file) if the
    server asks for one; otherwise leaves it NULL."""
    token = resolve(token)
    if plain_for_zmq(endpoint, token):
        set_plain(sock, token)


def set_plain(sock, token: str) -> None:
    """Makes a pyzmq socket a PLAIN client presenting `token` (before it
    connects)."""
    sock.setsockopt(zmq.PLAIN_USERNAME, USERNAME)
    sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
