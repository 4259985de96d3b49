#!/usr/bin/env python3
"""Small calls end to end, in one run: what a put and a get of a few rows
cost the Python client, round trip and CPU, against release stowds side by
side (each binary given, e.g. this commit's and a baseline's), each with the
bundled plugins and with the built-in policy (an empty plugin directory),
each pinned to the client's CPU (`same CPU`) and to the other one (`two
CPUs`); the client is pinned to CPU 0. A small call's time on this kind of
machine is mostly the two wake-ups of another process, and a wake-up across
CPUs costs far more than one on the same CPU, hence the two placements.

Sections (all by default; `--only` picks some):

- floors: a plain tcp ping-pong and a pyzmq DEALER<->ROUTER ping-pong
  between this process and a Python echo process, placed the same two
  ways (64 bytes out, 4,200 back: about a 1-row 4 KiB get): the median
  of --calls (at least 1,000) round trips, µs, and the plain ping-pong's
  client's CPU a round trip (shown under the client CPU check). With puts, also the plain
  tcp ping-pong with a 1-field and a 32-field put's rows out (64 bytes
  back), for each row count: the 32-vs-1 ratio of the bytes alone, shown
  under that check.
- matrix (`put`, `get`): fields {1, 10, 32} x rows {1, 4, 64}, each field
  float32[16] a row, put and got through `stowage.Client` (sync: its Rust
  core, with its default spin and with spin_us=0, the client's own work
  without the wait it spins through) and `stowage.AsyncClient` (one
  asyncio task, calls back to back). Puts go to fresh indexes, each pass's cleared after it
  (outside the timing) so memory stays bounded (`--puts fresh`, the
  default: what a producer of new samples does), or with `--puts
  overwrite` cycle over a window of 64 puts' worth of indexes (a put of an
  existing (index, field) replaces it; stowd spends more CPU on a small
  overwrite than on a fresh put). Gets cycle over 64 calls' worth of rows
  put beforehand with all 32 fields. Per cell: the median of --calls
  round trips (µs), then client and stowd CPU per call (µs, user +
  system, all threads) over a second pass of --cpu-x times the calls (the
  machine's noise moves CPU time far less than a round trip).
- 4k: the bench's earlier table: one 4 KiB row got and put through the
  core (default spin and spin_us=0; pyzmq no longer carries either).
- policy: the 4-row x 10-field put, bundled plugins against the built-in,
  two stowds at once on the same placement, alternating blocks of 100
  puts (order flipped every block) to cancel drift; puts as in the matrix.
- same-node: a stowd with shared memory ([shm], a directory of its own),
  pinned to CPU 1, holds 524,288 rows put same-node (float32
  [--same-node-width] a row; the default 1024 is the issue's seed case,
  float32 [524288, 1024], 2 GiB; the get is a mapping either way, and 1
  gives the same times with a cheaper put); a same-node get of all of
  them with the indexes given as range(n), as a numpy int64 array, as
  a Python list, and as a list of ints made out of order (each made
  before the timing; the last: the same values, their int objects made
  in shuffled order, so they do not lie in memory one after the other
  as list(range(n))'s do; no target, shown beside), alternating: the
  median of --same-node-reps after one uncounted round, ms.

Then checks against the targets, as ratio and PASS/FAIL: client CPU per
call <= 30 µs for 1-10 fields x 1-4 rows (sync with spin_us=0; the default
spin and async shown too); p50 <= 2x
the tcp ping-pong on the same placement (each cell against the ping-pong
timed right before and after its timed pass: the machine's speed moves
between spells of a few minutes, longer than a section of the run; the
count against the floors of the run's start is printed too); a 32-field put <= 2x a 1-field
put (same rows, p50); the bundled 4-row x 10-field put within 5% of the
built-in (median of the alternating run); same-node get of 524,288 rows:
list <= 5 ms, numpy <= 2 ms.

usage: python3 bench/small_calls.py --stowd NEW[=label] [--stowd OLD=label ...]
           [--plugins DIR] [--calls 1000] [--cpu-x 3] [--puts fresh|overwrite] [--quick]
           [--only floors,put,get,sync,async,4k,policy,same-node]
           [--same-node-width 1024] [--same-node-reps 9]

A full run (the defaults) takes about 6 minutes a --stowd on a 2-vCPU VM;
--quick (60 calls a cell, CPU pass 1x) about 20 s a --stowd, to check the
script works. Progress lines say how much CPU other processes took during
each part: this bench wants the machine to itself.
"""
import argparse
import asyncio
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from policy_put import start  # noqa: E402  (also puts clients/python on the path)

import stowage  # noqa: E402

FIELDS = (1, 10, 32)
ROWS = (1, 4, 64)
WIDTH = 16  # float32 elements a field a row
WINDOW = 64  # slots a cell cycles over: a put overwrites the rows put WINDOW calls before
SMALL = [(f, r) for f in (1, 10) for r in (1, 4)]  # the cells of the CPU target
CPU_TARGET_US = 30.0
FLOOR_X = 2.0
FIELDS_X = 2.0
POLICY_TOLERANCE = 1.05
SAME_NODE_ROWS = 524288
SAME_NODE_TARGET_MS = {"list": 5.0, "numpy int64": 2.0}
PLACEMENTS = (("0", "same CPU"), ("1", "two CPUs"))
SECTIONS = ("floors", "put", "get", "sync", "async", "4k", "policy", "same-node")


def cpu_seconds(pid: int) -> float:
    """User + system time of process `pid` so far (all its threads, those
    gone too): its process CPU clock (what clock_getcpuclockid gives, to
    the nanosecond), else /proc's clock ticks."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # CPUCLOCK_SCHED, process-wide
    except OSError:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (all CPUs, all processes)."""
    f = open("/proc/stat").readline().split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Others:
    """How busy other processes kept the machine over a stretch: the
    machine's busy CPU seconds less this process's and `pid`'s (stowd's),
    as a share of one CPU over the wall time."""

    def __init__(self, pids=()):
        self.pids = list(pids)
        self.t, self.busy, self.ours = time.monotonic(), machine_busy(), self._ours()

    def _ours(self) -> float:
        return time.process_time() + sum(cpu_seconds(p) for p in self.pids)

    def share(self) -> float:
        return max(0.0, (machine_busy() - self.busy) - (self._ours() - self.ours)) / (time.monotonic() - self.t)


def median_us(fn, calls: int) -> float:
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


# -- floors ----------------------------------------------------------------

class Echo:
    """A plain tcp exchange on 127.0.0.1 between this process and a Python
    echo process pinned to `cpu`, kept open: `out` bytes out, `back` bytes
    back (by default 64 and 4,200: about a 1-row get's request and reply;
    the echo answers once it has all `out` bytes). `samples(n)` times n
    round trips, s each."""

    # Every echo's socket on this side: an echo forked later closes its
    # copies, or an echo closed first would never see its peer go.
    _open: list = []

    def __init__(self, cpu: int, out: int = 64, back: int = 4200):
        self.out, self.back = out, back
        ls = socket.create_server(("127.0.0.1", 0))
        self.pid = os.fork()
        if self.pid == 0:  # the echo process: gone once this one closes its socket
            try:
                for other in Echo._open:
                    other.close()
                os.sched_setaffinity(0, {cpu})
                s, _ = ls.accept()
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                reply = b"r" * back
                inbuf = memoryview(bytearray(max(out, 65536)))
                while True:
                    got = 0
                    while got < out:
                        n = s.recv_into(inbuf[got:out])
                        if n == 0:
                            os._exit(0)
                        got += n
                    s.sendall(reply)
            finally:
                os._exit(0)
        address = ls.getsockname()
        ls.close()
        self.c = socket.create_connection(address)
        self.c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        Echo._open.append(self.c)
        self.buf = memoryview(bytearray(max(back, 8192)))
        self.request = b"q" * out
        self.samples(200)  # warm

    def once(self) -> None:
        self.c.sendall(self.request)
        got = 0
        while got < self.back:
            got += self.c.recv_into(self.buf[got:])

    def samples(self, n: int) -> list:
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            self.once()
            ts.append(time.perf_counter() - t)
        return ts

    def close(self) -> None:
        Echo._open.remove(self.c)
        self.c.close()
        os.waitpid(self.pid, 0)


def ping_pong(cpu: int, calls: int, out: int = 64, back: int = 4200) -> float:
    """The floor for a small call: the median round trip of an [`Echo`]
    exchange with an echo pinned to `cpu`, µs."""
    return ping_pong_cpu(cpu, calls, out, back)[0]


def ping_pong_cpu(cpu: int, calls: int, out: int = 64, back: int = 4200) -> tuple:
    """As [`ping_pong`], and this side's CPU a round trip (user + system,
    µs): what a bare Python socket client spends on the exchange, the floor
    under the client CPU check."""
    e = Echo(cpu, out, back)
    try:
        mine = time.process_time()
        ts = e.samples(calls)
        return statistics.median(ts) * 1e6, (time.process_time() - mine) / calls * 1e6
    finally:
        e.close()


# Round trips of the tcp ping-pong timed right before and right after each
# cell's timed pass: the cell's own floor, so that its p50 is compared with
# the machine as it was then (on these VMs a round trip's cost moves by 2-3x
# between spells of a few minutes, longer than one section of the run).
ADJACENT_FLOOR_CALLS = 200


def adjacent_floor(echo: "Echo | None", before: list) -> float | None:
    """The median of `before` and as many round trips timed now, µs (None
    without an echo)."""
    if echo is None:
        return None
    return statistics.median(before + echo.samples(ADJACENT_FLOOR_CALLS)) * 1e6


ZMQ_ECHO = r"""
import os, sys, zmq
os.sched_setaffinity(0, {int(sys.argv[1])})  # before the context: its I/O thread inherits it
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.linger = 0
print(s.bind_to_random_port("tcp://127.0.0.1"), flush=True)
reply = b"r" * 4200
while True:
    ident, msg = s.recv_multipart(copy=False)
    if msg.bytes == b"stop":
        break
    s.send_multipart([ident, reply], copy=False)
"""


def zmq_ping_pong(cpu: int, calls: int) -> float:
    """The same exchange through pyzmq, as a pyzmq client sees it: a DEALER
    here, a ROUTER in a Python echo process pinned to `cpu` (both with
    libzmq's I/O thread, on their process's CPU), µs."""
    import zmq
    echo = subprocess.Popen([sys.executable, "-c", ZMQ_ECHO, str(cpu)], stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()  # made here, after this process was pinned
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    try:
        s.connect(f"tcp://127.0.0.1:{int(echo.stdout.readline())}")
        request = b"q" * 64

        def once():
            s.send(request, copy=True)
            s.recv(copy=False)

        for _ in range(200):
            once()
        return median_us(once, calls)
    finally:
        s.send(b"stop")
        echo.wait(timeout=10)
        s.close()
        ctx.term()


# -- the matrix --------------------------------------------------------------

def windows(base: int, rows: int) -> list:
    """WINDOW lists of `rows` consecutive indexes from `base`."""
    return [list(range(base + s * rows, base + (s + 1) * rows)) for s in range(WINDOW)]


PUT_BASE = {r: (1 + k) * 1_000_000 for k, r in enumerate(ROWS)}
GET_BASE = {r: (10 + k) * 1_000_000 for k, r in enumerate(ROWS)}
NAMES = [f"f{i}" for i in range(max(FIELDS))]


def cells(ops) -> list:
    """(op, fields, rows, indexes by slot, payload or field names)."""
    out = []
    for op in ops:
        for f in FIELDS:
            for r in ROWS:
                if op == "put":
                    data = {n: np.full((r, WIDTH), i, np.float32) for i, n in enumerate(NAMES[:f])}
                    out.append((op, f, r, windows(PUT_BASE[r], r), data))
                else:
                    out.append((op, f, r, windows(GET_BASE[r], r), NAMES[:f]))
    return out


def seed_gets(c: stowage.Client) -> None:
    """Every row a get cell reads, with all 32 fields."""
    for r in ROWS:
        idx = [i for w in windows(GET_BASE[r], r) for i in w]
        for a in range(0, len(idx), 256):
            part = idx[a:a + 256]
            c.put(part, {n: np.full((len(part), WIDTH), i, np.float32) for i, n in enumerate(NAMES)})


class Indexes:
    """The index lists of a cell's passes. Gets, and puts with `fresh`
    False, cycle over the cell's window (a put then overwrites the rows
    put WINDOW calls before); puts with `fresh` take indexes never used
    before in this stowd, and `done` clears them after the pass (outside
    the timing), so memory stays bounded by one pass."""

    def __init__(self, fresh: bool, start: int):
        self.fresh, self.next = fresh, start

    def make(self, op: str, r: int, window: list, n: int) -> tuple[list, range | None]:
        if op == "get" or not self.fresh:
            return [window[k % WINDOW] for k in range(n)], None
        b = self.next
        self.next += n * r
        return [list(range(b + k * r, b + (k + 1) * r)) for k in range(n)], range(b, b + n * r)


def sync_matrix(endpoint: str, ops, calls: int, cpu_x: int, pid: int, fresh: bool, spin_us=None,
                echo: "Echo | None" = None) -> dict:
    """{(op, fields, rows): (p50 µs, client CPU µs a call, stowd CPU µs a
    call, the tcp ping-pong's µs around the timed pass (`echo`'s; None
    without))}; `spin_us` as for `stowage.Client` (None: its default)."""
    out, ix = {}, Indexes(fresh, 100_000_000 if spin_us is None else 150_000_000)
    with stowage.Client(endpoint, timeout=60, spin_us=spin_us) as c:
        for op, f, r, window, arg in cells(ops):
            call = c.put if op == "put" else c.get
            res = []
            for step, n in enumerate((50, calls, cpu_x * calls)):  # warm-up, timed pass, CPU pass
                idx, used = ix.make(op, r, window, n)
                ts = []
                if step == 1:
                    before = echo.samples(ADJACENT_FLOOR_CALLS) if echo else []
                mine, theirs = time.process_time(), cpu_seconds(pid)
                if step == 1:
                    for i in idx:
                        t = time.perf_counter()
                        call(i, arg)
                        ts.append(time.perf_counter() - t)
                    floor = adjacent_floor(echo, before)
                else:
                    for i in idx:
                        call(i, arg)
                if step == 2:
                    res += [(time.process_time() - mine) / n * 1e6, (cpu_seconds(pid) - theirs) / n * 1e6]
                elif step == 1:
                    res.append(statistics.median(ts) * 1e6)
                if used is not None:
                    c.clear(used)
            out[(op, f, r)] = (*res, floor)
    return out


def async_matrix(endpoint: str, ops, calls: int, cpu_x: int, pid: int, fresh: bool,
                 echo: "Echo | None" = None) -> dict:
    """As `sync_matrix`, through AsyncClient: one task, calls back to back."""
    async def run() -> dict:
        out, ix = {}, Indexes(fresh, 500_000_000)
        async with stowage.AsyncClient(endpoint, timeout=60) as c:
            for op, f, r, window, arg in cells(ops):
                call = c.put if op == "put" else c.get
                res = []
                for step, n in enumerate((50, calls, cpu_x * calls)):
                    idx, used = ix.make(op, r, window, n)
                    ts = []
                    if step == 1:
                        before = echo.samples(ADJACENT_FLOOR_CALLS) if echo else []
                    mine, theirs = time.process_time(), cpu_seconds(pid)
                    if step == 1:
                        for i in idx:
                            t = time.perf_counter()
                            await call(i, arg)
                            ts.append(time.perf_counter() - t)
                        floor = adjacent_floor(echo, before)
                    else:
                        for i in idx:
                            await call(i, arg)
                    if step == 2:
                        res += [(time.process_time() - mine) / n * 1e6, (cpu_seconds(pid) - theirs) / n * 1e6]
                    elif step == 1:
                        res.append(statistics.median(ts) * 1e6)
                    if used is not None:
                        await c.clear(used)
                out[(op, f, r)] = (*res, floor)
        return out
    return asyncio.run(run())


# -- the earlier 4 KiB table -------------------------------------------------

def measure_4k(endpoint: str, calls: int, cpu_x: int, stowd_pid: int) -> tuple[dict, dict]:
    """({(op, transport): µs} for a get and a put of one 4 KiB row (the
    core with its default spin, the core with spin_us=0), and
    {(op, transport): (client CPU µs, stowd CPU µs)} per call, from a
    second pass of cpu_x times the calls."""
    row = np.ones((1, 1024), np.float32)
    out, cpu = {}, {}
    with stowage.Client(endpoint, timeout=30) as c, stowage.Client(endpoint, timeout=30, spin_us=0) as asleep:
        c.put(range(16), {"x": np.zeros((16, 1024), np.float32)})
        for transport, client in (("core", c), ("core spin 0", asleep)):
            client.get([3], ["x"])  # warm: connections made, plugins instantiated
            for op, fn in (("get", lambda: client.get([3], ["x"])), ("put", lambda: client.put([5], {"x": row}))):
                out[(op, transport)] = median_us(fn, calls)
                mine, theirs = time.process_time(), cpu_seconds(stowd_pid)
                for _ in range(cpu_x * calls):
                    fn()
                cpu[(op, transport)] = ((time.process_time() - mine) / (cpu_x * calls) * 1e6,
                                        (cpu_seconds(stowd_pid) - theirs) / (cpu_x * calls) * 1e6)
    return out, cpu


# -- bundled plugins against the built-in ---------------------------------------

def policy_pair(binary: str, work: str, plugins: str, cpus: str, puts: int, fresh: bool, block: int = 100) -> dict:
    """{policy: [µs a put]} for the 4-row x 10-field put, the two stowds
    running at once on `cpus`, blocks alternating (order flipped every
    block); indexes as in the matrix (fresh: each put's own, the same
    sequence in both stowds, at most 2,000 puts' worth held at a time)."""
    data = {n: np.ones((4, WIDTH), np.float32) for n in NAMES[:10]}
    idx = windows(PUT_BASE[4], 4) if not fresh else [list(range(10**8 + 4 * k, 10**8 + 4 * k + 4)) for k in range(puts)]
    procs, clients, times = {}, {}, {}
    try:
        for policy, p in (("bundled plugins", plugins), ("built-in", None)):
            procs[policy], eps = start(binary, os.path.join(work, policy.replace(" ", "-")), p, cpus=cpus)
            clients[policy] = stowage.Client(eps["native"], timeout=30)
            times[policy] = []
        time.sleep(0.5)
        others = Others([p.pid for p in procs.values()])
        for c in clients.values():
            for k in range(2 * WINDOW):  # warm (and with overwrites, every slot already held)
                c.put(windows(PUT_BASE[4], 4)[k % WINDOW], data)
        for b in range(0, puts, block):
            order = list(clients.items())
            if (b // block) % 2:
                order.reverse()
            for policy, c in order:
                ts = times[policy]
                for j in range(b, min(b + block, puts)):
                    t = time.perf_counter()
                    c.put(idx[j % len(idx)], data)
                    ts.append(time.perf_counter() - t)
                if fresh and (b + block) % 2000 == 0:  # bound what the two hold (outside the timing)
                    c.clear(range(10**8 + 4 * (b + block - 2000), 10**8 + 4 * (b + block)))
        busy = others.share()
    finally:
        for c in clients.values():
            c.close()
        for p in procs.values():
            p.terminate()
            p.wait()
    return {policy: [t * 1e6 for t in ts] for policy, ts in times.items()}, busy


# -- same node ----------------------------------------------------------------

SAME_NODE_WAYS = ("range", "numpy int64", "list", "list made out of order")


def made_out_of_order(n: int) -> list:
    """[0, n) as a list whose int objects were made in a shuffled order:
    each lies wherever the allocator put it then, not after the one
    before it (as a list gathered from many places holds them)."""
    order = np.random.default_rng(n).permutation(n).tolist()
    out = [0] * n
    for i in order:
        out[i] = i + 1 - 1  # a new int object (beyond the small-int cache)
    return out


def same_node(binary: str, work: str, plugins: str, n: int, width: int, reps: int) -> dict:
    """{way: [ms]} for a same-node get of all `n` rows, the indexes as
    range(n), a numpy int64 array and a list; plus the put's seconds."""
    shm_dir = f"/dev/shm/stowage-small-calls-{os.getpid()}"
    shutil.rmtree(shm_dir, ignore_errors=True)
    proc, eps = start(binary, work, plugins, cpus="1", extra=f'\n[shm]\ndir = "{shm_dir}"\n')
    res = {way: [] for way in SAME_NODE_WAYS}
    try:
        with stowage.Client(eps["native"], timeout=300, same_node=True) as c:
            if not c.same_node:
                raise SystemExit("the same-node client did not get shared memory")
            a = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, width), np.float32)
            t = time.perf_counter()
            c.put(range(n), {"x": a})
            put_s = time.perf_counter() - t
            ways = {"range": lambda: range(n), "numpy int64": lambda: np.arange(n, dtype=np.int64),
                    "list": lambda: list(range(n)), "list made out of order": lambda: made_out_of_order(n)}
            for rep in range(reps + 1):  # the first round warms, uncounted
                names = list(ways)
                names = names[rep % len(names):] + names[:rep % len(names)]
                for way in names:
                    idx = ways[way]()  # made outside the timing: the caller has it already
                    t = time.perf_counter()
                    g = c.get(idx, ["x"])["x"]
                    dt = time.perf_counter() - t
                    if rep == 0:
                        assert g.shape == (n, width) and g[-1, 0] == n - 1 and g[n // 3, -1] == n // 3, way
                    else:
                        res[way].append(dt * 1e3)
                    del g
            del a
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(shm_dir, ignore_errors=True)
    res["put (s)"] = put_s
    return res


# -- output ---------------------------------------------------------------------

def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def file_id(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"{path} (sha256 {h.hexdigest()[:12]}, {time.strftime('%Y-%m-%d %H:%M', time.localtime(os.path.getmtime(path)))})"


def mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stowd", action="append", required=True, metavar="BIN[=LABEL]")
    ap.add_argument("--plugins", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "plugins"),
                    help="the bundled plugins (`cargo xtask plugins --out DIR`; default $CARGO_TARGET_DIR/plugins, else target/plugins)")
    ap.add_argument("--calls", type=int, default=1000, help="round trips a cell (its median)")
    ap.add_argument("--cpu-x", type=int, default=3, help="the CPU pass makes this many times --calls calls")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 60 calls, CPU pass 1x, 2 same-node reps")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help="comma-separated sections: " + ", ".join(SECTIONS) + " (put/get and sync/async narrow the matrix)")
    ap.add_argument("--puts", choices=("fresh", "overwrite"), default="fresh",
                    help="put at indexes never used before (cleared after each pass), or overwrite a window's")
    ap.add_argument("--same-node-width", type=int, default=1024,
                    help="float32 elements a row (1024: the seed case, 2 GiB; 1 gives the same get times)")
    ap.add_argument("--same-node-reps", type=int, default=9)
    a = ap.parse_args()
    fresh = a.puts == "fresh"
    only = set(a.only.split(","))
    if only - set(SECTIONS):
        raise SystemExit(f"--only: unknown {sorted(only - set(SECTIONS))}; sections: {', '.join(SECTIONS)}")
    ops = [op for op in ("put", "get") if op in only] or (["put", "get"] if only & {"sync", "async"} else [])
    kinds = [k for k in ("sync", "async") if k in only] or (["sync", "async"] if ops else [])
    if a.quick:
        a.calls, a.cpu_x, a.same_node_reps = 60, 1, 2
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two CPUs")
    os.sched_setaffinity(0, {0})
    if not os.path.isdir(a.plugins) or not any(n.endswith(".wasm") for n in os.listdir(a.plugins)):
        raise SystemExit(f"no plugins in {a.plugins} (cargo xtask plugins --out DIR; --plugins DIR)")
    for spec in a.stowd:
        if not os.access(spec.partition("=")[0], os.X_OK):
            raise SystemExit(f"no stowd at {spec.partition('=')[0]}")
    began = time.monotonic()
    print(f"# bench/small_calls.py at {git_commit()}, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; CPUs {os.cpu_count()}; "
          f"python {sys.version.split()[0]}; numpy {np.__version__}")
    print(f"# --calls {a.calls}, --cpu-x {a.cpu_x}, --puts {a.puts}, sections {','.join(s for s in SECTIONS if s in only)}"
          + (" (--quick)" if a.quick else ""))
    print(f"# client core: {file_id(stowage._core.__file__)}")
    for spec in a.stowd:
        binary, _, label = spec.partition("=")
        print(f"# stowd {label or binary}: {file_id(binary)}")
    print(f"# plugins: {a.plugins}", flush=True)
    print()

    floor, floor_cpu, zfloor, bfloor = {}, {}, {}, {}
    if "floors" in only or ops:
        for cpu, where in ((0, "same CPU"), (1, "two CPUs")):
            floor[where], floor_cpu[where] = ping_pong_cpu(cpu, max(a.calls, 1000))
            zfloor[where] = zmq_ping_pong(cpu, max(a.calls, 1000))
            print(f"  floors, {where}: tcp {floor[where]:.1f} us (its client's CPU {floor_cpu[where]:.1f} us a call), "
                  f"pyzmq {zfloor[where]:.1f} us", flush=True)
        if "put" in ops:
            # The 32-vs-1 check's bytes alone: a plain tcp ping-pong with a
            # 1-field and a 32-field put's rows out (64 bytes back).
            for cpu, where in ((0, "same CPU"), (1, "two CPUs")):
                for r in ROWS:
                    for f in (1, max(FIELDS)):
                        bfloor[(where, f, r)] = ping_pong(cpu, max(a.calls, 1000), out=f * r * WIDTH * 4, back=64)
                print(f"  put bytes alone, {where}: " + ", ".join(
                    f"{r} rows {bfloor[(where, max(FIELDS), r)] / bfloor[(where, 1, r)]:.2f}x" for r in ROWS), flush=True)

    matrix, legacy, pol, sn = [], [], [], []
    # The cells' own floors (see `ADJACENT_FLOOR_CALLS`): an echo a placement, kept for the run.
    echos = {where: Echo(int(cpus)) for cpus, where in PLACEMENTS} if ops else {}
    with tempfile.TemporaryDirectory(prefix="stowage-small-calls-") as work:
        for k, spec in enumerate(a.stowd):
            binary, _, label = spec.partition("=")
            label = label or binary
            if not (ops or "4k" in only):
                break
            for plugins, chain in ((a.plugins, "bundled plugins"), (None, "built-in")):
                for cpus, where in PLACEMENTS:
                    proc, eps = start(binary, os.path.join(work, f"{k}-{chain.replace(' ', '-')}-{cpus}"), plugins, cpus=cpus)
                    try:
                        time.sleep(0.5)
                        t0, others = time.monotonic(), Others([proc.pid])
                        got = {}
                        if "get" in ops:
                            with stowage.Client(eps["native"], timeout=60) as c:
                                seed_gets(c)
                        echo = echos.get(where)
                        if "sync" in kinds:
                            got["sync"] = sync_matrix(eps["native"], ops, a.calls, a.cpu_x, proc.pid, fresh, echo=echo)
                            # The client's own work, without the wait it spins through.
                            got["sync spin 0"] = sync_matrix(eps["native"], ops, a.calls, a.cpu_x, proc.pid, fresh,
                                                             spin_us=0, echo=echo)
                        if "async" in kinds:
                            got["async"] = async_matrix(eps["native"], ops, a.calls, a.cpu_x, proc.pid, fresh,
                                                        echo=echo)
                        if got:
                            matrix.append((label, chain, where, got))
                        if "4k" in only:
                            legacy.append((label, chain, where, *measure_4k(eps["native"], a.calls, a.cpu_x, proc.pid)))
                        busy = others.share()
                    finally:
                        proc.terminate()
                        proc.wait()
                    print(f"  {label}, {chain}, {where}: {time.monotonic() - t0:.0f} s; other processes kept "
                          f"{busy:.2f} of a CPU busy", flush=True)
        if "policy" in only:
            for k, spec in enumerate(a.stowd):
                binary, _, label = spec.partition("=")
                for cpus, where in PLACEMENTS:
                    got, busy = policy_pair(binary, os.path.join(work, f"policy-{k}-{cpus}"), a.plugins, cpus,
                                      max(2 * a.calls, 200), fresh)
                    pol.append((label or binary, where, got))
                    m = {p: statistics.median(v) for p, v in got.items()}
                    print(f"  policy, {label or binary}, {where}: " + ", ".join(f"{p} {v:.1f} us" for p, v in m.items())
                          + f"; other processes kept {busy:.2f} of a CPU busy", flush=True)
        if "same-node" in only:
            for k, spec in enumerate(a.stowd):
                binary, _, label = spec.partition("=")
                got = same_node(binary, os.path.join(work, f"same-node-{k}"), a.plugins, SAME_NODE_ROWS,
                                a.same_node_width, a.same_node_reps)
                sn.append((label or binary, got))
                print(f"  same node, {label or binary}: put {got['put (s)']:.2f} s, " + ", ".join(
                    f"{w} {statistics.median(v):.2f} ms" for w, v in got.items() if w != "put (s)"), flush=True)

    for e in echos.values():
        e.close()
    checks = []  # (check, PASS/FAIL)
    print()
    if floor:
        print("## Floors (µs, medians of", max(a.calls, 1000), "round trips; 64 bytes out, 4,200 back)\n")
        print("| placement | tcp ping-pong, plain Python | its client's CPU a call | pyzmq DEALER<->ROUTER | pyzmq / tcp |"
              "\n|---|---:|---:|---:|---:|")
        for where in floor:
            print(f"| {where} | {floor[where]:.1f} | {floor_cpu[where]:.1f} | {zfloor[where]:.1f} | "
                  f"{zfloor[where] / floor[where]:.2f} |")
        print("\nIts client's CPU: user + system of this process over the round trips, a bare Python socket "
              "client's (`sendall`, `recv_into`).\n")

    if matrix:
        print(f"## Small calls: fields x rows, float32[{WIDTH}] a field a row\n")
        print(f"p50: median of {a.calls} round trips; CPU: user + system µs a call over {a.cpu_x * a.calls} "
              "calls (client: this process, all threads; stowd: its process). "
              + ("Puts at fresh indexes (cleared after each pass, outside the timing)" if fresh else
                 f"Puts overwrite rows put {WINDOW} calls before")
              + f"; gets read rows put beforehand, cycling over {WINDOW} calls' worth. `sync`: stowage.Client with its "
              "default spin (the client polls for the reply for up to 200 µs, so its CPU includes the wait it spins "
              "through); `sync spin 0`: spin_us=0 (the client's own work); `async`: AsyncClient, whose puts under "
              f"{stowage.AsyncClient.CORE_MIN_BYTES >> 20} MiB and gets go through the core with the reply awaited by "
              "the event loop.\n")
        hdr = " | ".join(f"{what} {r} row{'s' if r > 1 else ''}" for what in ("p50", "client CPU", "stowd CPU") for r in ROWS)
        print(f"| stowd | policy | placement | client | op | fields | {hdr} |")
        print("|---|---|---|---|---|---:|" + "---:|" * (3 * len(ROWS)))
        for label, chain, where, got in matrix:
            for kind, cellv in got.items():
                for op in ops:
                    for f in FIELDS:
                        vals = [cellv[(op, f, r)][j] for j in range(3) for r in ROWS]
                        print(f"| {label} | {chain} | {where} | {kind} | {op} | {f} | "
                              + " | ".join(f"{v:.1f}" if j < len(ROWS) else f"{v:.0f}" for j, v in enumerate(vals)) + " |")
        print()

        print(f"### Check: client CPU a call <= {CPU_TARGET_US:.0f} µs, 1-10 fields x 1-4 rows\n")
        print("µs (ratio to the target) PASS/FAIL; checked: the sync client's own work (`sync spin 0`); the "
              "default spin and async shown too.\n")
        if floor_cpu:
            print("The bare tcp ping-pong's client took " + ", ".join(
                f"{floor_cpu[w]:.1f} µs a call on {w}" for w in floor_cpu)
                  + " in this run (the Floors table): what the exchange alone costs a Python process, its system "
                    "calls and wake-ups included.\n")
        print("| stowd | policy | placement | client | op | " + " | ".join(f"{f} field{'s' if f > 1 else ''} x {r} row{'s' if r > 1 else ''}" for f, r in SMALL) + " |")
        print("|---|---|---|---|---|" + "---|" * len(SMALL))
        for label, chain, where, got in matrix:
            for kind, cellv in got.items():
                for op in ops:
                    row = []
                    for f, r in SMALL:
                        v = cellv[(op, f, r)][1]
                        ok = v <= CPU_TARGET_US
                        row.append(f"{v:.1f} ({v / CPU_TARGET_US:.2f}) {mark(ok)}")
                        if kind == "sync spin 0":
                            checks.append((f"client CPU, {label}, {chain}, {where}, sync spin 0 {op} {f}x{r}", ok))
                    print(f"| {label} | {chain} | {where} | {kind} | {op} | " + " | ".join(row) + " |")
        print()

        print(f"### Check: p50 <= {FLOOR_X:.0f}x the tcp ping-pong on the same placement\n")
        print(f"p50 / tcp ping-pong (PASS/FAIL at <= 2), every cell; columns fields x rows. Each cell against "
              f"its own floor: the median of {ADJACENT_FLOOR_CALLS} ping-pong round trips timed right before "
              f"its timed pass and {ADJACENT_FLOOR_CALLS} right after (the last column: the lowest and highest "
              "of a row's floors, µs).\n")
        cols = [(f, r) for f in FIELDS for r in ROWS]
        print("| stowd | policy | placement | client | op | " + " | ".join(f"{f}x{r}" for f, r in cols)
              + " | floors |")
        print("|---|---|---|---|---|" + "---|" * len(cols) + "---|")
        at_start = 0
        for label, chain, where, got in matrix:
            for kind, cellv in got.items():
                for op in ops:
                    row, floors = [], []
                    for f, r in cols:
                        p50, own = cellv[(op, f, r)][0], cellv[(op, f, r)][3]
                        floors.append(own)
                        x = p50 / own
                        at_start += p50 / floor[where] <= FLOOR_X
                        row.append(f"{x:.2f} {mark(x <= FLOOR_X)}")
                        checks.append((f"p50 vs tcp, {label}, {chain}, {where}, {kind} {op} {f}x{r}", x <= FLOOR_X))
                    print(f"| {label} | {chain} | {where} | {kind} | {op} | " + " | ".join(row)
                          + f" | {min(floors):.1f}-{max(floors):.1f} |")
        cells_n = sum(len(got) * len(ops) * len(cols) for _, _, _, got in matrix)
        print(f"\nAgainst the floors measured once at the run's start (the Floors table) instead: {at_start} of "
              f"{cells_n} cells at or under {FLOOR_X:.0f}x.\n")

        if "put" in ops:
            print(f"### Check: a {max(FIELDS)}-field put <= {FIELDS_X:.0f}x a 1-field put (same rows, p50)\n")
            print("| stowd | policy | placement | client | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in ROWS) + " |")
            print("|---|---|---|---|" + "---|" * len(ROWS))
            for label, chain, where, got in matrix:
                for kind, cellv in got.items():
                    row = []
                    for r in ROWS:
                        x = cellv[("put", max(FIELDS), r)][0] / cellv[("put", 1, r)][0]
                        row.append(f"{x:.2f} {mark(x <= FIELDS_X)}")
                        checks.append((f"32 vs 1 field put, {label}, {chain}, {where}, {kind} {r} rows", x <= FIELDS_X))
                    print(f"| {label} | {chain} | {where} | {kind} | " + " | ".join(row) + " |")
            for where in dict.fromkeys(w for _, _, w, _ in matrix):
                if (where, 1, ROWS[0]) in bfloor:
                    print(f"| (the bytes alone) | plain tcp ping-pong | {where} | | " + " | ".join(
                        f"{bfloor[(where, max(FIELDS), r)] / bfloor[(where, 1, r)]:.2f}" for r in ROWS) + " |")
            print()
            if bfloor:
                print(f"The last rows: a plain tcp ping-pong between two Python processes, a {max(FIELDS)}-field "
                      f"put's rows out against a 1-field put's ({max(FIELDS)} x rows x {WIDTH * 4} bytes against "
                      "rows x "f"{WIDTH * 4}; 64 bytes back), p50 ratio: what moving the bytes alone costs, "
                      "no framing, no client, no stowd.\n")

    if legacy:
        keys = list(legacy[0][3])
        print(f"## One 4 KiB row (the earlier table): µs, medians of {a.calls} round trips\n")
        print("| stowd | policy | placement | " + " | ".join(f"{op}, {t}" for op, t in keys)
              + " | get, core / tcp ping-pong |")
        print("|---|---|---|" + "---:|" * (len(keys) + 1))
        for label, chain, where, got, _ in legacy:
            print(f"| {label} | {chain} | {where} | " + " | ".join(f"{got[k]:.1f}" for k in keys)
                  + (f" | {got[('get', 'core')] / floor[where]:.2f} |" if floor else " | |"))
        print(f"\nCPU a call, client + stowd (µs; {a.cpu_x}x the calls):\n")
        print("| stowd | policy | placement | " + " | ".join(f"{op}, {t}" for op, t in keys) + " |")
        print("|---|---|---|" + "---:|" * len(keys))
        for label, chain, where, _, cpu in legacy:
            print(f"| {label} | {chain} | {where} | "
                  + " | ".join(f"{cpu[k][0]:.0f} + {cpu[k][1]:.0f}" for k in keys) + " |")
        print()

    if pol:
        print(f"### Check: 4 rows x 10 fields put, bundled plugins within {100 * (POLICY_TOLERANCE - 1):.0f}% of the built-in\n")
        print("Two stowds at once on the placement, sync client, blocks of 100 puts alternating, puts as in the matrix; µs a put.\n")
        print("| stowd | placement | puts each | bundled p50 | built-in p50 | ratio (p50) | bundled mean | built-in mean | ratio (mean) | check |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for label, where, got in pol:
            b, i = got["bundled plugins"], got["built-in"]
            x = statistics.median(b) / statistics.median(i)
            checks.append((f"bundled vs built-in put, {label}, {where}", x <= POLICY_TOLERANCE))
            print(f"| {label} | {where} | {len(b)} | {statistics.median(b):.1f} | {statistics.median(i):.1f} | {x:.3f} | "
                  f"{statistics.mean(b):.1f} | {statistics.mean(i):.1f} | {statistics.mean(b) / statistics.mean(i):.3f} | "
                  f"{mark(x <= POLICY_TOLERANCE)} |")
        print()

    if sn:
        print(f"### Same node: a get of all {SAME_NODE_ROWS:,} rows (float32[{a.same_node_width}] a row), "
              f"ms, over {a.same_node_reps} rounds after one warm-up\n")
        print("| stowd | put of all (s) | indexes as | p50 | min | max | target | check |\n|---|---:|---|---:|---:|---:|---:|---|")
        for label, got in sn:
            for way in SAME_NODE_WAYS:
                v = got[way]
                p50 = statistics.median(v)
                tgt = SAME_NODE_TARGET_MS.get(way)
                if tgt is not None:
                    checks.append((f"same-node get, {label}, {way}", p50 <= tgt))
                print(f"| {label} | {got['put (s)']:.2f} | {way} | {p50:.2f} | {min(v):.2f} | {max(v):.2f} | "
                      + (f"{tgt:.0f} ({p50 / tgt:.2f}) | {mark(p50 <= tgt)} |" if tgt else " | |"))
        print()

    if checks:
        failed = [c for c, ok in checks if not ok]
        print(f"## Checks: {len(checks) - len(failed)} of {len(checks)} pass")
        groups = {}
        for c, ok in checks:
            g = c.split(",")[0]
            groups.setdefault(g, [0, 0])[ok] += 1
        for g, (bad, good) in groups.items():
            print(f"- {g}: {good} pass, {bad} fail")
    print(f"\n# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"run took {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
