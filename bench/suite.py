#!/usr/bin/env python3
"""Side-by-side benchmark suite: Stowage vs TransferQueue 0.1.11 vs the
machine's limits, the same workloads in ONE run.

Systems
  stowage-tcp     stowage Python client -> stowd native protocol over tcp
  stowage-shm     stowage Python client -> stowd, same-node shared memory
  tq->stowd       TransferQueue's own client + AsyncSimpleStorageManager
                  (adapter backend "Stowage") -> stowd's router (TQ protocol)
  tq              TransferQueue's own client + storage manager -> 4 of its
                  SimpleStorageUnits in a separate process (no Ray: the
                  classes are built through __ray_metadata__.modified_class)
stowd runs once with 4 local units (`[units] local = 4`): rows go g % 4.
TransferQueue's controller lives in the benchmark process (both tq rows).

Limits, for the same payload sizes: numpy copy into a reused buffer and
into fresh pages; pyzmq tcp loopback to another process with the messages
shaped as TransferQueue sends them (put: one frame per field; get: one frame
per row); shared memory (/dev/shm) write + read.

For every operation: time, and the peak RSS above its baseline of every
process involved (VmHWM reset through /proc/PID/clear_refs), as a ratio to
the payload. Median of --reps. Writes a section of docs/benchmarks.md and
docs/img/suite_*.png.

TransferQueue needs torch (~6 GB): the suite re-runs itself under
--tq-python (a venv with transferqueue==0.1.11 and matplotlib), or makes one
with --setup-tq DIR.

usage: python3 bench/suite.py --tq-python /work/tqenv/bin/python [--scale 1] [--reps 3]
       python3 bench/suite.py --setup-tq /tmp/tqenv [--scale 0.1]
"""
import argparse
import datetime
import gc
import json
import mmap
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ["stowage-tcp", "stowage-shm", "tq->stowd", "tq"]
WORKLOADS = ["headline", "small", "mixed", "irregular", "many-small"]
BEGIN, END = "<!-- bench/suite.py: begin -->", "<!-- bench/suite.py: end -->"


# ------------------------------------------------------------------ setup


def tq_importable(python):
    r = subprocess.run([python, "-c", "import transfer_queue, matplotlib, torch"], capture_output=True)
    return r.returncode == 0


def reexec_under_tq(a):
    """Run the suite under an interpreter that has transfer_queue."""
    try:
        import transfer_queue  # noqa: F401
        import matplotlib  # noqa: F401
        return
    except ImportError:
        pass
    python = a.tq_python or os.environ.get("TQ_PYTHON")
    if a.setup_tq:
        d = os.path.abspath(a.setup_tq)
        python = os.path.join(d, "bin", "python")
        if not os.path.exists(python) or not tq_importable(python):
            print(f"creating {d}: transferqueue==0.1.11 + matplotlib (brings torch, ~6 GB)", flush=True)
            subprocess.run([sys.executable, "-m", "venv", d], check=True)
            subprocess.run([python, "-m", "pip", "install", "transferqueue==0.1.11", "matplotlib"], check=True)
    if not python:
        raise SystemExit("transfer_queue is not importable here: pass --tq-python PY (a venv with "
                         "transferqueue==0.1.11 and matplotlib) or --setup-tq DIR to make one")
    if not tq_importable(python):
        print(f"{python}: installing matplotlib", flush=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "matplotlib"], check=True)
    argv = [a for a in sys.argv[1:]]
    os.execv(python, [python, os.path.abspath(__file__), *argv, "--_child"])


# ------------------------------------------------------------------ measuring


from procmem import reset_peak, status  # noqa: E402


def trim():
    """Hand freed heap back to the OS, so a baseline is not inflated by (and a
    peak not hidden in) memory an earlier operation freed."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(fn, pids):
    """fn() -> (seconds, result, {pid: (peak over before, after over before)})."""
    trim()
    base = {p: status(p)["VmRSS"] for p in pids}
    for p in pids:
        reset_peak(p)
    t = time.perf_counter()
    r = fn()
    took = time.perf_counter() - t
    mem = {}
    for p in pids:
        s = status(p)
        mem[p] = (s["VmHWM"] - base[p], s["VmRSS"] - base[p])
    return took, r, mem


# ------------------------------------------------------------------ workloads


class Workload:
    """numpy fields (for stowage) and a TensorDict (for TransferQueue) of the
    same rows; `get_pos` are the positions a get asks for (all, or a random
    subset in random order)."""

    def __init__(self, name, desc, fields, n, get_pos=None):
        self.name, self.desc, self.fields, self.n = name, desc, fields, n
        self.get_pos = get_pos if get_pos is not None else list(range(n))
        self.put_bytes = sum(field_bytes(v, range(n)) for v in fields.values())
        self.get_bytes = sum(field_bytes(v, self.get_pos) for v in fields.values())
        self._td = None

    def tensordict(self):
        import torch
        from tensordict import NonTensorStack, TensorDict
        if self._td is None:
            d = {}
            for k, v in self.fields.items():
                if hasattr(v, "dtype"):
                    d[k] = torch.from_numpy(v)
                elif isinstance(v[0], str):
                    d[k] = NonTensorStack(*v)
                else:
                    d[k] = torch.nested.as_nested_tensor([torch.from_numpy(x) for x in v], layout=torch.jagged)
            self._td = TensorDict(d, batch_size=self.n)
        return self._td


def field_bytes(v, pos):
    if hasattr(v, "dtype"):
        return v[0].nbytes * len(pos)
    if isinstance(v[0], str):
        return sum(len(v[i].encode()) for i in pos)
    return sum(v[i].nbytes for i in pos)


def make_workloads(scale, names):
    import numpy as np
    rng = np.random.default_rng(0)
    out = []
    s = lambda x: max(8, int(x * scale))  # noqa: E731
    for name in names:
        if name == "headline":
            n = s(524288)
            out.append(Workload(name, f"float32 [{n}, 1024] regular, 4 units (stride 4)",
                                {"x": np.ones((n, 1024), np.float32)}, n))
        elif name == "small":
            n = s(1024)
            f = {f"f{i}": np.full((n, 8192), i, np.float32) for i in range(9)}
            out.append(Workload(name, f"TQ perftest small: {n} x 9 fields x seq 8192 float32", f, n))
        elif name == "mixed":
            n = s(8192)
            lens = rng.integers(1, 2048, n)
            f = {"x": rng.standard_normal((n, 4096), dtype=np.float32),
                 "ids": [np.arange(k, dtype=np.int64) for k in lens],
                 "text": [f"sample {i} " + "lorem ipsum " * int(k % 40) for i, k in enumerate(lens)],
                 "label": np.arange(n, dtype=np.int64)}
            out.append(Workload(name, f"mixed: {n} rows, float32 [4096] + jagged int64 (1-2047) + "
                                "string + int64 scalar", f, n))
        elif name == "irregular":
            n = s(131072)
            pos = [int(p) for p in rng.permutation(n)[: n // 4]]
            out.append(Workload(name, f"float32 [{n}, 1024], get of a random quarter ({len(pos)} rows, "
                                "random order)", {"x": np.ones((n, 1024), np.float32)}, n, pos))
        elif name == "many-small":
            n = s(131072)
            out.append(Workload(name, f"many small rows: float32 [{n}, 128] (512 B rows)",
                                {"x": np.ones((n, 128), np.float32)}, n))
    return out


# ------------------------------------------------------------------ processes


class Stowd:
    def __init__(self, binary, tmp):
        cfg = os.path.join(tmp, "stowd.toml")
        self.eps_path = os.path.join(tmp, "stowd.json")
        with open(cfg, "w") as f:
            f.write("[units]\nlocal = 4\n")
        self.proc = subprocess.Popen(
            [binary, "serve", "--config", cfg, "--endpoints-file", self.eps_path],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "stowd.log"), "w"),
            env={**os.environ, "RUST_LOG": "warn"})
        deadline = time.time() + 300
        while not os.path.exists(self.eps_path):
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"stowd did not start (see {tmp}/stowd.log)")
            time.sleep(0.1)
        time.sleep(0.2)
        with open(self.eps_path) as f:
            self.ep = json.load(f)
        self.pid = self.proc.pid

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


TQ_UNITS = r"""
import json, sys
from transfer_queue.storage import SimpleStorageUnit
units = [SimpleStorageUnit.__ray_metadata__.modified_class(config={"num_data_storage_units": 4}) for _ in range(4)]
print(json.dumps([{"id": u.storage_unit_id, "endpoint": u.zmq_server_info.to_addr("put_get_socket")}
                  for u in units]), flush=True)
sys.stdin.read()
for u in units:
    u.shutdown()
"""


class TQUnits:
    """4 TransferQueue SimpleStorageUnits in their own process."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", TQ_UNITS], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.units = json.loads(self.proc.stdout.readline())
        self.pid = self.proc.pid

    def stop(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------ systems


def run_stowage(w, stowd, same_node, reps, rec):
    import stowage
    if same_node:
        c = stowage.Client(stowd.ep["native"], timeout=900, same_node=True, shm_dir=stowd.ep["shm_dir"])
    else:
        c = stowage.Client(stowd.ep["native"], timeout=900, max_message_bytes=256 << 20)
    sysname = "stowage-shm" if same_node else "stowage-tcp"
    idx = list(range(w.n))
    gidx = w.get_pos
    names = list(w.fields)
    pids = [os.getpid(), stowd.pid]
    try:
        for _ in range(reps):
            rec(sysname, w, "put", *measure(lambda: c.put(idx, w.fields), pids)[::2])
            t, got, mem = measure(lambda: c.get(gidx, names), pids)
            check_stowage(w, got)
            del got
            rec(sysname, w, "get", t, mem)
            c.clear(idx)
            if same_node:
                c.release_segments()
    finally:
        c.close()


def check_stowage(w, got):
    import numpy as np
    for k, v in w.fields.items():
        for j in (0, len(w.get_pos) - 1):
            p = w.get_pos[j]
            if hasattr(v, "dtype") or not isinstance(v[0], str):
                assert np.array_equal(np.asarray(got[k][j]), v[p]), (k, j)
            else:
                assert got[k][j] == v[p], (k, j)


class TQ:
    def __init__(self):
        from transfer_queue.controller import TransferQueueController
        self.controller = TransferQueueController.__ray_metadata__.modified_class()
        self.k = 0

    def client(self, backend, section):
        import uuid

        import stowage.transferqueue  # noqa: F401  registers "Stowage"
        from transfer_queue.client import TransferQueueClient
        c = TransferQueueClient(f"TransferQueueClient_{uuid.uuid4().hex[:8]}", self.controller.zmq_server_info)
        c.initialize_storage_manager(manager_type=backend, config=section)
        return c

    def run(self, sysname, w, client, server_pid, reps, rec):
        td = w.tensordict()
        names = list(w.fields)
        pids = [os.getpid(), server_pid]
        for _ in range(reps):
            self.k += 1
            part = f"bench{self.k}"
            t, meta, mem = measure(lambda: client.put(td, partition_id=part), pids)
            rec(sysname, w, "put", t, mem)
            fetched = client.get_meta(data_fields=names, batch_size=w.n, partition_id=part, mode="fetch",
                                      task_name=f"bench{self.k}")
            pos_of = {g: i for i, g in enumerate(meta.global_indexes)}
            order = [pos_of[g] for g in fetched.global_indexes]  # row of td at each fetched position
            if len(w.get_pos) != w.n:
                at = {r: j for j, r in enumerate(order)}
                sub = fetched.select_samples([at[p] for p in w.get_pos])
            else:
                sub = fetched
            t, got, mem = measure(lambda: client.get_data(sub), pids)
            check_tq(w, got, sub, pos_of)
            del got
            rec(sysname, w, "get", t, mem)
            client.clear_partition(part)
            del meta, fetched, sub


def check_tq(w, got, sub, pos_of):
    import numpy as np
    gis = list(sub.global_indexes)
    for k, v in w.fields.items():
        for j in (0, len(gis) - 1):
            p = pos_of[gis[j]]
            h = got[k][j]
            if hasattr(v, "dtype") or not isinstance(v[0], str):
                assert np.array_equal(np.asarray(h), v[p]), (k, j)
            else:
                assert h == v[p], (k, j)


# ------------------------------------------------------------------ limits


ZMQ_PEER = r"""
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
buf = None
while True:
    m = s.recv_multipart(copy=False)
    ident, op = m[0], m[1].bytes
    if op == b"quit":
        break
    if op == b"put":
        del m
        s.send_multipart([ident, b"ok"])
    else:
        n, r = map(int, op.split(b":")[1:])
        del m
        if buf is None or len(buf) < n * r:
            buf = bytearray(n * r)
        mv = memoryview(buf)
        s.send_multipart([ident] + [mv[i * r:(i + 1) * r] for i in range(n)], copy=r >= 65536)
"""


def run_limits(w, reps, rec):
    import numpy as np
    import zmq
    P = w.put_bytes
    # memcpy: the payload as one byte array
    src = np.ones(P, np.uint8)
    dst = np.empty_like(src)
    dst.fill(0)
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        rec("memcpy reused", w, "copy", time.perf_counter() - t, {})
        t = time.perf_counter()
        fresh = src.copy()
        rec("memcpy fresh", w, "copy", time.perf_counter() - t, {})
        del fresh
    # shared memory: write into a fresh /dev/shm file, read back into a reused buffer
    for _ in range(reps):
        path = f"/dev/shm/stowage-suite-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            t = time.perf_counter()
            os.ftruncate(fd, P)
            m = mmap.mmap(fd, P)
            a = np.frombuffer(m, np.uint8)
            np.copyto(a, src)
            np.copyto(dst, a)
            took = time.perf_counter() - t
            del a
            m.close()
        finally:
            os.close(fd)
            os.unlink(path)
        rec("shm write+read", w, "copy", took, {})
    del src, dst
    # pyzmq tcp loopback to another process, messages shaped as TransferQueue's
    peer = subprocess.Popen([sys.executable, "-c", ZMQ_PEER], stdout=subprocess.PIPE, text=True)
    port = int(peer.stdout.readline())
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{port}")
    try:
        frames = [np.ascontiguousarray(v) for v in w.fields.values() if hasattr(v, "dtype")]
        rows = w.n
        row = max(1, w.get_bytes // max(1, len(w.get_pos)) // max(1, len(w.fields)))
        for _ in range(reps):
            t = time.perf_counter()
            s.send_multipart([b"put"] + [memoryview(f).cast("B") for f in frames], copy=False)
            s.recv_multipart()
            rec("pyzmq loopback", w, "put", time.perf_counter() - t, {}, nbytes=sum(f.nbytes for f in frames))
            t = time.perf_counter()
            nf = len(w.get_pos) * len(w.fields)
            s.send(f"get:{nf}:{row}".encode())
            r = s.recv_multipart(copy=False)
            rec("pyzmq loopback", w, "get", time.perf_counter() - t, {}, nbytes=nf * row)
            del r
        del rows
    finally:
        s.send(b"quit")
        s.close(0)
        ctx.term()
        peer.wait(timeout=30)


# ------------------------------------------------------------------ report


def summarize(results, reps):
    """results: list of dicts -> {(system, workload, op): summary}."""
    med = statistics.median
    groups = {}
    for r in results:
        groups.setdefault((r["system"], r["workload"], r["op"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        t = med(r["t"] for r in rs)
        s = {"t": t, "gbs": rs[0]["nbytes"] / t / 1e9, "nbytes": rs[0]["nbytes"], "n": len(rs),
             # the first repetition: nothing freed by an earlier one to reuse
             "first_gbs": rs[0]["nbytes"] / rs[0]["t"] / 1e9}
        for role in ("client", "server"):
            if role in rs[0]["mem"]:
                s[f"{role}_first_peak"] = rs[0]["mem"][role][0] / rs[0]["nbytes"]
                s[f"{role}_peak"] = med(r["mem"][role][0] for r in rs) / rs[0]["nbytes"]
                s[f"{role}_after"] = med(r["mem"][role][1] for r in rs) / rs[0]["nbytes"]
        out[key] = s
    return out


def fmt_gbs(x):
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def pg(S, system, w):
    """put+get throughput: bytes put + bytes got over the two times."""
    p, g = S.get((system, w, "put")), S.get((system, w, "get"))
    if not p or not g:
        return None
    return (p["nbytes"] + g["nbytes"]) / (p["t"] + g["t"]) / 1e9


def report(S, wls, meta, systems):
    L = []
    L.append(BEGIN)
    L.append("## Side by side: Stowage, TransferQueue 0.1.11 and the machine's limits")
    L.append("")
    L.append(f"`{meta['command']}`")
    L.append("")
    if meta["scale"] != 1:
        L.append(f"**Quick run (--scale {meta['scale']}): payloads are {meta['scale']} of the full "
                 "workloads; not the full run.**")
        L.append("")
    L.append(f"Date {meta['date']}. Machine: {meta['machine']}. Versions: {meta['versions']}. "
             f"Median of {meta['reps']} repetitions, all in one run of `bench/suite.py`."
             + (f" {meta['load']}." if meta.get("load") else ""))
    L.append("")
    L.append("Systems: **stowage-tcp** the `stowage` client to stowd's native endpoint over tcp; "
             "**stowage-shm** the same client in same-node mode (shared memory); **tq->stowd** "
             "TransferQueue's own `TransferQueueClient` and `AsyncSimpleStorageManager` (adapter backend "
             "`Stowage`) to stowd's router, which routes `g % 4` to 4 units; **tq** TransferQueue's own "
             "client and storage manager to 4 of its `SimpleStorageUnit`s in a separate process (no Ray). "
             "stowd: release build, `[units] local = 4`. TransferQueue's controller runs in the benchmark "
             "process; its get time is `get_data` only (not `get_meta`). Peak RSS: each process's VmHWM "
             "(reset through `/proc/PID/clear_refs`) minus its RSS before the operation, over the payload; "
             "client = the benchmark process, server = stowd or the TransferQueue units process.")
    L.append("")
    L.append("Workloads:")
    for w in wls:
        L.append(f"- **{w.name}**: {w.desc}; put {w.put_bytes / 2**20:,.0f} MiB, "
                 f"get {w.get_bytes / 2**20:,.0f} MiB.")
    L.append("")
    L.append("### Headline ratios")
    L.append("")
    L.append("put+get throughput = (bytes put + bytes got) / (put time + get time).")
    L.append("")
    L.append("| workload | tq put+get GB/s | stowage-tcp / tq | stowage-shm / tq | tq->stowd / tq | "
             "stowage-shm / stowage-tcp | stowage-tcp / pyzmq limit |")
    L.append("|---|---:|---:|---:|---:|---:|---:|")
    for w in wls:
        tq = pg(S, "tq", w.name)
        tcp, shm, tqs = pg(S, "stowage-tcp", w.name), pg(S, "stowage-shm", w.name), pg(S, "tq->stowd", w.name)
        zl = pg(S, "pyzmq loopback", w.name)
        r = lambda a, b: f"{a / b:.2f}x" if a and b else "n/a"  # noqa: E731
        L.append(f"| {w.name} | {fmt_gbs(tq) if tq else 'n/a'} | {r(tcp, tq)} | {r(shm, tq)} | {r(tqs, tq)} | "
                 f"{r(shm, tcp)} | {r(tcp, zl)} |")
    L.append("")
    L.append("### Throughput and peak memory per system")
    L.append("")
    L.append("Medians, and the first repetition's put apart: stowd keeps the memory of cleared rows for "
             "the next put (`[limits] receive_pool_bytes`, `[shm] reuse_bytes`), so the first put of a run "
             "faults in fresh pages and later ones mostly do not; and the memory a repeated put reuses was "
             "already in stowd's RSS before it, so it does not show as growth (\"server peak, first put\" "
             "is the cold figure).")
    L.append("")
    L.append("| workload | system | put GB/s | put GB/s, first rep | get GB/s | put+get GB/s | "
             "client peak, put / payload | server peak, put | server peak, first put | "
             "transient in put (peak - kept), all processes | client peak, get | server peak, get |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in wls:
        for sname in systems:
            p, g = S.get((sname, w.name, "put")), S.get((sname, w.name, "get"))
            if not p or not g:
                continue
            trans = sum(max(0.0, p[f"{r}_peak"] - max(0.0, p[f"{r}_after"])) for r in ("client", "server"))
            L.append(f"| {w.name} | {sname} | {fmt_gbs(p['gbs'])} | {fmt_gbs(p['first_gbs'])} | "
                     f"{fmt_gbs(g['gbs'])} | {fmt_gbs(pg(S, sname, w.name))} | {p['client_peak']:.3f} | "
                     f"{p['server_peak']:.3f} | {p['server_first_peak']:.3f} | "
                     f"{trans:.3f} | {g['client_peak']:.3f} | {g['server_peak']:.3f} |")
    L.append("")
    L.append("### Machine limits for the same sizes")
    L.append("")
    L.append("memcpy and shared memory move the put payload as one byte array (shared memory: create a "
             "/dev/shm file, write it, read it back into a reused buffer). pyzmq: tcp loopback to another "
             "process, put = one message with one frame per regular field, get = one frame per row and "
             "field (TransferQueue's reply shape; frames under 64 KiB are copied by pyzmq).")
    L.append("")
    L.append("| workload | memcpy reused GB/s | memcpy fresh pages GB/s | shm write+read GB/s | "
             "pyzmq put GB/s | pyzmq get GB/s |")
    L.append("|---|---:|---:|---:|---:|---:|")
    for w in wls:
        g = lambda s, op: fmt_gbs(S[(s, w.name, op)]["gbs"]) if (s, w.name, op) in S else "n/a"  # noqa: E731
        L.append(f"| {w.name} | {g('memcpy reused', 'copy')} | {g('memcpy fresh', 'copy')} | "
                 f"{g('shm write+read', 'copy')} | {g('pyzmq loopback', 'put')} | {g('pyzmq loopback', 'get')} |")
    L.append("")
    L.append("![throughput](img/suite_throughput.png)")
    L.append("")
    L.append("![peak memory](img/suite_memory.png)")
    L.append("")
    L.append(NOTES_MARK)
    L.append("")
    L.append(END)
    return "\n".join(L)


NOTES_MARK = "<!-- notes -->"


def write_doc(section, path):
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    notes = ""
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        old, tail = rest.split(END, 1)
        if NOTES_MARK in old:  # keep hand-written notes between the marker and the end
            notes = old.split(NOTES_MARK, 1)[1].strip("\n")
    else:
        head, tail = text.rstrip("\n") + "\n\n", "\n"
    if notes:
        section = section.replace(NOTES_MARK, NOTES_MARK + "\n" + notes)
    with open(path, "w") as f:
        f.write(head + section + tail)


def plots(S, wls, systems, imgdir, title_extra):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    os.makedirs(imgdir, exist_ok=True)
    colors = {"stowage-tcp": "#1f77b4", "stowage-shm": "#2ca02c", "tq->stowd": "#9467bd", "tq": "#d62728",
              "pyzmq loopback": "#7f7f7f"}
    names = [w.name for w in wls]
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    shown = systems + ["pyzmq loopback"]
    bw = 0.8 / len(shown)
    for ax, op in zip(axes, ("put", "get")):
        for i, s in enumerate(shown):
            v = [S.get((s, n, op), {}).get("gbs", np.nan) for n in names]
            ax.bar(x + (i - (len(shown) - 1) / 2) * bw, v, bw, label=s, color=colors[s],
                   hatch="//" if s == "pyzmq loopback" else None, alpha=0.55 if s == "pyzmq loopback" else 1)
        for n_i, n in enumerate(names):
            for s, ls in (("memcpy reused", "-"), ("shm write+read", ":")):
                if (s, n, "copy") in S:
                    ax.hlines(S[(s, n, "copy")]["gbs"], n_i - 0.45, n_i + 0.45, colors="k", linestyles=ls,
                              lw=1, label=s if n_i == 0 else None)
        ax.set_yscale("log")
        ax.set_xticks(x, names)
        ax.set_title(f"{op} throughput (GB/s, log scale)")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s (higher is better)")
    axes[1].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"Stowage vs TransferQueue 0.1.11 vs machine limits{title_extra}")
    fig.tight_layout()
    fig.savefig(os.path.join(imgdir, "suite_throughput.png"), dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    bw = 0.8 / len(systems)
    for ax, op in zip(axes, ("put", "get")):
        for i, s in enumerate(systems):
            c = np.array([S.get((s, n, op), {}).get("client_peak", np.nan) for n in names])
            v = np.array([S.get((s, n, op), {}).get("server_peak", np.nan) for n in names])
            xs = x + (i - (len(systems) - 1) / 2) * bw
            ax.bar(xs, np.maximum(c, 0), bw, color=colors[s], label=f"{s}: client")
            ax.bar(xs, np.maximum(v, 0), bw, bottom=np.maximum(c, 0), color=colors[s], alpha=0.45,
                   hatch="..", label=f"{s}: server")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(x, names)
        ax.set_title(f"peak RSS above baseline during {op} / payload")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("x payload (lower is better); dashed = 1.0 (the data itself)")
    h, lab = axes[1].get_legend_handles_labels()
    fig.legend(h, lab, fontsize=8, ncol=4, loc="lower center")
    fig.suptitle(f"Peak memory per system, client (solid) + server (light){title_extra}")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(os.path.join(imgdir, "suite_memory.png"), dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="payload scale (0.1 for a quick run)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tq-python", help="python of a venv with transferqueue==0.1.11 (+ matplotlib)")
    ap.add_argument("--setup-tq", metavar="DIR", help="create (or reuse) that venv at DIR first")
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks.md"), help="'' to skip")
    ap.add_argument("--img", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument("--json", default=None, help="also write raw results here")
    ap.add_argument("--from-json", metavar="JSON", help="rewrite the doc section and plots from a --json file")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        meta = saved["meta"]
        systems = [s for s in a.systems.split(",") if s]
        wl_meta = [_WMeta(w) for w in make_workloads(meta["scale"], [w for w in a.workloads.split(",") if w])]
        S = summarize(saved["results"], meta["reps"])
        write_doc(report(S, wl_meta, meta, systems), a.doc)
        plots(S, wl_meta, systems, a.img, "" if meta["scale"] == 1 else f" (quick run, scale {meta['scale']})")
        return
    if not os.path.exists(a.stowd):
        raise SystemExit(f"{a.stowd} missing: cargo build --release -p stowage-host && cargo xtask plugins")
    if not a._child:
        reexec_under_tq(a)
    sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
    systems = [s for s in a.systems.split(",") if s]
    wls_names = [w for w in a.workloads.split(",") if w]
    results = []

    def rec(system, w, op, t, mem, nbytes=None):
        roles = {}
        for pid, v in mem.items():
            roles["client" if pid == os.getpid() else "server"] = v
        if nbytes is None:
            nbytes = w.put_bytes if op in ("put", "copy") else w.get_bytes
        results.append({"system": system, "workload": w.name, "op": op, "t": t, "mem": roles, "nbytes": nbytes})
        extra = ""
        if roles:
            extra = "  peak/payload " + " ".join(f"{k}={v[0] / nbytes:.3f}" for k, v in roles.items())
        print(f"  {system:15s} {w.name:11s} {op:4s} {t * 1e3:10.1f} ms {nbytes / t / 1e9:9.3f} GB/s{extra}",
              flush=True)

    started = time.time()
    load = []  # 1-minute load average every 15 s: how busy the machine was (the suite's own processes count)
    stop_load = threading.Event()

    def sample_load():
        while True:
            load.append(os.getloadavg()[0])
            if stop_load.wait(15):
                return

    threading.Thread(target=sample_load, daemon=True).start()
    wl_meta = []
    tmp = tempfile.mkdtemp(prefix="stowage-suite-")
    stowd = Stowd(a.stowd, tmp)
    tq = TQ() if any(s.startswith("tq") for s in systems) else None
    tq_stowd = tq.client("Stowage", {"endpoint": stowd.ep["router"]["endpoint"]}) if "tq->stowd" in systems \
        else None
    try:
        for name in wls_names:
            w = make_workloads(a.scale, [name])[0]
            wl_meta.append(_WMeta(w))
            print(f"{w.name}: {w.desc} (put {w.put_bytes / 2**20:.0f} MiB, get {w.get_bytes / 2**20:.0f} MiB)",
                  flush=True)
            run_limits(w, a.reps, rec)
            if "stowage-tcp" in systems:
                run_stowage(w, stowd, False, a.reps, rec)
            if "stowage-shm" in systems:
                run_stowage(w, stowd, True, a.reps, rec)
            if "tq->stowd" in systems:
                tq.run("tq->stowd", w, tq_stowd, stowd.pid, a.reps, rec)
            if "tq" in systems:
                import stowage.transferqueue as stq
                for _ in range(a.reps):  # fresh units each repetition: their freed heap is not returned
                    units = TQUnits()
                    c = tq.client("SimpleStorage", {"zmq_info": stq.storage_unit_infos(units.units)})
                    try:
                        tq.run("tq", w, c, units.pid, 1, rec)
                    finally:
                        c.close()
                        units.stop()
                        trim()
            w._td = None
            del w
            gc.collect()
    finally:
        if tq_stowd is not None:
            tq_stowd.close()
        stowd.stop()
    S = summarize(results, a.reps)
    import numpy
    import torch
    import transfer_queue
    import zmq
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    stowd_ver = subprocess.run([a.stowd, "--version"], capture_output=True, text=True).stdout.strip() or "stowd"
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    cmd_args = [x for x in sys.argv[1:] if x != "--_child"]
    stop_load.set()
    meta = {
        "command": "python3 bench/suite.py " + " ".join(cmd_args),
        "scale": a.scale, "reps": a.reps,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} vCPU ({cpu}), {mem_gib:.0f} GiB, Linux {platform.release()}, no GPU",
        "load": (f"1-minute load average during the run (sampled every 15 s; the suite's own stowd, client "
                 f"and TransferQueue processes count): median {statistics.median(load):.1f}, "
                 f"max {max(load):.1f}") if load else "",
        "versions": f"{stowd_ver} (release, commit {git}), transferqueue {transfer_queue.__version__}, "
                    f"torch {torch.__version__}, pyzmq {zmq.__version__}, numpy {numpy.__version__}, "
                    f"Python {platform.python_version()}",
        "took_s": time.time() - started,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    section = report(S, wl_meta, meta, systems)
    print()
    print(section)
    if a.doc:
        write_doc(section, a.doc)
        plots(S, wl_meta, systems, a.img, "" if a.scale == 1 else f" (quick run, scale {a.scale})")
        print(f"\nwrote {a.doc} and {a.img}/suite_*.png; took {meta['took_s']:.0f} s")


class _WMeta:
    def __init__(self, w):
        self.name, self.desc, self.put_bytes, self.get_bytes = w.name, w.desc, w.put_bytes, w.get_bytes


if __name__ == "__main__":
    main()
