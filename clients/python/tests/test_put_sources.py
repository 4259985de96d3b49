"""Every put source the core reads as it lies (`_core.Put`), through a real
stowd: strided arrays of several strides (rows apart, a column slice,
reversed, transposed, Fortran order, broadcast, blocks large enough to go
as slices of themselves and single items), big-endian ones, strided
`Bits` and `Packed` values, as regular and nested fields, each read back
equal over tcp (the core's writer), same node (the core's fill of a
lease) and from `AsyncClient` (on its event loop's connection and on a
lane). And a put split over many messages of such sources that fails in
a later one says how many rows the earlier ones stored, sync and async."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys

import numpy as np
import pytest

import stowage
from stowage import Packed

N = 12


def sources(n: int = N) -> dict:
    """Fields of n rows whose arrays are not C-contiguous little-endian."""
    rng = np.random.default_rng(n)
    wide = rng.standard_normal((n, 3, 40)).astype(np.float32)
    big = rng.integers(0, 1 << 30, (2 * n, 2, 5000), dtype=np.int32)  # 20,000-byte blocks
    return {
        "rows_apart": rng.standard_normal((2 * n, 5))[::2],
        "column_slice": wide[:, 1, 3:17],
        "every_other": wide[:, :, ::2],
        "reversed": np.arange(n * 4, dtype=np.int16).reshape(n, 4)[::-1],
        "reversed_inner": np.arange(n * 4, dtype=np.int16).reshape(n, 4)[:, ::-1],
        "transposed": np.arange(n * 7, dtype=np.uint8).reshape(7, n).T,
        "fortran": np.asfortranarray(rng.standard_normal((n, 6))),
        "broadcast": np.broadcast_to(np.arange(9, dtype=np.int64), (n, 9)),
        "big_blocks": big[::2, 1],  # each row a contiguous 20,000-byte block
        "big_blocks_apart": big[::2],  # rows of 2 blocks, 40,000 bytes apart
        "big_endian": np.arange(n * 3, dtype=">f8").reshape(n, 3),
        "big_endian_strided": np.arange(n * 6, dtype=">i4").reshape(n, 6)[:, ::3],
        "big_endian_complex": (np.arange(n * 2) + 1j * np.arange(n * 2)).astype(">c8").reshape(n, 2),
        "bits": stowage.BFloat16Bits(np.arange(n * 8, dtype=np.uint16).reshape(n, 8)[:, 1::2]),
        "nested": [wide[k, :, : k % 5 + 1] for k in range(n)],
        "nested_big_endian": [np.arange(k, dtype=">u2") for k in range(n)],
        "packed": Packed(np.arange(3 * n * (n + 1) // 2, dtype=np.float32)[::-1][::3],
                         [(k,) for k in range(1, n + 1)]),
        "packed_runs": Packed(np.arange(n * 12, dtype=np.int32).reshape(2 * n, 6)[:, ::2], [(2, 3)] * n),
        "packed_tails": Packed(np.arange(n * 12, dtype=np.int32)[::2], [(2, 3) if k % 2 else (6,) for k in range(n)]),
    }


def expected(v):
    """What a get returns for a put of `v`: little-endian values."""
    if isinstance(v, stowage.Bits):
        return np.ascontiguousarray(v.data)
    if isinstance(v, Packed):
        flat = np.asarray(v.values).reshape(-1)
        out, at = [], 0
        for s in v.shapes:
            k = int(np.prod(s))
            out.append(flat[at:at + k].reshape(s))
            at += k
        return [o.astype(o.dtype.newbyteorder("<")) for o in out]
    if isinstance(v, list):
        return [r.astype(r.dtype.newbyteorder("<")) for r in v]
    return v.astype(v.dtype.newbyteorder("<"))


def check(got: dict, data: dict) -> None:
    bad = []
    for name, v in data.items():
        want, g = expected(v), got[name]
        if isinstance(want, list):
            if isinstance(g, np.ndarray):  # rows of one shape come back as one array
                g = list(g)
            ok = len(g) == len(want) and all(
                a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(g, want))
        else:
            ok = g.shape == want.shape and g.tobytes() == want.tobytes() and (
                g.dtype == want.dtype or isinstance(v, stowage.Bits))
        if not ok:
            bad.append(name)
    assert not bad, f"fields that did not round-trip: {bad}"


def test_the_sources_are_what_they_claim():
    for name, v in sources().items():
        a = v.data if isinstance(v, stowage.Bits) else np.asarray(v.values) if isinstance(v, Packed) else v
        rows = a if isinstance(a, list) else [a]
        assert any(not r.flags.c_contiguous or r.dtype.byteorder == ">" for r in rows), name


WIRE_DTYPES = ["?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16"]


def test_numpy_arrays_are_read_from_their_fields_and_round_trip(endpoint, fresh):
    """An exact numpy array of a dtype the wire has is read from the
    array's own fields, not through the buffer protocol
    (`_core.ndarray_direct`: this numpy's layout checked once). Every such
    dtype in both byte orders, contiguous, strided, reversed, broadcast,
    rows of one item, read-only, and arrays the fields do not take (more
    than 8 axes, `long double`, a subclass) read back equal, and a put
    leaves each array's reference count as it found it."""
    from stowage import _core

    assert _core.ndarray_direct()
    rng = np.random.default_rng(7)
    data = {}
    for name in WIRE_DTYPES:
        for order in "<>":
            base = (rng.integers(0, 100, (N, 6, 4)) + (1j if name.startswith("c") else 0)).astype(order + name)
            data[f"{order}{name}"] = base
            data[f"{order}{name}_strided"] = base[:, ::-2, 1]
    ro = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    ro.flags.writeable = False
    data["read_only"] = ro
    data["scalar_rows"] = np.arange(N, dtype=np.int64)
    data["broadcast"] = np.broadcast_to(np.arange(5, dtype=np.uint16), (N, 5))
    data["many_axes"] = np.arange(N, dtype=np.float32).reshape((N,) + (1,) * 33)
    data["subclass"] = np.arange(N * 2, dtype=np.float64).reshape(N, 2).view(np.matrix)
    before = {k: sys.getrefcount(v) for k, v in data.items()}
    idx = fresh(N)
    with stowage.Client(endpoint, timeout=30) as c:
        assert c.put(idx, data) == N
        after = {k: sys.getrefcount(v) for k, v in data.items()}
        got = c.get(idx, list(data), as_torch=False)
        c.clear(idx)
    assert after == before
    data["subclass"] = np.asarray(data["subclass"])
    check(got, data)


def test_arrays_the_wire_has_no_dtype_for_are_refused(endpoint, fresh):
    """A `long double` or an object array (types the fields reader leaves
    to the buffer protocol) is refused, and nothing is stored."""
    idx = fresh(2)
    with stowage.Client(endpoint, timeout=30) as c:
        keys = c.stats()["keys"]
        for a in (np.zeros((2, 3), np.longdouble), np.array([[1], ["x"]], dtype=object)):
            with pytest.raises((TypeError, ValueError)):
                c.put(idx, {"x": a})
        assert c.stats()["keys"] == keys


@pytest.mark.parametrize("max_message_bytes", [64 << 20, 700], ids=["one-message", "split"])
def test_strided_sources_round_trip_over_tcp(endpoint, fresh, max_message_bytes):
    idx = fresh(N)
    data = sources()
    with stowage.Client(endpoint, timeout=30, max_message_bytes=max_message_bytes) as c:
        assert c.put(idx, data) == N
        check(c.get(idx, list(data), as_torch=False), data)
        # Each field on its own too (a piece alone in its frame, or shared).
        for name, v in data.items():
            c.put(idx, {name: v})
        check(c.get(idx, list(data), as_torch=False), data)
        c.clear(idx)


def test_strided_sources_round_trip_through_the_async_client(endpoint, fresh):
    """`AsyncClient`: a put of one message on the event loop's own
    connection (`start_put`), a split one on a lane; both read back."""
    idx = fresh(N)
    data = sources()
    # rows of 80,000 bytes: frames of their own
    data["contiguous_big"] = np.arange(N * 20_000, dtype=np.float32).reshape(N, 20_000)

    async def main():
        async with stowage.AsyncClient(endpoint, timeout=30) as c:
            small = {k: v for k, v in data.items() if k != "contiguous_big"}
            assert await c.put(idx, small) == N  # one message, under CORE_MIN_BYTES: on the loop
            got = [await c.get(idx, list(small), as_torch=False)]
        async with stowage.AsyncClient(endpoint, timeout=30, max_message_bytes=2000) as c:
            assert await c.put(idx, data) == N  # a message a row: on a lane
            got.append(await c.get(idx, list(data), as_torch=False))
            await c.clear(idx)
        return got

    small_got, got = asyncio.run(asyncio.wait_for(main(), 60))
    check(small_got, {k: v for k, v in data.items() if k != "contiguous_big"})
    check(got, data)


def test_strided_sources_round_trip_same_node(shm_server, fresh):
    """Same node: the core writes every source into the leased segment."""
    idx = fresh(N)
    data = sources()
    with stowage.Client(shm_server["native"], same_node=True, timeout=30) as c:
        assert c.put(idx, data) == N
        check(c.get(idx, list(data), as_torch=False), data)
    with stowage.Client(shm_server["native"], timeout=30) as tcp:
        check(tcp.get(idx, list(data), as_torch=False), data)

    async def put_async():
        async with stowage.AsyncClient(shm_server["native"], same_node=True, timeout=30) as c:
            return await c.put(idx, data)

    assert asyncio.run(asyncio.wait_for(put_async(), 60)) == N
    with stowage.Client(shm_server["native"], same_node=True, timeout=30) as c:
        check(c.get(idx, list(data), as_torch=False), data)
        c.clear(idx)


@pytest.mark.parametrize("way", ["sync", "async"])
def test_a_split_put_of_strided_sources_failing_later_counts_the_rows_stored(small_server, fresh, way):
    """Units of 4 KiB, rows of 1 KiB alternating between them, two rows a
    message (1,022 strided bytes and 2 packed a row): the fifth message finds
    the units full. rows_stored says the
    8 leading rows the first four stored, and those read back."""
    idx = fresh(10)
    rows = np.arange(10 * 2044, dtype=np.uint8).reshape(10, 2044)[:, ::2]  # strided: 1022 bytes a row
    data = {"x": rows, "p": Packed(np.arange(10 * 4, dtype=np.int8)[::2], [(2,)] * 10)}

    async def aput():
        async with stowage.AsyncClient(small_server["native"], timeout=10, max_message_bytes=2200) as c:
            await c.put(idx, data)

    with stowage.Client(small_server["native"], timeout=10, max_message_bytes=2200) as c:
        try:
            with pytest.raises(stowage.CapacityError) as ei:
                if way == "sync":
                    c.put(idx, data)
                else:
                    asyncio.run(asyncio.wait_for(aput(), 60))
            assert ei.value.rows_stored == 8
            got = c.get(idx[:8], ["x", "p"])
            np.testing.assert_array_equal(got["x"], rows[:8])
            np.testing.assert_array_equal(np.asarray(got["p"]), np.arange(0, 32, 2, dtype=np.int8).reshape(8, 2))
            with pytest.raises(stowage.KeyNotFound):
                c.get(idx[8:9], ["x"])
        finally:
            c.clear(idx)


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory):
    from stowd_harness import run_stowd

    shm_dir = f"/dev/shm/stowage-test-sources-{os.getpid()}"
    shutil.rmtree(shm_dir, ignore_errors=True)
    with run_stowd(tmp_path_factory.mktemp("sources"), config=f'[shm]\ndir = "{shm_dir}"\ninline_below = 0\n',
                   name="stowd-sources") as s:
        yield s
    shutil.rmtree(shm_dir, ignore_errors=True)
