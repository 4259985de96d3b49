"""The Rust core's fast paths for small calls (`_core.Connection.get_fast`,
`clear_fast`, `_core.read_index_list`) and its put (`_core.Put`, every
put): every index input kind reads as the general path reads it, every
bad one gets the general path's error (nothing sent), every field kind is
laid out by the protocol's rules (each descriptor names exactly its
rows' bytes) and comes back the same, against a real stowd."""

from __future__ import annotations

import array
import asyncio
import sys
import types

import msgpack
import numpy as np
import pytest

import stowage
from stowage import _codec, _core, _put

INT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


def _sent_indexes(wire) -> list[int]:
    """The indexes frame 0 of a get carries, expanded."""
    frame0 = msgpack.unpackb(_codec.envelope("get", 1, {"global_indexes": wire, "fields": ["x"]}))
    gi = frame0["body"]["global_indexes"]
    if isinstance(gi, dict):
        return [s + k * step for s, c, step in gi["ranges"] for k in range(c)]
    return gi


def _index_inputs(values: list[int]):
    """`values` in every input kind the core reads."""
    yield "list", list(values)
    yield "tuple", tuple(values)
    for dt in INT_DTYPES:
        if max(values) <= np.iinfo(dt).max:
            yield f"numpy {np.dtype(dt).name}", np.asarray(values, dt)
            strided = np.zeros(2 * len(values), dt)
            strided[::2] = values
            yield f"numpy {np.dtype(dt).name} strided", strided[::2]
    for code in "bBhHiIlLqQ":
        if max(values) <= 2 ** (8 * array.array(code).itemsize - (1 if code.islower() else 0)) - 1:
            yield f"array.array {code}", array.array(code, values)
    yield "memoryview", memoryview(array.array("Q", values))


@pytest.mark.parametrize("values", [[5], [0, 1, 2, 3], list(range(7, 700, 7)), [9, 3, 3, 200, 1, 2**40],
                                    list(range(1000, 0, -1)), [2**63 - 1, 2**63, 2**64 - 1]])
def test_every_index_input_kind_reads_as_its_ints(values):
    for kind, g in _index_inputs(values):
        if max(values) >= 2**63 and kind.startswith(("numpy int", "array.array")) and "u" not in kind:
            continue  # (built above only where the values fit)
        read = _core.read_index_list(g)
        assert read is not None, kind
        assert read.tolist() == values and len(read) == len(values), kind
        n, wire = _codec.get_indexes(g, "get")
        assert n == len(values) and _sent_indexes(wire) == values, kind
        assert _codec.check_indexes(g, "put", unique=False) == values, kind


def test_runs_found_while_reading_give_back_every_index():
    """Indexes are grouped into runs as they are read (never listed for a
    get): runs up, down, repeated, broken, at the ends of u64, in every
    input kind, expand to exactly the indexes given."""
    rng = np.random.default_rng(5)
    for trial in range(200):
        parts = []
        for _ in range(rng.integers(1, 8)):
            kind = rng.integers(0, 4)
            start, count, step = int(rng.integers(0, 1000)), int(rng.integers(1, 30)), int(rng.integers(0, 5))
            if kind == 0:
                parts += [start + k * step for k in range(count)]
            elif kind == 1:
                parts += [start] * count
            elif kind == 2:
                parts += [int(v) for v in rng.integers(0, 50, count)]
            else:
                parts += [2**64 - 1 - k for k in range(count)]
        for kind, g in (("list", parts), ("array", np.asarray(parts, np.uint64))):
            read = _core.read_index_list(g)
            assert read.tolist() == parts, (trial, kind)
            assert read.runs <= len(parts)


def test_lists_read_ahead_give_every_index_and_turn_away_a_bad_one_anywhere(fake_server):
    """A list or tuple is read some items ahead of the one converted (its
    objects prefetched): every length around that distance reads whole,
    ints made out of order too, and a bad item at any place, the first
    and last of each block included, turns the core away (None) so that
    the general path words the error."""
    rng = np.random.default_rng(11)
    for n in (1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65, 255, 256, 257, 1000):
        values = [int(v) for v in rng.integers(0, 2**62, n)]
        # The same values as int objects made in shuffled order.
        order = rng.permutation(n)
        made = [None] * n
        for i in order:
            made[i] = values[i] + 1 - 1
        for kind, g in (("list", values), ("tuple", tuple(values)), ("made shuffled", made)):
            read = _core.read_index_list(g)
            assert read is not None and read.tolist() == values and len(read) == n, (n, kind)
            distinct = _core.read_index_list(g, True)
            assert distinct is not None and distinct.tolist() == values, (n, kind)
        edges = {0, 1, 14, 15, 16, 17, 31, 32, 33, 255, 256, 257, 511, 512, n // 2, n - 2, n - 1}
        for at in sorted(edges & set(range(n))):
            for bad in (-1, 2**64, 2.0, "7", None, True):
                g = list(values)
                g[at] = bad
                assert _core.read_index_list(g) is None, (n, at, bad)
                assert _core.read_index_list(tuple(g), True) is None, (n, at, bad)
    srv = fake_server(lambda ident, frames: [])
    with stowage.Client(srv.endpoint, timeout=10) as c:
        g = list(range(100))
        g[33] = -5
        with pytest.raises(ValueError, match="global index -5 is out of range"):
            c.get(g, ["x"])
        g[33] = 3.5
        with pytest.raises(TypeError, match="global indexes must be ints, got 3.5"):
            c.put(g, {"x": np.zeros((100, 4), np.float32)})
    assert srv.requests == []


def test_ints_read_from_their_objects_give_the_c_apis_values_at_every_digit_count():
    """The core reads an int's value from its digits (30 bits each) where
    it confirmed the interpreter's layout: every value either side of a
    digit count's edge reads as Python has it, in lists and tuples and
    among other values; a negative one of any digit count, one of 2^64 or
    more, and an int subclass turn the core away (None). On this CPython
    the layouts are confirmed (else the core reads through the C API,
    slower)."""
    assert _core.index_layouts() == {"sequences": True, "int": "tag" if sys.version_info >= (3, 12) else "size"}
    edges = [0, 1, 2, 7]
    for bits in (30, 31, 32, 60, 62, 63, 64):
        edges += [2**bits - 2, 2**bits - 1] + ([2**bits, 2**bits + 1] if bits < 64 else [])
    rng = np.random.default_rng(5)
    for n in (1, 3, 40, 300):
        for _ in range(4):
            values = [edges[i] for i in rng.integers(0, len(edges), n)]
            for g in (values, tuple(values), [v + 1 - 1 for v in values]):
                read = _core.read_index_list(g)
                assert read is not None and read.tolist() == values, (n, type(g))
    class Int(int):
        pass
    for bad in (-1, -(2**30), -(2**30) - 1, -(2**60), -(2**63), -(2**64) + 1, -(2**64), 2**64, 2**64 + 1,
                2**90, 2**200, Int(5), False):
        for at in (0, 17, 299):
            g = [int(v) for v in rng.integers(0, 2**40, 300)]
            g[at] = bad
            assert _core.read_index_list(g) is None, (bad, at)
            assert _core.read_index_list(tuple(g), True) is None, (bad, at)


INDEX_CASES = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from stowage import _core
class Int(int):
    pass
edges = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 1]
cases = [list(range(n)) for n in (1, 255, 256, 257, 600)]
cases += [edges * 40, tuple(edges * 40), [v + 1 - 1 for v in reversed(edges * 40)]]
for bad in (-1, -(2**60), 2**64, 2**90, 2.0, "7", None, True, Int(3)):
    for at in (0, 255, 256, 319):
        g = edges * 40
        g[at] = bad
        cases += [g, tuple(g)]
out = []
for g in cases:
    for distinct in (False, True):
        r = _core.read_index_list(g, distinct)
        out.append(None if r is None else r.tolist())
print(json.dumps({"layouts": _core.index_layouts(), "reads": out}))
"""


def test_index_lists_read_through_the_c_api_give_the_same_as_read_from_the_objects():
    """Where the core cannot confirm the interpreter's layouts it reads
    every item and int through the C API (forced here with
    STOWAGE_INDEX_LAYOUTS=api): every list and tuple reads the same either
    way, edge values and bad items at chunk edges included."""
    import json
    import os
    import subprocess
    pkg = os.path.dirname(os.path.dirname(stowage.__file__))
    runs = {}
    for mode in ("api", ""):
        env = dict(os.environ, STOWAGE_INDEX_LAYOUTS=mode)
        done = subprocess.run([sys.executable, "-c", INDEX_CASES, pkg], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        runs[mode] = json.loads(done.stdout)
    assert runs["api"]["layouts"] == {"sequences": False, "int": "api"}
    assert runs[""]["layouts"]["sequences"] is True and runs[""]["layouts"]["int"] != "api"
    assert runs["api"]["reads"] == runs[""]["reads"]
    reads = runs["api"]["reads"]
    assert reads[0] == [0] and reads[8] == list(range(600)) and reads[9] == list(range(600))
    # The edge values repeat: read as given, turned away when asked distinct.
    assert reads[10] == reads[12] and reads[10][:8] == [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 1]
    assert reads[11] is None and reads[13] is None and reads[15] is None
    # Every bad item turned away, both ways.
    assert all(r is None for r in reads[16:]) and len(reads[16:]) == 9 * 4 * 2 * 2


def test_ranges_read_without_listing_them():
    assert _core.read_index_list(range(10, 10**15, 3)).runs == 1
    assert len(_core.read_index_list(range(10, 10**15, 3))) == len(range(10, 10**15, 3))
    assert _core.read_index_list(range(50, 0, -5)).tolist() == list(range(50, 0, -5))
    # A list in put order is one run, sent as one range.
    n, wire = _codec.get_indexes(list(range(100, 600)), "get")
    frame0 = msgpack.unpackb(_codec.envelope("get", 1, {"global_indexes": wire, "fields": ["x"]}))
    assert frame0["body"]["global_indexes"] == {"ranges": [[100, 500, 1]]}
    # A permuted list stays a list.
    perm = list(np.random.default_rng(1).permutation(1000) + 5)
    n, wire = _codec.get_indexes([int(x) for x in perm], "get")
    frame0 = msgpack.unpackb(_codec.envelope("get", 1, {"global_indexes": wire, "fields": ["x"]}))
    assert frame0["body"]["global_indexes"] == [int(x) for x in perm]


BAD_INDEXES = [
    # (input, error, words) for both put and get
    ([3, -1, 4], ValueError, "global index -1 is out of range"),
    ((3, -1, 4), ValueError, "global index -1 is out of range"),
    (range(-2, 5), ValueError, "global index -2 is out of range"),
    (np.asarray([3, -7, 4], np.int8), ValueError, "global index -7 is out of range"),
    (np.asarray([3, -7, 4], np.int64), ValueError, "global index -7 is out of range"),
    (np.asarray([3, 0, -7, 0], np.int64)[::2], ValueError, "global index -7 is out of range"),
    (array.array("q", [3, -9]), ValueError, "global index -9 is out of range"),
    ([1, 2**64], ValueError, "global index 18446744073709551616 is out of range"),
    (range(2**64 - 2, 2**64 + 2), ValueError, "out of range"),
    ([1, 2.5], TypeError, "global indexes must be ints, got 2.5"),
    ([1, "2"], TypeError, "global indexes must be ints, got '2'"),
    ((1, None), TypeError, "global indexes must be ints, got None"),
    # A list of bools is a mask, not the indexes 0 and 1.
    ([True, False, True], TypeError, r"global indexes must be ints, got True \(a bool: for a mask"),
    ((3, False), TypeError, r"global indexes must be ints, got False \(a bool"),
    ([np.bool_(True)], TypeError, r"global indexes must be ints, got np.True_ \(a bool"),
    (np.asarray([1.0, 2.0]), TypeError, "must be a 1-d integer array"),
    (np.asarray([True, False]), TypeError, "must be a 1-d integer array"),
    (np.zeros((2, 2), np.int64), TypeError, "must be a 1-d integer array"),
    (np.int64(5), TypeError, "global_indexes must be a sequence of non-negative ints"),
    (b"\x01\x02", TypeError, "global_indexes must be a sequence of non-negative ints, got bytes"),
    (bytearray(b"\x01\x02"), TypeError, "global_indexes must be a sequence of non-negative ints, got bytearray"),
    ("12", TypeError, "global_indexes must be a sequence of non-negative ints, got str"),
    (7, TypeError, "global_indexes must be a sequence of non-negative ints, got int"),
    ([], ValueError, "empty batch"),
    (range(0), ValueError, "empty batch"),
    (np.arange(0), ValueError, "empty batch"),
]
DUPLICATES = [
    [4, 5, 4],
    (4, 5, 4),
    np.asarray([4, 5, 4], np.uint16),
    array.array("L", [4, 5, 4]),
    range(5, 5, 1),  # (empty: the empty batch error, not a duplicate)
]


@pytest.mark.parametrize("case", range(len(BAD_INDEXES)))
def test_every_bad_index_input_gets_its_error_and_sends_nothing(fake_server, case):
    g, err, words = BAD_INDEXES[case]
    srv = fake_server(lambda ident, frames: [])
    n = len(g) if isinstance(g, (list, tuple, range, np.ndarray, array.array)) and np.ndim(g) == 1 else 2
    with stowage.Client(srv.endpoint, timeout=10) as c:
        with pytest.raises(err, match=words):
            c.put(g, {"x": np.zeros((max(n, 1), 4), np.float32)})
        with pytest.raises(err, match=words):
            c.get(g, ["x"])
        with pytest.raises(err, match=words):
            c.get_into(g, {"x": np.zeros((max(n, 1), 4), np.float32)})
        if words != "empty batch":  # a clear of nothing is allowed
            with pytest.raises(err, match=words):
                c.clear(g)

    async def aio():
        async with stowage.AsyncClient(srv.endpoint, timeout=10) as c:
            with pytest.raises(err, match=words):
                await c.put(g, {"x": np.zeros((max(n, 1), 4), np.float32)})
            with pytest.raises(err, match=words):
                await c.get(g, ["x"])

    asyncio.run(asyncio.wait_for(aio(), 30))
    assert srv.requests == []


def test_a_repeated_index_is_refused_for_a_put_in_every_input_kind(endpoint, fresh):
    base = fresh(10)[0]
    with stowage.Client(endpoint, timeout=10) as c:
        for g in DUPLICATES:
            shifted = [base + int(x) for x in g]
            kinds = [shifted, tuple(shifted), np.asarray(shifted, np.uint64), array.array("Q", shifted)]
            for k in kinds:
                if not shifted:
                    with pytest.raises(ValueError, match="empty batch"):
                        c.put(k, {"x": np.zeros((0, 4), np.float32)})
                    continue
                with pytest.raises(ValueError, match=f"duplicate global index {base + 4}"):
                    c.put(k, {"x": np.zeros((len(shifted), 4), np.float32)})
        # A get may repeat an index.
        c.put([base + 4, base + 5], {"x": np.arange(8, dtype=np.float32).reshape(2, 4)})
        got = c.get(np.asarray([base + 4, base + 5, base + 4], np.int32), ["x"])["x"]
        np.testing.assert_array_equal(got[0], got[2])


def _field_kinds(n: int) -> dict:
    """One field of every kind the fast path reads, n rows each."""
    rng = np.random.default_rng(n)
    out = {
        "f32": rng.standard_normal((n, 16)).astype(np.float32),
        "f16": rng.standard_normal((n, 3)).astype(np.float16),
        "f64": rng.standard_normal(n),
        "c64": (rng.standard_normal((n, 2)) + 1j).astype(np.complex64),
        "c128": rng.standard_normal((n, 1)) + 2j,
        "b": rng.integers(0, 2, (n, 5)).astype(bool),
        "big": rng.standard_normal((n, 20000)).astype(np.float32),  # >= 64 KiB: its own frame
        "nested": [rng.integers(0, 100, (i % 4, 2)).astype(np.int32) for i in range(n)],
        "nested0d": [np.full((), float(i)) for i in range(n)],  # 0-d rows
        "strs": [f"row {i} é" for i in range(n)],
        "bytes": [bytes([i % 256]) * (i % 7) for i in range(n)],
        "plain": [[1, 2.5, True, None, 2**40, -3][i % 6] for i in range(n)],
    }
    for dt in INT_DTYPES:
        out[np.dtype(dt).name] = rng.integers(0, 100, (n, 2)).astype(dt)
    return out


def _described(frame0: bytes, frames: list) -> dict:
    """Each field of a put message as its descriptor says: regular fields
    as the bytes of their one part, nested ones as (shape, bytes) per row,
    values as they are; and checks the layout rules on the way: a piece
    of at least 64 KiB is a frame of its own, smaller ones share frames of
    at most 1 MiB, each at a multiple of its itemsize (at most 16); every
    frame is named by a descriptor."""
    body = msgpack.unpackb(frame0)["body"]
    data = [bytes(memoryview(f).cast("B")) for f in frames]
    used = set()

    def piece(k, off, ln, itemsize):
        f = data[k - 1]
        assert off + ln <= len(f)
        if ln >= 64 << 10:
            assert (off, ln) == (0, len(f)), "a large piece is a frame of its own"
        else:
            assert len(f) <= 1 << 20 and off % min(max(itemsize, 1), 16) == 0
        used.add(k)
        return f[off:off + ln]

    out = {}
    for name, d in body["fields"].items():
        if d["kind"] == "values":
            out[name] = d["values"]
        elif d["kind"] == "regular":
            (p,) = d["parts"]
            assert p["rows"] == d["shape"][0]
            out[name] = piece(p["frame"], p["offset"], p["len"], np.dtype(_codec.WIRE_DTYPES[d["dtype"]]).itemsize)
        else:
            size = _codec.WIRE_DTYPES[d["dtype"]].itemsize
            out[name] = [(tuple(r["shape"]), piece(r["frame"], r["offset"], r["len"], size)) for r in d["rows"]]
    assert used == set(range(1, len(frames) + 1)), "a data frame no descriptor names"
    return out


def _wire_bytes(v) -> bytes:
    return np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<"), copy=False).tobytes()


@pytest.mark.parametrize("n", [1, 4, 64])
def test_every_field_kind_is_laid_out_by_the_rules(n):
    """What `_core.Put` writes for every field kind, alone and all in one
    put (and 50 fields of ~24 KiB, across two shared frames): each
    descriptor names exactly its rows' bytes, by the layout rules."""
    data = _field_kinds(n)
    data["strided"] = np.arange(n * 12, dtype=np.float64).reshape(n, 12)[:, ::3]
    data["big_endian"] = np.arange(n * 3, dtype=">i4").reshape(n, 3)
    idx = list(range(1000, 1000 + n))
    many = {f"r{i}": np.full((n, 3000 // n), i, np.float64) for i in range(50)}  # ~24 KiB each: 1.2 MiB
    for one in [{k: data[k]} for k in data] + [data, many]:
        put = _core.Put(idx, one, 64 << 20)
        assert (put.rows, put.messages) == (n, 1)
        frame0, frames = put.encode(0, 7)
        assert msgpack.unpackb(frame0)["id"] == 7 and msgpack.unpackb(frame0)["body"]["global_indexes"] == idx
        got = _described(frame0, frames)
        assert list(got) == list(one)
        for k, v in one.items():
            if isinstance(v, np.ndarray):
                assert got[k] == _wire_bytes(v), k
            elif isinstance(v[0], np.ndarray):
                assert got[k] == [(r.shape, _wire_bytes(r)) for r in v], k
            else:
                assert got[k] == list(v), k
        if one is many:
            assert len(frames) == 2, "1.2 MiB of small pieces: two shared frames"


def test_every_input_kind_is_read_or_refused_with_its_words():
    """The inputs the fast path once left to Python are the core's now:
    read as they are (strided, big-endian, bits, values msgpack packs,
    puts of several messages) or refused with the words the Python client
    used (nothing sent)."""
    idx = [1, 2]
    ok = np.arange(6, dtype=np.float32).reshape(2, 3)
    for data, rows in (
        ({"x": ok.T.copy().T}, [ok.tobytes()]),  # not C-contiguous: sent as its blocks
        ({"x": ok.astype(">f4")}, [ok.tobytes()]),  # big-endian: swapped
        ({"x": stowage.BFloat16Bits(np.arange(6, dtype=np.uint16).reshape(2, 3))},
         [np.arange(6, dtype=np.uint16).tobytes()]),
        ({"x": [{"a": 1}, {"b": 2}]}, None),  # values msgpack packs
    ):
        frame0, frames = _core.Put(idx, data, 64 << 20).encode(0, 1)
        got = _described(frame0, frames)["x"]
        if rows is None:
            assert got == data["x"]
        else:
            assert [got] == rows
    for data, exc, words in (
        ({"x": np.zeros((3, 3), np.float32)}, ValueError, "field 'x' has 3 rows but 2 global indexes"),
        ({"x": np.array(1.0)}, ValueError, "needs a row axis"),
        ({"x": np.float32(1)}, TypeError, "field 'x': expected a numpy array"),
        ({"x": [ok[0], ok[1].astype(np.float64)]}, ValueError, r"must share one dtype, got \['float32', 'float64'\]"),
        ({"x": [ok[0], "a"]}, TypeError, "mixes arrays/tensors and plain values"),
        ({"x": [2**70, 1]}, TypeError, r"field 'x' row 0: cannot send int as a value"),
        ({"x": ok.astype(np.longdouble)}, TypeError, "has no stowage/1 equivalent"),
        ({1: ok}, TypeError, "field names must be str"),
        ({}, ValueError, "empty batch: data has no fields"),
        ({"x": memoryview(ok)}, TypeError, "expected a numpy array or torch tensor"),
        ({"x": stowage.Bits(np.zeros((2, 3), np.float32), "float8_e5m2")}, TypeError, "needs a uint8 or int8"),
    ):
        with pytest.raises(exc, match=words):
            _core.Put(idx, data, 64 << 20)
    with pytest.raises(ValueError, match="duplicate global index 1"):
        _core.Put([1, 1], {"x": ok}, 64 << 20)
    assert _core.Put(idx, {"x": ok}, 10).messages == 2  # a row a message


def _general(indexes: list) -> list:
    """The indexes as numpy scalars: not plainly ints, so the fast paths
    leave them to Python's checks (then the core reads the checked list)."""
    return [np.int64(g) for g in indexes]


@pytest.mark.parametrize("n", [1, 4, 64])
def test_fast_and_general_paths_store_and_return_the_same(endpoint, fresh, n):
    data = _field_kinds(n)
    a, b = fresh(n), fresh(n)
    with stowage.Client(endpoint, timeout=30) as c:
        assert c.put(a, data) == n  # the indexes read by the core
        assert c.put(_general(b), data) == n  # checked by Python first
        names = list(data)
        fast_a, fast_b = c.get(a, names, as_torch=False), c.get(np.asarray(b), tuple(names), as_torch=False)
        gen_a, gen_b = c.get(_general(a), names, as_torch=False), c.get(_general(b), names, as_torch=False)
        for got in (fast_a, fast_b, gen_a, gen_b):
            assert list(got) == names
            for k, v in data.items():
                if isinstance(v, np.ndarray):
                    np.testing.assert_array_equal(got[k], v, err_msg=k)
                    assert got[k].dtype == v.dtype, k
                elif isinstance(v[0], np.ndarray):
                    assert len(got[k]) == n
                    for r, w in zip(got[k], v):
                        np.testing.assert_array_equal(r, w, err_msg=k)
                else:
                    assert got[k] == v, k
        # get_into, fast (dicts of C-contiguous arrays) and general (a
        # mapping that is not a dict).
        regular = [k for k, v in data.items() if isinstance(v, np.ndarray)]
        for make in (dict, lambda d: types.MappingProxyType(dict(d))):
            out = make({k: np.full_like(data[k], 7) for k in regular})
            assert c.get_into(np.asarray(a, np.int32), out) is out
            for k in regular:
                np.testing.assert_array_equal(out[k], data[k], err_msg=k)
        with pytest.raises(ValueError, match="read-only"):
            ro = np.empty_like(data["f32"])
            ro.flags.writeable = False
            c.get_into(a, {"f32": ro})
        with pytest.raises(ValueError, match="has dtype float64, but field 'f32' is float32"):
            c.get_into(a, {"f32": np.empty(data["f32"].shape, np.float64)})
        with pytest.raises(TypeError, match="holds plain values"):
            c.get_into(a, {"strs": np.empty((n, 1), np.float32)})
        # One field by name as a str, and the fast clear.
        np.testing.assert_array_equal(c.get(a[::-1], "f32")["f32"], data["f32"][::-1])
        assert c.clear(a, ["f32", "strs"]) == 2 * n
        assert c.clear(np.asarray(a)) == (len(data) - 2) * n
        assert c.clear(_general(b)) == len(data) * n
        with pytest.raises(stowage.KeyNotFound):
            c.get(a, ["f32"])


def test_a_refused_fast_put_raises_as_stowd_says_and_stores_nothing(small_server, fresh):
    """stowd's error reply to a fast put: raised as its error, with
    rows_stored 0; the client goes on."""
    idx = fresh(4)
    with stowage.Client(small_server["native"], timeout=10) as c:
        with pytest.raises(stowage.StowageError) as e:
            c.put(idx, {"x": np.zeros((4, 4096), np.float32)})  # more than the units hold
        assert e.value.rows_stored == 0
        with pytest.raises(stowage.KeyNotFound):
            c.get(idx, ["x"])
        assert c.put(idx, {"x": np.ones((4, 2), np.float32)}) == 4
        np.testing.assert_array_equal(c.get(idx, ["x"])["x"], np.ones((4, 2), np.float32))
        assert c.clear(idx) == 4  # (the units are small, and shared by the session's tests)


def test_a_fast_put_answered_wrongly_is_a_protocol_error(fake_server):
    """A put_ok for other rows, or another id, is not taken as success."""
    def reply(ident, frames):
        env = msgpack.unpackb(frames[0])
        return [[msgpack.packb({"proto": "stowage/1", "op": "put_ok", "id": env["id"], "body": {"rows": 99}})]]

    srv = fake_server(reply)
    with stowage.Client(srv.endpoint, timeout=5) as c:
        with pytest.raises(stowage.ProtocolError, match="does not answer"):
            c.put([1, 2], {"x": np.zeros((2, 2), np.float32)})


def test_the_small_calls_make_no_closure_cells():
    """A name that a lambda anywhere in a function takes is a cell, made and
    freed on each call whichever branch runs: the calls a small call goes
    through keep their lambdas in helpers of their own."""
    from stowage import aio, client
    hot = [client.Client.get, client.Client.put, client.Client.get_into, client.Client._get_into,
           client.Client.clear, client.Client._ask, client.Client._core_call,
           aio.AsyncClient.get, aio.AsyncClient.put, aio.AsyncClient.get_into, aio.AsyncClient.clear,
           aio.AsyncClient._ask, aio.AsyncClient._in_loop]
    assert {f.__qualname__: f.__code__.co_cellvars for f in hot if f.__code__.co_cellvars} == {}


def test_a_put_ok_written_another_way_is_read_and_taken(fake_server):
    """The client takes a put_ok in stowd's own bytes without reading it;
    one written another way (keys in another order, rows as a wider int)
    or with a stray key is read as before: taken, or refused, by sync and
    async puts alike."""
    def reply(ident, frames):
        env = msgpack.unpackb(frames[0])
        rows = len(env["body"]["global_indexes"])
        if env["body"]["global_indexes"][0] == 1:  # keys reordered, rows as a uint32
            body = b"\x81\xa4rows\xce" + rows.to_bytes(4, "big")
            return [[b"\x84\xa2id" + msgpack.packb(env["id"]) + b"\xa4body" + body
                     + b"\xa2op\xa6put_ok\xa5proto\xa9stowage/1"]]
        bad = {"proto": "stowage/1", "op": "put_ok", "id": env["id"], "body": {"rows": rows}, "zz": 1}
        return [[msgpack.packb(bad)]]

    srv = fake_server(reply)
    x = np.zeros((2, 2), np.float32)
    with stowage.Client(srv.endpoint, timeout=5) as c:
        assert c.put([1, 2], {"x": x}) == 2
        with pytest.raises(stowage.ProtocolError):
            c.put([5, 6], {"x": x})

    async def main():
        async with stowage.AsyncClient(srv.endpoint, timeout=5) as c:
            assert await c.put([1, 2], {"x": x}) == 2
            with pytest.raises(stowage.ProtocolError):
                await c.put([5, 6], {"x": x})

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_async_client_sends_small_calls_through_the_core_codec(endpoint, fresh):
    data = _field_kinds(4)
    idx = fresh(4)

    async def main():
        async with stowage.AsyncClient(endpoint, timeout=30) as c:
            assert await c.put(idx, data) == 4
            got = await c.get(np.asarray(idx, np.uint32), list(data), as_torch=False)
            assert await c.clear(idx) == 4 * len(data)
            with pytest.raises(ValueError, match="duplicate global index"):
                await c.put([idx[0], idx[0]], {"x": np.zeros((2, 1), np.float32)})
            return got

    got = asyncio.run(asyncio.wait_for(main(), 60))
    np.testing.assert_array_equal(got["f32"], data["f32"])
    assert got["strs"] == data["strs"] and got["plain"] == data["plain"]
    for r, w in zip(got["nested"], data["nested"]):
        np.testing.assert_array_equal(r, w)


@pytest.mark.parametrize("rows", [3, 1000])  # under and over the bytes a reply's fields share one buffer for
def test_a_gets_arrays_are_read_only_views_of_the_cores_own_buffer(endpoint, fresh, rows):
    """The core makes a get's arrays itself (numpy's C API) over the buffer
    it received them into: every dtype and shape reads back equal, each
    array's base is that buffer, none is writable (a write raises), each
    is C-contiguous, and none claims an alignment it lacks (checked on
    nested rows of odd byte lengths among the others too)."""
    dtypes = [np.bool_, np.int8, np.uint16, np.float16, np.int32, np.float32, np.int64, np.float64,
              np.complex64, np.complex128]
    data = {f"d{i}": (np.arange(rows * 6) % 7).astype(dt).reshape(rows, 2, 3) for i, dt in enumerate(dtypes)}
    data["odd"] = [np.arange(i % 3 + 1, dtype=np.uint8) for i in range(rows)]
    data["after"] = [np.arange(i % 4 + 1, dtype=np.float64) for i in range(rows)]
    idx = fresh(rows)
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(idx, data)
        got = c.get(idx, list(data))
    arrays = []
    for k, want in data.items():
        if type(want) is list:
            assert len(got[k]) == rows
            for r, w in zip(got[k], want):
                np.testing.assert_array_equal(r, w, err_msg=k)
                assert r.dtype == w.dtype, k
                arrays.append(r)
        else:
            np.testing.assert_array_equal(got[k], want, err_msg=k)
            assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
            arrays.append(got[k])
    for a in arrays:
        assert type(a.base).__name__ == "Buffer", type(a.base)
        assert not a.flags.writeable and a.flags.c_contiguous
        with pytest.raises(ValueError, match="read-only"):
            a.flat[0] = a.flat[0]
        if a.flags.aligned:
            assert a.ctypes.data % a.dtype.alignment == 0, (a.dtype, a.ctypes.data)


@pytest.mark.parametrize("rows", [3, 1000])  # under and over the bytes a reply's fields share one buffer for
def test_a_gets_fields_are_aligned_apart_and_outlive_each_other(endpoint, fresh, rows):
    """A small reply's fields share one receive buffer, a large one's each
    have their own: either way every array is aligned for its dtype, no two
    overlap, empty nested rows and zero-width fields read as empty, and an
    array stays right after the others are dropped."""
    rng = np.random.default_rng(rows)
    data = {
        "u8": rng.integers(0, 255, (rows, 3), dtype=np.uint8),  # 3 bytes a row: odd sizes before the next
        "f64": rng.standard_normal((rows, 5)),
        "c128": (rng.standard_normal((rows, 2)) + 1j).astype(np.complex128),
        "empty": np.zeros((rows, 0), np.float32),
        "nested": [np.arange(i % 3, dtype=np.int16) for i in range(rows)],  # rows 0, 3, 6, ...: empty
        "strs": [f"s{i}" for i in range(rows)],
    }
    idx = fresh(rows)
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(idx, data)
        got = c.get(idx, list(data))
        spans = []
        for k in ("u8", "f64", "c128"):
            a = got[k]
            np.testing.assert_array_equal(a, data[k], err_msg=k)
            assert a.ctypes.data % a.dtype.alignment == 0 and a.flags.aligned, k
            spans.append((a.ctypes.data, a.ctypes.data + a.nbytes))
        for r, w in zip(got["nested"], data["nested"]):
            np.testing.assert_array_equal(r, w)
            if r.size:
                spans.append((r.ctypes.data, r.ctypes.data + r.nbytes))
        assert got["empty"].shape == (rows, 0) and got["strs"] == data["strs"]
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two arrays of one get overlap"
        keep = got["c128"]
        del got
        np.testing.assert_array_equal(keep, data["c128"])


def test_a_gets_keys_are_made_once_and_stay_right(endpoint, fresh):
    """A get's dict is keyed by one Python string a field name, made for
    the first get and reused by the next (the same object), for the sync
    and the async client alike; names over 256 bytes, and more names than
    the table keeps (1,024: it starts over), still come back as keys equal
    to the names asked for, each with its own rows."""
    idx = fresh(2)
    long_name = "L" * 300
    names = [f"k{i}" for i in range(40)] + [long_name]
    data = {n: np.full((2, 3), i, np.int32) for i, n in enumerate(names)}
    with stowage.Client(endpoint, timeout=30) as c:
        c.put(idx, data)
        first = c.get(idx, names, as_torch=False)
        second = c.get(idx, names, as_torch=False)
        assert list(first) == names and list(second) == names
        k1 = {k: k for k in first}
        for k in second:
            if k != long_name:
                assert k is k1[k], k
        for i, n in enumerate(names):
            assert second[n].tolist() == [[i] * 3] * 2
        # More distinct names than the table keeps: every key still right.
        many = [f"m{i}" for i in range(1100)]
        for chunk in range(0, len(many), 100):
            part = many[chunk:chunk + 100]
            c.put(idx, {n: np.full((2, 1), j, np.int16) for j, n in enumerate(part)})
            got = c.get(idx, part, as_torch=False)
            assert list(got) == part
            assert all(got[n].tolist() == [[j], [j]] for j, n in enumerate(part))
        c.clear(idx)

    async def main():
        async with stowage.AsyncClient(endpoint, timeout=30) as a:
            await a.put(idx, data)
            g1 = await a.get(idx, names, as_torch=False)
            g2 = await a.get(idx, names, as_torch=False)
            await a.clear(idx)
            return g1, g2

    g1, g2 = asyncio.run(main())
    assert list(g1) == names and list(g2) == names
    k1 = {k: k for k in g1}
    assert all(k is k1[k] for k in g2 if k != long_name)


def test_gets_of_one_connection_follow_every_change_of_a_fields_layout(endpoint, fresh):
    """The core keeps the last get_ok's layout and takes it again for a
    reply whose descriptors are the same bytes. Gets on one connection of
    the same field name, stored again between them with other values, then
    another dtype, shape, row kind, and back: every get has the rows and
    the dtype and shape stored last, through get and get_into alike."""
    idx = fresh(4)
    rng = np.random.default_rng(7)
    a = rng.random((4, 16), dtype=np.float32)
    stored = [
        a,
        a + 1,  # the same layout, other bytes
        rng.integers(0, 1 << 40, (4, 16), dtype=np.int64),
        rng.random((4, 8), dtype=np.float32),
        rng.integers(-9, 9, (4, 16), dtype=np.int32),
        rng.integers(0, 255, (4, 64), dtype=np.uint8),  # (a descriptor as long as the last)
        rng.random((4, 16), dtype=np.float32).astype(">f4"),
        [np.arange(n, dtype=np.int16) for n in (3, 0, 5, 1)],
        ["a", b"b", 3, None],
        a,
    ]
    with stowage.Client(endpoint, timeout=30) as c:
        for k, x in enumerate(stored):
            c.put(idx, {"x": x, "y": np.full((4, 2), k, np.uint8)})
            for _ in range(2):
                got = c.get(idx, ["x", "y"], as_torch=False)
                assert got["y"].tolist() == [[k, k]] * 4, k
                if isinstance(x, np.ndarray):
                    native = x.dtype.newbyteorder("=")  # (stored in the machine's order)
                    assert got["x"].dtype == native and got["x"].shape == x.shape, k
                    np.testing.assert_array_equal(got["x"], x)
                    into = {"x": np.empty(x.shape, native), "y": np.empty((4, 2), np.uint8)}
                    c.get_into(idx, into)
                    np.testing.assert_array_equal(into["x"], x)
                elif isinstance(x[0], np.ndarray):
                    assert [r.tolist() for r in got["x"]] == [r.tolist() for r in x], k
                else:
                    assert got["x"] == x, k
        c.clear(idx)
