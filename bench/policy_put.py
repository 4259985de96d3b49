#!/usr/bin/env python3
"""The cost of the policy chain on a small put, end to end (issue 20).

Three release stowds side by side in one run: one with the bundled plugins
(the default chain), one with them and their memo off (`[plugins]
memo_entries = 0`: every decision enters a plugin, once per put under
stowage:policy@0.2.0), one with no plugin directory (the built-in policy
decides). The Python client over tcp puts 4 rows x 10 fields of float32
[16] at fresh indexes, alternating between the two stowds in blocks, and
the table gives the median and p90 of each. stowd's own `policy_ns`
(nanoseconds spent deciding) and the plugins' `calls` / `call_ns` across
the run give the share of stowd's time spent in policies and the time per
entry into a plugin (`call_ns` times only chain calls that entered one);
`entries` and `memo_hits` say how many times a plugin was entered and how
many decisions came from its memo; "policy us per put" is `policy_ns` over
the puts.

`--stowd` may be given more than once (`PATH=LABEL`): each binary then runs
its three stowds, all side by side in the same alternating blocks, and each
binary's ratios are against its own built-in (`--no-memo-off` leaves the
memo-off stowds out); with two binaries, the second's median and CPU a put
are also given over the first's, per kind. `--fields` and `--rows` change
the put's shape (10 and 4); "stowd CPU us per put" is its process's user +
system time over the timed puts (its threads' run time, `schedstat`).

usage: python3 bench/policy_put.py --stowd target/release/stowd[=LABEL] [--stowd OTHER=LABEL]
           --plugins target/plugins [--puts 2000] [--no-memo-off] [--fields 10] [--rows 4]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
import stowage  # noqa: E402


def start(binary: str, work: str, plugins: str | None, memo_entries: int | None = None, cpus: str | None = None,
          extra: str = ""):
    """A stowd with 4 local units on `plugins` (None: the built-in), pinned
    to `cpus` (taskset's list) if given, `extra` appended to its config
    (whole tables, e.g. `[shm]`): (process, its endpoints file)."""
    os.makedirs(work, exist_ok=True)
    if plugins is None:  # an empty plugin directory: the built-in decides
        plugins = os.path.join(work, "no-plugins")
        os.makedirs(plugins, exist_ok=True)
    cfg = os.path.join(work, "stowd.toml")
    eps = os.path.join(work, "stowd.json")
    with open(cfg, "w") as f:
        f.write("[units]\nlocal = 4\n\n[plugins]\n")
        f.write(f"dir = {json.dumps(plugins)}\n")
        if memo_entries is not None:
            f.write(f"memo_entries = {memo_entries}\n")
        f.write(extra)
    pin = ["taskset", "-c", cpus] if cpus else []
    proc = subprocess.Popen([*pin, binary, "serve", "--config", cfg, "--endpoints-file", eps],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not os.path.exists(eps):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"stowd did not start ({binary}, plugins {plugins})")
        time.sleep(0.05)
    return proc, json.load(open(eps))


def proc_cpu(pid: int) -> float:
    """Seconds process `pid`'s threads have run so far: the sum of their
    `schedstat` run times (nanoseconds; `/proc/PID/stat`'s utime and
    stime count 10 ms ticks, coarser than a block of small puts)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # a thread that ended since the listing
            pass
    return total / 1e9


def plugin_totals(stats: dict) -> tuple[int, int, int, int]:
    """(decisions asked, entries, memo hits, ns) over every plugin."""
    plugins = [v for k, v in stats.items() if k.startswith("plugin.")]
    return tuple(sum(v.get(key, 0) for v in plugins) for key in ("calls", "entries", "memo_hits", "call_ns"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", action="append", help="PATH[=LABEL], repeatable")
    ap.add_argument("--plugins", default=os.path.join(ROOT, "target", "plugins"))
    ap.add_argument("--puts", type=int, default=2000)
    ap.add_argument("--block", type=int, default=100, help="puts per block before switching stowd")
    ap.add_argument("--no-memo-off", action="store_true", help="leave out the stowds with the memo off")
    ap.add_argument("--fields", type=int, default=10)
    ap.add_argument("--rows", type=int, default=4)
    a = ap.parse_args()
    nf, nr = a.fields, a.rows
    binaries = []  # (label, path)
    for spec in a.stowd or [os.path.join(ROOT, "target", "release", "stowd")]:
        path, _, label = spec.partition("=")
        binaries.append((label or (os.path.basename(path) if len(a.stowd or []) > 1 else ""), path))
    work = tempfile.mkdtemp(prefix="stowage-policy-put-")
    kinds = {"bundled plugins": (a.plugins, None), "bundled, memo off": (a.plugins, 0), "built-in": (None, None)}
    if a.no_memo_off:
        del kinds["bundled, memo off"]
    systems = {}  # name -> (binary, plugins, memo, label, kind)
    for label, path in binaries:
        for kind, (plugins, memo) in kinds.items():
            name = f"{label}: {kind}" if label else kind
            systems[name] = (path, plugins, memo, label, kind)
    procs, clients, times, before = {}, {}, {}, {}
    try:
        for name, (binary, plugins, memo, _, _) in systems.items():
            work_dir = os.path.join(work, name.replace(" ", "-").replace(",", "").replace(":", ""))
            procs[name], ep = start(binary, work_dir, plugins, memo)
            clients[name] = stowage.Client(ep["native"], timeout=30)
            times[name] = []
        fields = {f"f{i}": np.ones((nr, 16), np.float32) for i in range(nf)}
        for c in clients.values():  # warm up
            for k in range(50):
                c.put([nr * k + j for j in range(nr)], fields)
        for name, c in clients.items():
            s = c.stats()
            before[name] = (s.get("policy_ns", 0), *plugin_totals(s))
        base = 1000
        wall = {name: 0.0 for name in systems}
        # Over the whole timed loop (an idle stowd waits in epoll, at no
        # CPU).
        cpu = {name: -proc_cpu(procs[name].pid) for name in systems}
        for block in range(0, a.puts, a.block):
            for name, c in (clients.items() if (block // a.block) % 2 == 0 else reversed(clients.items())):
                t0 = time.perf_counter()
                for k in range(block, min(block + a.block, a.puts)):
                    idx = [base + nr * k + j for j in range(nr)]
                    t = time.perf_counter()
                    c.put(idx, fields)
                    times[name].append(time.perf_counter() - t)
                wall[name] += time.perf_counter() - t0
        for name in systems:
            cpu[name] += proc_cpu(procs[name].pid)
        print(f"{a.puts} puts of {nr} rows x {nf} fields of float32 [16] over tcp, 4 units, "
              f"alternating blocks of {a.block}; stowd " + ", ".join(f"{p}" + (f" ({l})" if l else "") for l, p in binaries) + "\n")
        print("| stowd | median us | p90 us | stowd CPU us per put | policy share of put time | policy us per put | "
              "decisions per put | entries per put | memo hits per put | us per entry |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, c in clients.items():
            ts = sorted(times[name])
            s = c.stats()
            pol = s.get("policy_ns", 0) - before[name][0]
            calls, entries, hits, ns = (x - y for x, y in zip(plugin_totals(s), before[name][1:]))
            per_call = f"{ns / entries / 1e3:.2f}" if entries else "-"
            print(f"| {name} | {statistics.median(ts) * 1e6:.1f} | {ts[int(len(ts) * 0.9)] * 1e6:.1f} | "
                  f"{cpu[name] / a.puts * 1e6:.1f} | {pol / 1e9 / wall[name]:.1%} | {pol / a.puts / 1e3:.2f} | {calls / a.puts:.1f} | "
                  f"{entries / a.puts:.1f} | {hits / a.puts:.1f} | {per_call} |")
        print()
        for label, _ in binaries:
            def of(kind: str) -> list[float]:
                return sorted(next(times[n] for n, v in systems.items() if v[3] == label and v[4] == kind))
            builtin = of("built-in")
            for kind in kinds:
                if kind == "built-in":
                    continue
                ts = of(kind)
                p50 = statistics.median(ts) / statistics.median(builtin)
                p90 = ts[int(len(ts) * 0.9)] / builtin[int(len(builtin) * 0.9)]
                print(f"{label + ': ' if label else ''}{kind} / built-in: median {p50:.3f}, p90 {p90:.3f}")
        if len(binaries) == 2:
            (first, _), (second, _) = binaries
            for kind in kinds:
                one, two = (next(n for n, v in systems.items() if v[3] == lab and v[4] == kind) for lab in (first, second))
                print(f"{kind}: {second} / {first}: median "
                      f"{statistics.median(times[two]) / statistics.median(times[one]):.3f}, "
                      f"stowd CPU a put {cpu[two] / cpu[one]:.3f}")
    finally:
        for c in clients.values():
            c.close()
        for p in procs.values():
            p.terminate()
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
