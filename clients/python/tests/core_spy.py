"""A spy in front of a client's real Rust core connection, for tests that
count the put messages a client sends (not a stand-in: every call goes to
the real connection)."""

from __future__ import annotations


class CoreSpy:
    """Stands in front of a client's real Rust core connection (`client._core
    = CoreSpy(...)`) and reports each put message it sends as
    `record("put", data bytes, rows)`: each message of a `_core.Put` given
    to the connection's `put` (whether or not it then succeeds). Everything
    else goes to the connection."""

    def __init__(self, inner, record):
        self._inner, self._record = inner, record

    def put(self, rid, ids, put, timeout, segments=None):
        for k in range(put.messages):
            self._record("put", 0 if segments else put.message_bytes(k), put.message_rows(k))
        return self._inner.put(rid, ids, put, timeout, segments)

    def __getattr__(self, name):
        return getattr(self._inner, name)
