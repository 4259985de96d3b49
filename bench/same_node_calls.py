#!/usr/bin/env python3
"""Small same-node calls, sync and async, against the same calls over tcp,
in one run: what a put and a get of 4 rows of float32[16] per field (1 and
10 fields) cost a same-node client that went through a lease and a lane
before, and what they cost now.

One release stowd (the built-in policy, 4 units, shared memory with the
default `[shm] inline_below`). Ways, each timed in turn over the same
calls (p50 of --calls put+get pairs at fresh indexes, cleared after):

- `tcp`: `Client` and `AsyncClient` over the socket alone;
- `same node, leases`: `SAME_NODE_INLINE_BELOW = 0` (every put that holds
  a byte leases a segment: a round trip more, a descriptor, a mapping);
  the async one with its calls on lanes (a sync client in a worker
  thread), as an `AsyncClient` ran every same-node put and get before;
- `same node`: the defaults (a put under 64 KiB on the socket, an
  `AsyncClient`'s same-node get on its event loop).

Then puts through a lease (128 KiB and 512 KiB, float32 rows of 4 KiB,
each put's rows cleared after it, outside the timing): a `Client`, an
`AsyncClient` (the lease and the put from its event loop, under
`CORE_MIN_BYTES`), and an `AsyncClient` with every call on a lane (as
before the event loop took them); p50 of --lease-puts puts.

Placements: stowd and the client on CPU 0, then stowd on CPU 1 and the
client on CPU 0.

usage: python3 bench/same_node_calls.py [--stowd target/release/stowd] [--calls 1500] [--lease-puts 400]
"""
import argparse
import asyncio
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


def sync_calls(c, data, base, n):
    fields, pt, gt = list(data), [], []
    for k in range(n):
        idx = list(range(base + 4 * k, base + 4 * k + 4))
        t = time.perf_counter()
        c.put(idx, data)
        pt.append(time.perf_counter() - t)
        t = time.perf_counter()
        c.get(idx, fields)
        gt.append(time.perf_counter() - t)
    c.clear(list(range(base, base + 4 * n)))
    return pt, gt


async def async_calls(c, data, base, n):
    fields, pt, gt = list(data), [], []
    for k in range(n):
        idx = list(range(base + 4 * k, base + 4 * k + 4))
        t = time.perf_counter()
        await c.put(idx, data)
        pt.append(time.perf_counter() - t)
        t = time.perf_counter()
        await c.get(idx, fields)
        gt.append(time.perf_counter() - t)
    await c.clear(list(range(base, base + 4 * n)))
    return pt, gt


WAYS = ["sync tcp", "sync same node, leases", "sync same node",
        "async tcp", "async same node, leases and lanes", "async same node"]


def measure(way, ep, data, base, n):
    same = "same node" in way
    old = "leases" in way
    if way.startswith("sync"):
        with stowage.Client(ep, same_node=same) as c:
            if old:
                c.SAME_NODE_INLINE_BELOW = 0
            sync_calls(c, data, base, 50)  # warm: connection, channel
            return sync_calls(c, data, base, n)

    async def go():
        async with stowage.AsyncClient(ep, same_node=same) as c:
            if old:
                c.SAME_NODE_INLINE_BELOW = 0
                c._loop_idle = None  # every call on a lane (STOWAGE_ASYNC_IN_LOOP=0 for this client)
            await async_calls(c, data, base, 50)
            return await async_calls(c, data, base, n)
    return asyncio.run(go())


def leased_puts(ep, kib, n):
    """p50 µs of `n` same-node puts of `kib` KiB (through a lease) three ways."""
    x = np.ones((kib // 4, 1024), np.float32)
    idx = list(range(len(x)))
    out = {}
    with stowage.Client(ep, same_node=True) as c:
        ts = []
        for k in range(n + 20):
            t = time.perf_counter()
            c.put(idx, {"x": x})
            ts.append(time.perf_counter() - t)
            c.clear(idx)
        out["sync"] = statistics.median(ts[20:]) * 1e6

    async def go(lanes):
        async with stowage.AsyncClient(ep, same_node=True) as c:
            if lanes:
                c._loop_idle = None
            ts = []
            for k in range(n + 20):
                t = time.perf_counter()
                await c.put(idx, {"x": x})
                ts.append(time.perf_counter() - t)
                await c.clear(idx)
            return statistics.median(ts[20:]) * 1e6
    out["async, on a lane"] = asyncio.run(go(True))
    out["async"] = asyncio.run(go(False))
    return out


def run(placement, cpus, a):
    work = tempfile.mkdtemp(prefix="stowage-sncalls-")
    proc, eps = start(a.stowd, os.path.join(work, "s"), None, cpus=cpus,
                      extra=f'\n[shm]\ndir = "{os.path.join(work, "shm")}"\n')
    try:
        print(f"\n### {placement}\n")
        print("| fields | way | put p50 µs | get p50 µs | put / tcp | get / tcp |")
        print("|---:|---|---:|---:|---:|---:|")
        for nf in (1, 10):
            data = {f"f{i}": np.ones((4, 16), np.float32) for i in range(nf)}
            p50 = {}
            for w, way in enumerate(WAYS):
                pt, gt = measure(way, eps["native"], data, (nf * 10 + w) * 10**6, a.calls)
                p50[way] = (statistics.median(pt) * 1e6, statistics.median(gt) * 1e6)
            for way in WAYS:
                tcp = p50[("sync" if way.startswith("sync") else "async") + " tcp"]
                put, get = p50[way]
                print(f"| {nf} | {way} | {put:.1f} | {get:.1f} | {put / tcp[0]:.2f} | {get / tcp[1]:.2f} |")
        print("\n| KiB a put | sync | async, on a lane | async | async / sync | on a lane / sync |")
        print("|---:|---:|---:|---:|---:|---:|")
        for kib in (128, 512):
            p = leased_puts(eps["native"], kib, a.lease_puts)
            print(f"| {kib} | {p['sync']:.1f} | {p['async, on a lane']:.1f} | {p['async']:.1f} "
                  f"| {p['async'] / p['sync']:.2f} | {p['async, on a lane'] / p['sync']:.2f} |")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--calls", type=int, default=1500, help="put+get pairs a way (their medians)")
    ap.add_argument("--lease-puts", type=int, default=400, help="puts through a lease a way and size")
    a = ap.parse_args()
    print(f"# Small same-node calls, p50 µs; load at start {' '.join(open('/proc/loadavg').read().split()[:3])}")
    os.sched_setaffinity(0, {0})
    run("same CPU (stowd and client on CPU 0)", "0", a)
    run("two CPUs (stowd on CPU 1, client on CPU 0)", "1", a)
    print(f"\n# load at end: {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
