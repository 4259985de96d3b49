"""TransferQueue 0.1.11 golden frames replayed against a real stowd.

Each `_req` is sent as captured (every frame), from a DEALER with identity
`TQ_STORAGE_fixture_0` (`TQ_STORAGE_fixture_probe` for metrics), to a unit
endpoint and to the router endpoint of a stowd private to this module, and
the reply is compared with the matching `_resp` field by field, then byte by
byte with the run-dependent values (ids, request id, timestamp) substituted.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import msgpack
import pytest

from tq_codec import TQClient, TensorRef, unpack

SEQUENCE = ["put", "get", "get_missing", "clear", "metrics"]
FIXTURE_UNIT_ID = "TQ_STORAGE_UNIT_48745fbb"


def load(fdir: Path, name: str) -> list[bytes]:
    paths = sorted(fdir.glob(f"{name}.frame*.bin"), key=lambda p: int(re.search(r"frame(\d+)", p.name).group(1)))
    assert paths, f"no frames for {name} in {fdir}"
    frames = [p.read_bytes() for p in paths]
    assert [int(re.search(r"frame(\d+)", p.name).group(1)) for p in paths] == list(range(len(frames)))
    return frames


def restamp(fixture_f0: bytes, fixture_env: dict, env: dict) -> bytes:
    """The fixture's frame 0 with the sender id, request id and timestamp of `env`."""
    out = fixture_f0
    # The unit id also appears inside messages: replace the raw bytes (same
    # length, so no msgpack length header changes).
    assert len(fixture_env["sender_id"]) == len(env["sender_id"]), env["sender_id"]
    out = out.replace(fixture_env["sender_id"].encode(), env["sender_id"].encode())
    old_b, new_b = msgpack.packb(fixture_env["request_id"]), msgpack.packb(env["request_id"])
    assert out.count(old_b) == 1
    out = out.replace(old_b, new_b)
    ts_old = b"\xcb" + struct.pack(">d", fixture_env["timestamp"])
    ts_new = b"\xcb" + struct.pack(">d", env["timestamp"])
    assert out.count(ts_old) == 1
    return out.replace(ts_old, ts_new)


def same_type(a, b) -> bool:
    return type(a) is type(b)


@pytest.mark.parametrize("target", ["unit", "router"])
def test_golden_fixtures(fresh_stowd, tq_fixtures, target):
    if target == "unit":
        endpoint, sender = fresh_stowd["units"][0]["endpoint"], fresh_stowd["units"][0]["id"]
    else:
        endpoint, sender = fresh_stowd["router"]["endpoint"], fresh_stowd["router"]["id"]

    main = TQClient(endpoint, ident=b"TQ_STORAGE_fixture_0")
    probe = TQClient(endpoint, ident=b"TQ_STORAGE_fixture_probe")
    try:
        for name in SEQUENCE:
            req = load(tq_fixtures, f"{name}_req")
            want_frames = load(tq_fixtures, f"{name}_resp")
            want = unpack(want_frames[0])
            client = probe if name == "metrics" else main
            got = client.request(req)
            where = f"{target} {name}"

            # Envelope, field by field.
            assert got.request_type == want["request_type"], f"{where}: {got.request_type} {got.body!r}"
            got.check_envelope(sender)
            assert list(got.env) == list(want), where
            assert want["sender_id"] == FIXTURE_UNIT_ID and want["receiver_id"] is None

            wb, gb = want["body"], got.body
            if name == "put":
                assert gb == wb == {}, where
            elif name == "get":
                assert len(got.frames) == len(want_frames) == 7, f"{where}: {len(got.frames)} frames"
                assert list(gb) == list(wb) == ["data"], where
                assert list(gb["data"]) == list(wb["data"]) == ["reg", "jag", "txt", "bf"], where
                for field, want_cells in wb["data"].items():
                    got_cells = gb["data"][field]
                    assert len(got_cells) == len(want_cells), f"{where} {field}"
                    for i, (g, w) in enumerate(zip(got_cells, want_cells)):
                        if isinstance(w, TensorRef):
                            assert isinstance(g, TensorRef), f"{where} {field}[{i}]: {g!r}"
                            assert (g.dtype, g.shape, g.frame) == (w.dtype, w.shape, w.frame), (
                                f"{where} {field}[{i}]: {g} != {w}"
                            )
                            assert got.frames[g.frame] == want_frames[w.frame], (
                                f"{where} {field}[{i}]: frame bytes {got.frames[g.frame].hex()} != "
                                f"{want_frames[w.frame].hex()}"
                            )
                        else:
                            assert same_type(g, w) and g == w, f"{where} {field}[{i}]: {g!r} != {w!r}"
                for k in range(1, 7):
                    assert got.frames[k] == want_frames[k], f"{where}: data frame {k}"
            elif name in ("get_missing", "clear"):
                assert list(gb) == list(wb) == ["message"], where
                assert gb["message"] == wb["message"].replace(FIXTURE_UNIT_ID, sender), where
                if name == "get_missing":
                    assert gb["message"].startswith("[TQKeyNotFound] "), where
            else:  # metrics
                assert list(gb) == list(wb), f"{where}: keys {list(gb)} != {list(wb)}"
                for k in wb:
                    assert same_type(gb[k], wb[k]), f"{where}: {k} = {gb[k]!r} ({type(gb[k]).__name__}) vs {wb[k]!r}"
                assert gb["storage_unit_id"] == sender, where
                assert gb["capacity"] is None, where
                assert gb["active_keys"] == 0, where
                assert gb["process_rss_bytes"] > 0, where
                for k in ("ssd_offload_enabled", "ssd_active_values", "ssd_active_bytes", "ssd_fallback_values_total"):
                    assert gb[k] == wb[k] == 0, f"{where}: {k}"
                # This endpoint saw exactly the fixture's five requests.
                assert gb["requests_arrived"] == wb["requests_arrived"] == 5, where
                assert list(gb["arrivals_by_op"].items()) == list(wb["arrivals_by_op"].items()), (
                    f"{where}: arrivals_by_op {gb['arrivals_by_op']} != {wb['arrivals_by_op']}"
                )

            # Byte for byte, except for the run-dependent values.
            if name != "metrics":  # process_rss_bytes changes size
                assert got.frames[0] == restamp(want_frames[0], want, got.env), (
                    f"{where}: frame 0 differs from the fixture\n got  {got.frames[0].hex()}\n want "
                    f"{restamp(want_frames[0], want, got.env).hex()}"
                )
    finally:
        main.close()
        probe.close()
