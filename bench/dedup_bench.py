#!/usr/bin/env python3
"""Deduplicated puts (issue 19): what `[dedup] fields` costs and saves.

Two release stowds side by side, one with `[dedup] fields = ["p*"]`, one
without; the Python client puts float32 rows of 4 KiB over tcp to each, in
alternation, --reps times:

  unique     --mib of distinct rows: the scan finds nothing (the pure cost
             of one XXH3 pass and the per-row bookkeeping);
  repeated   the same bytes as --prompts distinct rows, each repeated for
             --samples rows in a row (GRPO: a prompt per sample): stored
             once per distinct row.

Columns: put seconds with and without dedup (median), stowd's own
`dedup_ns` per GiB scanned (its hash, compare and compaction time, from
`stats`), the bytes it saved, RSS growth of each stowd over the put, and a
memcpy of the same bytes (numpy, into a resident buffer) and an XXH3 pass
if the `xxhash` module is installed, in the same run. Needs a release
build: `cargo build --release -p stowage-host`.

usage: python3 bench/dedup_bench.py [--mib 512] [--reps 5] [--stowd PATH]
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


def start(binary, tmp, name, extra):
    cfg = os.path.join(tmp, f"{name}.toml")
    eps = os.path.join(tmp, f"{name}.json")
    with open(cfg, "w") as f:
        f.write("[units]\nlocal = 2\n\n[shm]\nenabled = false\n" + extra)
    proc = subprocess.Popen([binary, "serve", "--config", cfg, "--endpoints-file", eps],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"{name}.log"), "w"),
                            env={**os.environ, "RUST_LOG": "warn"})
    deadline = time.time() + 120
    while not os.path.exists(eps):
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"stowd {name} did not start (see {tmp}/{name}.log)")
        time.sleep(0.1)
    with open(eps) as f:
        return proc, json.load(f)["native"]


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    a = ap.parse_args()
    rows = a.mib * 256  # 4 KiB rows
    samples = max(1, rows // a.prompts)
    unique = np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024)
    distinct = unique[: a.prompts]
    repeated = np.repeat(distinct, samples, axis=0)[:rows].copy()
    nbytes = unique.nbytes
    with tempfile.TemporaryDirectory() as tmp:
        on, on_ep = start(a.stowd, tmp, "dedup", '\n[dedup]\nfields = ["p*"]\n')
        off, off_ep = start(a.stowd, tmp, "plain", "")
        try:
            c_on, c_off = stowage.Client(on_ep), stowage.Client(off_ep)
            idx = list(range(rows))
            out = {}
            for name, data in (("unique", unique), ("repeated", repeated)):
                t_on, t_off, ns, scanned, saved, g_on, g_off = [], [], [], [], [], [], []
                for _ in range(a.reps):
                    for client, proc, times, growth in ((c_on, on, t_on, g_on), (c_off, off, t_off, g_off)):
                        before = rss(proc.pid)
                        s0 = client.stats()
                        t = time.perf_counter()
                        client.put(idx, {"p": data})
                        times.append(time.perf_counter() - t)
                        growth.append(rss(proc.pid) - before)
                        s1 = client.stats()
                        if client is c_on:
                            ns.append(s1["dedup_ns"] - s0["dedup_ns"])
                            scanned.append(s1["dedup_scanned_bytes"] - s0["dedup_scanned_bytes"])
                            saved.append(s1["dedup_bytes"] - s0["dedup_bytes"])
                        got = client.get(idx[:: max(1, rows // 64)], ["p"])["p"]
                        if not np.array_equal(got, data[:: max(1, rows // 64)]):
                            raise SystemExit(f"{name}: wrong rows read back")
                        client.clear(idx)
                out[name] = (t_on, t_off, ns, scanned, saved, g_on, g_off)
            dst = np.empty_like(unique)
            dst[:] = 1
            cps = []
            for _ in range(a.reps):
                t = time.perf_counter()
                np.copyto(dst, unique)
                cps.append(time.perf_counter() - t)
            try:
                import xxhash  # noqa: F401
                hs = []
                for _ in range(a.reps):
                    t = time.perf_counter()
                    xxhash.xxh3_64_intdigest(unique)
                    hs.append(time.perf_counter() - t)
                hash_s = statistics.median(hs)
            except ImportError:
                hash_s = None
        finally:
            for p in (on, off):
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)
    gib = nbytes / 2**30
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\n{a.mib} MiB of float32 4 KiB rows, 2 units, tcp; stowd {head}; load {open('/proc/loadavg').read().split()[:3]}; median of {a.reps}")
    print(f"repeated: {a.prompts} distinct rows x {samples}\n")
    print("| put | with dedup s | without s | ratio | stowd dedup_ns per GiB scanned | saved / payload | RSS growth with / without (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (t_on, t_off, ns, scanned, saved, g_on, g_off) in out.items():
        m_on, m_off = statistics.median(t_on), statistics.median(t_off)
        per_gib = statistics.median(n / (s / 2**30) for n, s in zip(ns, scanned)) / 1e9
        print(f"| {name} | {m_on:.3f} | {m_off:.3f} | {m_on / m_off:.2f} | {per_gib:.3f} s | "
              f"{statistics.median(saved) / nbytes:.3f} | {statistics.median(g_on) / 2**20:.0f} / {statistics.median(g_off) / 2**20:.0f} |")
    print(f"\nmemcpy of the payload (numpy, resident): {statistics.median(cps) / gib:.3f} s per GiB")
    if hash_s is not None:
        print(f"XXH3 of the payload (python xxhash): {hash_s / gib:.3f} s per GiB")


if __name__ == "__main__":
    main()
