#!/usr/bin/env python3
"""Round trip of small calls, end to end: one 4 KiB row got, and put, by
the Python client (through its Rust core, and with STOWAGE_PURE_PYTHON=1
through pyzmq), against release stowds side by side in one run: each
binary given (e.g. this commit's and a baseline's) with the bundled
plugins and with the built-in policy (an empty plugin directory).

A small call's time on this kind of machine is mostly the two wake-ups
of another process, and a wake-up across CPUs costs far more than one on
the same CPU, so each stowd is measured twice: pinned to the client's CPU
(`same CPU`) and to the other one (`two CPUs`); the client is pinned to
CPU 0. Per cell: the median of --calls round trips, µs.

usage: python3 bench/small_calls.py --stowd NEW[=label] [--stowd OLD=label ...]
           [--plugins target/plugins] [--calls 3000]
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


def median_us(fn, calls: int) -> float:
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def measure(endpoint: str, calls: int) -> dict:
    """{(op, transport): µs} for a get and a put of one 4 KiB row."""
    row = np.ones((1, 1024), np.float32)
    out = {}
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(range(16), {"x": np.zeros((16, 1024), np.float32)})
        for transport in ("core", "pyzmq"):
            if transport == "pyzmq":
                os.environ["STOWAGE_PURE_PYTHON"] = "1"
            else:
                os.environ.pop("STOWAGE_PURE_PYTHON", None)
            c.get([3], ["x"])  # warm: connections made, plugins instantiated
            out[("get", transport)] = median_us(lambda: c.get([3], ["x"]), calls)
            out[("put", transport)] = median_us(lambda: c.put([5], {"x": row}), calls)
        os.environ.pop("STOWAGE_PURE_PYTHON", None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", action="append", required=True, metavar="BIN[=LABEL]")
    ap.add_argument("--plugins", default=os.path.join(ROOT, "target", "plugins"))
    ap.add_argument("--calls", type=int, default=3000)
    a = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two CPUs")
    os.sched_setaffinity(0, {0})
    rows = []
    with tempfile.TemporaryDirectory(prefix="stowage-small-calls-") as work:
        for k, spec in enumerate(a.stowd):
            binary, _, label = spec.partition("=")
            for plugins, chain in ((a.plugins, "bundled plugins"), (None, "built-in")):
                for cpus, where in (("0", "same CPU"), ("1", "two CPUs")):
                    proc, eps = start(binary, os.path.join(work, f"{k}-{chain}-{cpus}"), plugins, cpus=cpus)
                    try:
                        time.sleep(0.5)
                        got = measure(eps["native"], a.calls)
                    finally:
                        proc.terminate()
                        proc.wait()
                    rows.append((label or binary, chain, where, got))
                    print(f"  {label or binary}, {chain}, {where}: " +
                          ", ".join(f"{op} {t} {v:.1f} us" for (op, t), v in got.items()), flush=True)
    keys = list(rows[0][3])
    print()
    print("| stowd | policy | placement | " + " | ".join(f"{op}, {t} (µs)" for op, t in keys) + " |")
    print("|---|---|---|" + "---:|" * len(keys))
    for label, chain, where, got in rows:
        print(f"| {label} | {chain} | {where} | " + " | ".join(f"{got[k]:.1f}" for k in keys) + " |")
    print(f"\nload: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
