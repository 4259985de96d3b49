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
greeting says PLAIN).

stowd with `[security] auth = "curve"` speaks CurveZMQ instead: a client
needs stowd's public key and a key pair stowd allows, all in Z85
(`curve_keys`). It finds them, in this order: the keys it was given;
`$STOWAGE_CURVE_SERVER_KEY` and `$STOWAGE_CURVE_DIR`; stowd's curve
directory (`curve` in stowd's state directory). A directory holds
certificates as pyzmq writes them: `server.key` (stowd's public key) and
`client.key_secret` (a key pair stowd always allows), both this user's and
the secret readable by no one else (read here; pyzmq is no dependency).
The core uses the keys only with a server whose greeting says CURVE.
"""

from __future__ import annotations

import os
import stat


def state_dir() -> str | None:
    """This user's stowd's state directory (None: no home to look in)."""
    state = os.environ.get("XDG_STATE_HOME")
    if state and os.path.isabs(state):
        return os.path.join(state, "stowd")
    home = os.environ.get("HOME")
    if home and os.path.isabs(home):
        return os.path.join(home, ".local", "state", "stowd")
    if os.geteuid() == 0:
        return "/var/lib/stowd"
    return None


def default_token_file() -> str | None:
    """Where this user's stowd keeps its token (None: no home to look in)."""
    if os.environ.get("STOWAGE_TOKEN_FILE"):
        return os.environ["STOWAGE_TOKEN_FILE"]
    state = state_dir()
    return None if state is None else os.path.join(state, "token")


def default_curve_dir() -> str | None:
    """Where this user's stowd keeps its CURVE certificates (None: no home
    to look in)."""
    state = state_dir()
    return None if state is None else os.path.join(state, "curve")


def _z85_key(what: str, key) -> str:
    if isinstance(key, bytes):
        key = key.decode("ascii", "replace")
    if not isinstance(key, str) or len(key.strip()) != 40:
        raise ValueError(f"{what} must be a CURVE key in Z85 (40 characters)")
    return key.strip()


def _own_file(path: str, secret: bool) -> bool:
    """Whether `path` is a regular file of this user's (and, for a secret,
    readable by no one else)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not (secret and st.st_mode & 0o077)


def _read_certificate(path: str) -> tuple[str | None, str | None]:
    """(public key, secret key) of a ZeroMQ certificate file as pyzmq and
    czmq write it (`public-key = "..."` and `secret-key = "..."` lines in
    its `curve` section; comments start with #); None for a key it lacks."""
    public = secret = None
    with open(path, "rb") as f:
        for line in f.read(1 << 16).splitlines():
            line = line.strip()
            if line.startswith(b"#") or b"=" not in line:
                continue
            name, value = (x.strip() for x in line.split(b"=", 1))
            value = value.strip(b" \t'\"").decode("ascii", "replace")
            if name == b"public-key" and public is None:
                public = value
            elif name == b"secret-key" and secret is None:
                secret = value
    return public, secret


def _load_public(path: str) -> str | None:
    """The public key of the certificate `path` (None: not this user's, or
    not a certificate)."""
    if not _own_file(path, secret=False):
        return None
    try:
        public, _ = _read_certificate(path)
    except OSError:
        return None
    return public if public and len(public) == 40 else None


def _load_pair(path: str) -> tuple[str, str] | None:
    """(public, secret) of the secret certificate `path` (None: not this
    user's, readable by others, or not a secret certificate)."""
    if not _own_file(path, secret=True):
        return None
    try:
        public, secret = _read_certificate(path)
    except OSError:
        return None
    if not public or not secret or len(public) != 40 or len(secret) != 40:
        return None
    return public, secret


def curve_keys(server_key: str | None = None, public_key: str | None = None,
               secret_key: str | None = None) -> tuple[str, str, str] | None:
    """(stowd's public key, this client's public key, its secret key) in
    Z85, for a server that speaks CURVE; None if none are found.

    Keys given win (`public_key` and `secret_key` go together); what is not
    given comes from `$STOWAGE_CURVE_SERVER_KEY` and the directory
    `$STOWAGE_CURVE_DIR`, else stowd's curve directory (`server.key`,
    `client.key_secret`)."""
    if (public_key is None) != (secret_key is None):
        raise ValueError("curve_public_key and curve_secret_key go together")
    if server_key is not None:
        server_key = _z85_key("curve_server_key", server_key)
    if public_key is not None:
        public_key = _z85_key("curve_public_key", public_key)
        secret_key = _z85_key("curve_secret_key", secret_key)
    if server_key is None and os.environ.get("STOWAGE_CURVE_SERVER_KEY"):
        server_key = _z85_key("$STOWAGE_CURVE_SERVER_KEY", os.environ["STOWAGE_CURVE_SERVER_KEY"])
    if server_key is None or public_key is None:
        d = os.environ.get("STOWAGE_CURVE_DIR") or default_curve_dir()
        if d is not None:
            if server_key is None:
                server_key = _load_public(os.path.join(d, "server.key"))
            if public_key is None:
                pair = _load_pair(os.path.join(d, "client.key_secret"))
                if pair is not None:
                    public_key, secret_key = pair
    if server_key is None or public_key is None:
        return None
    return server_key, public_key, secret_key


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
