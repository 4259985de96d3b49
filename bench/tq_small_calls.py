#!/usr/bin/env python3
"""Small calls through the TransferQueue backend's client side, against
the `stowage` clients, in one run: the client CPU and wall time of a put
and a get of 4 rows of float32[16] per field, 1 and 10 fields, `stowd`
and the client pinned to one CPU (or to two with --two-cpus).

Rows:
- `backend`: `stowage.transferqueue._Clients.run`, what the "Stowage"
  backend's `put_data` / `get_data` await (an `AsyncClient` per event
  loop; the get as the backend asks it, `as_torch=True`,
  `nested="packed"`);
- `get_data`: the backend's get and what `get_data` makes of it: each
  field as SimpleStorage gives it (rows of 1 dim or more as a nested
  jagged tensor) in a TensorDict (a tenth of --calls);
- `thread hop`: the same call on a `stowage.Client` in a worker thread,
  awaited through `loop.run_in_executor` (what the backend did before);
- `AsyncClient`, and the sync `Client` (default spin) for the floor.

Needs transferqueue's venv only for torch (the backend's gets ask for
tensors): `python bench/tq_small_calls.py` with `--tq-python` given, or
run it under that venv's python. Prints a markdown table.

With --same-node, stowd has shared memory (`[shm]`, its defaults) and
every client is a same-node one (as the backend's `same_node: auto` makes
it on stowd's own node).

usage: TQ_VENV/bin/python bench/tq_small_calls.py [--stowd target/release/stowd] [--calls 3000] [--two-cpus]
           [--same-node]
"""
import argparse
import asyncio
import os
import resource
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from policy_put import ROOT, start  # noqa: E402  (also puts clients/python on the path)

import stowage  # noqa: E402
from stowage.transferqueue import _Clients  # noqa: E402
from stowage import _tqvalues  # noqa: E402  (needs torch and TransferQueue, as the backend does)

# (A client from before `tensordict_of`: the checked constructor it used.)
tensordict_of = getattr(_tqvalues, "tensordict_of", None) or (
    lambda fields, n: __import__("tensordict").TensorDict(fields, batch_size=n))


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def timed(n: int, call) -> tuple[float, float]:
    """(client CPU µs, wall µs) a call over `n` awaited calls, after one."""
    await call()
    c, w = cpu(), time.perf_counter()
    for _ in range(n):
        await call()
    return (cpu() - c) / n * 1e6, (time.perf_counter() - w) / n * 1e6


async def one_shape(ep: str, fields: int, n: int, same: bool = False) -> dict:
    data = {f"f{i}": np.full((4, 16), i, np.float32) for i in range(fields)}
    idx, names = [0, 1, 2, 3], list(data)
    out = {}
    backend = _Clients(ep, same, 60.0)
    try:
        out["backend", "put"] = await timed(n, lambda: backend.run("put", idx, data))
        out["backend", "get"] = await timed(n, lambda: backend.run("get", idx, names, as_torch=True,
                                                                   nested="packed"))

        async def get_data():
            # What `get_data` returns from that: each field as SimpleStorage
            # gives it (a nested jagged tensor for rows of 1 dim or more)
            # and the TensorDict around them.
            got = await backend.run("get", idx, names, as_torch=True, nested="packed")
            return tensordict_of({k: _tqvalues.from_wire(got[k], 4) for k in names}, 4)
        out["get_data", "get"] = await timed(max(n // 10, 50), get_data)
    finally:
        backend.close()
    loop = asyncio.get_running_loop()
    with stowage.Client(ep, timeout=60, same_node=same) as c, ThreadPoolExecutor(4) as pool:
        out["thread hop", "put"] = await timed(n, lambda: loop.run_in_executor(pool, c.put, idx, data))
        out["thread hop", "get"] = await timed(n, lambda: loop.run_in_executor(
            pool, lambda: c.get(idx, names, as_torch=True, nested="packed")))

        async def sync(f):
            f()
        out["sync Client", "put"] = await timed(n, lambda: sync(lambda: c.put(idx, data)))
        out["sync Client", "get"] = await timed(n, lambda: sync(lambda: c.get(idx, names)))
    async with stowage.AsyncClient(ep, timeout=60, same_node=same) as a:
        out["AsyncClient", "put"] = await timed(n, lambda: a.put(idx, data))
        out["AsyncClient", "get"] = await timed(n, lambda: a.get(idx, names))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--two-cpus", action="store_true", help="stowd on CPU 1, the client on CPU 0")
    ap.add_argument("--same-node", action="store_true", help="stowd with [shm], every client same-node")
    a = ap.parse_args()
    os.sched_setaffinity(0, {0})
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as work:
        shm = f'\n[shm]\ndir = "{os.path.join(work, "shm")}"\n' if a.same_node else ""
        proc, eps = start(a.stowd, work, None, cpus="1" if a.two_cpus else "0", extra=shm)
        os.environ.setdefault("STOWAGE_TOKEN", eps.get("token") or "")
        try:
            rows = {f: asyncio.run(one_shape(eps["native"], f, a.calls, a.same_node)) for f in (1, 10)}
        finally:
            proc.terminate()
            proc.wait()
    print(f"{a.calls} calls each, 4 rows x float32[16] a field, built-in policy, stowd {a.stowd}, "
          f"{'two CPUs' if a.two_cpus else 'one CPU'}{', same node' if a.same_node else ''}; load average {load[0]:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end\n")
    print("| way | op | client CPU, 1 field | wall, 1 field | client CPU, 10 fields | wall, 10 fields |")
    print("|---|---|---:|---:|---:|---:|")
    for way in ("backend", "get_data", "thread hop", "AsyncClient", "sync Client"):
        for op in ("put", "get"):
            if (way, op) not in rows[1]:
                continue
            (c1, w1), (c10, w10) = rows[1][way, op], rows[10][way, op]
            print(f"| {way} | {op} | {c1:.1f} | {w1:.1f} | {c10:.1f} | {w10:.1f} |")


if __name__ == "__main__":
    main()
