"""The training run of a profile-guided build (`cargo xtask wheel --pgo`).

Drives an instrumented `stowd` (and, when the client's core is
instrumented too, that core) through what a training job asks of it:
small puts and gets of 1, 10 and 32 fields by 1, 4 and 64 rows, sync and
async, with the bundled plugins and with the built-in policy; get_into,
clear and stats; puts and gets of a few MiB; a same-node get. Each
`stowd` is stopped with SIGTERM, so it exits through `main` and writes its
profile (an instrumented process writes it at exit; one killed does not).

usage: python3 bench/pgo_train.py --stowd BIN --plugins DIR [--scale 1.0]
                                  [--client-dir DIR]

`--client-dir`: the directory that holds the `stowage` package to drive
it with (default: the checkout's `clients/python`), e.g. a copy whose
`_core.abi3.so` is the instrumented core.

It checks what it reads back (a wrong answer is an error, not a profile),
and prints what it ran and how long it took. It times nothing: a
profile's worth is in how often each path runs, not how fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

import numpy as np  # noqa: E402

stowage = None  # imported in main(), from --client-dir


def start(binary: str, work: str, plugins: str | None, extra: str = ""):
    """A stowd with 4 local units: (process, endpoints)."""
    os.makedirs(work, exist_ok=True)
    if plugins is None:
        plugins = os.path.join(work, "no-plugins")
        os.makedirs(plugins, exist_ok=True)
    cfg = os.path.join(work, "stowd.toml")
    eps = os.path.join(work, "stowd.json")
    with open(cfg, "w") as f:
        f.write(f"[units]\nlocal = 4\n\n[plugins]\ndir = {json.dumps(plugins)}\n{extra}")
    # Its log to a file, not a pipe nobody reads while it serves.
    log = os.path.join(work, "stowd.log")
    with open(log, "wb") as err:
        proc = subprocess.Popen([binary, "serve", "--config", cfg, "--endpoints-file", eps],
                                stdout=subprocess.DEVNULL, stderr=err)
    proc.log = log
    deadline = time.monotonic() + 120
    while not os.path.exists(eps):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise SystemExit(f"stowd did not start ({binary}): {tail(log)}")
        time.sleep(0.05)
    return proc, json.load(open(eps))


def tail(path: str) -> str:
    with open(path, "rb") as f:
        return f.read()[-2000:].decode(errors="replace")


def stop(proc) -> None:
    """SIGTERM, and wait for a clean exit (the profile is written then)."""
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SystemExit("stowd did not stop within 60 s of SIGTERM: no profile written")
    if rc != 0:
        raise SystemExit(f"stowd exited {rc} on SIGTERM: {tail(proc.log)}")


def batch(fields: int, rows: int, width: int = 16, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {f"f{i}": rng.standard_normal((rows, width), dtype=np.float32) for i in range(fields)}


def check(got: dict, want: dict, what: str) -> None:
    for name, arr in want.items():
        if not np.array_equal(np.asarray(got[name]), arr):
            raise SystemExit(f"{what}: field {name} read back wrong")


def small(c, calls: int) -> int:
    """Small puts and gets, every shape; returns the calls made."""
    n = 0
    base = 0
    for fields in (1, 10, 32):
        for rows in (1, 4, 64):
            data = batch(fields, rows, seed=fields * 100 + rows)
            names = list(data)
            out = {k: np.empty_like(v) for k, v in data.items()}
            for k in range(calls):
                idx = list(range(base + k * rows, base + (k + 1) * rows))
                c.put(idx, data)
                got = c.get(idx, names)
                c.get_into(np.arange(idx[0], idx[-1] + 1), out)
                n += 3
                if k == 0:
                    check(got, data, f"get {fields}x{rows}")
                    check(out, data, f"get_into {fields}x{rows}")
            c.clear(list(range(base, base + calls * rows)))
            n += 1
            base += calls * rows
    c.stats()
    return n + 1


async def small_async(address: str, token, calls: int) -> int:
    n = 0
    async with stowage.AsyncClient(address, token=token) as c:
        for fields in (1, 10):
            for rows in (1, 4):
                data = batch(fields, rows, seed=7)
                names = list(data)
                for k in range(calls):
                    idx = list(range(k * rows, (k + 1) * rows))
                    await c.put(idx, data)
                    got = await c.get(idx, names)
                    n += 2
                    if k == 0:
                        check(got, data, f"async get {fields}x{rows}")
                await c.clear(list(range(calls * rows)))
                n += 1
    return n


def large(c, mib: int) -> int:
    """Puts and gets of `mib` MiB in 16 KiB and 4 KiB rows."""
    n = 0
    for width in (4096, 1024):
        rows = mib * (1 << 20) // (width * 4)
        data = batch(2, rows // 2, width, seed=width)
        idx = np.arange(rows // 2)
        for _ in range(3):
            c.put(idx, data)
            got = c.get(idx, list(data))
            out = {k: np.empty_like(v) for k, v in data.items()}
            c.get_into(idx, out)
            n += 3
        check(got, data, f"large get, {width} floats a row")
        check(out, data, f"large get_into, {width} floats a row")
        c.clear(idx.tolist())
        n += 1
    return n


def same_node(binary: str, work: str, plugins: str | None, rows: int) -> int:
    shm_dir = tempfile.mkdtemp(prefix="stowage-pgo-", dir="/dev/shm")
    proc, eps = start(binary, work, plugins, extra=f'\n[shm]\ndir = {json.dumps(shm_dir)}\n')
    n = 0
    try:
        with stowage.Client(eps["native"], token=eps.get("token"), same_node=True, timeout=120) as c:
            if not c.same_node:
                raise SystemExit("the same-node client did not get shared memory")
            data = batch(1, rows, 256, seed=3)
            c.put(np.arange(rows), data)
            for idx in (range(rows), np.arange(rows), list(range(rows)), list(range(rows - 1, -1, -1))):
                got = c.get(idx, ["f0"])
                n += 1
            check({"f0": np.asarray(got["f0"])[::-1]}, data, "same-node get, indexes reversed")
            for k in range(200):
                c.get([k, k + 1], ["f0"])
                n += 1
    finally:
        stop(proc)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return n + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", required=True, help="the (instrumented) stowd to run")
    ap.add_argument("--plugins", required=True, help="the bundled plugins' directory")
    ap.add_argument("--scale", type=float, default=1.0, help="how many calls, as a multiple of the default")
    ap.add_argument("--client-dir", default=os.path.join(HERE, "..", "clients", "python"),
                    help="the directory holding the stowage package to import")
    a = ap.parse_args()
    global stowage
    client_dir = os.path.abspath(a.client_dir)
    if not os.path.isfile(os.path.join(client_dir, "stowage", "__init__.py")):
        raise SystemExit(f"pgo_train: no stowage package in {client_dir}")
    sys.path.insert(0, client_dir)
    import stowage as imported
    if os.path.dirname(os.path.abspath(imported.__file__)) != os.path.join(client_dir, "stowage"):
        raise SystemExit(f"pgo_train: imported stowage from {imported.__file__}, not from {client_dir}")
    stowage = imported
    print(f"pgo_train: the client from {os.path.dirname(stowage.__file__)}", flush=True)
    calls = max(2, int(100 * a.scale))
    t0 = time.monotonic()
    work = tempfile.mkdtemp(prefix="stowage-pgo-")
    total = 0
    try:
        for label, plugins in (("bundled plugins", a.plugins), ("built-in", None)):
            proc, eps = start(a.stowd, os.path.join(work, label.replace(" ", "-")), plugins)
            try:
                with stowage.Client(eps["native"], token=eps.get("token"), timeout=120) as c:
                    n = small(c, calls) + large(c, max(1, int(16 * a.scale)))
                n += asyncio.run(small_async(eps["native"], eps.get("token"), calls))
            finally:
                stop(proc)
            print(f"pgo_train: {label}: {n} calls", flush=True)
            total += n
        n = same_node(a.stowd, os.path.join(work, "same-node"), a.plugins, max(1024, int(65536 * a.scale)))
        print(f"pgo_train: same node: {n} calls", flush=True)
        total += n
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"pgo_train: {total} calls in {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
