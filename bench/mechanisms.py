"""ZMTP NULL, PLAIN and CURVE on the native endpoint, paired: one release
stowd per mechanism (`[security] auth = "none"`, `"token"`, `"curve"`), the
same `stowage.Client` code against each, and every repetition puts and
gets the same batch through all three back to back, in an order that
rotates, so load that comes and goes hits them alike.

For each operation it prints the median GB/s of each mechanism, the
median of the per-repetition ratios to NULL (a ratio taken within one
repetition, so the machine's drift cancels), a 95% bootstrap interval of
that median, and the CPU seconds per GiB of the client and of stowd. The
plain tcp stream in the same run (one loopback socket to another process)
is the physical limit the GB/s are read against.

usage: python3 bench/mechanisms.py [--mib 64] [--row-bytes 4096] [--fields 1] [--reps 41]
       [--stowd target/release/stowd]
       [--mechanisms none,token,curve]

Needs a release stowd and the release core in clients/python/stowage.
"""
import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import policy_put  # noqa: E402
import stowage  # noqa: E402

NAMES = {"none": "NULL", "token": "PLAIN", "curve": "CURVE"}


def start(binary, work, auth):
    """A stowd with 4 units, no plugins, no same-node memory, `auth`."""
    return policy_put.start(binary, work, None,
                            extra=f"\n[shm]\nenabled = false\n\n[security]\nauth = {json.dumps(auth)}\n")


def cpu(pid):
    s = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(s[11]) + int(s[12])) / os.sysconf("SC_CLK_TCK")


def tcp_stream(nbytes):
    """GB/s of one loopback tcp socket to another process, one sender."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    code = ("import socket,sys\ns=socket.create_connection(('127.0.0.1',%d))\nb=bytearray(4<<20)\n"
            "v=memoryview(b)\nn=0\nwhile True:\n k=s.recv_into(v)\n if not k: break\n n+=k\n"
            "s.sendall(b'k')\n" % port)
    rx = subprocess.Popen([sys.executable, "-c", code])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(1 << 20))
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        k = min(left, len(buf))
        conn.sendall(buf[:k])
        left -= k
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
    t = time.perf_counter() - t0
    conn.close()
    srv.close()
    rx.wait()
    return nbytes / t / 1e9


def median_ci(xs, n=2000):
    rng = random.Random(1)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return statistics.median(xs), meds[int(0.025 * n)], meds[int(0.975 * n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=64, help="payload per operation, all fields together")
    ap.add_argument("--row-bytes", type=int, default=4096, help="bytes of a row of one field (float32)")
    ap.add_argument("--fields", type=int, default=1, help="fields per put and get")
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--mechanisms", default="none,token,curve")
    a = ap.parse_args()
    mechs = [m for m in a.mechanisms.split(",") if m]
    cols = max(1, a.row_bytes // 4)
    rows = max(1, int(a.mib * (1 << 20)) // (cols * 4 * a.fields))
    data = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    names = [f"f{i}" for i in range(a.fields)]
    batch = {n: data for n in names}
    outs = {n: np.empty_like(data) for n in names}
    nbytes = data.nbytes * a.fields
    idx = range(rows)
    out = outs[names[0]]
    load0 = " ".join(open("/proc/loadavg").read().split()[:3])
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    gbs = {(m, op): [] for m in mechs for op in ("put", "get")}
    cpus = {(m, op, who): [] for m in mechs for op in ("put", "get") for who in ("client", "stowd")}
    stream = []
    with tempfile.TemporaryDirectory() as tmp:
        procs, clients = {}, {}
        try:
            for m in mechs:
                procs[m], eps = start(a.stowd, os.path.join(tmp, m), m)
                clients[m] = stowage.Client(eps["native"], timeout=600, max_message_bytes=max(256 << 20, 2 * nbytes))
            for m in mechs:  # warm: every stowd's memory touched once
                clients[m].put(idx, batch)
                clients[m].get_into(idx, outs)
                clients[m].clear(idx)
            for rep in range(a.reps):
                stream.append(tcp_stream(nbytes))
                order = mechs[rep % len(mechs):] + mechs[:rep % len(mechs)]
                for m in order:
                    c, pid = clients[m], procs[m].pid
                    for op, fn in (("put", lambda: c.put(idx, batch)),
                                   ("get", lambda: c.get_into(idx, outs))):
                        c0, s0 = time.process_time(), cpu(pid)
                        t0 = time.perf_counter()
                        fn()
                        t = time.perf_counter() - t0
                        gbs[(m, op)].append(nbytes / t / 1e9)
                        cpus[(m, op, "client")].append((time.process_time() - c0) / (nbytes / 2**30))
                        cpus[(m, op, "stowd")].append((cpu(pid) - s0) / (nbytes / 2**30))
                    if not np.array_equal(out[:: max(1, rows // 97)], data[:: max(1, rows // 97)]):
                        raise SystemExit(f"{m}: wrong rows read back")
                    c.clear(idx)
                    for o in outs.values():
                        o.fill(0)
        finally:
            for c in clients.values():
                c.close()
            for p in procs.values():
                p.terminate()
                p.wait()
    load1 = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"\n{a.mib:g} MiB ({a.fields} x float32 [{rows}, {cols}]) per operation, {a.reps} repetitions, stowd {commit} "
          f"(release), 4 units, tcp on 127.0.0.1; load {load0} before, {load1} after")
    print(f"plain tcp stream in the same run: {statistics.median(stream):.2f} GB/s (median)\n")
    print("| mechanism | put GB/s | get GB/s | put / NULL (95% interval) | get / NULL (95% interval) "
          "| CPU s/GiB put: client / stowd | get: client / stowd |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m in mechs:
        cells = [NAMES[m], f"{statistics.median(gbs[(m, 'put')]):.3f}", f"{statistics.median(gbs[(m, 'get')]):.3f}"]
        for op in ("put", "get"):
            if m == mechs[0]:
                cells.append("1")
                continue
            r = [x / y for x, y in zip(gbs[(m, op)], gbs[(mechs[0], op)])]
            med, lo, hi = median_ci(r)
            cells.append(f"{med:.3f} ({lo:.3f}-{hi:.3f})")
        for op in ("put", "get"):
            cells.append(" / ".join(f"{statistics.median(cpus[(m, op, w)]):.3f}" for w in ("client", "stowd")))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
