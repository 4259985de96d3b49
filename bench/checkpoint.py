#!/usr/bin/env python3
"""Unit checkpoints against the disk's own pace (issue 16, first part).

One release stowd with `[units] local = 4`; the Stowage client puts float32
[ROWS, 1024] (2 GiB at the default) over tcp. Then, in one run:

- disk write: the same bytes written by this process to one file in the
  same directory, then fsync (the limit a save can reach);
- save: SAVE_STORAGE_CHECKPOINT to each of the 4 unit endpoints, one after
  the other (each writes its file, fsyncs it and renames it);
- disk read: the page cache dropped (`/proc/sys/vm/drop_caches`, root),
  the written file read back;
- load: the page cache dropped, LOAD_STORAGE_CHECKPOINT of each unit's
  file (each read and verified against its SHA-256, then swapped in);
- a get of every row afterwards, compared with what was put.

Prints a table: seconds, GB/s, and each checkpoint step as a ratio to its
disk counterpart.

usage: python3 bench/checkpoint.py --stowd target/release/stowd --dir DIR [--rows 524288]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
import stowage  # noqa: E402
from _disk import drop_caches, timed_read, timed_write  # noqa: E402
from tq_codec import TQClient, envelope  # noqa: E402



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--dir", required=True, help="where the checkpoint files go (same disk as the limit)")
    ap.add_argument("--rows", type=int, default=524288)
    ap.add_argument("--no-roots", action="store_true",
                    help="a stowd from before [checkpoint] roots: leave that table out")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="stowage-ckpt-bench-")
    cfg, eps = os.path.join(work, "stowd.toml"), os.path.join(work, "stowd.json")
    with open(cfg, "w") as f:
        f.write("[units]\nlocal = 4\nmemory_percent = 0\n\n[plugins]\ndir = \"%s\"\n" % os.path.join(work, "none"))
        if not a.no_roots:
            f.write("\n[checkpoint]\nroots = [%s]\n" % json.dumps(os.path.abspath(a.dir)))
    os.makedirs(os.path.join(work, "none"))
    proc = subprocess.Popen([a.stowd, "serve", "--config", cfg, "--endpoints-file", eps],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(eps):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("stowd did not start")
            time.sleep(0.05)
        ep = json.load(open(eps))
        x = np.random.default_rng(0).random((a.rows, 1024), dtype=np.float32)
        payload = x.nbytes
        idx = list(range(a.rows))
        with stowage.Client(ep["native"], timeout=600) as c:
            c.put(idx, {"x": x})
        units = [TQClient(u["endpoint"], timeout=600) for u in ep["units"]]
        files = [os.path.join(a.dir, f"su_{i}.safetensors") for i in range(len(units))]
        rows = []

        limit = os.path.join(a.dir, "limit.bin")
        rows.append(("disk write + fsync", timed_write(limit, x)))

        t = time.perf_counter()
        for u, p in zip(units, files):
            r = u.request([envelope("SAVE_STORAGE_CHECKPOINT", {"path": p})])
            assert r.body == {"success": True}, r.body
        rows.append(("save (4 units)", time.perf_counter() - t))

        dropped = drop_caches()
        rows.append(("disk read", timed_read(limit)))

        with stowage.Client(ep["native"], timeout=600) as c:
            c.clear(idx)
        drop_caches()
        t = time.perf_counter()
        for u, p in zip(units, files):
            r = u.request([envelope("LOAD_STORAGE_CHECKPOINT", {"path": p})])
            assert r.body == {"success": True}, r.body
        rows.append(("load (4 units)", time.perf_counter() - t))

        with stowage.Client(ep["native"], timeout=600) as c:
            got = c.get(idx, ["x"])["x"]
        assert np.array_equal(got, x), "rows differ after load"
        sizes = sum(os.path.getsize(p) for p in files)
        print(f"float32 [{a.rows}, 1024] = {payload / 2**30:.2f} GiB, 4 units, files {sizes / 2**30:.2f} GiB "
              f"in {a.dir}; page cache dropped before reads: {dropped}\n")
        print("| step | seconds | GB/s | ratio to the disk |")
        print("|---|---:|---:|---:|")
        limits = {"save (4 units)": rows[0][1], "load (4 units)": rows[2][1]}
        for name, s in rows:
            ratio = f"{limits[name] / s:.2f}" if name in limits else "-"
            print(f"| {name} | {s:.2f} | {payload / s / 1e9:.2f} | {ratio} |")
        print("\nevery row read back equal after the load")
        os.remove(limit)
        for p in files:
            os.remove(p)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
