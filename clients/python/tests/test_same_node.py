"""Same-node zero copy against a real stowd: gets map stowd's shared-memory
segments read-only, two gets share memory (in one process and across two),
writes raise, a mapping outlives a clear, puts go through leased segments
without a socket copy, and a lease that is never used is removed."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import stowage
from stowd_harness import run_stowd

GIB = 1 << 30
HOLD_MS = 300


def eventually(cond, secs: float = 5.0) -> bool:
    """Polls `cond` until it holds or `secs` pass (a segment named in a get
    outlives its rows by the server's reply hold)."""
    deadline = time.monotonic() + secs
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _shm_stowd(tmp_path_factory, tag: str, lease_secs: int):
    """A stowd whose segments live in a directory of their own under /dev/shm
    (so the test can count them)."""
    shm_dir = f"/dev/shm/stowage-test-{tag}-{os.getpid()}"
    shutil.rmtree(shm_dir, ignore_errors=True)
    # Segments named in a reply are held 300 ms (10 s by default), so that
    # tests of release and reuse need not wait long.
    config = f'[shm]\ndir = "{shm_dir}"\nlease_secs = {lease_secs}\nreply_hold_ms = {HOLD_MS}\n'
    with run_stowd(tmp_path_factory.mktemp(tag), config=config, name=f"stowd-{tag}") as s:
        assert s["shm_dir"] == shm_dir
        yield s
    shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory):
    yield from _shm_stowd(tmp_path_factory, "same-node", 30)


@pytest.fixture(scope="module")
def short_lease_server(tmp_path_factory):
    """Leases expire after 1 second."""
    yield from _shm_stowd(tmp_path_factory, "short-lease", 1)


def segments(server) -> set:
    return set(os.listdir(server["shm_dir"]))


def data_ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_two_gets_share_memory_and_writes_raise(shm_server, fresh):
    idx = fresh(64)
    a = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    with stowage.Client(shm_server["native"]) as tcp:  # arrives over tcp...
        tcp.put(idx, {"x": a, "tag": [f"t{i}" for i in range(64)]})
    with stowage.Client(shm_server["native"], same_node=True, shm_dir=shm_server["shm_dir"]) as c:
        g1 = c.get(idx, ["x", "tag"])  # ...moved to shared memory once
        after_first = segments(shm_server)
        g2 = c.get(idx, ["x"])
        assert segments(shm_server) == after_first, "the second get copied the rows again"
        np.testing.assert_array_equal(g1["x"], a)
        assert g1["tag"] == [f"t{i}" for i in range(64)]
        assert data_ptr(g1["x"]) == data_ptr(g2["x"]), "two gets of the same rows do not share memory"
        assert not g1["x"].flags.writeable
        with pytest.raises(ValueError):
            g1["x"][0, 0] = -1.0
        # A subset in another order still comes from the same pages.
        g3 = c.get([idx[5]], ["x"])
        assert data_ptr(g3["x"]) == data_ptr(g1["x"]) + 5 * a[0].nbytes
    with stowage.Client(shm_server["native"]) as tcp:
        np.testing.assert_array_equal(tcp.get(idx, ["x"])["x"], a)  # the store is intact


def test_a_mapping_stays_valid_after_a_clear(shm_server, fresh):
    idx = fresh(8)
    a = np.random.default_rng(1).random((8, 1024), dtype=np.float32)
    with stowage.Client(shm_server["native"], same_node=True, shm_dir=shm_server["shm_dir"]) as c:
        c.put(idx, {"x": a})
        got = c.get(idx, ["x"])["x"]
        before = segments(shm_server)
        assert c.clear(idx) == 8
        assert eventually(lambda: len(segments(shm_server)) < len(before)), \
            "the cleared rows' segment was not released by stowd"
        np.testing.assert_array_equal(got, a)  # still mapped, still the same bytes
        with pytest.raises(stowage.KeyNotFound):
            c.get(idx, ["x"])


def test_puts_go_through_a_leased_segment_without_a_copy(shm_server, fresh):
    idx = fresh(16)
    a = np.arange(16 * 100, dtype=np.int64).reshape(16, 100)
    nested = [np.arange(i % 4, dtype=np.int8) for i in range(16)]
    with stowage.Client(shm_server["native"], same_node=True, shm_dir=shm_server["shm_dir"]) as c:
        before = segments(shm_server)
        c.put(idx, {"x": a, "n": nested})
        new = segments(shm_server) - before
        assert len(new) == 1, f"expected the one leased segment, got {new}"
        got = c.get(idx, ["x", "n"])
        # Served from the adopted lease itself: no further segment was made.
        assert segments(shm_server) - before == new
        np.testing.assert_array_equal(got["x"], a)
        for want, row in zip(nested, got["n"]):
            np.testing.assert_array_equal(row, want)
    with stowage.Client(shm_server["native"]) as tcp:  # and over tcp, the same rows
        np.testing.assert_array_equal(tcp.get(idx, ["x"])["x"], a)


def test_get_into_from_shared_memory(shm_server, fresh):
    idx = fresh(32)
    a = np.random.default_rng(2).random((32, 64))
    with stowage.Client(shm_server["native"], same_node=True, shm_dir=shm_server["shm_dir"]) as c:
        c.put(idx, {"x": a})
        out = np.zeros_like(a)
        c.get_into(idx[::-1], {"x": out})
        np.testing.assert_array_equal(out, a[::-1])


def test_an_unused_lease_expires_and_a_crashed_client_leaks_nothing(short_lease_server):
    shm_server = short_lease_server
    # A client that leases a segment and dies before putting it.
    script = textwrap.dedent(f"""
        import os, stowage
        c = stowage.Client({shm_server["native"]!r}, same_node=True, shm_dir={shm_server["shm_dir"]!r})
        body, _ = c._call("lease", {{"bytes": 1 << 20}}, (), None, "lease_ok")
        print(body["segment"], flush=True)
        os._exit(9)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 9, out.stderr
    name = out.stdout.strip()
    assert name in segments(shm_server)
    deadline = time.monotonic() + 10
    while name in segments(shm_server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert name not in segments(shm_server), "the expired lease's segment was not removed"
    # Naming it in a put afterwards is refused, not trusted.
    with stowage.Client(shm_server["native"], same_node=True, shm_dir=shm_server["shm_dir"]) as c:
        msg = {"global_indexes": [1], "fields": {"x": {"kind": "regular", "dtype": "uint8", "shape": [1, 4],
                                                       "parts": [{"frame": 1, "offset": 0, "len": 4, "rows": 1}]}}}
        with pytest.raises(stowage.BadRequest, match="lease"):
            c._call("put", msg, (), None, "put_ok", {"segments": [[name, 0, 4]]})


def _pfn(address: int) -> int:
    """Physical frame of the page at `address` in this process (needs root)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek((address // os.sysconf("SC_PAGE_SIZE")) * 8)
        entry = struct.unpack("<Q", f.read(8))[0]
    assert entry >> 63, "page not present"
    return entry & ((1 << 55) - 1)


def test_two_processes_read_the_same_pages(shm_server, fresh):
    if os.geteuid() != 0:
        pytest.fail("reading physical page numbers from /proc/self/pagemap needs root (CI runs as root)")
    idx = fresh(4)
    a = np.full((4, 4096), 7, dtype=np.uint8)
    with stowage.Client(shm_server["native"], same_node=True, shm_dir=shm_server["shm_dir"]) as c:
        c.put(idx, {"x": a})
        mine = c.get(idx, ["x"])["x"]
        assert int(mine[2, 0]) == 7
        here = _pfn(data_ptr(mine) + 2 * 4096)
        script = textwrap.dedent(f"""
            import os, struct, stowage
            c = stowage.Client({shm_server["native"]!r}, same_node=True, shm_dir={shm_server["shm_dir"]!r})
            x = c.get({idx!r}, ["x"])["x"]
            assert int(x[2, 0]) == 7
            addr = x.__array_interface__["data"][0] + 2 * 4096
            with open("/proc/self/pagemap", "rb") as f:
                f.seek((addr // os.sysconf("SC_PAGE_SIZE")) * 8)
                e = struct.unpack("<Q", f.read(8))[0]
            print(e & ((1 << 55) - 1))
        """)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert here != 0 and int(out.stdout) == here, "the other process reads different physical pages"


def test_a_1_gib_get_maps_without_copying(shm_server, fresh):
    """The Ray-style check: a 1 GiB same-node get returns in well under the
    time a copy would take and does not grow this process's RSS by the
    tensor's size; two gets share memory."""
    n = GIB // (4096 * 4)
    idx = fresh(n)
    a = np.ones((n, 4096), dtype=np.float32)
    with stowage.Client(shm_server["native"], same_node=True, shm_dir=shm_server["shm_dir"], timeout=120) as c:
        c.put(idx, {"x": a})
        del a
        rss0 = rss_bytes()
        t = time.perf_counter()
        g1 = c.get(idx, ["x"])["x"]
        took = time.perf_counter() - t
        grown = rss_bytes() - rss0
        g2 = c.get(idx, ["x"])["x"]
        assert g1.nbytes == GIB
        assert data_ptr(g1) == data_ptr(g2)
        assert grown < GIB // 10, f"RSS grew by {grown / GIB:.2f} GiB on a 1 GiB zero-copy get"
        assert float(g1[n - 1, 4095]) == 1.0
        print(f"1 GiB same-node get: {took * 1e3:.2f} ms, RSS +{grown >> 20} MiB")
        c.clear(idx)


@pytest.mark.parametrize("same_node", [True, False])
def test_scattered_rows_from_several_puts_are_gathered_right(shm_server, fresh, same_node):
    """A get of rows in random order, from two puts (two segments, or two
    received frames), some repeated: many parts that the client gathers with
    one numpy call per buffer (and the nested and scalar fields beside them)."""
    idx = fresh(300)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((300, 33)).astype(np.float32)  # 132-byte rows: offsets not multiples of 64
    s = np.arange(300, dtype=np.int64)
    ids = [np.arange(k, dtype=np.int16) for k in rng.integers(0, 40, 300)]
    with stowage.Client(shm_server["native"], same_node=same_node, shm_dir=shm_server["shm_dir"]) as c:
        c.put(idx[:150], {"x": x[:150], "s": s[:150], "ids": ids[:150]})
        c.put(idx[150:], {"x": x[150:], "s": s[150:], "ids": ids[150:]})
        pick = [int(p) for p in rng.permutation(300)[:200]] + [5, 5, 299]
        got = c.get([idx[p] for p in pick], ["x", "s", "ids"])
        np.testing.assert_array_equal(got["x"], x[pick])
        np.testing.assert_array_equal(got["s"], s[pick])
        assert all(np.array_equal(a, ids[p]) for a, p in zip(got["ids"], pick))
        assert not got["x"].flags.writeable
        out = {"x": np.full((len(pick), 33), -1, np.float32), "s": np.zeros(len(pick), np.int64)}
        c.get_into([idx[p] for p in pick], out)
        np.testing.assert_array_equal(out["x"], x[pick])
        np.testing.assert_array_equal(out["s"], s[pick])
        c.clear(idx)


def _inode(server, name: str) -> int:
    return os.stat(os.path.join(server["shm_dir"], name)).st_ino


def _spares(server) -> dict:
    """inode -> name of the segments stowd keeps for reuse."""
    return {_inode(server, n): n for n in segments(server) if "-spare-" in n}


def test_a_cleared_segment_no_array_maps_is_reused_by_the_next_put(shm_server, fresh):
    idx = fresh(64)
    a = np.full((64, 8192), 1, np.float32)  # 2 MiB: above the 1 MiB floor for reuse
    with stowage.Client(shm_server["native"], same_node=True, shm_dir=shm_server["shm_dir"]) as c:
        before = segments(shm_server)
        c.put(idx, {"x": a})
        (first,) = segments(shm_server) - before
        ino = _inode(shm_server, first)
        got = c.get(idx, ["x"])["x"]
        assert float(got[63, 8191]) == 1.0
        del got  # the last array over the mapping: its lock goes with it
        assert c.clear(idx) == 64
        assert eventually(lambda: first not in segments(shm_server))
        spares = _spares(shm_server)
        assert ino in spares, "the cleared segment was unlinked, not kept"
        b = np.full((64, 8192), 2, np.float32)
        before = segments(shm_server)
        c.put(idx, {"x": b})
        (second,) = segments(shm_server) - before
        assert "-spare-" not in second and second != first
        assert _inode(shm_server, second) in spares, "the put faulted in a new segment instead of a spare"
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], b)
        c.clear(idx)


def test_rows_another_process_still_maps_are_never_rewritten(shm_server, fresh):
    """A reader's arrays stay what they were after the rows are cleared and
    new puts of the same size follow: stowd sees the reader's lock and does
    not reuse that segment."""
    idx = fresh(64)
    a = np.full((64, 8192), 3, np.float32)
    script = textwrap.dedent(f"""
        import sys, numpy as np, stowage
        c = stowage.Client({shm_server["native"]!r}, same_node=True, shm_dir={shm_server["shm_dir"]!r})
        x = c.get({idx!r}, ["x"])["x"]
        print("mapped", flush=True)
        sys.stdin.readline()
        assert (x == 3).all(), "rows this process maps were rewritten"
        print("intact", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with stowage.Client(shm_server["native"], same_node=True, shm_dir=shm_server["shm_dir"]) as c:
        before = segments(shm_server)
        c.put(idx, {"x": a})
        (first,) = segments(shm_server) - before
        ino = _inode(shm_server, first)
        reader = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env)
        try:
            assert reader.stdout.readline().strip() == "mapped"
            c.clear(idx)  # this process maps nothing; the other one does
            assert ino not in _spares(shm_server), "a segment another process maps was kept for reuse"
            for k in range(4):
                c.put(idx, {"x": np.full((64, 8192), 10 + k, np.float32)})
                c.clear(idx)
            reader.stdin.write("go\n")
            reader.stdin.flush()
            assert reader.stdout.readline().strip() == "intact"
            assert reader.wait(timeout=60) == 0
        finally:
            reader.kill()
            reader.wait()


def test_a_segment_renamed_for_reuse_before_it_is_mapped_is_refused(shm_server, fresh):
    """A reply names a segment; its rows are cleared and the file kept for
    reuse before this client maps it: mapping it fails clearly instead of
    reading whatever the next put writes there."""
    idx = fresh(64)
    with stowage.Client(shm_server["native"], same_node=True, shm_dir=shm_server["shm_dir"]) as c:
        before = segments(shm_server)
        c.put(idx, {"x": np.zeros((64, 8192), np.float32)})
        (name,) = segments(shm_server) - before
        c.clear(idx)
        with pytest.raises(stowage.ProtocolError, match="does not exist"):
            c._segments.view(name, 0, 16)


def test_a_rename_between_open_and_lock_is_noticed(tmp_path, monkeypatch):
    """The narrow race: the client opened the name, and stowd renamed the file
    for reuse before the client's shared lock; the client must notice that the
    name no longer names what it opened."""
    from stowage import _shm
    (tmp_path / "seg").write_bytes(b"x" * 4096)
    segs = _shm.Segments(str(tmp_path))
    real_flock = _shm.fcntl.flock

    def flock_after_stowd_renamed(fd, op):
        os.rename(tmp_path / "seg", tmp_path / "spare")
        (tmp_path / "seg").write_bytes(b"y" * 4096)  # and even a new file under the old name
        return real_flock(fd, op)

    monkeypatch.setattr(_shm.fcntl, "flock", flock_after_stowd_renamed)
    with pytest.raises(stowage.ProtocolError, match="does not exist"):
        segs.view("seg", 0, 16)
    monkeypatch.setattr(_shm.fcntl, "flock", real_flock)
    assert bytes(segs.view("seg", 0, 4)) == b"yyyy"
    assert segs.mapped() == 0, "a mapping no array uses was kept"


def test_a_same_node_get_names_each_segment_once(shm_server, fresh):
    """Scattered rows of one segment, regular and nested: the reply lists the
    segment once, as a whole file, and every row is an offset in it (not one
    segment entry per row)."""
    import msgpack
    import zmq

    from stowage import _codec
    idx = fresh(300)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((300, 33)).astype(np.float32)
    ids = [np.arange(k, dtype=np.int16) for k in rng.integers(1, 40, 300)]
    pick = [idx[int(p)] for p in rng.permutation(300)[:200]]
    with stowage.Client(shm_server["native"], same_node=True, shm_dir=shm_server["shm_dir"]) as c:
        before = segments(shm_server)
        c.put(idx, {"x": x, "ids": ids})
        (seg,) = segments(shm_server) - before
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(shm_server["native"])
        try:
            sock.send(_codec.envelope("get", 7, {"global_indexes": pick, "fields": ["x", "ids"]}, {"same_node": True}))
            assert sock.poll(30_000)
            frames = sock.recv_multipart()
        finally:
            sock.close(linger=0)
        env = msgpack.unpackb(frames[0], raw=False)
        assert env["op"] == "get_ok" and len(frames) == 1
        size = os.stat(os.path.join(shm_server["shm_dir"], seg)).st_size
        assert env["segments"] == [[seg, 0, size]]
        parts = env["body"]["fields"]["x"]["parts"]
        assert len(parts) > 100 and {p["frame"] for p in parts} == {1}
        assert {r["frame"] for r in env["body"]["fields"]["ids"]["rows"]} == {1}
        got = c.get(pick, ["x", "ids"])
        want = [int(p) - idx[0] for p in pick]
        np.testing.assert_array_equal(got["x"], x[want])
        assert all(np.array_equal(a, ids[w]) for a, w in zip(got["ids"], want))
        c.clear(idx)
