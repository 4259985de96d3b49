#!/usr/bin/env python3
"""Router-mode benchmark: put and get a float32 batch through stowd's
TransferQueue router endpoint to 4 units, as an unchanged TransferQueue
client would (one DEALER, one ext 3 tensor per field, one frame).

Two layouts, each in its own stowd processes started here:
  local   one stowd: router -> 4 in-process units
  remote  stowd R (router, no data) -> 4 units in stowd U over tcp

Reports put/get throughput and every stowd's peak RSS above its baseline
(VmHWM after resetting it through /proc/PID/clear_refs), as a ratio to the
payload. Needs a release build: `cargo build --release -p stowage-host`.

usage: python3 bench/router_bench.py [--gib 2] [--reps 3] [--stowd PATH]
"""
import argparse
import json
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


from procmem import status as rss, reset_peak  # noqa: E402


class Stowd:
    def __init__(self, binary, config_text, tmp, name):
        self.cfg = os.path.join(tmp, f"{name}.toml")
        self.eps = os.path.join(tmp, f"{name}.json")
        with open(self.cfg, "w") as f:
            f.write(config_text)
        self.proc = subprocess.Popen(
            [binary, "serve", "--config", self.cfg, "--endpoints-file", self.eps],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"{name}.log"), "w"),
            env={**os.environ, "RUST_LOG": "warn"})
        deadline = time.time() + 300
        while not os.path.exists(self.eps):
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"stowd {name} did not start (see {tmp}/{name}.log)")
            time.sleep(0.1)
        with open(self.eps) as f:
            self.endpoints = json.load(f)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def envelope(kind, body):
    return msgpack.packb({"request_type": kind, "sender_id": "TQ_STORAGE_bench", "receiver_id": None,
                          "request_id": "0badf00d", "timestamp": time.time(), "body": body},
                         use_bin_type=True)


def ext3(dtype, shape, frame):
    return msgpack.ExtType(3, pickle.dumps((dtype, tuple(shape), frame), protocol=5))


def request(sock, frames, timeout_s=600):
    sock.send_multipart(frames, copy=False)
    if not sock.poll(timeout_s * 1000):
        raise SystemExit("no reply")
    return sock.recv_multipart(copy=False)


def run(layout, binary, gib, reps, tmp):
    rows = int(gib * (1 << 30)) // (1024 * 4)
    payload = rows * 1024 * 4
    data = np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024)
    procs = []
    if layout == "local":
        main = Stowd(binary, "[units]\nlocal = 4\n", tmp, "local")
        procs = [("stowd", main)]
    else:
        units = Stowd(binary, "[units]\nlocal = 4\n[router]\nenabled = false\n", tmp, "units")
        eps = [u["endpoint"] for u in units.endpoints["units"]]
        main = Stowd(binary, "[units]\nlocal = 1\n[router]\nunits = %s\n" % json.dumps(eps), tmp, "router")
        procs = [("router stowd", main), ("unit stowd", units)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"TQ_STORAGE_bench_0")
    sock.connect(main.endpoints["router"]["endpoint"])
    gis = list(range(rows))
    put_t, get_t, peaks = [], [], {n: {"put": [], "get": []} for n, _ in procs}
    for _ in range(reps):
        base = {n: rss(p.proc.pid)["VmRSS"] for n, p in procs}
        for _, p in procs:
            reset_peak(p.proc.pid)
        t = time.perf_counter()
        body = {"global_indexes": gis, "data": {"x": ext3("float32", data.shape, 1)}, "data_parser": None}
        r = request(sock, [envelope("PUT", body), memoryview(data).cast("B")])
        put_t.append(time.perf_counter() - t)
        head = msgpack.unpackb(r[0].bytes, strict_map_key=False)
        assert head["request_type"] == "PUT_DATA_RESPONSE", head
        for n, p in procs:
            peaks[n]["put"].append(rss(p.proc.pid)["VmHWM"] - base[n])
        stored = {n: rss(p.proc.pid)["VmRSS"] for n, p in procs}
        for _, p in procs:
            reset_peak(p.proc.pid)
        t = time.perf_counter()
        r = request(sock, [envelope("GET", {"global_indexes": gis, "fields": ["x"]})])
        get_t.append(time.perf_counter() - t)
        head = msgpack.unpackb(r[0].bytes, strict_map_key=False)
        assert head["request_type"] == "GET_DATA_RESPONSE", head["body"]
        assert len(r) == rows + 1, len(r)
        # Spot-check rows against the input.
        for i in (0, rows // 2, rows - 1):
            assert np.array_equal(np.frombuffer(r[i + 1].buffer, dtype=np.float32), data[i])
        del r
        for n, p in procs:
            peaks[n]["get"].append(rss(p.proc.pid)["VmHWM"] - stored[n])
        request(sock, [envelope("CLEAR_DATA", {"global_indexes": gis})])
    sock.close(0)
    ctx.term()
    for _, p in procs:
        p.stop()
    med = statistics.median
    out = []
    for n, _ in procs:
        out.append((layout, n, payload, payload / med(put_t) / 1e9, payload / med(get_t) / 1e9,
                    med(peaks[n]["put"]) / payload, med(peaks[n]["get"]) / payload))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stowd", default=os.path.join(ROOT, "target", "release", "stowd"))
    ap.add_argument("--layouts", default="local,remote")
    a = ap.parse_args()
    if not os.path.exists(a.stowd):
        raise SystemExit(f"{a.stowd} missing: cargo build --release -p stowage-host && cargo xtask plugins")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in a.layouts.split(","):
            rows += run(layout, a.stowd, a.gib, a.reps, tmp)
    print(f"\nfloat32 [{int(a.gib * (1 << 30)) // 4096}, 1024] = {a.gib} GiB through the router to 4 units, "
          f"median of {a.reps}\n")
    print("| layout | process | put GB/s | get GB/s | peak RSS over baseline during put / payload | during get / payload |")
    print("|---|---|---:|---:|---:|---:|")
    for layout, n, _, put, get, pp, gp in rows:
        print(f"| {layout} | {n} | {put:.2f} | {get:.2f} | {pp:.3f} | {gp:.3f} |")


if __name__ == "__main__":
    main()
