#!/usr/bin/env python3
"""Side-by-side benchmark suite: Stowage vs TransferQueue 0.1.11 vs the
machine's limits, the same workloads in ONE run.

Systems
  stowage-tcp     stowage Python client -> stowd native protocol over tcp
  stowage-shm     stowage Python client -> stowd, same-node shared memory
  tq->stowd       TransferQueue's own client + AsyncSimpleStorageManager
                  (backend "Stowage", protocol: transferqueue) -> stowd's
                  router (TQ protocol)
  tq->stowd native     TransferQueue's own client + the native backend
                  (backend "Stowage", the default protocol: stowage) ->
                  stowd's native endpoint over tcp (stowage/1, Rust core)
  tq->stowd same-node  the same, same-node mode (shared memory)
  tq              TransferQueue's own client + storage manager -> 4 of its
                  SimpleStorageUnits in a separate process (no Ray: the
                  classes are built through __ray_metadata__.modified_class)
stowd runs with 4 local units (`[units] local = 4`: rows go g % 4), a fresh
process per workload. TransferQueue's controller lives in the benchmark
process (both tq rows).

Two stowd binaries in one run: --stowd-base BIN (labelled --base-label,
default "today") adds stowage-tcp@today and stowage-shm@today, the same
clients against the baseline stowd, which runs beside the new one through
each workload; their repetitions alternate, and the report gives new / today
ratios. --no-pools starts every stowd with `[limits] receive_pool_bytes = 0`
and `[shm] reuse_bytes = 0`, so the memory an operation allocates shows in
its peak RSS.

Limits, for the same payload sizes: numpy copy into a reused buffer and
into fresh pages; pyzmq tcp loopback to another process with the messages
shaped as TransferQueue sends them (put: one frame per field; get: one frame
per row); shared memory (/dev/shm) write + read; a plain tcp stream (one
loopback socket to another process, one sender, the receiver reading with
recv_into into one reused preallocated buffer).

For every operation: time, the peak RSS above its baseline of every process
involved (VmHWM reset through /proc/PID/clear_refs) as a ratio to the
payload, and each process's CPU time (user + sys from /proc/PID/stat) per
GiB moved. For stowage systems also, from stowd's `stats` around each
operation: the bytes stowd kept (so its transient memory = peak - kept) and
copied, and the frames of the get reply. Median of --reps. Writes a section
of docs/benchmarks.md and docs/img/suite_*.png.

TransferQueue needs torch (~6 GB): the suite re-runs itself under
--tq-python (a venv with transferqueue==0.1.11 and matplotlib), or makes one
with --setup-tq DIR.

usage: python3 bench/suite.py --tq-python $TQ_VENV/bin/python [--scale 1] [--reps 3]
       python3 bench/suite.py --setup-tq $TQ_VENV [--scale 0.1]
       python3 bench/suite.py --tq-python PY --stowd NEW/stowd --stowd-base OLD/stowd
           --stowd-base-plugins OLD/plugins [--no-pools] [--doc ''] [--json out.json]
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
SYSTEMS = ["stowage-tcp", "stowage-shm", "tq->stowd native", "tq->stowd same-node", "tq->stowd", "tq"]
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


def cpu_seconds(pid):
    """User + system CPU time of process `pid` (all its threads, live and
    exited), seconds, from /proc/PID/stat (clock-tick resolution, 10 ms)."""
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    rest = s[s.rindex(")") + 2:].split()  # fields from 3 (state) on
    return (int(rest[11]) + int(rest[12])) / CLK_TCK  # fields 14 utime, 15 stime


CLK_TCK = os.sysconf("SC_CLK_TCK")


def measure(fn, pids):
    """fn() -> (seconds, result, {pid: (peak over before, after over before,
    CPU seconds during fn)})."""
    trim()
    base = {p: status(p)["VmRSS"] for p in pids}
    for p in pids:
        reset_peak(p)
    cpu0 = {p: cpu_seconds(p) for p in pids}
    t = time.perf_counter()
    r = fn()
    took = time.perf_counter() - t
    mem = {}
    for p in pids:
        cpu = cpu_seconds(p) - cpu0[p]
        s = status(p)
        mem[p] = (s["VmHWM"] - base[p], s["VmRSS"] - base[p], cpu)
    return took, r, mem


# ------------------------------------------------------------------ workloads


class Workload:
    """numpy fields (for stowage) and a TensorDict (for TransferQueue) of the
    same rows; `get_pos` are the positions a get asks for (all, or a random
    subset in random order)."""

    def __init__(self, name, desc, fields, n, get_pos=None):
        self.name, self.desc, self.fields, self.n = name, desc, fields, n
        self.get_pos = get_pos if get_pos is not None else list(range(n))
        # What the stowage client is asked for: all rows in order as a range
        # (one range on the wire for a stowd that takes ranges), else the list.
        self.get_arg = range(n) if get_pos is None else get_pos
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
    """One stowd with 4 local units; `no_pools` turns off the reuse of
    cleared memory (`[limits] receive_pool_bytes = 0`, `[shm] reuse_bytes =
    0`), so what a put or get allocates shows in its peak RSS. (A stowd
    whose same-node segments are sealed, d34b8ec on, never reuses shared
    memory: it takes `reuse_bytes` with a warning, for the baselines that
    still read it.)"""

    def __init__(self, binary, tmp, plugins=None, no_pools=False, extra=""):
        os.makedirs(tmp, exist_ok=True)
        cfg = os.path.join(tmp, "stowd.toml")
        self.eps_path = os.path.join(tmp, "stowd.json")
        self.binary = binary
        text = "[units]\nlocal = 4\n"
        if plugins:
            text += f"\n[plugins]\ndir = {json.dumps(os.path.abspath(plugins))}\n"
        if no_pools:
            text += "\n[limits]\nreceive_pool_bytes = 0\n\n[shm]\nreuse_bytes = 0\n"
        text += extra
        with open(cfg, "w") as f:
            f.write(text)
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

    def plugins_loaded(self):
        """Names of the plugins this stowd loaded (from the native stats)."""
        import stowage
        with stowage.Client(self.ep["native"], timeout=60) as c:
            return sorted(k[len("plugin."):] for k in c.stats() if k.startswith("plugin."))

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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


def client_package(directory):
    """The `stowage` package of another checkout's `clients/python`
    (`directory`), loaded as `stowage_base`, beside this one's: a baseline
    stowd may need its own release's client (same-node mode changed with
    the descriptor channel)."""
    import importlib.util
    init = os.path.join(directory, "stowage", "__init__.py")
    if not os.path.exists(init):
        raise SystemExit(f"--stowd-base-client: no stowage package in {directory}")
    spec = importlib.util.spec_from_file_location("stowage_base", init,
                                                  submodule_search_locations=[os.path.dirname(init)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["stowage_base"] = mod
    spec.loader.exec_module(mod)
    return mod


def stowage_client(stowd, same_node, package=None):
    """A stowage client to `stowd`. `package`: another release's client
    (`client_package`), else this one's."""
    import stowage
    stowage = package or stowage
    if same_node:
        return stowage.Client(stowd.ep["native"], timeout=900, same_node=True, shm_dir=stowd.ep["shm_dir"])
    return stowage.Client(stowd.ep["native"], timeout=900, max_message_bytes=256 << 20)


def stowage_rep(sysname, w, c, stowd, rec):
    """One put, get (checked) and clear. Besides time and memory, records
    from stowd's `stats` before and after each op: bytes it keeps (`bytes`
    delta) and bytes it copied (`copied_bytes` delta)."""
    idx = list(range(w.n))
    names = list(w.fields)
    pids = [os.getpid(), stowd.pid]
    s0 = c.stats()
    t, _, mem = measure(lambda: c.put(idx, w.fields), pids)
    s1 = c.stats()
    rec(sysname, w, "put", t, mem, extra={"kept": s1["bytes"] - s0["bytes"], "same_node": c.same_node,
                                          "copied": s1["copied_bytes"] - s0["copied_bytes"]})
    t, got, mem = measure(lambda: c.get(w.get_arg, names), pids)
    s2 = c.stats()
    check_stowage(w, got)
    del got
    rec(sysname, w, "get", t, mem, extra={"kept": s2["bytes"] - s1["bytes"], "same_node": c.same_node,
                                          "copied": s2["copied_bytes"] - s1["copied_bytes"]})
    c.clear(idx)
    if c.same_node:
        c.release_segments()


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

    def run(self, sysname, w, client, server_pid, reps, rec, native=None):
        """`native`: stowd's native endpoint, for the native backend: then
        each op also records the seconds spent inside the backend's stowage
        client calls (`stowage_s`: the rest is TransferQueue's own layer:
        its controller calls, the field schema, building the TensorDict)
        and stowd's `copied_bytes` delta."""
        td = w.tensordict()
        names = list(w.fields)
        pids = [os.getpid(), server_pid]
        inner = [0.0]
        probe = None
        if native is not None:
            import stowage
            probe = stowage.Client(native)
            clients = client.storage_manager._clients
            run0 = clients.run

            async def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return await run0(*args, **kwargs)
                finally:
                    inner[0] += time.perf_counter() - t0

            clients.run = timed

        def extra(c0):
            if probe is None:
                return None
            return {"stowage_s": inner[0], "copied": probe.stats()["copied_bytes"] - c0}

        def copied():
            return probe.stats()["copied_bytes"] if probe is not None else 0

        for _ in range(reps):
            self.k += 1
            part = f"bench{self.k}"
            inner[0], c0 = 0.0, copied()
            t, meta, mem = measure(lambda: client.put(td, partition_id=part), pids)
            rec(sysname, w, "put", t, mem, extra=extra(c0))
            fetched = client.get_meta(data_fields=names, batch_size=w.n, partition_id=part, mode="fetch",
                                      task_name=f"bench{self.k}")
            pos_of = {g: i for i, g in enumerate(meta.global_indexes)}
            order = [pos_of[g] for g in fetched.global_indexes]  # row of td at each fetched position
            if len(w.get_pos) != w.n:
                at = {r: j for j, r in enumerate(order)}
                sub = fetched.select_samples([at[p] for p in w.get_pos])
            else:
                sub = fetched
            inner[0], c0 = 0.0, copied()
            t, got, mem = measure(lambda: client.get_data(sub), pids)
            check_tq(w, got, sub, pos_of)
            del got
            rec(sysname, w, "get", t, mem, extra=extra(c0))
            client.clear_partition(part)
            del meta, fetched, sub
        if probe is not None:
            probe.close()


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


TCP_PEER = r"""
import socket, sys
size = int(sys.argv[1])
buf = bytearray(size)  # ONE preallocated buffer (zero-filled: its pages are touched), reused
mv = memoryview(buf)
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
c, _ = srv.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
hdr = bytearray(9)

def recv_exact(m):
    got = 0
    while got < len(m):
        k = c.recv_into(m[got:])
        if not k:
            raise EOFError
        got += k

while True:
    recv_exact(memoryview(hdr))
    op, n = hdr[0:1], int.from_bytes(hdr[1:], "little")
    if op == b"q":
        break
    if op == b"p":  # put: n bytes into the reused buffer, then a 1-byte ack
        recv_exact(mv[:n])
        c.sendall(b"k")
    else:  # get: n bytes from the buffer
        c.sendall(mv[:n])
"""


def tcp_stream(w, reps, rec):
    """The plain tcp limit: one socket on 127.0.0.1 to another process, one
    sender, the receiver reading with recv_into into one reused preallocated
    buffer. put = the put payload to the peer + a 1-byte ack; get = a
    9-byte request + the get payload from the peer."""
    import socket
    P, G = w.put_bytes, w.get_bytes
    peer = subprocess.Popen([sys.executable, "-c", TCP_PEER, str(max(P, G))], stdout=subprocess.PIPE, text=True)
    port = int(peer.stdout.readline())
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src = memoryview(bytearray(b"\x01") * P)  # sender's payload, touched
    dst = memoryview(bytearray(G))  # the client's one reused receive buffer
    ack = bytearray(1)

    def recv_exact(m):
        got = 0
        while got < len(m):
            k = s.recv_into(m[got:])
            if not k:
                raise EOFError("tcp peer closed")
            got += k

    try:
        for _ in range(reps):
            # The peer's CPU: what receiving (put) and sending (get) the bytes
            # costs a process that does nothing else, the floor for stowd's.
            c, t = cpu_seconds(peer.pid), time.perf_counter()
            s.sendall(b"p" + P.to_bytes(8, "little"))
            s.sendall(src)
            recv_exact(memoryview(ack))
            rec("tcp stream", w, "put", time.perf_counter() - t, {"peer": (0, 0, cpu_seconds(peer.pid) - c)}, nbytes=P)
            c, t = cpu_seconds(peer.pid), time.perf_counter()
            s.sendall(b"g" + G.to_bytes(8, "little"))
            recv_exact(dst)
            rec("tcp stream", w, "get", time.perf_counter() - t, {"peer": (0, 0, cpu_seconds(peer.pid) - c)}, nbytes=G)
        s.sendall(b"q" + bytes(8))
    finally:
        s.close()
        peer.wait(timeout=30)


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
    tcp_stream(w, reps, rec)


# ------------------------------------------------------------------ report


def kept_in_rss(mem, extra):
    """Of the bytes stowd kept in an operation (the `bytes` delta of its
    stats), those in its RSS: none for a same-node put (the rows stay in the
    shared-memory segment the client wrote, which stowd does not touch);
    otherwise the received frames, as far as RSS grew (with the reuse pools
    on, a repeated put refills memory already counted before it)."""
    if extra.get("same_node"):
        return 0
    return min(max(0, extra["kept"]), max(0, mem[1]))


def transient(mem, extra):
    """Stowd's transient memory in one operation: peak RSS - (RSS before +
    payload kept), from mem = (peak - before, after - before, cpu)."""
    return mem[0] - kept_in_rss(mem, extra)


def overhead(mem, extra):
    """What stayed in stowd's RSS beyond the payload it kept: its index and
    per-row bookkeeping (RSS after - RSS before - payload kept)."""
    return mem[1] - kept_in_rss(mem, extra)


def trimmed_mean(xs, cut=0.2):
    """The mean of `xs` without its lowest and highest `cut` of values."""
    xs = sorted(xs)
    k = int(len(xs) * cut)
    return statistics.mean(xs[k:len(xs) - k] or xs)


def summarize(results, reps):
    """results: list of dicts -> {(system, workload, op): summary}. Memory
    figures are over the payload; `*_cpu` are CPU seconds per GiB moved;
    `server_transient` is stowd's peak RSS over its RSS before, less the
    bytes it kept (the `bytes` delta of its stats), over the payload."""
    med = statistics.median
    groups = {}
    for r in results:
        groups.setdefault((r["system"], r["workload"], r["op"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        t = med(r["t"] for r in rs)
        nb = rs[0]["nbytes"]
        s = {"t": t, "gbs": nb / t / 1e9, "nbytes": nb, "n": len(rs),
             # over the trimmed mean time: a series in two modes (a same-node
             # put finding a memory file allocated ahead or not) has its
             # median in whichever mode has one repetition more; this does
             # not flip, and a few stalls do not move it either
             "mean_gbs": nb / trimmed_mean([r["t"] for r in rs]) / 1e9,
             # the first repetition: nothing freed by an earlier one to reuse
             "first_gbs": nb / rs[0]["t"] / 1e9}
        for role in ("client", "server", "peer"):
            if role in rs[0]["mem"]:
                s[f"{role}_first_peak"] = rs[0]["mem"][role][0] / nb
                s[f"{role}_peak"] = med(r["mem"][role][0] for r in rs) / nb
                s[f"{role}_after"] = med(r["mem"][role][1] for r in rs) / nb
                if len(rs[0]["mem"][role]) > 2:
                    s[f"{role}_cpu"] = med(r["mem"][role][2] for r in rs) / (nb / 2**30)
        ex = [dict(r.get("extra") or {}) for r in rs]
        for e in ex:  # results written before same_node was recorded
            e.setdefault("same_node", key[0].startswith("stowage-shm"))
        if "kept" in ex[0] and "server" in rs[0]["mem"]:
            tr = [transient(r["mem"]["server"], e) for r, e in zip(rs, ex)]
            s["server_transient"] = med(tr) / nb
            s["server_first_transient"] = tr[0] / nb
            ov = [overhead(r["mem"]["server"], e) for r, e in zip(rs, ex)]
            s["server_overhead"] = med(ov) / nb
            s["server_first_overhead"] = ov[0] / nb
        for k in ("copied", "frames", "segments", "kept", "stowage_s"):
            if k in ex[0]:
                s[k] = med(e[k] for e in ex)
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


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "n/a"


def report(S, wls, meta, systems):
    base = meta.get("base_label")
    no_pools = meta.get("no_pools")
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
             + (f" {meta['load']}." if meta.get("load") else "")
             + (" Plugins loaded: " + "; ".join(f"{k}: {', '.join(v) or 'none (built-in only)'}"
                                                for k, v in meta["plugins"].items()) + "."
                if meta.get("plugins") else ""))
    L.append("")
    L.append("Systems: **stowage-tcp** the `stowage` client to stowd's native endpoint over tcp; "
             "**stowage-shm** the same client in same-node mode (shared memory); "
             + (f"**stowage-tcp@{base}**, **stowage-shm@{base}** the same against the baseline stowd "
                "(`--stowd-base`), which runs beside the new one through each workload, repetitions "
                "alternating between the two; " if base else "")
             + "**tq->stowd** "
             "TransferQueue's own `TransferQueueClient` and `AsyncSimpleStorageManager` (backend `Stowage`, "
             "`protocol: transferqueue`) to stowd's router, which routes `g % 4` to 4 units; **tq->stowd "
             "native** / **tq->stowd same-node** TransferQueue's own client with backend `Stowage` in its "
             "native mode (stowage/1 through the `stowage` client) over tcp / same node; **tq** TransferQueue's own "
             "client and storage manager to 4 of its `SimpleStorageUnit`s in a separate process (no Ray). "
             "stowd: release build, `[units] local = 4`, a fresh process per workload"
             + (", with `[limits] receive_pool_bytes = 0` and `[shm] reuse_bytes = 0` (no reuse pools)"
                if no_pools else "")
             + ". TransferQueue's controller runs in the benchmark "
             "process; its get time is `get_data` only (not `get_meta`). Peak RSS: each process's VmHWM "
             "(reset through `/proc/PID/clear_refs`) minus its RSS before the operation, over the payload; "
             "client = the benchmark process, server = stowd or the TransferQueue units process. CPU: "
             "user + system time of the process (all threads) from `/proc/PID/stat` before and after the "
             "operation (10 ms ticks), per GiB moved.")
    L.append("")
    L.append("Workloads:")
    for w in wls:
        L.append(f"- **{w.name}**: {w.desc}; put {w.put_bytes / 2**20:,.0f} MiB, "
                 f"get {w.get_bytes / 2**20:,.0f} MiB.")
    L.append("")
    L.append("### Headline ratios")
    L.append("")
    L.append("put+get throughput = (bytes put + bytes got) / (put time + get time). tcp stream: the plain "
             "tcp limit (one loopback socket, one sender, recv_into one reused buffer; see the limits).")
    L.append("")
    L.append("| workload | tq put+get GB/s | stowage-tcp / tq | stowage-shm / tq | tq->stowd / tq | "
             "stowage-shm / stowage-tcp | stowage-tcp / pyzmq limit | stowage-tcp put / tcp stream | "
             "stowage-tcp get / tcp stream |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    gbs = lambda s, w, op: S.get((s, w, op), {}).get("gbs")  # noqa: E731
    for w in wls:
        tq = pg(S, "tq", w.name)
        tcp, shm, tqs = pg(S, "stowage-tcp", w.name), pg(S, "stowage-shm", w.name), pg(S, "tq->stowd", w.name)
        zl = pg(S, "pyzmq loopback", w.name)
        L.append(f"| {w.name} | {fmt_gbs(tq) if tq else 'n/a'} | {ratio(tcp, tq)} | {ratio(shm, tq)} | "
                 f"{ratio(tqs, tq)} | {ratio(shm, tcp)} | {ratio(tcp, zl)} | "
                 f"{ratio(gbs('stowage-tcp', w.name, 'put'), gbs('tcp stream', w.name, 'put'))} | "
                 f"{ratio(gbs('stowage-tcp', w.name, 'get'), gbs('tcp stream', w.name, 'get'))} |")
    L.append("")
    if any(pg(S, x, w.name) for x in ("tq->stowd native", "tq->stowd same-node") for w in wls):
        L.append("### TransferQueue users: the native backend")
        L.append("")
        L.append("**tq->stowd native** / **same-node**: TransferQueue's own client with backend `Stowage` "
                 "(protocol stowage, the default) over tcp / same node. TQ layer: the part of the native "
                 "backend's put+get time spent outside its stowage client calls (TransferQueue's "
                 "`get_meta(insert)`, `extract_field_schema`, the controller notification and custom meta "
                 "on put; building the TensorDict on get), measured in the same repetitions. Target: "
                 "tq->stowd native at least 0.8x stowage-tcp, or, where the TQ layer alone exceeds 20% "
                 "of stowage-tcp's time, within 10% of stowage-tcp's time plus that layer. Client peak "
                 "during the get over the payload. Copied: stowd's `copied_bytes` on the get, the "
                 "backend's / the native client's.")
        L.append("")
        L.append("| workload | stowage-tcp put+get GB/s | native / stowage-tcp | TQ layer s (put+get) | "
                 "native s vs target s | same-node / stowage-shm | tq->stowd (TQ protocol) / stowage-tcp | "
                 "client peak, get: native / same-node / stowage-tcp | stowd copied on get MiB: native / "
                 "stowage-tcp |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---|---|")
        for w in wls:
            tcp, shm = pg(S, "stowage-tcp", w.name), pg(S, "stowage-shm", w.name)
            nat, nsn, old = pg(S, "tq->stowd native", w.name), pg(S, "tq->stowd same-node", w.name), \
                pg(S, "tq->stowd", w.name)
            ops = [S.get(("tq->stowd native", w.name, op), {}) for op in ("put", "get")]
            tops = [S.get(("stowage-tcp", w.name, op), {}) for op in ("put", "get")]
            layer = sum(o["t"] - o.get("stowage_s", o["t"]) for o in ops if o) if all(ops) else None
            t_nat = sum(o["t"] for o in ops) if all(ops) else None
            t_tcp = sum(o["t"] for o in tops) if all(tops) else None
            target = None
            if t_tcp and layer is not None:
                target = t_tcp / 0.8 if layer <= 0.2 * t_tcp else (t_tcp + layer) * 1.1
            peak = lambda sysn: (f"{S[(sysn, w.name, 'get')]['client_peak']:.2f}"  # noqa: E731
                                 if "client_peak" in S.get((sysn, w.name, "get"), {}) else "n/a")
            cop = lambda sysn: (f"{S[(sysn, w.name, 'get')]['copied'] / 2**20:,.1f}"  # noqa: E731
                                if "copied" in S.get((sysn, w.name, "get"), {}) else "n/a")
            L.append(f"| {w.name} | {fmt_gbs(tcp) if tcp else 'n/a'} | {ratio(nat, tcp)} | "
                     f"{f'{layer:.3f}' if layer is not None else 'n/a'} | "
                     f"{f'{t_nat:.3f} vs {target:.3f}' if t_nat and target else 'n/a'} | {ratio(nsn, shm)} | "
                     f"{ratio(old, tcp)} | {peak('tq->stowd native')} / {peak('tq->stowd same-node')} / "
                     f"{peak('stowage-tcp')} | {cop('tq->stowd native')} / {cop('stowage-tcp')} |")
        L.append("")
    for base in [b for b in [base, *meta.get("variants", {})] if b]:
        L.append(f"### New stowd vs {base}")
        L.append("")
        L.append(f"new / {base} of throughput (above 1: new is faster), and each one's stowd CPU per GiB "
                 "moved, stowd transient memory (peak RSS - RSS before - bytes stowd kept, over the "
                 "payload; see the CPU table) and frames in the get reply, as `new / " + base + "`. "
                 "`ratio` is of the medians; `of means` of the trimmed mean times (the middle 60% of the "
                 "repetitions), which a series in two modes (a same-node put that finds a memory file "
                 "allocated ahead of it or not) does not flip from one mode to the other as its median can.")
        L.append("")
        L.append(f"| workload | system | put GB/s new / {base} | ratio | of means | get GB/s new / {base} | "
                 "ratio | of means | stowd CPU s/GiB, put | stowd CPU s/GiB, get | stowd transient, put | "
                 "stowd transient, get | get reply frames |")
        L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for w in wls:
            for kind in ("stowage-tcp", "stowage-shm"):
                n = {op: S.get((kind, w.name, op)) for op in ("put", "get")}
                b = {op: S.get((f"{kind}@{base}", w.name, op)) for op in ("put", "get")}
                if not all(n.values()) or not all(b.values()):
                    continue
                two = lambda k, op, f="{:.3f}": (f"{f.format(n[op][k])} / {f.format(b[op][k])}"  # noqa: E731
                                                  if k in n[op] and k in b[op] else "n/a")
                means = {op: ratio(n[op]["mean_gbs"], b[op]["mean_gbs"]) if "mean_gbs" in n[op] else "n/a"
                         for op in ("put", "get")}
                L.append(f"| {w.name} | {kind} | {fmt_gbs(n['put']['gbs'])} / {fmt_gbs(b['put']['gbs'])} | "
                         f"{ratio(n['put']['gbs'], b['put']['gbs'])} | {means['put']} | "
                         f"{fmt_gbs(n['get']['gbs'])} / {fmt_gbs(b['get']['gbs'])} | "
                         f"{ratio(n['get']['gbs'], b['get']['gbs'])} | {means['get']} | {two('server_cpu', 'put')} | "
                         f"{two('server_cpu', 'get')} | {two('server_transient', 'put')} | "
                         f"{two('server_transient', 'get')} | {two('frames', 'get', '{:,.0f}')} |")
        L.append("")
    L.append("### Throughput and peak memory per system")
    L.append("")
    if no_pools:
        L.append("Medians, and the first repetition's put apart. The reuse pools are off, so every put "
                 "faults in fresh pages.")
    else:
        L.append("Medians, and the first repetition's put apart: stowd keeps the memory of cleared rows for "
                 "the next put (`[limits] receive_pool_bytes`, `[shm] reuse_bytes`), so the first put into "
                 "a fresh stowd faults in fresh pages and later ones mostly do not; and the memory a repeated "
                 "put reuses was already in stowd's RSS before it, so it does not show as growth (\"server "
                 "peak, first put\" is the cold figure).")
    L.append("")
    L.append("| workload | system | put GB/s | put GB/s, first rep | get GB/s | put+get GB/s | put / tcp stream | "
             "get / tcp stream | client peak, put / payload | server peak, put | server peak, first put | "
             "transient in put (peak - kept), all processes | client peak, get | server peak, get |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in wls:
        for sname in systems:
            p, g = S.get((sname, w.name, "put")), S.get((sname, w.name, "get"))
            if not p or not g:
                continue
            trans = sum(max(0.0, p[f"{r}_peak"] - max(0.0, p[f"{r}_after"])) for r in ("client", "server"))
            L.append(f"| {w.name} | {sname} | {fmt_gbs(p['gbs'])} | {fmt_gbs(p['first_gbs'])} | "
                     f"{fmt_gbs(g['gbs'])} | {fmt_gbs(pg(S, sname, w.name))} | "
                     f"{ratio(p['gbs'], gbs('tcp stream', w.name, 'put'))} | "
                     f"{ratio(g['gbs'], gbs('tcp stream', w.name, 'get'))} | {p['client_peak']:.3f} | "
                     f"{p['server_peak']:.3f} | {p['server_first_peak']:.3f} | "
                     f"{trans:.3f} | {g['client_peak']:.3f} | {g['server_peak']:.3f} |")
    L.append("")
    L.append("### CPU, transient memory and reply shape per system")
    L.append("")
    L.append("CPU: seconds of user + system time per GiB moved, server (stowd or the TransferQueue units) "
             "and client (the benchmark process). Stowd transient: peak RSS minus (RSS before + the payload "
             "stowd kept in its RSS), over the payload. Payload kept: the `bytes` delta of stowd's `stats`, "
             "as far as RSS grew by it (with the reuse pools on, a repeated put refills memory already "
             "counted before it), and none for a same-node put (its rows stay in the segment the client "
             "wrote, which is not in stowd's RSS). By this definition, index memory that a put keeps counts "
             "as transient too; \"stowd RSS kept beyond payload\" (RSS after - RSS before - payload kept in "
             "RSS) shows it apart"
             + (". The reuse pools are off: this is what the operation allocated" if no_pools else
                ". The reuse pools are on: run with --no-pools for the transient of the issue")
             + ". Get reply: data frames (tcp) or shared-memory frames and distinct segments (same node); "
             "copied: the `copied_bytes` delta of stowd's `stats` across the operation (stowd ef17a9b counts "
             "there only the copies of put-side gathers and of packing for remote units, not the copy a "
             "native get makes to join rows into one reply frame).")
    L.append("")
    L.append("| workload | system | server CPU s/GiB, put | server CPU s/GiB, get | client CPU s/GiB, put | "
             "client CPU s/GiB, get | stowd transient, put | stowd transient, first put | "
             "stowd transient, get | stowd RSS kept beyond payload, put | same, first put | "
             "get reply frames | get reply segments | copied MiB, put | copied MiB, get |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in wls:
        for sname in systems:
            p, g = S.get((sname, w.name, "put")), S.get((sname, w.name, "get"))
            if not p or not g:
                continue
            f = lambda d, k, fm="{:.3f}": fm.format(d[k]) if k in d else "n/a"  # noqa: E731
            mib = lambda d: f"{d['copied'] / 2**20:,.1f}" if "copied" in d else "n/a"  # noqa: E731
            L.append(f"| {w.name} | {sname} | {f(p, 'server_cpu')} | {f(g, 'server_cpu')} | "
                     f"{f(p, 'client_cpu')} | {f(g, 'client_cpu')} | {f(p, 'server_transient')} | "
                     f"{f(p, 'server_first_transient')} | {f(g, 'server_transient')} | "
                     f"{f(p, 'server_overhead')} | {f(p, 'server_first_overhead')} | "
                     f"{f(g, 'frames', '{:,.0f}')} | {f(g, 'segments', '{:,.0f}')} | {mib(p)} | {mib(g)} |")
    L.append("")
    L.append("### Machine limits for the same sizes")
    L.append("")
    L.append("memcpy and shared memory move the put payload as one byte array (shared memory: create a "
             "/dev/shm file, write it, read it back into a reused buffer). pyzmq: tcp loopback to another "
             "process, put = one message with one frame per regular field, get = one frame per row and "
             "field (TransferQueue's reply shape; frames under 64 KiB are copied by pyzmq). tcp stream: one "
             "tcp socket on 127.0.0.1 to another process, one sender (`sendall` of the payload), the receiver "
             "reading with `recv_into` into one reused preallocated buffer; put = the put payload to the peer "
             "and a 1-byte ack, get = a 9-byte request and the get payload back. The tcp stream's CPU is the "
             "peer's (user + system, per GiB): receiving the put and sending the get with nothing else to do, "
             "the floor for stowd's CPU on the same bytes.")
    L.append("")
    L.append("| workload | memcpy reused GB/s | memcpy fresh pages GB/s | shm write+read GB/s | "
             "pyzmq put GB/s | pyzmq get GB/s | tcp stream put GB/s | tcp stream get GB/s | "
             "tcp stream CPU s/GiB, put | tcp stream CPU s/GiB, get |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in wls:
        g = lambda s, op: fmt_gbs(S[(s, w.name, op)]["gbs"]) if (s, w.name, op) in S else "n/a"  # noqa: E731
        cpu = lambda op: (f"{S[('tcp stream', w.name, op)]['peer_cpu']:.3f}"  # noqa: E731
                          if "peer_cpu" in S.get(("tcp stream", w.name, op), {}) else "n/a")
        L.append(f"| {w.name} | {g('memcpy reused', 'copy')} | {g('memcpy fresh', 'copy')} | "
                 f"{g('shm write+read', 'copy')} | {g('pyzmq loopback', 'put')} | {g('pyzmq loopback', 'get')} | "
                 f"{g('tcp stream', 'put')} | {g('tcp stream', 'get')} | {cpu('put')} | {cpu('get')} |")
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
              "tq->stowd native": "#17becf", "tq->stowd same-node": "#ff7f0e",
              "pyzmq loopback": "#7f7f7f", "tcp stream": "#bcbd22"}
    light = {"stowage-tcp": "#aec7e8", "stowage-shm": "#98df8a"}
    for sname in systems:  # the baseline stowd's systems: the lighter shade of the same hue
        if "@" in sname:
            colors[sname] = light.get(sname.split("@")[0], "#c7c7c7")
    limit = ("pyzmq loopback", "tcp stream")
    names = [w.name for w in wls]
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    shown = systems + list(limit)
    bw = 0.8 / len(shown)
    for ax, op in zip(axes, ("put", "get")):
        for i, s in enumerate(shown):
            v = [S.get((s, n, op), {}).get("gbs", np.nan) for n in names]
            ax.bar(x + (i - (len(shown) - 1) / 2) * bw, v, bw, label=s, color=colors[s],
                   hatch="//" if s in limit else None, alpha=0.55 if s in limit else 1)
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
    ap.add_argument("--stowd", default=os.path.join(os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target"),
                                                    "release", "stowd"),
                    help="the stowd binary (default: $CARGO_TARGET_DIR or target/, then release/stowd)")
    ap.add_argument("--stowd-plugins", metavar="DIR",
                    help="plugin directory of --stowd (default: stowd's own: <binary dir>/../plugins)")
    ap.add_argument("--stowd-base", metavar="STOWD",
                    help="a second stowd binary (the baseline): stowage-tcp and stowage-shm run against both, "
                         "repetitions alternating, and the report gives new / baseline ratios")
    ap.add_argument("--stowd-base-plugins", metavar="DIR", help="plugin directory of --stowd-base")
    ap.add_argument("--stowd-base-client", metavar="DIR",
                    help="clients/python of --stowd-base's own checkout: its stowage client talks to it "
                         "(default: this checkout's client talks to both)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=TOML",
                    help="the --stowd binary once more, with TOML added to its config, as system@LABEL "
                         "(repeatable), repetitions alternating with the others; e.g. "
                         "--variant 'NULL=[security]\\nauth = \"none\"' --variant "
                         "'CURVE=[security]\\nauth = \"curve\"': ZMTP NULL, PLAIN (the default) and CURVE "
                         "in one run")
    ap.add_argument("--base-label", default="today", help="name of --stowd-base in the tables (default: today)")
    ap.add_argument("--base-config", default="", metavar="TOML",
                    help="tables added to --stowd-base's config, e.g. '[security]\\nauth = \"none\"' with "
                         "--stowd-base the same binary as --stowd: ZMTP NULL against the default PLAIN, one run")
    ap.add_argument("--no-pools", action="store_true",
                    help="start stowd with [limits] receive_pool_bytes = 0 and [shm] reuse_bytes = 0, so that "
                         "transient memory shows in the peak RSS")
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
        systems = meta.get("systems") or [s for s in a.systems.split(",") if s]
        if meta.get("workloads"):
            wl_meta = [_WMeta(w) for w in meta["workloads"]]
        else:
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

    def rec(system, w, op, t, mem, nbytes=None, extra=None):
        roles = {}
        for pid, v in mem.items():  # (a role name as the key is kept as it is)
            roles[pid if isinstance(pid, str) else "client" if pid == os.getpid() else "server"] = v
        if nbytes is None:
            nbytes = w.put_bytes if op in ("put", "copy") else w.get_bytes
        r = {"system": system, "workload": w.name, "op": op, "t": t, "mem": roles, "nbytes": nbytes}
        if extra:
            r["extra"] = extra
        results.append(r)
        line = ""
        if roles:
            line = "  peak/payload " + " ".join(f"{k}={v[0] / nbytes:.3f}" for k, v in roles.items())
            line += "  cpu s/GiB " + " ".join(f"{k}={v[2] / (nbytes / 2**30):.3f}" for k, v in roles.items())
        if extra:
            if "kept" in extra and "server" in roles:
                line += f"  stowd transient/payload={transient(roles['server'], extra) / nbytes:.3f}"
            line += "".join(f" {k}={extra[k]}" for k in ("frames", "segments", "copied") if k in extra)
        print(f"  {system:17s} {w.name:11s} {op:4s} {t * 1e3:10.1f} ms {nbytes / t / 1e9:9.3f} GB/s{line}",
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
    label = a.base_label
    kinds = [k for k in ("stowage-tcp", "stowage-shm") if k in systems]
    variants = {}
    for v in a.variant:
        vlabel, sep, toml = v.partition("=")
        if not sep or not vlabel or vlabel in (label, ""):
            raise SystemExit(f"--variant {v!r}: want LABEL=TOML, LABEL new and not --base-label")
        variants[vlabel] = toml.replace("\\n", "\n")
    if a.stowd_base:
        if not os.path.exists(a.stowd_base):
            raise SystemExit(f"--stowd-base {a.stowd_base} missing")
    others = ([label] if a.stowd_base else []) + list(variants)
    systems = [x for s in systems for x in ([s] + [f"{s}@{o}" for o in others] if s in kinds else [s])]
    binaries = {"": (a.stowd, a.stowd_plugins)}
    base_client = client_package(a.stowd_base_client) if a.stowd_base_client else None
    if a.stowd_base:
        binaries[label] = (a.stowd_base, a.stowd_base_plugins)
    for vlabel in variants:
        binaries[vlabel] = (a.stowd, a.stowd_plugins)
    plugins_seen = {}
    tq = TQ() if any(s.startswith("tq") for s in systems) else None
    for name in wls_names:
        w = make_workloads(a.scale, [name])[0]
        wl_meta.append(_WMeta(w))
        print(f"{w.name}: {w.desc} (put {w.put_bytes / 2**20:.0f} MiB, get {w.get_bytes / 2**20:.0f} MiB)",
              flush=True)
        run_limits(w, a.reps, rec)
        # a fresh stowd per binary and workload; both live through the workload, and their
        # repetitions alternate (today, new, new, today, ...) so load changes hit both alike
        stowds = {}
        try:
            for lab, (binary, plugins) in binaries.items():
                if lab in variants:
                    extra = "\n" + variants[lab] + "\n"
                else:
                    extra = "\n" + a.base_config.replace("\\n", "\n") + "\n" if lab and a.base_config else ""
                stowds[lab] = Stowd(binary, os.path.join(tmp, f"{w.name}-{lab or 'new'}"), plugins, a.no_pools,
                                    extra)
                if lab not in plugins_seen:
                    plugins_seen[lab] = stowds[lab].plugins_loaded()
                    print(f"  stowd {lab or 'new'} ({binary}): plugins {', '.join(plugins_seen[lab]) or 'NONE'}"
                          + (" (no pools)" if a.no_pools else ""), flush=True)
                    if not plugins_seen[lab]:
                        print("  WARNING: no plugins loaded: only the built-in policy answers "
                              "(pass --stowd-plugins / --stowd-base-plugins)", flush=True)
            for kind in kinds:
                clients = {lab: stowage_client(sd, kind == "stowage-shm",
                                               base_client if lab and lab not in variants else None)
                           for lab, sd in stowds.items()}
                try:
                    for rep in range(a.reps):
                        order = list(stowds)[::1 if rep % 2 == 0 else -1]
                        for lab in order:
                            stowage_rep(f"{kind}@{lab}" if lab else kind, w, clients[lab], stowds[lab], rec)
                finally:
                    for c in clients.values():
                        c.close()
            for sysname, same in (("tq->stowd native", False), ("tq->stowd same-node", True)):
                if sysname in systems:
                    ep = stowds[""].ep["native"]
                    tq_native = tq.client("Stowage", {"endpoint": ep, "same_node": same})
                    try:
                        tq.run(sysname, w, tq_native, stowds[""].pid, a.reps, rec, native=ep)
                    finally:
                        tq_native.close()
            if "tq->stowd" in systems:
                tq_stowd = tq.client("Stowage", {"protocol": "transferqueue",
                                                 "endpoint": stowds[""].ep["router"]["endpoint"]})
                try:
                    tq.run("tq->stowd", w, tq_stowd, stowds[""].pid, a.reps, rec)
                finally:
                    tq_stowd.close()
        finally:
            for sd in stowds.values():
                sd.stop()
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
    base_ver = (subprocess.run([a.stowd_base, "--version"], capture_output=True, text=True).stdout.strip()
                or "stowd") if a.stowd_base else ""
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
        "versions": f"{stowd_ver} (release, {a.stowd}; suite at commit {git})"
                    + (f", {label}: {base_ver} (release, {a.stowd_base})" if a.stowd_base else "")
                    + f", transferqueue {transfer_queue.__version__}, "
                    f"torch {torch.__version__}, pyzmq {zmq.__version__}, numpy {numpy.__version__}, "
                    f"Python {platform.python_version()}",
        "took_s": time.time() - started,
        "systems": systems, "base_label": label if a.stowd_base else None, "no_pools": a.no_pools,
        "variants": variants,
        "plugins": {lab or "new": p for lab, p in plugins_seen.items()},
        "workloads": [vars(w) for w in wl_meta],
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
        g = w.get if isinstance(w, dict) else lambda k: getattr(w, k)
        self.name, self.desc, self.put_bytes, self.get_bytes = g("name"), g("desc"), g("put_bytes"), g("get_bytes")


if __name__ == "__main__":
    main()
