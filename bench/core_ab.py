#!/usr/bin/env python3
"""Two builds of the Python client side by side, on one stowd, in one run.

A client core's change is measured the way the stowd benches measure
stowd's: in one run, alternating blocks, so that the machine's drift (these
VMs run at two speeds, minutes apart) falls on both alike. Each client is a
process of its own that imports the `stowage` package from its own
directory (`--client DIR=LABEL`, twice: e.g. a checkout of an older commit
with its core built in, and this one's `clients/python`); the parent starts
one release stowd with 4 local units (the built-in policy, or
`--plugins`), and tells the clients in turn to put a block of `--block`
puts of `--rows` rows x `--fields` fields of float32 [16] at fresh
indexes, flipping the order every block (`--op get`: gets of such rows,
cycling over 64 calls' worth each client put beforehand; `--op
get_into`: the same rows into arrays made once; `--op get_data`: such
gets as the TransferQueue backend's `get_data` asks and finishes them,
each field made as SimpleStorage gives it, in a TensorDict; `--async`:
through an `AsyncClient`, each call awaited in turn; `--as-torch`: gets
of torch tensors, `as_torch=True`, with `--nested`, run with a Python that
has torch). Each client times its calls and
its own CPU (`time.process_time`, this process's threads); the table gives
the medians and CPU a put, and the second client's over the first's.

`stowd` and both clients are pinned to CPU 0 (`--cpu`; `--cpu none`
leaves them to the scheduler). Unpinned, the scheduler put one client on
`stowd`'s CPU and the other on the other CPU (`--cpu 1:0` pins `stowd` to
CPU 1 and the clients to CPU 0), and the CPU a call moved
with where a client ran, not with its build: the same build took 20.4 µs
of client CPU a 10x4 get in one process and 37.2 in the other, in one run
(a wake-up across CPUs is charged to the client woken).

usage: python3 bench/core_ab.py --client OLD/clients/python=old --client clients/python=new
           --stowd target/release/stowd [--op put|get|get_into|get_data] [--async] [--as-torch] [--nested rows|packed]
           [--fields 32] [--rows 4] [--puts 3000] [--block 50] [--cpu 0|1:0|none]
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Calls each client makes, untimed, before the first block.
WARM_UP = 20


class Job:
    """What a child process does, whichever client it drives: its rows,
    the arguments of its next call, its blocks (one a "go" line from the
    parent), and its report."""

    def __init__(self, a: argparse.Namespace):
        import numpy as np

        self.a = a
        self.fields = {f"f{i}": np.ones((a.rows, 16), np.float32) for i in range(a.fields)}
        self.names = list(self.fields)
        self.k, self.times, self.cpu = 64, [], 0.0

    def rows(self, k: int) -> list:
        """The indexes of put `k` (0..64: the warm-up, which the gets read)."""
        return [self.a.base + self.a.rows * k + j for j in range(self.a.rows)]

    def next(self) -> tuple:
        """The next call's arguments: a get cycles over the warm-up's rows,
        a put takes fresh ones."""
        k, self.k = self.k, self.k + 1
        if self.a.op != "put":
            return self.rows(k % 64), self.names
        return self.rows(k), self.fields

    def call(self, c):
        """What a call of client `c` is."""
        if self.a.op == "put":
            return c.put
        if self.a.op == "get_data":
            return self.get_data(c)
        if self.a.op == "get_into":
            import numpy as np

            out = {name: np.empty((self.a.rows, 16), np.float32) for name in self.names}
            return lambda idx, names: c.get_into(idx, out)
        if self.a.as_torch:
            return lambda idx, names: c.get(idx, names, as_torch=True, nested=self.a.nested)
        return lambda idx, names: c.get(idx, names, nested=self.a.nested)

    def get_data(self, c):
        """The TransferQueue backend's `get_data` on client `c`: the get it
        asks for, then each field as SimpleStorage gives it, in a
        TensorDict, with that client's own `stowage._tqvalues` (needs torch
        and TransferQueue)."""
        from stowage import _tqvalues
        from tensordict import TensorDict

        n = self.a.rows
        made = getattr(_tqvalues, "tensordict_of", None) or (lambda f, n: TensorDict(f, batch_size=n))

        def build(got, names):
            return made({k: _tqvalues.from_wire(got[k], n) for k in names}, n)
        if self.a.use_async:
            async def one(idx, names):
                return build(await c.get(idx, names, as_torch=True, nested="packed"), names)
            return one
        return lambda idx, names: build(c.get(idx, names, as_torch=True, nested="packed"), names)

    def blocks(self):
        """Yields once a block the parent asks for, counting its CPU."""
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            c0 = time.process_time()
            yield
            self.cpu += time.process_time() - c0
            print("done", flush=True)

    def report(self, stowage) -> None:
        with open(stowage._core.__file__, "rb") as f:
            core = hashlib.sha256(f.read()).hexdigest()[:12]
        print(json.dumps({"times": self.times, "cpu": self.cpu, "core": core}), flush=True)


def child(a: argparse.Namespace) -> None:
    sys.path.insert(0, a.child)
    if a.cpu != "none":
        os.sched_setaffinity(0, {int(a.cpu.rpartition(":")[2])})
    if a.use_async:
        import asyncio

        return asyncio.run(child_async(a))
    import stowage

    job = Job(a)
    with stowage.Client(a.endpoint, timeout=60, spin_us=0) as c:
        for k in range(64):
            c.put(job.rows(k), job.fields)
        call = job.call(c)
        for _ in range(WARM_UP):  # (the first as_torch get imports torch)
            call(*job.next())
        for _ in job.blocks():
            for _ in range(a.block):
                args = job.next()
                t = time.perf_counter()
                call(*args)
                job.times.append(time.perf_counter() - t)
    job.report(stowage)


async def child_async(a: argparse.Namespace) -> None:
    """[`child`] through an `AsyncClient`, each call awaited in turn."""
    import stowage

    job = Job(a)
    async with stowage.AsyncClient(a.endpoint, timeout=60) as c:
        for k in range(64):
            await c.put(job.rows(k), job.fields)
        call = job.call(c)
        for _ in range(WARM_UP):
            await call(*job.next())
        for _ in job.blocks():
            for _ in range(a.block):
                args = job.next()
                t = time.perf_counter()
                await call(*args)
                job.times.append(time.perf_counter() - t)
    job.report(stowage)


def pinned(cpu: str) -> str:
    if ":" in cpu:
        s, _, c = cpu.partition(":")
        return f"stowd on CPU {s}, the clients on CPU {c}"
    return f"all on CPU {cpu}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client", action="append", metavar="DIR=LABEL", help="twice")
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--plugins", default=None, help="plugin directory (default: the built-in policy)")
    ap.add_argument("--op", choices=("put", "get", "get_into", "get_data"), default="put",
                    help="get_data: the TransferQueue backend's get and the TensorDict it makes")
    ap.add_argument("--async", dest="use_async", action="store_true", help="each client an AsyncClient")
    ap.add_argument("--as-torch", action="store_true", help="gets of torch tensors (as_torch=True)")
    ap.add_argument("--nested", choices=("rows", "packed"), default="rows", help="a get's nested=")
    ap.add_argument("--cpu", default="0",
                    help="the CPU stowd and both clients are pinned to, STOWD:CLIENTS (e.g. 1:0) for two, or none")
    ap.add_argument("--fields", type=int, default=32)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--puts", type=int, default=3000)
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--base", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    if not a.client or len(a.client) != 2:
        raise SystemExit("give --client DIR=LABEL twice")
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from policy_put import start  # noqa: E402

    clients = [(spec.partition("=")[2] or spec, os.path.abspath(spec.partition("=")[0])) for spec in a.client]
    work = tempfile.mkdtemp(prefix="stowage-core-ab-")
    proc, eps = start(a.stowd, work, a.plugins, cpus=None if a.cpu == "none" else a.cpu.partition(":")[0])
    kids = []
    try:
        for k, (label, path) in enumerate(clients):
            kid = subprocess.Popen(
                [sys.executable, __file__, "--child", path, "--endpoint", eps["native"], "--base", str((k + 1) << 32),
                 "--fields", str(a.fields), "--rows", str(a.rows), "--block", str(a.block), "--op", a.op, "--nested", a.nested, "--cpu", a.cpu]
                + (["--async"] if a.use_async else []) + (["--as-torch"] if a.as_torch else []),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if kid.stdout.readline().strip() != "ready":
                raise SystemExit(f"client {label} did not start")
            kids.append(kid)
        load = os.getloadavg()
        blocks = a.puts // a.block
        for b in range(blocks):
            for kid in (kids if b % 2 == 0 else kids[::-1]):
                kid.stdin.write("go\n")
                kid.stdin.flush()
                if kid.stdout.readline().strip() != "done":
                    raise SystemExit("a client stopped")
        results = []
        for kid in kids:
            kid.stdin.write("stop\n")
            kid.stdin.flush()
            results.append(json.loads(kid.stdout.readline()))
            kid.wait(timeout=60)
    finally:
        for kid in kids:
            if kid.poll() is None:
                kid.kill()
        proc.terminate()
        proc.wait(timeout=30)
    n = blocks * a.block
    what = f", as_torch=True, nested={a.nested!r}" if a.as_torch and a.op == "get" else ""
    print(f"{n} {a.op}s each ({'AsyncClient' if a.use_async else 'Client'}{what}) of {a.rows} rows x {a.fields} fields of float32 [16], blocks of {a.block} alternating; "
          f"stowd {a.stowd} ({'plugins ' + a.plugins if a.plugins else 'built-in'}); "
          f"{'not pinned' if a.cpu == 'none' else pinned(a.cpu)}; load at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print(f"| client | core (sha256) | p50 us | p90 us | client CPU us a {a.op} |")
    print("|---|---|---:|---:|---:|")
    for (label, _), r in zip(clients, results):
        ts = sorted(r["times"])
        print(f"| {label} | {r['core']} | {statistics.median(ts) * 1e6:.1f} | {ts[int(len(ts) * 0.9)] * 1e6:.1f} | "
              f"{r['cpu'] / n * 1e6:.1f} |")
    (l1, _), (l2, _) = clients
    r1, r2 = results
    print(f"\n{l2} / {l1}: p50 {statistics.median(r2['times']) / statistics.median(r1['times']):.3f}, "
          f"client CPU {r2['cpu'] / r1['cpu']:.3f}")


if __name__ == "__main__":
    main()
