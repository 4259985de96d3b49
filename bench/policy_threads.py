#!/usr/bin/env python3
"""stowd's threads and put throughput under many clients of small puts
through the bundled plugins (issue 20): CLIENTS threads, each with its own
client over tcp, put 4 rows x 10 fields of float32 [16] for SECS seconds;
prints the puts done and the most threads stowd had (/proc/PID/status,
sampled every 0.2 s).

usage: python3 bench/policy_threads.py --stowd STOWD --plugins DIR [--clients 64] [--secs 10] [--memo-entries N]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
import stowage  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--plugins", default=os.path.join(ROOT, "target", "plugins"))
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--secs", type=float, default=10.0)
    ap.add_argument("--memo-entries", type=int, default=None,
                    help="[plugins] memo_entries (0: every put enters a plugin)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="stowage-policy-threads-")
    cfg, eps = os.path.join(work, "stowd.toml"), os.path.join(work, "stowd.json")
    with open(cfg, "w") as f:
        f.write(f"[units]\nlocal = 4\n\n[plugins]\ndir = {json.dumps(a.plugins)}\n")
        if a.memo_entries is not None:
            f.write(f"memo_entries = {a.memo_entries}\n")
    proc = subprocess.Popen([a.stowd, "serve", "--config", cfg, "--endpoints-file", eps],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(eps):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("stowd did not start")
            time.sleep(0.05)
        native = json.load(open(eps))["native"]
        fields = {f"f{i}": np.ones((4, 16), np.float32) for i in range(10)}
        stop = time.monotonic() + a.secs
        done = [0] * a.clients

        def worker(w: int) -> None:
            with stowage.Client(native, timeout=60) as c:
                k = 0
                while time.monotonic() < stop:
                    c.put([w * 10**6 + 4 * k + j for j in range(4)], fields)
                    k += 1
            done[w] = k

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(a.clients)]
        for t in threads:
            t.start()
        most = 0
        while any(t.is_alive() for t in threads):
            with open(f"/proc/{proc.pid}/status") as f:
                most = max(most, next(int(line.split()[1]) for line in f if line.startswith("Threads:")))
            time.sleep(0.2)
        print(f"{a.stowd}: {a.clients} clients, {a.secs:g} s: {sum(done)} puts, at most {most} stowd threads")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
