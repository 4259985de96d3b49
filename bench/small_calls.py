#!/usr/bin/env python3
"""Round trip of small calls, end to end: one 4 KiB row got, and put, by
the Python client (through its Rust core, which polls for a reply for up
to spin_us before sleeping: its default and spin_us=0; and with
STOWAGE_PURE_PYTHON=1 through pyzmq), against release stowds side by side in one run: each
binary given (e.g. this commit's and a baseline's) with the bundled
plugins and with the built-in policy (an empty plugin directory).

A small call's time on this kind of machine is mostly the two wake-ups
of another process, and a wake-up across CPUs costs far more than one on
the same CPU, so each stowd is measured twice: pinned to the client's CPU
(`same CPU`) and to the other one (`two CPUs`); the client is pinned to
CPU 0. Per cell: the median of --calls round trips, µs. The floor, in
the same run: a plain tcp ping-pong between two Python processes, placed
the same two ways. Then the CPU time per call of the client and of
stowd over 5x --calls more calls (the machine's noise moves it far less
than a round trip).

usage: python3 bench/small_calls.py --stowd NEW[=label] [--stowd OLD=label ...]
           [--plugins target/plugins] [--calls 3000]
"""
import argparse
import os
import socket
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


def cpu_seconds(pid: int) -> float:
    """User + system time of process `pid` so far (all its threads)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def measure(endpoint: str, calls: int, stowd_pid: int) -> tuple[dict, dict]:
    """({(op, transport): µs} for a get and a put of one 4 KiB row (the
    core with its default spin, the core with spin_us=0, pyzmq), and
    {(op, transport): (client CPU µs, stowd CPU µs)} per call, from a
    second pass of 5x the calls: CPU time moves far less with the
    machine's noise than a round trip does)."""
    row = np.ones((1, 1024), np.float32)
    out, cpu = {}, {}
    with stowage.Client(endpoint, timeout=30) as c, stowage.Client(endpoint, timeout=30, spin_us=0) as asleep:
        c.put(range(16), {"x": np.zeros((16, 1024), np.float32)})
        for transport, client in (("core", c), ("core spin 0", asleep), ("pyzmq", c)):
            if transport == "pyzmq":
                os.environ["STOWAGE_PURE_PYTHON"] = "1"
            else:
                os.environ.pop("STOWAGE_PURE_PYTHON", None)
            client.get([3], ["x"])  # warm: connections made, plugins instantiated
            for op, fn in (("get", lambda: client.get([3], ["x"])), ("put", lambda: client.put([5], {"x": row}))):
                out[(op, transport)] = median_us(fn, calls)
                mine, theirs = time.process_time(), cpu_seconds(stowd_pid)
                for _ in range(5 * calls):
                    fn()
                cpu[(op, transport)] = ((time.process_time() - mine) / (5 * calls) * 1e6,
                                        (cpu_seconds(stowd_pid) - theirs) / (5 * calls) * 1e6)
        os.environ.pop("STOWAGE_PURE_PYTHON", None)
    return out, cpu


def ping_pong(cpu: int, calls: int) -> float:
    """The floor for a small call: the median round trip of a plain tcp
    exchange on 127.0.0.1 between this process and a Python echo process
    pinned to `cpu` (64 bytes out, 4,200 back: about a 1-row get's
    request and reply), µs."""
    ls = socket.create_server(("127.0.0.1", 0))
    pid = os.fork()
    if pid == 0:  # the echo process: gone once this one closes its socket
        try:
            os.sched_setaffinity(0, {cpu})
            s, _ = ls.accept()
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reply = b"r" * 4200
            while s.recv(65536):
                s.sendall(reply)
        finally:
            os._exit(0)
    address = ls.getsockname()
    ls.close()
    c = socket.create_connection(address)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(8192))
    request = b"q" * 64

    def once():
        c.sendall(request)
        got = 0
        while got < 4200:
            got += c.recv_into(buf[got:])

    for _ in range(200):
        once()
    try:
        return median_us(once, calls)
    finally:
        c.close()
        os.waitpid(pid, 0)


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
                        got, cpu = measure(eps["native"], a.calls, proc.pid)
                    finally:
                        proc.terminate()
                        proc.wait()
                    rows.append((label or binary, chain, where, got, cpu))
                    print(f"  {label or binary}, {chain}, {where}: " +
                          ", ".join(f"{op} {t} {v:.1f} us" for (op, t), v in got.items()), flush=True)
    floor = {where: ping_pong(cpu, a.calls) for cpu, where in ((0, "same CPU"), (1, "two CPUs"))}
    keys = list(rows[0][3])
    print()
    print("| placement | tcp ping-pong, plain Python (µs) |\n|---|---:|")
    for where, us in floor.items():
        print(f"| {where} | {us:.1f} |")
    print()
    print("| stowd | policy | placement | " + " | ".join(f"{op}, {t} (µs)" for op, t in keys)
          + " | get, core / pyzmq | get, core / ping-pong |")
    print("|---|---|---|" + "---:|" * (len(keys) + 2))
    for label, chain, where, got, _ in rows:
        print(f"| {label} | {chain} | {where} | " + " | ".join(f"{got[k]:.1f}" for k in keys)
              + f" | {got[('get', 'core')] / got[('get', 'pyzmq')]:.2f}"
              + f" | {got[('get', 'core')] / floor[where]:.2f} |")
    print("\nCPU per call, client + stowd (µs; 5x the calls, all of them):\n")
    print("| stowd | policy | placement | " + " | ".join(f"{op}, {t}" for op, t in keys)
          + " | get, core / pyzmq |")
    print("|---|---|---|" + "---:|" * (len(keys) + 1))
    for label, chain, where, _, cpu in rows:
        total = {k: sum(v) for k, v in cpu.items()}
        print(f"| {label} | {chain} | {where} | "
              + " | ".join(f"{cpu[k][0]:.0f} + {cpu[k][1]:.0f}" for k in keys)
              + f" | {total[('get', 'core')] / total[('get', 'pyzmq')]:.2f} |")
    print(f"\nload: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
