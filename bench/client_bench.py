#!/usr/bin/env python3
"""Python client benchmark: 1 GiB batches through the native protocol over
tcp, over same-node shared memory, and with get_into.

For each shape of a 1 GiB float32 regular field, and each way, it reports
throughput and the peak RSS above baseline of the client and of stowd (each
process's VmHWM reset through /proc/PID/clear_refs before the operation),
as a ratio to the payload. Median of --reps runs, all in one run of this
program, so ratios between rows are comparable.

Needs a release build: `cargo build --release -p stowage-host && cargo xtask plugins`.
usage: python3 bench/client_bench.py [--gib 1] [--reps 3]
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
import stowage  # noqa: E402


from procmem import reset_peak, status  # noqa: E402


def measure(fn, pids):
    """Runs fn(); returns (seconds, {pid: peak RSS over the RSS before})."""
    base = {p: status(p)["VmRSS"] for p in pids}
    for p in pids:
        reset_peak(p)
    t = time.perf_counter()
    fn()
    took = time.perf_counter() - t
    return took, {p: status(p)["VmHWM"] - base[p] for p in pids}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    a = ap.parse_args()
    if not os.path.exists(a.stowd):
        raise SystemExit(f"{a.stowd} missing: cargo build --release -p stowage-host && cargo xtask plugins")
    payload = int(a.gib * (1 << 30))
    shapes = [(payload // (1 << 20), (1 << 20) // 4), (payload // (16 << 10), (16 << 10) // 4)]
    tmp = tempfile.mkdtemp()
    eps = os.path.join(tmp, "ep.json")
    proc = subprocess.Popen([a.stowd, "serve", "--endpoints-file", eps], stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(tmp, "stowd.log"), "w"), env={**os.environ, "RUST_LOG": "warn"})
    while not os.path.exists(eps):
        if proc.poll() is not None:
            raise SystemExit("stowd did not start")
        time.sleep(0.1)
    ep = json.load(open(eps))
    me, srv = os.getpid(), proc.pid
    tcp = stowage.Client(ep["native"], timeout=300, max_message_bytes=256 << 20)
    shm = stowage.Client(ep["native"], timeout=300, same_node=True, shm_dir=ep["shm_dir"])
    rows = []
    try:
        for n, cols in shapes:
            data = np.ones((n, cols), dtype=np.float32)
            idx = list(range(n))
            out = np.empty_like(data)
            out.fill(0)  # fault its pages in once: get_into reuses a buffer
            results = {}

            def rec(name, fn):
                took, peak = measure(fn, [me, srv])
                results.setdefault(name, []).append((took, peak[me], peak[srv]))

            for _ in range(a.reps):
                rec("put, tcp", lambda: tcp.put(idx, {"x": data}))
                rec("get, tcp", lambda: tcp.get(idx, ["x"]))
                rec("get_into, tcp", lambda: tcp.get_into(idx, {"x": out}))
                tcp.clear(idx)
                rec("put, same node (leased segment)", lambda: shm.put(idx, {"x": data}))
                rec("get, same node", lambda: shm.get(idx, ["x"]))
                rec("get_into, same node", lambda: shm.get_into(idx, {"x": out}))
                shm.clear(idx)
                shm.release_segments()
                # Put over tcp, then the first same-node get moves the rows
                # into shared memory once; the next one is zero-copy.
                tcp.put(idx, {"x": data})
                rec("get, same node, first after a tcp put (moves once)", lambda: shm.get(idx, ["x"]))
                rec("get, same node, again", lambda: shm.get(idx, ["x"]))
                tcp.clear(idx)
                shm.release_segments()
            assert np.array_equal(out, data)
            med = statistics.median
            for name, r in results.items():
                t = med(x[0] for x in r)
                rows.append((f"[{n}, {cols}]", name, t, payload / t / 1e9,
                             med(x[1] for x in r) / payload, med(x[2] for x in r) / payload))
            del data, out
    finally:
        tcp.close()
        shm.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    print(f"\n{payload >> 20} MiB float32 regular field, native protocol, stowd with 2 local units, "
          f"median of {a.reps}\n")
    print("| shape | operation | time (ms) | GB/s | client peak RSS / payload | stowd peak RSS / payload |")
    print("|---|---|---:|---:|---:|---:|")
    for shape, name, t, gbs, cpk, spk in rows:
        print(f"| {shape} | {name} | {t * 1e3:.2f} | {gbs:.2f} | {cpk:.3f} | {spk:.3f} |")


if __name__ == "__main__":
    main()
