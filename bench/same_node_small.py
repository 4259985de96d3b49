#!/usr/bin/env python3
"""Same-node gets by size: where a reply through stowd's segments starts to
pay for its descriptor, mapping and checks, and what `[shm] inline_below`
(a same-node get under that many bytes answered over the socket) makes of
the small ones.

Two release stowds (the built-in policy, 4 units, shared memory in a
directory of each's own) run at once: one with `inline_below = 0` (every
same-node get through segments, as before the key) and one with the
default (`--inline-below`, 65536). Each holds one field of float32 rows
(4 KiB a row; 1 KiB as 1 row of 256) for each size; the client (this
process) gets all of a size's rows, 3 ways in alternating blocks of
`--block` gets: over tcp (`Client`), same node from the segments stowd,
same node from the default stowd. Each way's median of `--gets` gets, µs,
and its ratio to tcp in the same run. Placements: stowd and the client on
CPU 0, then stowd on CPU 1 and the client on CPU 0.

usage: python3 bench/same_node_small.py [--gets 600] [--block 50] [--inline-below 65536]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from policy_put import start  # noqa: E402  (also puts clients/python on the path)
import numpy as np  # noqa: E402
import stowage  # noqa: E402

SIZES_KIB = [1, 4, 16, 64, 128, 256, 1024, 4096]


def rows_of(kib: int) -> np.ndarray:
    if kib < 4:
        return np.arange(kib * 256, dtype=np.float32).reshape(1, kib * 256)
    return np.arange(kib * 256, dtype=np.float32).reshape(kib // 4, 1024)


def run(placement: str, stowd_cpus: str, a: argparse.Namespace, binary: str) -> None:
    work = tempfile.mkdtemp(prefix="stowage-snsmall-")
    procs = []
    try:
        eps = {}
        for label, below in (("segments", 0), ("inline", a.inline_below)):
            shm = os.path.join(work, f"shm-{label}")
            proc, ep = start(binary, os.path.join(work, label), None, cpus=stowd_cpus,
                             extra=f'\n[shm]\ndir = "{shm}"\ninline_below = {below}\n')
            procs.append(proc)
            eps[label] = ep["native"]
        clients = {
            "tcp": stowage.Client(eps["inline"], timeout=60),
            "same node, segments": stowage.Client(eps["segments"], timeout=60, same_node=True),
            "same node, inline_below": stowage.Client(eps["inline"], timeout=60, same_node=True),
        }
        print(f"\n### {placement}\n")
        print(f"| KiB a get | {' | '.join(clients)} | segments / tcp | inline_below / tcp |")
        print("|---:|" + "---:|" * (len(clients) + 2))
        for k, kib in enumerate(SIZES_KIB):
            a_rows = rows_of(kib)
            idx = list(range(k * 10**6, k * 10**6 + len(a_rows)))
            for ep in set(eps.values()):
                with stowage.Client(ep, timeout=60) as c:
                    c.put(idx, {"x": a_rows})
            times = {w: [] for w in clients}
            for c in clients.values():  # warm: channels open, rows in segments
                for _ in range(5):
                    c.get(idx, ["x"])
            gets = a.gets if kib < 1024 else max(a.block, a.gets // 4)
            order = list(clients)
            while min(len(t) for t in times.values()) < gets:
                for w in order:
                    c = clients[w]
                    for _ in range(a.block):
                        t = time.perf_counter()
                        got = c.get(idx, ["x"])
                        times[w].append(time.perf_counter() - t)
                    assert got["x"].shape == a_rows.shape and got["x"][-1, -1] == a_rows[-1, -1]
                    del got
                order.reverse()
            p50 = {w: statistics.median(t) * 1e6 for w, t in times.items()}
            cells = " | ".join(f"{p50[w]:.1f}" for w in clients)
            print(f"| {kib:,} | {cells} | {p50['same node, segments'] / p50['tcp']:.2f} "
                  f"| {p50['same node, inline_below'] / p50['tcp']:.2f} |")
        for c in clients.values():
            c.close()
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--gets", type=int, default=600, help="gets a way and size (a quarter from 1 MiB on)")
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--inline-below", type=int, default=65536)
    a = ap.parse_args()
    print(f"# Same-node gets by size, p50 µs; load at start {' '.join(open('/proc/loadavg').read().split()[:3])}")
    os.sched_setaffinity(0, {0})
    run("same CPU (stowd and client on CPU 0)", "0", a, a.stowd)
    run("two CPUs (stowd on CPU 1, client on CPU 0)", "1", a, a.stowd)
    print(f"\n# load at end: {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
