"""The map probes' prefetching (D-PERF-47, optimized/_native_warm.h).

The prefetching changes no result (the pool's map loops are held to their
Python twins in test_native.py), so what can go wrong is where it reads:
it walks CPython's dict table through a mirror of a private layout, and a
wrong mirror or probe sequence would warm the wrong lines (or read past a
table). ``_native.map_probe`` runs the same walk to its end and answers the
entry index each key's probe settles on; these tests hold it to the dict's
own answers. A dict built by insertions alone keeps its entries in
insertion order, and deleting keys leaves the remaining entries where they
were (their slots turn into deleted markers the probes must step over), so
the expected index of each key is its insertion position.
"""

from __future__ import annotations

import os
import random
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pagedkv.optimized.native import NATIVE

needs_native = pytest.mark.skipif(NATIVE is None, reason="built without the C module")


def probe(table: dict[bytes, int], keys: list[object]) -> list[int]:
    assert NATIVE is not None
    found = NATIVE.map_probe(table, keys)
    if found is None:
        pytest.skip("the probe walk does not read this CPython's dict layout (a no-op here)")
    return list(found)


def keys_of(count: int, seed: int, size: int = 32) -> list[bytes]:
    rng = random.Random(seed)
    return list(dict.fromkeys(rng.randbytes(size) for _ in range(count)))


@needs_native
@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 3000), seed=st.integers(0, 2**32), size=st.sampled_from([1, 2, 8, 32]),
       deleted=st.floats(0.0, 0.9))
def test_the_walk_settles_where_the_dict_keeps_each_key(count: int, seed: int, size: int, deleted: float) -> None:
    keys = keys_of(count, seed, size)
    table = {key: index for index, key in enumerate(keys)}
    rng = random.Random(seed)
    gone = {key for key in keys if rng.random() < deleted}
    for key in gone:
        del table[key]  # no resize on deletion: the others keep their entry index
    found = probe(table, list(keys))
    assert found == [-1 if key in gone else index for index, key in enumerate(keys)]


@needs_native
@pytest.mark.parametrize("count", [5, 100, 20_000, 50_000])
def test_every_index_width_is_read(count: int) -> None:
    # 1-, 2- and 4-byte index slots (tables of up to 128, 32768 and 2**32 slots).
    keys = keys_of(count, count)
    table = dict.fromkeys(keys, 0)
    assert probe(table, list(keys)) == list(range(len(keys)))
    assert probe(table, [os.urandom(40) for _ in range(50)]) == [-1] * 50


@needs_native
def test_the_walk_skips_what_is_not_exact_bytes() -> None:
    class Key(bytes):
        def __hash__(self) -> int:
            raise AssertionError("the walk ran a key's Python __hash__")

    table = {b"a": 1, b"b": 2}
    assert probe(table, [b"b", Key(b"a"), "a", 3, b"c"]) == [1, -2, -2, -2, -1]


@needs_native
def test_tables_the_walk_does_not_read_are_declined() -> None:
    assert NATIVE is not None

    class Holder:
        def __init__(self) -> None:
            self.a = 1

    assert NATIVE.map_probe({"a": 1}, [b"a"]) is None        # unicode keys: another entry layout
    assert NATIVE.map_probe({}, [b"a"]) is None               # the shared empty table
    assert NATIVE.map_probe(vars(Holder()), [b"a"]) is None   # a split table
    assert NATIVE.map_probe(dict.fromkeys([b"a"]), (b"a",)) is not None
    not_a_dict: Any = []
    not_a_sequence: Any = iter([b"a"])
    assert NATIVE.map_probe(not_a_dict, [b"a"]) is None
    assert NATIVE.map_probe({b"a": 1}, not_a_sequence) is None
