"""A spy in front of a client's real Rust core connection, for tests that
count the put messages a client sends (not a stand-in: every call goes to
the real connection)."""

from __future__ import annotations


class CoreSpy:
    """Stands in front of a client's real Rust core connection (`client._core
    = CoreSpy(...)`) and reports each put message it sends as
    `record("put", data bytes, rows)`: `put_fast`'s one message (when the
    core took the put, or failed sending it), and with `messages` each of a
    split put's (`send_many`). Everything else goes to the connection."""

    def __init__(self, inner, record, messages: bool = True):
        self._inner, self._record, self._messages = inner, record, messages

    def put_fast(self, rid, indexes, data, timeout, max_bytes):
        from stowage import _put

        try:
            got = self._inner.put_fast(rid, indexes, data, timeout, max_bytes)
        except BaseException:
            got = True
            raise
        finally:
            if got is not None:
                self._record("put", _put.payload_bytes(data), len(indexes))
        return got

    def send_many(self, messages, timeout):
        if self._messages:
            for _, frames in messages:
                self._record("put", sum(memoryview(f).nbytes if not isinstance(f, list) else
                                        sum(memoryview(p).nbytes for p in f) for f in frames), None)
        return self._inner.send_many(messages, timeout)

    def __getattr__(self, name):
        return getattr(self._inner, name)
