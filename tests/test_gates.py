"""The gates can fail: planted bugs are caught.

A property gate that never fails proves nothing. These tests plant bugs and
require the gates to catch them: the lockstep machine against a mutant whose
free order is wrong, and ``check_invariants()`` against corrupted states,
naming the right invariant ID.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import pagedkv.reference as reference
import tests.test_differential as differential
from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.spec import FullAttentionSpec, InvariantViolation, KVCacheConfig, KVCacheGroupSpec


class HeadFirstFreeManager(reference.KVCacheManager):
    """A planted bug: frees a request's blocks head first, so the prefix root
    would be evicted before the tail (the wrong LRU order)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pool = self.block_pool
        release = pool.free_blocks

        def head_first(blocks: Iterable[KVCacheBlock]) -> None:
            release(list(blocks)[::-1])

        pool.free_blocks = head_first  # type: ignore[method-assign, assignment]


def test_lockstep_machine_catches_a_planted_free_order_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(differential, "optimized", SimpleNamespace(KVCacheManager=HeadFirstFreeManager))
    with pytest.raises(AssertionError, match="snapshots differ|!="):
        run_state_machine_as_test(  # type: ignore[no-untyped-call]
            differential.LockstepMachine,
            settings=settings(max_examples=300, stateful_step_count=60, deadline=None, database=None,
                              derandomize=True, print_blob=False, phases=[Phase.generate],
                              suppress_health_check=list(HealthCheck)),
        )


def _manager() -> Any:
    config = KVCacheConfig(8, (), (KVCacheGroupSpec(("l",), FullAttentionSpec(2, 1, 8, "float16")),))
    manager = reference.KVCacheManager(config, 32)
    request = manager.make_request("a", [1, 2, 3, 4, 5])
    manager.allocate_slots(request, 5)
    manager.check_invariants()
    return manager


@pytest.mark.parametrize("corrupt, invariant", [
    (lambda m: setattr(m.block_pool.blocks[1], "ref_cnt", 2), "REQ-1"),
    (lambda m: m.block_pool.free_queue.append(m.block_pool.free_queue[0]), "POOL-2"),
    (lambda m: m.block_pool.free_queue.insert(0, m.block_pool.blocks[0]), "POOL-1"),
    (lambda m: setattr(m.block_pool.blocks[5], "block_hash", b"\0" * 36), "CACHE-1"),
    (lambda m: m.block_pool.cached.clear(), "CACHE-1"),
    (lambda m: m.coordinator.managers[0].num_cached_blocks.__setitem__("a", 9), "REQ-2"),
    (lambda m: m.coordinator.known.add("ghost"), "REQ-5"),
])
def test_check_invariants_names_the_broken_invariant(corrupt: Any, invariant: str) -> None:
    manager = _manager()
    corrupt(manager)
    with pytest.raises(InvariantViolation, match=f"^{invariant}:"):
        manager.check_invariants()
