"""The identity rule: a TransferQueue endpoint answers only identities
starting with `TQ_STORAGE_` or `metrics_collector_`; others get no reply at
all, and the server keeps answering proper identities."""

from __future__ import annotations

import zmq

from tq_codec import TQClient, identity, metrics_frames


def test_unknown_identity_gets_no_reply(tq_target, stowd):
    endpoint, sender = tq_target
    strangers = [TQClient(endpoint, ident=i) for i in (b"hello", b"tq_storage_lowercase", b"xTQ_STORAGE_")]
    try:
        for c in strangers:
            c.send(metrics_frames())
        # ~1 s of silence for all of them (every request was sent before the wait).
        assert strangers[0].no_reply_within(1.0), "identity 'hello' got a reply"
        for c in strangers[1:]:
            assert c.no_reply_within(0.05), f"identity {c.sock.getsockopt(zmq.IDENTITY)!r} got a reply"

        # The server still answers proper identities...
        assert stowd.alive()
        for ident in (identity("TQ_STORAGE_pytest"), identity("metrics_collector_pytest")):
            with TQClient(endpoint, ident=ident) as c:
                r = c.metrics().expect("METRICS_RESPONSE")
                r.check_envelope(sender)
                assert r.body["storage_unit_id"] == sender
        # ... and still has nothing for the strangers.
        assert all(c.no_reply_within(0) for c in strangers)
    finally:
        for c in strangers:
            c.close()
