#!/usr/bin/env python3
"""Multi-node at wire speed (issue 19): put and get one float32 batch
through a stowd "A" that routes to the units of another stowd "B", beside
the client talking to B directly and beside the physical limits, all
measured in the same run on 127.0.0.1 (or, with --netns, with B in its own
network namespace behind a veth pair).

Rows of the tables:

  tcp, one hop        plain tcp: a Python sender (sendall of the batch's
                      numpy buffer, 1 MiB at a time) to a Python receiver
                      process (recv_into one reused 4 MiB buffer, to EOF).
                      Each call moves 1-4 MiB, so Python's own cost per
                      call is noise: on the 2-CPU VM this was written on,
                      a C send loop (bench/tcp_send_cpu.c, "send") gave
                      1.77 GB/s and this pair 1.8-2.6 in the same minutes.
  tcp, two hops       the same sender -> bench/tcp_relay.c (accepts one
                      connection, connects onward, forwards with a
                      read/write loop through a reused 1 MiB buffer) -> the
                      same receiver: the limit for a stowd that forwards
                      bytes to another. Measured one way (sender to
                      receiver); the ratios of put and get are both to it.
                      Its CPU columns (seconds per GB of each process)
                      say whether it is bound by the machine's CPUs: three
                      processes and the kernel's tcp work share them.
  direct              the Python client (stowage.Client over tcp) to B's
                      native endpoint; B holds the units itself
                      ([units] local = --units, [router] units = []).
  via A, TransferQueue  the client to A's native endpoint; A holds no units
                      ([units] local = 0) and routes g % N to B's unit
                      endpoints over TransferQueue's protocol
                      ([router] units = ["tcp://<B unit i>", ...]).
  via A, stowage/1    the same, A reaching B's units through B's native
                      stowage/1 endpoint
                      ([router] units = ["stowage://<B native>/<i>", ...]).
                      A stowd that refuses the config at start shows the
                      row as "not supported by this stowd" (and its error).
  ..., cache off      the same with [cache] enabled = false in A
                      (--no-cache runs it instead of the cached one;
                      --modes ...,peer-nocache runs both).

Columns: put, get, and "get again" (a second get of the same rows right
after the first: where A may serve them from its cache), in GB/s (1e9
bytes/s of payload), the median over --reps and, in parentheses, the first
rep; then each as a ratio to the two-hop relay: the median over reps of
(the rep's GB/s / that rep's relay GB/s). Each rep: the relays, then for
each path put, get, get again, then clear. A second table gives the CPU
seconds per GB of the client, A and B (utime + stime from /proc), median
over reps; with --netns, the bytes that crossed the A-B veth per byte of
payload.

--netns: B and the receiver run in a new network namespace, 10.78.K.2,
behind a veth pair whose other end, 10.78.K.1, is in this process's
namespace, where the client, A, the sender and the relay run; the
namespace and the veth are removed at the end, whatever happens. Needs
root and ip (iproute2).

Data: row i is filled with float(i). Every get is checked outside the
timed region: shape and dtype, the first and last element of every row,
and every 997th row in full; a wrong result makes the script exit 1 (after
printing the table), as does any error of a path that started.

Before the reps this process touches and frees twice the payload: on a
VM whose memory the host backs lazily, the first touch of memory runs at a
fraction of its later speed (the kernel's clear_page at ~0.3 GB/s was
measured here), which the first get would time instead of stowd.

Defaults: 512 MiB as float32 [131072, 1024] (4 KiB rows) over 2 units;
--seed: 2 GiB as float32 [524288, 1024] over 4 units (the docs' router
case). Needs a release build (cargo build --release -p stowage-host;
cargo xtask plugins) and cc.

usage: python3 bench/peer_bench.py [--mib 512] [--row-kib 4] [--units 2]
           [--seed] [--reps 3] [--modes direct,tq,peer] [--no-cache]
           [--get-into] [--netns] [--set NAME:SECTION.KEY=TOML ...]
           [--stowd PATH] [--plugins DIR]
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
import stowage  # noqa: E402

MODES = {  # name: label
    "direct": "direct: client -> B",
    "tq": "via A, TransferQueue: client -> A -> B's units",
    "peer": "via A, stowage/1: client -> A -> B native",
    "peer-nocache": "via A, stowage/1, cache off",
}


# ---------------------------------------------------------------- configs
# Every stowd's config is made here, as {section: {key: value}}; --set
# NAME:SECTION.KEY=VALUE (NAME: B; A for every A; tq, peer, peer-nocache
# for that mode's A) adds or replaces keys after.

def config_b(a, host):
    return {"server": {"host": host},
            "units": {"local": a.units},
            "router": {"units": []},
            "plugins": {"dir": a.plugins}}


def config_a(a, mode, b_eps):
    """A's config for `mode` ("tq", "peer", "peer-nocache"), from B's
    endpoints file."""
    cfg = {"server": {"host": "127.0.0.1"},
           "units": {"local": 0},
           "plugins": {"dir": a.plugins}}
    if mode == "tq":
        cfg["router"] = {"units": [u["endpoint"] for u in b_eps["units"]]}
    else:
        hostport = b_eps["native"].removeprefix("tcp://")
        cfg["router"] = {"units": [f"stowage://{hostport}/{i}" for i in range(len(b_eps["units"]))]}
    if mode == "peer-nocache":
        cfg["cache"] = {"enabled": False}
    return cfg


# ZMTP security of every stowd (--security): B's native endpoint, each A's,
# and A's connections to B's (the TransferQueue endpoints are NULL always).
SECURITY = {"null": {"auth": "none"}, "plain": {"auth": "token"}, "curve": {"auth": "curve"}}
SECURITY_NAMES = {"null": "NULL", "plain": "PLAIN", "curve": "CURVE"}


def with_security(cfg, sec):
    cfg = dict(cfg)
    cfg["security"] = {**cfg.get("security", {}), **SECURITY[sec]}
    return cfg


def check_sets(sets):
    for spec in sets:
        who, _, rest = spec.partition(":")
        key, eq, value = rest.partition("=")
        names = ("A", "B", *(m for m in MODES if m != "direct"))
        if who not in names or "." not in key or not eq:
            raise SystemExit(f"--set {spec!r}: want NAME:SECTION.KEY=VALUE, NAME one of {', '.join(names)}")
        try:
            tomllib.loads(f"v = {value}")
        except tomllib.TOMLDecodeError as e:
            raise SystemExit(f"--set {spec!r}: the value is not TOML ({e}); strings need quotes")


def apply_sets(cfg, name, sets):
    for spec in sets:
        who, _, rest = spec.partition(":")
        key, _, value = rest.partition("=")
        if who == name or (who == "A" and name != "B"):
            section, _, k = key.partition(".")
            cfg.setdefault(section, {})[k] = tomllib.loads(f"v = {value}")["v"]
    return cfg


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string for what we write
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r}")


def toml_text(cfg):
    return "".join(f"[{s}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items()) + "\n"
                   for s, keys in cfg.items())


# ---------------------------------------------------------------- processes

class StartError(Exception):
    pass


def cpu_seconds(pid):
    """User + system time of process `pid` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        s = f.read().rsplit(")", 1)[1].split()
    return (int(s[11]) + int(s[12])) / os.sysconf("SC_CLK_TCK")


class Stowd:
    def __init__(self, binary, cfg, tmp, name, netns=None):
        self.name = name
        self.cfg = os.path.join(tmp, f"{name}.toml")
        self.eps_path = os.path.join(tmp, f"{name}.json")
        self.log = os.path.join(tmp, f"{name}.log")
        with open(self.cfg, "w") as f:
            f.write(toml_text(cfg))
        wrap = ["ip", "netns", "exec", netns] if netns else []
        self.proc = subprocess.Popen(
            [*wrap, binary, "serve", "--config", self.cfg, "--endpoints-file", self.eps_path],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "w"), env={**os.environ, "RUST_LOG": "warn"})
        deadline = time.monotonic() + 120
        while not os.path.exists(self.eps_path):
            if self.proc.poll() is not None:
                raise StartError(self.error_line())
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"stowd {name} did not start in 120 s (see {self.log})")
            time.sleep(0.05)
        for _ in range(100):  # read again if caught half written
            try:
                with open(self.eps_path) as f:
                    self.eps = json.load(f)
                break
            except json.JSONDecodeError:
                time.sleep(0.05)
        else:
            self.stop()
            raise SystemExit(f"stowd {name}: {self.eps_path} is not JSON")
        self.pid = self.eps["pid"]

    def error_line(self):
        with open(self.log) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        errs = [ln for ln in lines if "error" in ln.lower()]
        return (errs or lines or [f"exit status {self.proc.returncode}"])[-1]

    def cpu(self):
        return cpu_seconds(self.pid)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


RECEIVER = r"""
import socket, sys, time
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
buf = memoryview(bytearray(4 << 20))
buf[:] = b"\0" * len(buf)
while True:
    c, _ = srv.accept()
    n, t = 0, time.process_time()
    while k := c.recv_into(buf):
        n += k
    c.close()
    print(n, time.process_time() - t, flush=True)
"""


class Receiver:
    """A Python process (in `netns` if given) that takes connection after
    connection and reads each to EOF into one reused buffer; per connection
    it prints the bytes and its CPU seconds."""

    def __init__(self, host, netns=None):
        wrap = ["ip", "netns", "exec", netns] if netns else []
        self.host = host
        self.proc = subprocess.Popen([*wrap, sys.executable, "-c", RECEIVER, host],
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def done(self):
        n, cpu = self.proc.stdout.readline().split()
        return int(n), float(cpu)

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def build_relay(tmp):
    out = os.path.join(tmp, "tcp_relay")
    subprocess.run(["cc", "-O2", "-o", out, os.path.join(ROOT, "bench", "tcp_relay.c")], check=True)
    return out


SEND_CHUNK = 1 << 20  # on this kind of machine a little faster than one sendall of it all


def stream(payload, receiver, relay=None):
    """Sends `payload` to `receiver`, through a fresh `relay` process if
    given: (seconds until the receiver has every byte, {who: CPU s})."""
    rp = None
    if relay:
        rp = subprocess.Popen([relay, "127.0.0.1", "0", receiver.host, str(receiver.port)],
                              stdout=subprocess.PIPE, text=True)
        to = ("127.0.0.1", int(rp.stdout.readline()))
    else:
        to = (receiver.host, receiver.port)
    s = socket.create_connection(to)
    c0, t0 = time.process_time(), time.perf_counter()
    for o in range(0, len(payload), SEND_CHUNK):
        s.sendall(payload[o:o + SEND_CHUNK])
    s.shutdown(socket.SHUT_WR)
    n, rcpu = receiver.done()
    t = time.perf_counter() - t0
    cpu = {"sender": time.process_time() - c0, "receiver": rcpu}
    s.close()
    if n != len(payload):
        raise SystemExit(f"tcp stream: receiver got {n} bytes of {len(payload)}")
    if rp:
        forwarded = int(rp.stdout.readline())
        _, status, ru = os.wait4(rp.pid, 0)
        rp.returncode = os.waitstatus_to_exitcode(status)
        if rp.returncode != 0 or forwarded != len(payload):
            raise SystemExit(f"tcp_relay: exit {rp.returncode}, forwarded {forwarded} of {len(payload)}")
        cpu["relay"] = ru.ru_utime + ru.ru_stime
    return t, cpu


# ---------------------------------------------------------------- netns

class Netns:
    """B's namespace and the veth from the host's (A's and the client's):
    10.78.K.1/24 on the host end, 10.78.K.2/24 in B's. Removed by close()."""

    def __init__(self):
        if os.geteuid() != 0:
            raise SystemExit("--netns needs root")
        tag = f"{os.getpid() % 100000:05d}"
        self.ns, self.host_link, peer = f"stowage-pb-{tag}", f"spb{tag}h", f"spb{tag}b"
        routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
        k = next((k for k in range(1, 255) if f"10.78.{k}." not in routes), None)
        if k is None:
            raise SystemExit("no free 10.78.x.0/24")
        self.a_addr, self.b_addr = f"10.78.{k}.1", f"10.78.{k}.2"
        self.made = False
        try:
            self.ip("netns", "add", self.ns)
            self.made = True
            self.ip("-n", self.ns, "link", "set", "lo", "up")
            self.ip("link", "add", self.host_link, "type", "veth", "peer", "name", peer, "netns", self.ns)
            self.ip("addr", "add", f"{self.a_addr}/24", "dev", self.host_link)
            self.ip("link", "set", self.host_link, "up")
            self.ip("-n", self.ns, "addr", "add", f"{self.b_addr}/24", "dev", peer)
            self.ip("-n", self.ns, "link", "set", peer, "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def ip(*args):
        r = subprocess.run(["ip", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def link_bytes(self):
        base = f"/sys/class/net/{self.host_link}/statistics/"
        return sum(int(open(base + k).read()) for k in ("rx_bytes", "tx_bytes"))

    def close(self):
        if self.made:
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
            self.made = False
        if os.path.exists(f"/sys/class/net/{self.host_link}"):
            subprocess.run(["ip", "link", "del", self.host_link], capture_output=True)


# ---------------------------------------------------------------- the batch

class WrongData(Exception):
    pass


def batch(rows, cols):
    data = np.empty((rows, cols), np.float32)
    data[:] = np.arange(rows, dtype=np.float32)[:, None]
    return data


def verify(got, rows, cols):
    if not isinstance(got, np.ndarray) or got.dtype != np.float32 or got.shape != (rows, cols):
        raise WrongData(f"got {type(got).__name__} {getattr(got, 'dtype', '?')} {getattr(got, 'shape', '?')}")
    want = np.arange(rows, dtype=np.float32)
    for col in (0, cols - 1):
        bad = np.flatnonzero(got[:, col] != want)
        if bad.size:
            i = bad[0]
            raise WrongData(f"row {i} element {col} is {got[i, col]} ({bad.size} rows wrong)")
    for i in range(0, rows, 997):
        if not (got[i] == want[i]).all():
            raise WrongData(f"row {i} is not all {want[i]}")


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=512, help="payload, MiB (default 512)")
    ap.add_argument("--row-kib", type=float, default=4, help="row size, KiB of float32 (default 4)")
    ap.add_argument("--units", type=int, default=2, help="B's units (default 2)")
    ap.add_argument("--seed", action="store_true", help="the 2 GiB case: --mib 2048 --row-kib 4 --units 4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="direct,tq,peer", help=f"of {','.join(MODES)}")
    ap.add_argument("--no-cache", action="store_true", help="stowage/1 peers with A's cache off: peer -> peer-nocache")
    ap.add_argument("--get-into", action="store_true", help="get_into one preallocated array instead of get")
    ap.add_argument("--netns", action="store_true", help="B in its own network namespace (needs root and ip)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME:SECTION.KEY=TOML",
                    help="a config key for stowd NAME (B; A: every A; tq, peer, peer-nocache: that mode's A), "
                         "e.g. A:limits.max_rows=1000 or peer:cache.enabled=false")
    ap.add_argument("--readers", type=int, default=1,
                    help="also get the batch with this many clients at once, twice, after each put (a table of "
                         "its own: seconds and, with --netns, bytes on the A-B veth per payload byte)")
    ap.add_argument("--timeout", type=float, default=600, help="client timeout, s")
    ap.add_argument("--security", default="plain",
                    help="ZMTP security of every stowd, comma-separated of null, plain (the default), curve: "
                         "each path runs once per mechanism, repetitions interleaved, in one run")
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--plugins", default=os.path.join(ROOT, "target", "plugins"))
    a = ap.parse_args()
    if a.seed:
        a.mib, a.row_kib, a.units = 2048, 4, 4
    if not os.path.exists(a.stowd):
        raise SystemExit(f"{a.stowd} missing: cargo build --release -p stowage-host && cargo xtask plugins")
    a.plugins = os.path.abspath(a.plugins)
    check_sets(a.set)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if a.no_cache:
        modes = ["peer-nocache" if m == "peer" else m for m in modes]
    modes = list(dict.fromkeys(modes))
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}: {', '.join(MODES)}")
    securities = list(dict.fromkeys(x.strip() for x in a.security.split(",") if x.strip()))
    for sec in securities:
        if sec not in SECURITY:
            raise SystemExit(f"unknown --security {sec!r}: {', '.join(SECURITY)}")
    # One run per (path, mechanism); named by the path alone with one mechanism.
    run_of = {(m if len(securities) == 1 else f"{m}@{sec}"): (m, sec) for sec in securities for m in modes}
    names = list(run_of)

    def row_label(name):
        m, sec = run_of[name]
        return MODES[m] + ("" if len(securities) == 1 else f", {SECURITY_NAMES[sec]}")
    cols = int(a.row_kib * 1024) // 4
    rows = int(a.mib * (1 << 20)) // (cols * 4)
    payload_bytes = rows * cols * 4
    data = batch(rows, cols)
    payload = memoryview(data).cast("B")
    idx = range(rows)
    # Touch and free twice the payload first: on this VM the first touch of
    # memory is slow (the kernel's clear_page at ~0.3 GB/s), and the first
    # rep would time that instead of stowd's own first-time costs.
    warm = np.ones(2 * payload_bytes, np.uint8)
    del warm
    out = np.empty_like(data) if a.get_into else None
    if out is not None:
        out.fill(-1)

    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "-C", ROOT, "diff", "--quiet", "HEAD", "--", "host", "wire"]).returncode != 0
    built = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(a.stowd)))
    load = " ".join(open("/proc/loadavg").read().split()[:3])

    # results[row][op] = [GB/s per rep]; cpu[row][op][who] = [s/GB per rep]
    results, ratios, cpu, link = {}, {}, {}, {}
    readers = {}  # mode -> {"first"|"again": [(seconds, veth bytes / payload)]}
    status = {}  # mode -> None (ran) | "not supported ..." | "error ..."
    failed = False
    net = None
    stowds = {}
    tmp = tempfile.mkdtemp(prefix="stowage-peer-bench-")
    receiver = None
    try:
        relay = build_relay(tmp)
        if a.netns:
            net = Netns()
        b_host = net.b_addr if net else "127.0.0.1"
        receiver = Receiver(b_host, net.ns if net else None)
        bs = {}
        for sec in securities:
            bs[sec] = Stowd(a.stowd, apply_sets(with_security(config_b(a, b_host), sec), "B", a.set), tmp,
                            f"B-{sec}", net.ns if net else None)
            stowds[f"B-{sec}"] = bs[sec]
        for name, (m, sec) in run_of.items():
            if m == "direct":
                status[name] = None
                continue
            try:
                cfg = with_security(config_a(a, m, bs[sec].eps), sec)
                stowds[name] = Stowd(a.stowd, apply_sets(cfg, m, a.set), tmp, f"A-{m}-{sec}")
                status[name] = None
            except StartError as e:
                status[name] = f"not supported by this stowd: {str(e).replace(tmp + '/', '')}"
        cl_ep = {n: (bs[run_of[n][1]] if run_of[n][0] == "direct" else stowds[n]).eps["native"]
                 for n in names if status[n] is None}
        clients = {n: stowage.Client(cl_ep[n], timeout=a.timeout) for n in cl_ep}

        def record(row, op, seconds, cpus, rep, link_delta=None):
            gbs = payload_bytes / seconds / 1e9
            results.setdefault(row, {}).setdefault(op, []).append(gbs)
            for who, s in cpus.items():
                cpu.setdefault(row, {}).setdefault(op, {}).setdefault(who, []).append(s / (payload_bytes / 1e9))
            if link_delta is not None:
                link.setdefault(row, {}).setdefault(op, []).append(link_delta / payload_bytes)
            return gbs

        for rep in range(a.reps):
            t, c = stream(payload, receiver)
            record("one", "stream", t, c, rep)
            t, c = stream(payload, receiver, relay)
            relay_gbs = record("two", "stream", t, c, rep)
            for name in names:
                if status[name] is not None:
                    continue
                m, sec = run_of[name]
                cl, via, b = clients[name], stowds.get(name), bs[sec]

                def timed(op, fn):
                    c0 = time.process_time()
                    p0 = {"A": via.cpu() if via else None, "B": b.cpu()}
                    l0 = net.link_bytes() if net else None
                    t0 = time.perf_counter()
                    r = fn()
                    t = time.perf_counter() - t0
                    cpus = {"client": time.process_time() - c0, "B": b.cpu() - p0["B"]}
                    if via:
                        cpus["A"] = via.cpu() - p0["A"]
                    gbs = record(name, op, t, cpus, rep, net.link_bytes() - l0 if net else None)
                    ratios.setdefault(name, {}).setdefault(op, []).append(gbs / relay_gbs)
                    return r

                def get():
                    if out is not None:
                        return cl.get_into(idx, {"x": out})["x"]
                    return cl.get(idx, ["x"])["x"]

                def many_readers():
                    ends = [stowage.Client(cl_ep[name], timeout=a.timeout) for _ in range(a.readers)]
                    try:
                        for phase in ("first", "again"):
                            got = [None] * a.readers
                            gate = threading.Barrier(a.readers + 1)

                            def one(k):
                                gate.wait()
                                got[k] = ends[k].get(idx, ["x"])["x"]
                            threads = [threading.Thread(target=one, args=(k,)) for k in range(a.readers)]
                            for th in threads:
                                th.start()
                            l0 = net.link_bytes() if net else None
                            t0 = time.perf_counter()
                            gate.wait()
                            for th in threads:
                                th.join()
                            t = time.perf_counter() - t0
                            moved = (net.link_bytes() - l0) / payload_bytes if net else None
                            for g in got:
                                if g is None:
                                    raise WrongData("a reader got nothing")
                                verify(g, rows, cols)
                            del got
                            readers.setdefault(name, {}).setdefault(phase, []).append((t, moved))
                    finally:
                        for e in ends:
                            e.close()

                try:
                    timed("put", lambda: cl.put(idx, {"x": data}))
                    if a.readers > 1 and m != "direct":
                        # Then the same rows put again (untimed), so that
                        # the single get below starts from nothing cached.
                        many_readers()
                        cl.clear(idx)
                        cl.put(idx, {"x": data})
                    for op in ("get", "get again"):
                        got = timed(op, get)
                        verify(got, rows, cols)
                        del got
                        if out is not None:
                            out.fill(-1)
                    cl.clear(idx)
                except WrongData as e:
                    status[name] = f"WRONG DATA: {e}"
                    failed = True
                    print(f"{name}, rep {rep + 1}: {status[name]}", file=sys.stderr, flush=True)
                except Exception as e:  # a path that fails: reported in its row, exit 1 at the end
                    status[name] = f"error: {type(e).__name__}: {e}"
                    failed = True
                    print(f"{name}, rep {rep + 1}: {status[name]}", file=sys.stderr, flush=True)
            print(f"  rep {rep + 1}/{a.reps} done, load {' '.join(open('/proc/loadavg').read().split()[:3])}",
                  file=sys.stderr, flush=True)
        for cl in clients.values():
            cl.close()
    finally:
        for s in stowds.values():
            s.stop()
        if receiver:
            receiver.stop()
        if net:
            net.close()
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)

    # ---------------------------------------------------------- report
    med = statistics.median

    def cell(vals, fmt="{:.2f}"):
        if not vals:
            return "—"
        return f"{fmt.format(med(vals))} ({fmt.format(vals[0])})" if len(vals) > 1 else fmt.format(vals[0])

    where = (f"A and the client in the host's namespace, B in namespace {net.ns} behind a veth "
             f"({net.a_addr} -> {net.b_addr})" if net else "everything on 127.0.0.1")
    print(f"\nfloat32 [{rows}, {cols}] = {payload_bytes / (1 << 20):.0f} MiB "
          f"({a.row_kib:g} KiB rows), B with {a.units} units; {where}")
    print(f"stowd {commit}{' (host/ or wire/ modified since)' if dirty else ''}, binary built {built}; "
          f"load before {load}, after {' '.join(open('/proc/loadavg').read().split()[:3])}; "
          f"{a.reps} reps, median (first); {'get_into' if a.get_into else 'get'}\n")
    print("| physical limit | GB/s | CPU s/GB: sender | relay | receiver |")
    print("|---|---:|---:|---:|---:|")
    for row, label in (("one", "tcp, one hop: sender -> receiver"),
                       ("two", "tcp, two hops: sender -> tcp_relay -> receiver")):
        c = cpu.get(row, {}).get("stream", {})
        print(f"| {label} | {cell(results.get(row, {}).get('stream', []))} | "
              + " | ".join(cell(c.get(w, [])) for w in ("sender", "relay", "receiver")) + " |")
    ops = ("put", "get", "get again")
    print("\n| path | put GB/s | get GB/s | get again GB/s | put / two hops | get / two hops | get again / two hops |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in names:
        if status[n] is not None and n not in results:
            print(f"| {row_label(n)} | {status[n]} | | | | | |")
            continue
        r = results.get(n, {})
        print(f"| {row_label(n)} | " + " | ".join(cell(r.get(op, [])) for op in ops) + " | "
              + " | ".join(cell(ratios.get(n, {}).get(op, [])) for op in ops) + " |")
        if status[n] is not None:
            print(f"|   {status[n]} | | | | | | |")
    print("\nCPU seconds per GB of payload (median): client / A / B"
          + ("; bytes on the A-B veth per payload byte" if net else ""))
    print("\n| path | put | get | get again |" + (" veth put | veth get | veth get again |" if net else ""))
    print("|---|---|---|---|" + ("---:|---:|---:|" if net else ""))
    for n in names:
        if n not in cpu:
            continue
        cells = []
        for op in ops:
            c = cpu[n].get(op, {})
            cells.append(" / ".join(f"{med(c[w]):.2f}" if w in c else "—" for w in ("client", "A", "B")))
        veth = [cell(link.get(n, {}).get(op, []), "{:.3f}") for op in ops] if net else []
        print(f"| {row_label(n)} | " + " | ".join(cells + veth) + " |")
    if readers:
        print(f"\n{a.readers} clients get the whole batch at once, right after the put, then again "
              "(median seconds, first rep in parentheses"
              + ("; bytes on the A-B veth per payload byte)" if net else ")"))
        print("\n| path | first: s | again: s |" + (" first: veth | again: veth |" if net else ""))
        print("|---|---:|---:|" + ("---:|---:|" if net else ""))
        for n, phases in readers.items():
            secs = [cell([t for t, _ in phases.get(p, [])]) for p in ("first", "again")]
            veth = [cell([v for _, v in phases.get(p, [])], "{:.3f}") for p in ("first", "again")] if net else []
            print(f"| {row_label(n)} | " + " | ".join(secs + veth) + " |")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
