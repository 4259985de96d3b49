#!/usr/bin/env python3
"""Scrape latency of stowd's /metrics, idle and while 16 clients put and get.

Starts the real stowd (the binary given, debug or release) with the metrics
endpoint on, then in one run:

1. idle: scrapes /metrics --scrapes times, nothing else running (baseline);
2. load: starts 16 client processes, each putting and getting batches of
   --rows rows of a [rows, --cols] float32 field over the native protocol
   (real ZeroMQ over tcp on 127.0.0.1), and scrapes --scrapes times while
   they run.

A scrape is one HTTP/1.1 GET on a new TCP connection, timed from connect to
the last byte of the body (the endpoint closes each connection). Scrapes are
spaced --interval seconds apart. Every exposition is checked to end in a
newline and contain `stowd_uptime_seconds`. Prints a table of p50/p99/max
in milliseconds, the clients' put+get rate, and the machine's load.

Bounded: each client stops after --secs seconds or when the scrapes are
done, whichever is first; only 127.0.0.1 is contacted.

usage: python3 bench/metrics_scrape.py --stowd target/debug/stowd [--plugins DIR]
"""
import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

CLIENTS = 16


def scrape(port):
    """One GET /metrics; returns (seconds, body)."""
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        chunks = []
        while True:
            b = s.recv(1 << 16)
            if not b:
                break
            chunks.append(b)
    took = time.perf_counter() - t
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200") or not body.endswith(b"\n") or b"stowd_uptime_seconds" not in body:
        raise SystemExit(f"bad scrape: {raw[:300]!r}")
    return took, body


def native_requests(body):
    """stowd_requests_total summed over the native protocol."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith('stowd_requests_total{protocol="native"'))


def client(endpoint, rows, cols, first, stop, secs, nice):
    os.nice(nice)
    import numpy as np
    import stowage

    c = stowage.Client(endpoint, timeout=60)
    data = np.ones((rows, cols), dtype=np.float32)
    idx = list(range(first, first + rows))
    end = time.monotonic() + secs
    try:
        while not stop.is_set() and time.monotonic() < end:
            c.put(idx, {"x": data})
            got = c.get(idx, ["x"])
            assert got["x"].shape == (rows, cols)
    finally:
        c.close()


def percentiles(xs):
    xs = sorted(xs)

    def q(p):
        return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]

    return q(0.5), q(0.99), xs[-1]


def run(port, scrapes, interval):
    times, size = [], 0
    for _ in range(scrapes):
        took, body = scrape(port)
        times.append(took)
        size = len(body)
        time.sleep(interval)
    return times, size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "debug", "stowd"))
    ap.add_argument("--plugins", default=None, help="plugin directory (default: none, the built-in answers)")
    ap.add_argument("--scrapes", type=int, default=500)
    ap.add_argument("--interval", type=float, default=0.01)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--secs", type=float, default=120)
    ap.add_argument("--client-nice", type=int, default=0,
                    help="niceness of the client processes (10: stowd and the scraper run first)")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    eps = os.path.join(tmp, "ep.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = os.path.join(tmp, "stowd.toml")
    with open(cfg, "w") as f:
        f.write(f"[metrics]\nport = {port}\n")
        if a.plugins:
            f.write(f'\n[plugins]\ndir = "{a.plugins}"\n')
    env = {**os.environ, "RUST_LOG": "warn"}
    proc = subprocess.Popen([a.stowd, "serve", "--config", cfg, "--endpoints-file", eps], stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(tmp, "stowd.log"), "w"), env=env)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(eps):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"stowd did not start: {open(os.path.join(tmp, 'stowd.log')).read()}")
            time.sleep(0.1)
        time.sleep(0.2)
        ep = json.load(open(eps))
        idle, idle_size = run(port, a.scrapes, a.interval)

        stop = mp.Event()
        procs = [mp.Process(target=client, args=(ep["native"], a.rows, a.cols, i * a.rows, stop, a.secs, a.client_nice))
                 for i in range(CLIENTS)]
        for p in procs:
            p.start()
        time.sleep(3)  # let every client connect and start its loop
        before, t0 = native_requests(scrape(port)[1]), time.perf_counter()
        loaded, loaded_size = run(port, a.scrapes, a.interval)
        requests, took = native_requests(scrape(port)[1]) - before, time.perf_counter() - t0
        load_avg = open("/proc/loadavg").read().split()[:3]
        stop.set()
        for p in procs:
            p.join(timeout=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise SystemExit(f"client processes failed: {bad}")
    print(f"\nstowd {a.stowd}; {a.scrapes} scrapes {a.interval * 1e3:.0f} ms apart per row; "
          f"load: {CLIENTS} client processes, put+get of [{a.rows}, {a.cols}] float32 "
          f"({a.rows * a.cols * 4 >> 10} KiB) in a loop at nice {a.client_nice}; {os.cpu_count()} cores; "
          f"loadavg {' '.join(load_avg)}\n")
    print("| state | scrapes | exposition bytes | p50 (ms) | p99 (ms) | max (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, xs, size in [("idle", idle, idle_size), (f"{CLIENTS} clients putting and getting", loaded, loaded_size)]:
        p50, p99, mx = percentiles(xs)
        print(f"| {name} | {len(xs)} | {size} | {p50 * 1e3:.2f} | {p99 * 1e3:.2f} | {mx * 1e3:.2f} |")
    print(f"\nnative requests answered while the loaded scrapes ran: {requests:.0f} in {took:.1f} s "
          f"({requests / took:.0f}/s, counted by stowd_requests_total)")


if __name__ == "__main__":
    main()
