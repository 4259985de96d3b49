#!/usr/bin/env python3
"""A same-node get of rows scattered over stowd's segments, gathered into
one array by the client's Rust core (one pass into a buffer of its receive
pool). The numpy way it replaced (one `take` per segment into a temporary,
a masked assignment from it into a fresh `np.empty`), which this script
once ran alternately, is gone from the client, and so from here.

A release stowd (bundled plugins, 4 units) holds float32 [131072, 1024]
(512 MiB, 4 KiB rows) put same-node; each get asks for a random quarter
(32,768 rows, random order) and is checked. Prints ms per get: the first
of each way, the median, min and max over ROUNDS.

usage: python3 bench/same_node_gather.py [ROUNDS]   (default 12)
"""
import os, shutil, sys, time, tempfile, statistics
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from policy_put import start  # noqa: E402  (also puts clients/python on the path)
import numpy as np, stowage
w = tempfile.mkdtemp(prefix="stowage-gather-")
proc, eps = start(os.path.join(ROOT, "target", "release", "stowd"), w, os.path.join(ROOT, "target", "plugins"))
try:
    a = np.arange(131072, dtype=np.float32)[:, None] * np.ones((1, 1024), np.float32)
    with stowage.Client(eps["native"], timeout=120, same_node=True) as c:
        c.put(range(131072), {"x": a})
        rng = np.random.default_rng(1)
        res = {"core gather": []}
        for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 12):
            for way in res:
                idx = rng.permutation(131072)[:32768].tolist()
                t = time.perf_counter(); g = c.get(idx, ["x"])["x"]; dt = time.perf_counter() - t
                assert (g[:, 0] == np.array(idx, np.float32)).all() and (g[:, -1] == g[:, 0]).all()
                res[way].append(dt * 1e3)
                del g
        print("| gather | first (ms) | median | min | max |\n|---|---:|---:|---:|---:|")
        for k, v in res.items():
            print(f"| {k} | {v[0]:.0f} | {statistics.median(v):.0f} | {min(v):.0f} | {max(v):.0f} |")
        print(f"\nload: {open('/proc/loadavg').read().split()[:3]}")
finally:
    proc.terminate()
    proc.wait()
    shutil.rmtree(w, ignore_errors=True)
