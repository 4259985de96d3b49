"""The client needs no pyzmq: in a fresh interpreter where `import zmq`
fails, `import stowage` works, and every call of `Client` and
`AsyncClient` is served over tcp and same node (the Rust core carries
every byte; pyzmq is only a test dependency, for peers of our own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from test_imports import PACKAGE
from test_same_node import shm_server  # noqa: F401  (a module fixture: stowd with shared memory)


def _python_without_pyzmq(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE.parent), *sys.path]))
    code = "import sys; sys.modules['zmq'] = None\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)


def test_every_call_without_pyzmq(shm_server, fresh):  # noqa: F811
    idx = fresh(8)
    out = _python_without_pyzmq("""
        import asyncio, json, sys
        import numpy as np
        import stowage
        try:
            import zmq
            raise SystemExit("zmq imported")
        except ImportError:
            pass
        ep, idx = sys.argv[1], json.loads(sys.argv[2])
        x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
        data = {"x": x, "s": x[:, ::2], "n": [np.arange(k, dtype=np.int64) for k in range(8)],
                "v": [str(k) for k in range(8)], "p": stowage.Packed(np.arange(28, dtype=np.int32), [(k,) for k in range(8)])}

        def check(got, rows):
            assert np.array_equal(got["x"], x[rows]) and np.array_equal(got["s"], x[rows, ::2])
            assert [r.tolist() for r in got["n"]] == [list(range(k)) for k in rows]
            assert got["v"] == [str(k) for k in rows]

        for same_node in (False, True):
            with stowage.Client(ep, timeout=20, same_node=same_node) as c:
                assert c.put(idx, data) == 8
                check(c.get(idx[::-1], ["x", "s", "n", "v"]), list(range(7, -1, -1)))
                out = {"x": np.zeros((8, 12), np.float32)[:, ::2]}  # a strided target
                c.get_into(idx, out)
                assert np.array_equal(out["x"], x)
                assert c.stats()["rows"] >= 8
                assert c.clear(idx) == 8 * len(data)

            async def main():
                async with stowage.AsyncClient(ep, timeout=20, same_node=same_node) as c:
                    assert await c.put(idx, data) == 8
                    check(await c.get(idx, ["x", "s", "n", "v"]), list(range(8)))
                    out = {"x": np.zeros((8, 6), np.float32)}
                    await c.get_into(idx, out)
                    assert np.array_equal(out["x"], x)
                    assert (await c.stats())["rows"] >= 8
                    assert await c.clear(idx) == 8 * len(data)

            asyncio.run(main())
        assert sys.modules["zmq"] is None
        print("ok")
    """, shm_server["native"], json.dumps(idx))
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-3000:]
