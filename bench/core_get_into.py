#!/usr/bin/env python3
"""tcp put, get_into and get through the client's Rust core against the
plain tcp stream (issue 17), all in one run. (The pure-Python path it was
first measured against, pyzmq, carries none of them any more.)

A release stowd with `[units] local = 4` holds each case (put twice over
tcp: the first overwrite finds stowd's receive pool empty and pays for
fresh pages, 0.8 to 2.9 GB/s where later ones made 3.0 to 3.6 on the
benchmark machine, so no timed put is a first overwrite); then, `--reps` times each, in this order:

- tcp stream: 9 bytes of request, then the payload from another process on
  127.0.0.1, read with `recv_into` into one reused buffer (the limit; the
  peer is the side-by-side suite's, bench/suite.py);
- put, core: `Client.put` of the whole array again (the rows overwritten;
  messages of the default `max_message_bytes`, each answered before the
  next), the Rust core writing each frame from the array;
- get_into, core: `Client.get_into` into a pre-faulted array (the Rust
  core reads each frame straight into it);
- get, core: a plain `Client.get` (the core reads each
  field into one buffer the returned array is a view of: the buffer of the
  previous get's result, dropped, when one fits); "get, core, no reuse"
  is the same with `STOWAGE_RECEIVE_POOL_BYTES=0` (a fresh buffer each
  time, as before the receive pool);
- async put, get_into and get, core: the same calls of an `AsyncClient`
  on one event loop (each runs in one of the client's worker threads);
- then 2,000 gets and 2,000 puts of one 4 KiB row, and 2,000 async gets
  (us per round trip).

Per row: median GB/s, its ratio to the tcp stream, and the client's peak
RSS above what it held before the call (VmHWM reset through
/proc/self/clear_refs), over the payload.

With `--strided`, only get_into into strided arrays instead, for rows of
256 B to 64 KiB (256 MiB of float32 a row size, times `--scale`): into a
C-contiguous array; into every other row of a bigger one (each row a run
of contiguous bytes), read straight into place (one slice a row) and
through the scratch buffer (the whole field received, then scattered by
one copy), forced with `STOWAGE_VECTORED_RUN`; into every other element
(every element a run: the scratch buffer); beside numpy copying the same
bytes from a contiguous array into each strided one (`out[...] = x`, the
copy the scratch way adds). Median GB/s of `--reps`.

Run it with the Python that has the package installed with its release
core (`pip install ./clients/python`):
usage: /path/to/venv/bin/python bench/core_get_into.py --stowd target/release/stowd [--reps 3] [--strided]
"""
import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import stowage  # noqa: E402  (the installed package, with its release core)
from stowage import client as client_mod  # noqa: E402
from procmem import reset_peak, status  # noqa: E402
from suite import TCP_PEER  # noqa: E402


def measure(fn):
    """(seconds, client peak RSS above before)."""
    me = os.getpid()
    reset_peak(me)
    before = status(me)["VmRSS"]
    t = time.perf_counter()
    r = fn()
    s = time.perf_counter() - t
    grew = status(me)["VmHWM"] - before
    del r
    return s, grew


def tcp_limit(nbytes: int, reps: int) -> list[float]:
    peer = subprocess.Popen([sys.executable, "-c", TCP_PEER, str(nbytes)], stdout=subprocess.PIPE, text=True)
    port = int(peer.stdout.readline())
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    dst = memoryview(bytearray(nbytes))
    out = []
    try:
        for _ in range(reps):
            t = time.perf_counter()
            s.sendall(b"g" + nbytes.to_bytes(8, "little"))
            got = 0
            while got < nbytes:
                k = s.recv_into(dst[got:])
                if not k:
                    raise EOFError
                got += k
            out.append(time.perf_counter() - t)
        s.sendall(b"q" + bytes(8))
    finally:
        s.close()
        peer.wait()
    return out


def strided(c, reps: int, scale: float) -> None:
    """The `--strided` table (see the module doc)."""
    nbytes = int((256 << 20) * scale)
    print("| row | target | way | get_into GB/s | numpy copy GB/s |")
    print("|---:|---|---|---:|---:|")
    for row_bytes in (256, 1024, 2048, 4096, 16384, 65536):
        cols, n = row_bytes // 4, nbytes // row_bytes
        x = np.random.default_rng(0).random((n, cols), dtype=np.float32)
        idx = list(range(n))
        c.put(idx, {"x": x})
        c.put(idx, {"x": x})
        flat = np.zeros_like(x)
        rows = np.zeros((n, 2, cols), np.float32)[:, 0]
        items = np.zeros((n, 2 * cols), np.float32)[:, ::2]
        for target, way, out, run in [
            ("contiguous", "straight into place", flat, None),
            ("every other row", "straight into place", rows, "1"),
            ("every other row", "scratch, scatter", rows, str(1 << 62)),
            ("every other element", "scratch, scatter", items, None),
        ]:
            if run is None:
                os.environ.pop("STOWAGE_VECTORED_RUN", None)
            else:
                os.environ["STOWAGE_VECTORED_RUN"] = run
            times = []
            for _ in range(reps):
                out[...] = 0
                t = time.perf_counter()
                c.get_into(idx, {"x": out})
                times.append(time.perf_counter() - t)
                if not np.array_equal(out, x):
                    raise SystemExit(f"{target}, {way}: rows differ")
            copies = []
            for _ in range(reps):
                t = time.perf_counter()
                out[...] = x
                copies.append(time.perf_counter() - t)
            print(f"| {row_bytes} B | {target} | {way} | {x.nbytes / statistics.median(times) / 1e9:.2f} "
                  f"| {x.nbytes / statistics.median(copies) / 1e9:.2f} |", flush=True)
        os.environ.pop("STOWAGE_VECTORED_RUN", None)
        c.clear(idx)
        del x, flat, rows, items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--strided", action="store_true", help="only the strided get_into table (see above)")
    a = ap.parse_args()
    if client_mod._core is None:
        raise SystemExit("this Python's stowage has no Rust core: pip install ./clients/python")
    work = tempfile.mkdtemp(prefix="stowage-core-bench-")
    os.makedirs(os.path.join(work, "none"))
    cfg, eps = os.path.join(work, "stowd.toml"), os.path.join(work, "stowd.json")
    with open(cfg, "w") as f:
        f.write(f"[units]\nlocal = 4\nmemory_percent = 0\n[plugins]\ndir = \"{work}/none\"\n")
    proc = subprocess.Popen([a.stowd, "serve", "--config", cfg, "--endpoints-file", eps],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not os.path.exists(eps):
            if proc.poll() is not None:
                raise SystemExit("stowd did not start")
            time.sleep(0.02)
        ep = json.load(open(eps))
        if a.strided:
            print(f"release stowd, 4 units, {a.reps} repetitions (median); load average {os.getloadavg()[0]:.2f}\n")
            with stowage.Client(ep["native"], timeout=600) as c:
                strided(c, a.reps, a.scale)
            return
        rows = []
        cases = [(what, int(n * a.scale), cols) for what, n, cols in [("seed", 524288, 1024), ("16 KiB rows", 65536, 4096)]]
        cases = [(f"{what}: float32 [{n}, {cols}], {n * cols * 4 / 2**30:g} GiB", n, cols) for what, n, cols in cases]
        loop = asyncio.new_event_loop()
        ac = stowage.AsyncClient(ep["native"], timeout=600)
        arun = loop.run_until_complete
        with stowage.Client(ep["native"], timeout=600) as c:
            for name, n, cols in cases:
                x = np.random.default_rng(0).random((n, cols), dtype=np.float32)
                idx = list(range(n))
                c.put(idx, {"x": x})
                c.put(idx, {"x": x})
                payload = x.nbytes
                out = np.empty_like(x)
                out.fill(0)
                limit = tcp_limit(payload, a.reps)
                results = {"tcp stream": [(s, 0) for s in limit]}
                for label, fn in [
                    ("put, core", lambda: c.put(idx, {"x": x})),
                    ("get_into, core", lambda: c.get_into(idx, {"x": out})),
                    ("get, core", lambda: c.get(idx, ["x"])),
                    ("get, core, no reuse", lambda: c.get(idx, ["x"])),
                    ("async put, core", lambda: arun(ac.put(idx, {"x": x}))),
                    ("async get_into, core", lambda: arun(ac.get_into(idx, {"x": out}))),
                    ("async get, core", lambda: arun(ac.get(idx, ["x"]))),
                ]:
                    if "no reuse" in label:
                        os.environ["STOWAGE_RECEIVE_POOL_BYTES"] = "0"
                        stowage.release_receive_buffers()
                    results[label] = [measure(fn) for _ in range(a.reps)]
                    os.environ.pop("STOWAGE_RECEIVE_POOL_BYTES", None)
                    if "get_into" in label:
                        if not np.array_equal(out, x):
                            raise SystemExit(f"{label}: rows differ")
                        out.fill(0)
                lim = statistics.median(limit)
                for label, rs in results.items():
                    s = statistics.median(t for t, _ in rs)
                    grew = max(g for _, g in rs)
                    rows.append((name, label, payload / s / 1e9, lim / s, grew / payload))
                c.clear(idx)
                del x, out
            # One row of 4 KiB, round trip: get, and put (the row overwritten).
            small = {}
            row = {"s": np.ones((1, 1024), np.float32)}
            c.put([10**9], row)
            for label, fn in [("get, core", lambda: c.get([10**9], ["s"])),
                              ("put, core", lambda: c.put([10**9], row)),
                              ("async get, core", lambda: arun(ac.get([10**9], ["s"])))]:
                for _ in range(200):
                    fn()
                t = time.perf_counter()
                for _ in range(2000):
                    fn()
                small[label] = (time.perf_counter() - t) / 2000
            c.clear([10**9])
        arun(ac.aclose())
        loop.close()
        print(f"release stowd, 4 units, {a.reps} repetitions (median); load average {os.getloadavg()[0]:.2f}\n")
        print("| case | way | GB/s | of the tcp stream | client peak over payload |")
        print("|---|---|---:|---:|---:|")
        for name, label, gbs, ratio, mem in rows:
            print(f"| {name} | {label} | {gbs:.2f} | {ratio:.2f} | {mem:.2f} |")
        print("\n| one 4 KiB row | us per round trip |")
        print("|---|---:|")
        for label, sec in small.items():
            print(f"| {label} | {sec * 1e6:.0f} |")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
