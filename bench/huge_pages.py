#!/usr/bin/env python3
"""Fresh get buffers with and without transparent huge pages (the Rust
core's `STOWAGE_HUGE_PAGES=1`), in one run.

A release stowd (built-in policy, 4 units) holds float32 [262144, 1024]
(1 GiB). Per round and way, after --idle seconds of nothing (so that a VM
that hands free memory back to its host has done so), a fresh client
process makes one get of all of it into a fresh buffer ("after idle"),
then --again more, each after `release_receive_buffers()` so that each is
fresh too but lands in memory just freed ("back to back"). Ways alternate.
Prints GB/s (1e9 bytes of payload a second).

usage: python3 bench/huge_pages.py [--stowd target/release/stowd] [--rounds 3] [--idle 8] [--again 3]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from policy_put import start  # noqa: E402  (also puts clients/python on the path)

import stowage  # noqa: E402

ROWS = 262144

ONE = r"""
import sys, time, stowage
n, again = int(sys.argv[2]), int(sys.argv[3])
with stowage.Client(sys.argv[1], timeout=120) as c:
    c.get([0], ["x"])  # connected
    g = None
    for k in range(1 + again):
        if g is not None:
            del g
            stowage.release_receive_buffers()
        t = time.perf_counter()
        g = c.get(range(n), ["x"])["x"]
        print(g.nbytes / (time.perf_counter() - t) / 1e9)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle", type=float, default=8.0)
    ap.add_argument("--again", type=int, default=3)
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "clients", "python"))
    env.pop("STOWAGE_HUGE_PAGES", None)
    ways = {"4 KiB pages (default)": env, "huge pages (STOWAGE_HUGE_PAGES=1)": dict(env, STOWAGE_HUGE_PAGES="1")}
    got = {w: ([], []) for w in ways}
    with tempfile.TemporaryDirectory(prefix="stowage-huge-") as work:
        proc, eps = start(a.stowd, work, None)
        try:
            with stowage.Client(eps["native"], timeout=120) as c:
                c.put(range(ROWS), {"x": np.ones((ROWS, 1024), np.float32)})
            for r in range(a.rounds):
                for way, e in ways.items():
                    time.sleep(a.idle)
                    out = subprocess.run([sys.executable, "-c", ONE, eps["native"], str(ROWS), str(a.again)],
                                         env=e, capture_output=True, text=True, check=True).stdout.split()
                    gbs = [float(x) for x in out]
                    got[way][0].append(gbs[0])
                    got[way][1].extend(gbs[1:])
                    print(f"  round {r + 1}, {way}: " + " ".join(f"{x:.2f}" for x in gbs), flush=True)
        finally:
            proc.terminate()
            proc.wait()
    print(f"\n1 GiB get into a fresh buffer, GB/s; {a.rounds} rounds, {a.idle:g} s idle before each\n")
    print("| buffer pages | after idle: each | median | back to back: range | median |")
    print("|---|---|---:|---|---:|")
    for way, (idle, again) in got.items():
        print(f"| {way} | {', '.join(f'{x:.2f}' for x in idle)} | {statistics.median(idle):.2f} | "
              f"{min(again):.2f}-{max(again):.2f} | {statistics.median(again):.2f} |")
    print(f"\nload: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
