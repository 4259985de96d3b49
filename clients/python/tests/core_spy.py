"""A spy in front of a client's real Rust core connection, for tests that
count the put messages a client sends (not a stand-in: every call goes to
the real connection)."""

from __future__ import annotations


class CoreSpy:
    """Stands in front of a client's real Rust core connection (`client._core
    = CoreSpy(...)`) and reports each put message it sends as
    `record("put", data bytes, rows)`: each message of a `_core.Put` given
    to the connection's `put` (whether or not it then succeeds), and the one
    `start_put` writes. Everything else goes to the connection."""

    def __init__(self, inner, record):
        self._inner, self._record = inner, record

    def put(self, rid, ids, put, timeout, segments=None):
        for k in range(put.messages):
            self._record("put", 0 if segments else put.message_bytes(k), put.message_rows(k))
        return self._inner.put(rid, ids, put, timeout, segments)

    def start_put(self, rid, put, timeout):
        got = self._inner.start_put(rid, put, timeout)
        if got is not None:
            self._record("put", put.message_bytes(0), put.message_rows(0))
        return got

    def __getattr__(self, name):
        return getattr(self._inner, name)


def spy_async(client, record):
    """The same for an `AsyncClient`, whose calls take connections of their
    own: a spy in front of each connection a core call (`_core_call`, in a
    worker thread) or a call its event loop awaits (`_in_loop`) runs on."""
    def core_call(op, body, timeout, run, inner=client._core_call):
        return inner(op, body, timeout, lambda conn, rid, t: run(CoreSpy(conn, record), rid, t))

    def in_loop(op, timeout, start, finish, inner=client._in_loop):
        return inner(op, timeout, lambda conn, rid, t: start(CoreSpy(conn, record), rid, t), finish)

    client._core_call, client._in_loop = core_call, in_loop
