"""Time of a same-node get of 1 GiB, as numpy and as torch (issue 14,
finding 8): what building tensors over private copy-on-write mappings costs.

    STOWD_BIN=... STOWAGE_PLUGIN_DIR=... python3 bench/same_node_torch.py [--pkg DIR] [--reps 7]

Starts its own stowd (shared memory in a directory of its own under
/dev/shm), puts 1 GiB of float32 three ways (regular [1024, 262144],
regular [262144, 1024], nested 262,144 rows of 1024 or 1020) through a same-node
client, then times gets of all rows: as_torch=False, as_torch=True, and
as_torch=True followed by one in-place write to the first row (which
copies the pages it touches); then the client's part alone (one recorded
reply decoded into results again and again, segment mapping included: what
stowd does is left out, so a debug stowd does not drown it). Prints one line per case: median and min over
--reps (after one warm-up get), and the RSS the as_torch get added.
`--pkg` picks the `stowage` package to import (e.g. an old checkout's
clients/python, to compare), default this repository's. The write case is
skipped for a package whose tensors are read-only mappings (it would kill
the process).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def start_stowd(work: Path, shm_dir: str) -> tuple[subprocess.Popen, dict]:
    binary = os.environ.get("STOWD_BIN") or str(REPO / "target" / "release" / "stowd")
    cfg = work / "stowd.toml"
    cfg.write_text(f'[shm]\ndir = "{shm_dir}"\n')
    ep = work / "endpoints.json"
    log = open(work / "stowd.log", "wb")
    proc = subprocess.Popen([binary, "serve", "--config", str(cfg), "--endpoints-file", str(ep)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if ep.is_file():
            try:
                return proc, json.loads(ep.read_text())
            except json.JSONDecodeError:
                pass
        if proc.poll() is not None:
            sys.exit(f"stowd exited with {proc.returncode}; see {work / 'stowd.log'}")
        time.sleep(0.05)
    proc.kill()
    sys.exit("stowd did not start within 120 s")


def timed(fn, reps: int) -> tuple[list, int]:
    fn()  # warm-up (and the rows' first move into shared memory, if any)
    gc.collect()
    times, grown = [], 0
    for _ in range(reps):
        r0 = rss()
        t = time.perf_counter()
        keep = fn()
        times.append(time.perf_counter() - t)
        grown = max(grown, rss() - r0)
        del keep
        gc.collect()
    return times, grown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pkg", default=str(REPO / "clients" / "python"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    sys.path.insert(0, args.pkg)
    import stowage
    import torch
    from stowage import _codec

    private = hasattr(_codec, "to_private_numpy") or hasattr(stowage._core, "GetOptions")
    # (The client's part alone can be timed only on clients that assembled
    # results in Python, `_get_result`; the core's results come with its reads.)
    client_only = hasattr(stowage.Client, "_get_result")
    work = Path(tempfile.mkdtemp(prefix="same-node-torch-"))
    shm_dir = f"/dev/shm/stowage-bench-{os.getpid()}"
    proc, ep = start_stowd(work, shm_dir)
    try:
        c = stowage.Client(ep["native"], same_node=True, shm_dir=ep["shm_dir"], timeout=300)
        cases = {
            "regular 1,024 rows": (1024, lambda n: np.ones((n, GIB // 4 // n), np.float32)),
            "regular 262,144 rows": (262144, lambda n: np.ones((n, GIB // 4 // n), np.float32)),
            # two row lengths (rows of one shape would come back as one regular array): 1 GiB - 2 MiB
            "nested 262,144 rows": (262144, lambda n: [np.ones(GIB // 4 // n - 4 * (i % 2), np.float32)
                                                       for i in range(n)]),
        }
        base = 0
        for name, (n, make) in cases.items():
            idx = list(range(base, base + n))
            base += n
            c.put(idx, {"x": make(n)})
            gc.collect()
            row = (lambda t: t[0]) if name.startswith("nested") else (lambda t: t)

            def get_np():
                return c.get(idx, ["x"], as_torch=False)["x"]

            def get_torch():
                return c.get(idx, ["x"], as_torch=True)["x"]

            def get_torch_write():
                t = c.get(idx, ["x"], as_torch=True)["x"]
                row(t)[0].add_(1)
                return t

            # The client's part alone: one recorded reply (envelope and
            # frames), turned into results again and again (mapping included).
            seen = []
            if client_only:
                real = c._reply_frames
                c._reply_frames = lambda env, frames: (seen.append((env, frames)), real(env, frames))[1]
                c.get(idx, ["x"])
                c._reply_frames = real
                env, frames = seen[0]
                body = env["body"]

            def client_np():
                return c._get_result(body, c._reply_frames(env, frames), ["x"], n, False)["x"]

            def client_torch():
                return c._get_result(body, c._reply_frames(env, frames), ["x"], n, True)["x"]

            runs = [("numpy", get_np), ("torch", get_torch)]
            if private:
                runs.append(("torch + add_ on row 0", get_torch_write))
            if client_only:
                runs += [("client only: numpy", client_np), ("client only: torch", client_torch)]
            for what, fn in runs:
                times, grown = timed(fn, args.reps)
                print(f"{args.label}{name:22s} {what:22s} median {statistics.median(times) * 1e3:9.3f} ms"
                      f"  min {min(times) * 1e3:9.3f} ms  RSS +{grown >> 20} MiB", flush=True)
            del seen
            if client_only:
                del env, frames, body
            c.clear(idx)
            c.release_segments()
        c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    _ = torch


if __name__ == "__main__":
    main()
