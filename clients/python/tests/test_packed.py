"""Nested fields without an array per row (`stowage.Packed`), through a real
stowd: puts of values + row shapes, gets with `nested="packed"` over tcp
and same node; the bytes on the wire
are the same nested field a list of rows gives, so either form reads the
other's rows."""

from __future__ import annotations

import numpy as np
import pytest

import stowage
from stowage import Packed

SHAPES = [(3,), (0,), (5,), (1,), (2,)]


def packed(dtype="int32", shapes=SHAPES, start=0):
    total = sum(int(np.prod(s)) for s in shapes)
    return Packed(np.arange(start, start + total, dtype=dtype), list(shapes))


def rows_of(p: Packed) -> list:
    out, at = [], 0
    for s in p.shapes:
        k = int(np.prod(s))
        out.append(np.asarray(p.values[at:at + k]).reshape(s))
        at += k
    return out


def assert_rows(got: list, want: list):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)


@pytest.fixture
def client(endpoint):
    with stowage.Client(endpoint) as c:
        yield c


def test_packed_put_reads_as_rows_and_packed(client, fresh):
    idx = fresh(len(SHAPES))
    p = packed()
    client.put(idx, {"p": p, "x": np.ones((len(SHAPES), 2), np.float32)})
    got = client.get(idx, ["p"])["p"]
    assert_rows(got, rows_of(p))
    back = client.get(idx, ["p", "x"], nested="packed")
    assert isinstance(back["p"], Packed) and back["p"].shapes == SHAPES
    assert back["p"].values.dtype == np.int32 and np.array_equal(back["p"].values, p.values)
    assert not back["p"].values.flags.writeable  # read-only, as every get result
    assert back["x"].shape == (len(SHAPES), 2)  # regular fields as always
    assert list(back["p"].offsets()) == [0, 3, 3, 8, 9, 11]


def test_packed_get_of_a_reordered_subset_with_repeats(client, fresh):
    idx = fresh(len(SHAPES))
    client.put(idx, {"p": [r for r in rows_of(packed("float64"))]})  # put as a list of rows
    pick = [idx[4], idx[0], idx[4], idx[1]]
    back = client.get(pick, ["p"], nested="packed")["p"]
    want = rows_of(packed("float64"))
    assert_rows(rows_of(back), [want[4], want[0], want[4], want[1]])


def test_rows_of_several_tails_and_scalars(client, fresh):
    shapes = [(2, 3), (), (4,), (1, 1, 2)]
    idx = fresh(len(shapes))
    p = packed("int16", shapes)
    client.put(idx, {"p": p})
    assert_rows(client.get(idx, ["p"])["p"], rows_of(p))
    back = client.get(idx[::-1], ["p"], nested="packed")["p"]
    assert back.shapes == shapes[::-1]
    assert_rows(rows_of(back), rows_of(p)[::-1])


def test_a_large_packed_field_is_one_frame_each_way(endpoint, fresh):
    """4,096 rows, 4 MiB: put as one piece, got back as one buffer whose
    values are a view of what the core received (no gather)."""
    rng = np.random.default_rng(3)
    lens = rng.integers(0, 512, 4096)
    p = Packed(rng.standard_normal(int(lens.sum())).astype(np.float32), [(int(k),) for k in lens])
    idx = fresh(len(lens))
    with stowage.Client(endpoint) as c:
        c.put(idx, {"p": p})
        back = c.get(idx, ["p"], nested="packed")["p"]
    assert back.shapes == p.shapes and np.array_equal(back.values, p.values)
    assert back.values.base is not None  # a view of a received buffer, not a fresh array


@pytest.mark.parametrize("bad, match", [
    (Packed(np.arange(5), [(3,), (3,)]), "hold 6 elements, values has 5"),
    (Packed(np.arange(3), [(3,)]), "must list 2 row shapes"),
    (Packed(np.arange(3), [(3,), (-1,)]), "negative"),
    (Packed(np.arange(3), "no"), "must list 2 row shapes"),
])
def test_bad_packed_fields_are_refused_before_sending(endpoint, fresh, bad, match):
    with stowage.Client(endpoint) as c:
        before = c.stats()["keys"]
        with pytest.raises(ValueError, match=match):
            c.put(fresh(2), {"p": bad})
        assert c.stats()["keys"] == before


def test_nested_must_be_rows_or_packed(endpoint, fresh):
    with stowage.Client(endpoint) as c:
        with pytest.raises(ValueError, match="nested must be"):
            c.get(fresh(1), ["p"], nested="jagged")


def test_same_node_packed(shm_server, fresh):
    idx = fresh(len(SHAPES))
    p = packed("uint8")
    with stowage.Client(shm_server["native"], same_node=True) as c:
        c.put(idx, {"p": p})
        back = c.get(idx, ["p"], nested="packed")["p"]
        assert back.shapes == SHAPES and np.array_equal(back.values, p.values)
        with pytest.raises(ValueError):
            back.values[0] = 1  # a shared mapping: read-only
        sub = c.get([idx[2], idx[0], idx[2]], ["p"], nested="packed")["p"]
        assert np.array_equal(sub.values, np.concatenate([rows_of(p)[2], rows_of(p)[0], rows_of(p)[2]]))
        # rows of one shape are a regular field, packed or not
        same = c.get([idx[2], idx[2]], ["p"], nested="packed")["p"]
        assert isinstance(same, np.ndarray) and same.shape == (2, 5)


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory):
    import os
    import shutil

    from stowd_harness import run_stowd

    shm_dir = f"/dev/shm/stowage-test-packed-{os.getpid()}"
    shutil.rmtree(shm_dir, ignore_errors=True)
    with run_stowd(tmp_path_factory.mktemp("packed"), config=f'[shm]\ndir = "{shm_dir}"\ninline_below = 0\n',
                   name="stowd-packed") as s:
        yield s
    shutil.rmtree(shm_dir, ignore_errors=True)
