#!/usr/bin/env python3
"""A plain tcp get through the Rust core into a reused buffer against one
into fresh memory (the client's receive pool, `clients/python/core/src/pool.rs`).

A release stowd (built-in policy) holds one float32 field of --gib GiB as
rows of 4 KiB, put twice. Then --rounds rounds, each: a get with the pool
on, whose previous result was dropped just before (so its buffer is there
to take), and a get with `STOWAGE_RECEIVE_POOL_BYTES=0` and the pool
emptied (a fresh buffer, faulted in as the reply is read). Prints GB/s
(median, min, max) per way and the load average.

usage: python3 bench/get_reuse.py --stowd target/release/stowd [--gib 1] [--rounds 8]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from policy_put import start  # noqa: E402  (also puts clients/python on the path)

import stowage  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    n = int(a.gib * (1 << 30)) // 4096
    x = np.random.default_rng(0).random((n, 1024), dtype=np.float32)
    got = {"reused buffer": [], "fresh buffer": []}
    with tempfile.TemporaryDirectory(prefix="stowage-get-reuse-") as work:
        proc, eps = start(a.stowd, work, None)
        try:
            with stowage.Client(eps["native"], timeout=600) as c:
                c.put(range(n), {"x": x})
                c.put(range(n), {"x": x})
                for _ in range(a.rounds):
                    for way in got:
                        if way == "fresh buffer":
                            os.environ["STOWAGE_RECEIVE_POOL_BYTES"] = "0"
                            stowage.release_receive_buffers()
                        else:
                            os.environ.pop("STOWAGE_RECEIVE_POOL_BYTES", None)
                            r = c.get(range(n), ["x"])
                            del r  # its buffer goes back to the pool
                        t = time.perf_counter()
                        r = c.get(range(n), ["x"])
                        got[way].append(x.nbytes / (time.perf_counter() - t) / 1e9)
                        if not np.array_equal(r["x"], x):
                            raise SystemExit(f"{way}: rows differ")
                        del r
                os.environ.pop("STOWAGE_RECEIVE_POOL_BYTES", None)
        finally:
            proc.terminate()
            proc.wait()
    print(f"get of {x.nbytes / 2**30:g} GiB (float32 [{n}, 1024]), {a.rounds} rounds, alternating\n")
    print("| way | GB/s median | min | max |\n|---|---:|---:|---:|")
    for way, v in got.items():
        print(f"| {way} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    print(f"\nload: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
