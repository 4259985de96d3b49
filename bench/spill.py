#!/usr/bin/env python3
"""Spill, checkpoint and restore against the disk's own pace (issue 16).

All in one run, on one disk (`--dir`), with release stowds and the Stowage
client over tcp; the payload is float32 [ROWS, 1024] (2 GiB at the default),
put and got in chunks of CHUNK rows (16 MiB at the default).

1. The limits: this process writes the payload to one file and fsyncs it;
   the page cache is dropped (`/proc/sys/vm/drop_caches`, root) and the file
   is read back.
2. Spill: a stowd with 4 units of 64 MiB (256 MiB of memory in all) and
   `spill_dir` in `--dir`, reuse pool off. The payload is put: every byte
   past 256 MiB goes to spill files (each written, fdatasync'd, mapped).
   Reported: the put as a whole, and stowd's own spill writing
   (`spilled_bytes_total / spill_write_ns_total`). Then the page cache is
   dropped and every row is got back (most of it from the spill files),
   compared with what was put.
3. Checkpoint and restore: a stowd without a bound holds the payload; a
   `checkpoint` to `--dir`; SIGKILL; `stowd serve --restore` timed from
   spawn to its endpoints file (page cache dropped before, then again
   warm), against the same stowd starting without a checkpoint; the SHA-256
   pass alone (hashlib over the files, cold) for comparison. Every row is
   got back and compared.
4. The journal: 2,000 puts of one 4 KiB row before any checkpoint, and
   after one (each put then appends its index to the journal and fsyncs).

usage: python3 bench/spill.py --stowd target/release/stowd --dir DIR [--rows 524288]
"""
import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import stowage  # noqa: E402
from _disk import drop_caches, timed_read, timed_write  # noqa: E402



# The [checkpoint] table (the checkpoint directory's disk as the root).
ROOTS = ""


class Stowd:
    """One release stowd with `config` (no plugins: the built-in policy)."""

    def __init__(self, binary: str, config: str, extra=()):
        self.work = tempfile.mkdtemp(prefix="stowage-spill-bench-")
        os.makedirs(os.path.join(self.work, "none"))
        cfg, self.eps = os.path.join(self.work, "stowd.toml"), os.path.join(self.work, "stowd.json")
        with open(cfg, "w") as f:
            f.write(config + "\n[plugins]\ndir = \"%s\"\n" % os.path.join(self.work, "none") + ROOTS)
        self.log = os.path.join(self.work, "stowd.log")
        t = time.perf_counter()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([binary, "serve", "--config", cfg, "--endpoints-file", self.eps, *extra],
                                         stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 600
        while not os.path.exists(self.eps):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"stowd did not start ({config!r}, {extra})")
            time.sleep(0.002)
        self.start_s = time.perf_counter() - t
        self.ep = json.load(open(self.eps))

    def logged(self, key: str) -> int:
        """The value of `key=N` in stowd's log (the restore's timings)."""
        text = open(self.log).read()
        return int(text.split(f"{key}=", 1)[1].split()[0])

    def client(self) -> stowage.Client:
        return stowage.Client(self.ep["native"], timeout=3600)

    def stop(self, kill=False) -> None:
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        self.proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)


def chunks(rows: int, chunk: int):
    for s in range(0, rows, chunk):
        yield list(range(s, min(rows, s + chunk)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure (emptied)")
    ap.add_argument("--rows", type=int, default=524288)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--no-roots", action="store_true",
                    help="a stowd from before [checkpoint] roots: leave that table out")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    global ROOTS
    if not a.no_roots:
        ROOTS = "\n[checkpoint]\nroots = [%s]\n" % json.dumps(os.path.abspath(a.dir))
    x = np.random.default_rng(0).random((a.rows, 1024), dtype=np.float32)
    payload = x.nbytes
    gb = lambda s: payload / s / 1e9  # noqa: E731
    table = []

    # 1. The disk's own pace.
    limit = os.path.join(a.dir, "limit.bin")
    disk_write = timed_write(limit, x)
    dropped = drop_caches()
    disk_read = timed_read(limit)
    os.remove(limit)
    table.append(("disk: write + fsync", disk_write, gb(disk_write), "1.00 (write)"))
    table.append(("disk: read, cache dropped", disk_read, gb(disk_read), "1.00 (read)"))

    # 2. Spill.
    spill_dir = os.path.join(a.dir, "spill")
    s = Stowd(a.stowd, f"[units]\nlocal = 4\ncapacity_bytes = {64 << 20}\nspill_dir = \"{spill_dir}\"\n"
                       "[limits]\nreceive_pool_bytes = 0\n")
    try:
        with s.client() as c:
            t = time.perf_counter()
            for idx in chunks(a.rows, a.chunk):
                c.put(idx, {"x": x[idx[0]:idx[-1] + 1]})
            put_s = time.perf_counter() - t
            st = c.stats()
            spilled, write_s = st["spilled_bytes_total"], st["spill_write_ns_total"] / 1e9
            drop_caches()
            t = time.perf_counter()
            for idx in chunks(a.rows, a.chunk):
                got = c.get(idx, ["x"])["x"]
                if not np.array_equal(got, x[idx[0]:idx[-1] + 1]):
                    raise SystemExit(f"spilled rows {idx[0]}.. differ")
            get_s = time.perf_counter() - t
        table.append((f"put with spill ({spilled / 2**30:.2f} GiB spilled)", put_s, gb(put_s),
                      f"{disk_write / put_s:.2f} (write)"))
        if write_s > 0:  # nothing spills below the 256 MiB bound
            table.append(("stowd's spill writes alone", write_s, spilled / write_s / 1e9,
                          f"{(spilled / write_s) / (payload / disk_write):.2f} (write)"))
        table.append(("get of every row, cache dropped", get_s, gb(get_s), f"{disk_read / get_s:.2f} (read)"))
    finally:
        s.stop()

    # 3. Checkpoint, SIGKILL, restore.
    ckpt = os.path.join(a.dir, "ckpt")
    plain = Stowd(a.stowd, "[units]\nlocal = 4\nmemory_percent = 0\n")
    plain_start = plain.start_s
    plain.stop()
    s = Stowd(a.stowd, "[units]\nlocal = 4\nmemory_percent = 0\n")
    with s.client() as c:
        for idx in chunks(a.rows, a.chunk):
            c.put(idx, {"x": x[idx[0]:idx[-1] + 1]})
        t = time.perf_counter()
        done = c.checkpoint(ckpt)
        ckpt_s = time.perf_counter() - t
    s.stop(kill=True)
    files = [os.path.join(ckpt, n) for n in os.listdir(ckpt) if n.endswith(".safetensors")]
    size = sum(os.path.getsize(f) for f in files)
    table.append((f"checkpoint ({done['files']} files, {size / 2**30:.2f} GiB)", ckpt_s, gb(ckpt_s),
                  f"{disk_write / ckpt_s:.2f} (write)"))
    drop_caches()
    t = time.perf_counter()
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while b := fh.read(16 << 20):
                h.update(b)
    hash_s = time.perf_counter() - t
    table.append(("SHA-256 of the files (hashlib), cache dropped", hash_s, gb(hash_s),
                  f"{disk_read / hash_s:.2f} (read)"))
    for cold in (True, False):
        if cold:
            drop_caches()
        r = Stowd(a.stowd, "[units]\nlocal = 4\nmemory_percent = 0\n", ["--restore", ckpt])
        restore_s = r.start_s - plain_start
        verify_s, total_s = r.logged("verify_ms") / 1e3, r.logged("total_ms") / 1e3
        if cold:
            with r.client() as c:
                for idx in chunks(a.rows, a.chunk):
                    if not np.array_equal(c.get(idx, ["x"])["x"], x[idx[0]:idx[-1] + 1]):
                        raise SystemExit(f"restored rows {idx[0]}.. differ")
        r.stop(kill=True)
        what = "cache dropped" if cold else "warm"
        table.append((f"serve --restore, {what} (start {r.start_s:.2f} s - plain start {plain_start:.2f} s)",
                      restore_s, gb(restore_s), f"{disk_read / restore_s:.2f} (read)" if cold else "-"))
        table.append((f"  of which mapping + SHA-256 of the files ({what}; restore in all {total_s:.2f} s)",
                      verify_s, gb(verify_s), f"{disk_read / verify_s:.2f} (read)" if cold else "-"))

    # 4. The journal's cost per small put.
    s = Stowd(a.stowd, "[units]\nlocal = 4\nmemory_percent = 0\n")
    small = np.ones((1, 1024), np.float32)
    times = {}
    with s.client() as c:
        for phase in ("no checkpoint yet", "after a checkpoint (journal + fsync)"):
            if phase.startswith("after"):
                c.checkpoint(os.path.join(a.dir, "ckpt-journal"))
            t = time.perf_counter()
            for i in range(2000):
                c.put([i], {"x": small})
            times[phase] = (time.perf_counter() - t) / 2000
    s.stop()
    shutil.rmtree(a.dir, ignore_errors=True)

    print(f"float32 [{a.rows}, 1024] = {payload / 2**30:.2f} GiB in chunks of {a.chunk} rows; disk of {a.dir}; "
          f"page cache dropped before reads: {dropped}; load average {os.getloadavg()[0]:.2f}\n")
    print("| step | seconds | GB/s | ratio to the disk |")
    print("|---|---:|---:|---:|")
    for name, sec, rate, ratio in table:
        print(f"| {name} | {sec:.2f} | {rate:.2f} | {ratio} |")
    print("\n| put of one 4 KiB row | us per put |")
    print("|---|---:|")
    for k, v in times.items():
        print(f"| {k} | {v * 1e6:.0f} |")
    print("\nevery spilled and every restored row read back equal")


if __name__ == "__main__":
    main()
