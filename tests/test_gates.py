"""The gates can fail: planted bugs are caught.

A property gate that never fails proves nothing. These tests plant bugs and
require the gates to catch them:

- for every invariant ID of spec/state.md, a corruption planted in each
  implementation's state (or, for the post-conditions the lockstep machines
  assert, in its answer) is reported under that ID — by ``check_invariants()``
  or by ``tests/postconditions.py``;
- the lockstep machine catches a planted behaviour bug (a free order that is
  wrong), and its failure report names the operation that went wrong.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import pagedkv.optimized as optimized
import pagedkv.reference as reference
import tests.test_differential as differential
from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.spec import FullAttentionSpec, InvariantViolation, KVCacheConfig, KVCacheGroupSpec, SlidingWindowMLASpec
from pagedkv.spec.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.types import BlockHash, BlockRemoved, get_block_hash, make_block_hash_with_group_id
from tests import postconditions
from tests.implementations import IMPLEMENTATIONS

# -- a state with every group type, built by each implementation ---------------------

FULL, SWA, CHUNK, MAMBA, XATTN, SINK, FULL2 = range(7)
"""Group ids of :func:`_hybrid` (the sliding window is 3 tokens, the chunk 4)."""
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def _hybrid(implementation: Any, *, enable_caching: bool = True, events: bool = False) -> Any:
    """One request of 9 tokens computed in every group type, the blocks of
    its full prefix cached, no events unless asked."""
    specs = [
        FullAttentionSpec(2, 1, 8, "float16"),
        SlidingWindowSpec(2, 1, 8, "float16", sliding_window=3),
        ChunkedLocalAttentionSpec(2, 1, 8, "float16", attention_chunk_size=4),
        MambaSpec(2, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="all"),
        CrossAttentionSpec(2, 1, 8, "float16"),
        SinkFullAttentionSpec(2, 1, 8, "float16", sink_len=2),
        FullAttentionSpec(2, 1, 8, "float16"),
    ]
    config = KVCacheConfig(80, (), tuple(KVCacheGroupSpec((f"layer.{g}",), spec) for g, spec in enumerate(specs)))
    manager = implementation.KVCacheManager(config, 32, enable_caching=enable_caching,
                                            enable_kv_cache_events=events, max_num_batched_tokens=2)
    request = manager.make_request("a", PROMPT)
    assert manager.allocate_slots(request, len(PROMPT), num_encoder_tokens=4) is not None
    request.num_computed_tokens = len(PROMPT)
    # A decode step: the windows move on, their dead blocks become null.
    request.append_output_token_ids([10])
    assert manager.allocate_slots(request, 1) is not None
    manager.check_invariants()
    return manager, request


class Surgery:
    """The few state edits the corruptions need, in each representation."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.pool = manager.block_pool
        self.groups = manager.coordinator.managers
        self.is_reference = isinstance(self.pool.null_block, KVCacheBlock)

    def ids(self, group: int, request_id: str = "a") -> list[int]:
        """The request's block ids in ``group``."""
        blocks = self.groups[group].req_to_blocks[request_id]
        return [block.block_id for block in blocks] if self.is_reference else list(blocks)

    def put(self, group: int, position: int | None, block_id: int, request_id: str = "a") -> None:
        """Write ``block_id`` into the request's list (append with ``None``)."""
        blocks = self.groups[group].req_to_blocks[request_id]
        value = self.pool.blocks[block_id] if self.is_reference else block_id
        if position is None:
            blocks.append(value)
        else:
            blocks[position] = value

    def take(self) -> int:
        """A fresh block off the free queue (ref count 1, held by nobody)."""
        block = self.pool.get_new_blocks(1)[0]
        return int(block.block_id if self.is_reference else block)

    def add_ref(self, block_id: int, delta: int) -> None:
        if self.is_reference:
            self.pool.blocks[block_id].ref_cnt += delta
        else:
            self.pool.ref_counts[block_id] += delta

    def key(self, block_id: int) -> bytes | None:
        return self.manager.snapshot().pool.block_hashes[block_id]  # type: ignore[no-any-return]

    def set_key(self, block_id: int, raw: bytes, group: int) -> None:
        """Give the block the key ``(raw, group)``, map and block agreeing."""
        self.drop_key(block_id)
        if self.is_reference:
            key = make_block_hash_with_group_id(raw, group)  # type: ignore[arg-type]
            block = self.pool.blocks[block_id]
            block.block_hash = key
            self.pool.cached.setdefault(key, []).append(block)
        else:
            self.pool.block_hashes[block_id] = raw
            self.pool.block_group_ids[block_id] = group
            while len(self.pool.cached_by_group) <= group:
                self.pool.cached_by_group.append({})
                self.pool.dup_by_group.append({})
            # First holder in the table, later ones in the duplicates (D-PERF-10).
            if self.pool.cached_by_group[group].setdefault(raw, block_id) != block_id:
                self.pool.dup_by_group[group].setdefault(raw, []).append(block_id)

    def drop_key(self, block_id: int) -> None:
        if self.is_reference:
            block = self.pool.blocks[block_id]
            if block.block_hash is not None:
                holders = self.pool.cached[block.block_hash]
                holders.remove(block)
                if not holders:
                    del self.pool.cached[block.block_hash]
                block.block_hash = None
        else:
            raw, group = self.pool.block_hashes[block_id], self.pool.block_group_ids[block_id]
            if raw is not None:
                table, dups = self.pool.cached_by_group[group], self.pool.dup_by_group[group]
                holders = self.pool.holders(group, raw)
                holders.remove(block_id)
                del table[raw]
                dups.pop(raw, None)
                if holders:
                    table[raw] = holders[0]
                if holders[1:]:
                    dups[raw] = holders[1:]
                self.pool.block_hashes[block_id] = None
                self.pool.block_group_ids[block_id] = -1

    def queue_held_block(self, block_id: int) -> None:
        if self.is_reference:
            self.pool.free_queue.append(self.pool.blocks[block_id])
        else:
            self.pool.free_queue.push_back([block_id])

    def queue_null_block(self) -> None:
        if self.is_reference:
            self.pool.free_queue.insert(0, self.pool.null_block)
        else:
            self.pool.free_queue.push_front([0])

    def unqueue(self, block_id: int) -> None:
        if self.is_reference:
            self.pool.free_queue.remove(self.pool.blocks[block_id])
        else:
            self.pool.free_queue.remove(block_id)

    def num_cached(self, group: int) -> dict[str, int]:
        manager = self.groups[group]
        # ``cached_count`` is the optimized name until the vocabulary is one (issue 9).
        table = manager.num_cached_blocks if hasattr(manager, "num_cached_blocks") else manager.cached_count
        return table  # type: ignore[no-any-return]

    def known(self) -> set[str]:
        return self.manager.coordinator.known if self.is_reference else self.manager.coordinator.requests  # type: ignore[no-any-return]

    def events(self) -> list[Any]:
        return self.pool.events if self.is_reference else self.pool.pending_events  # type: ignore[no-any-return]

    def plant_foreign_state(self, group: int) -> None:
        """A state remembered this step under another group's key."""
        states = self.groups[group].cached_this_step
        some = next(iter(states))
        if self.is_reference:
            states.add(make_block_hash_with_group_id(get_block_hash(some), group + 1))
        else:
            states.add(make_block_hash_with_group_id(some, group + 1))  # a key, not a raw hash


def _real(surgery: Surgery, group: int) -> int:
    return next(block for block in surgery.ids(group) if block)


def _corrupt_pool_3(s: Surgery) -> None:
    s.add_ref(s.take(), -2)  # ref -1, out of the queue: consistent with POOL-2


def _duplicate_in_group(s: Surgery) -> None:
    block = _real(s, FULL)
    s.put(FULL, None, block)
    s.add_ref(block, 1)


def _share_across_groups(s: Surgery) -> None:
    block = _real(s, FULL)
    s.put(FULL2, None, block)
    s.add_ref(block, 1)


def _move_key_to_other_group(s: Surgery) -> None:
    block = s.ids(FULL)[0]
    s.set_key(block, get_block_hash(s.key(block)), FULL2)  # type: ignore[arg-type]


def _hash_cross_attention_block(s: Surgery) -> None:
    block = _real(s, XATTN)
    s.set_key(block, b"\1" * 32, XATTN)


def _hash_sink_block(s: Surgery) -> None:
    sink = s.groups[SINK].sink_blocks[0]
    s.set_key(sink.block_id if s.is_reference else sink, b"\2" * 32, SINK)


def _free_block_keyed_for_missing_group(s: Surgery) -> None:
    block = s.pool.free_queue[0].block_id if s.is_reference else s.pool.free_queue.front()
    s.set_key(block, b"\3" * 32, len(s.groups))


def _patch_usage(monkeypatch: pytest.MonkeyPatch, s: Surgery) -> None:
    monkeypatch.setattr(type(s.pool), "get_usage", lambda self: 0.5)


# ID -> (how the state is built, the corruption). Every ID of spec/state.md
# that check_invariants() decides.
STATE_CORRUPTIONS: dict[str, tuple[dict[str, bool], Callable[[Surgery], None]]] = {
    "POOL-1": ({}, lambda s: s.queue_null_block()),
    "POOL-2": ({}, lambda s: s.queue_held_block(s.ids(FULL)[0])),
    "POOL-3": ({}, _corrupt_pool_3),
    "CACHE-1": ({}, lambda s: s.pool.cached.clear() if s.is_reference else s.pool.cached_by_group[FULL].clear()),
    "CACHE-2": ({"enable_caching": False}, lambda s: s.set_key(s.ids(FULL)[0], b"\5" * 32, FULL)),
    "CACHE-3": ({}, _free_block_keyed_for_missing_group),
    "EVT-1": ({}, lambda s: s.events().append(BlockRemoved((BlockHash(b"\6" * 32),)))),
    "REQ-1": ({}, lambda s: s.add_ref(s.ids(FULL)[0], 1)),
    "REQ-2": ({}, lambda s: s.num_cached(FULL).__setitem__("a", 99)),
    "REQ-3": ({}, _move_key_to_other_group),
    "REQ-4": ({}, _duplicate_in_group),
    "REQ-5": ({}, lambda s: s.known().add("ghost")),
    "REQ-6": ({"enable_caching": False}, _share_across_groups),
    "SKIP-1": ({}, lambda s: s.put(SWA, None, 0)),
    "SINK-1": ({}, _hash_sink_block),
    "XATTN-1": ({}, _hash_cross_attention_block),
    "MAMBA-2": ({}, lambda s: s.plant_foreign_state(MAMBA)),
}


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("invariant", [*STATE_CORRUPTIONS, "POOL-4"])
def test_check_invariants_names_the_broken_invariant(invariant: str, implementation: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    options, corrupt = STATE_CORRUPTIONS.get(invariant, ({}, lambda s: None))
    manager, _ = _hybrid(IMPLEMENTATIONS[implementation], **options)
    surgery = Surgery(manager)
    if invariant == "POOL-4":
        _patch_usage(monkeypatch, surgery)  # a planted bug in the pool's own arithmetic
    else:
        corrupt(surgery)
    with pytest.raises(InvariantViolation, match=f"^{invariant}:"):
        manager.check_invariants()


# -- the post-conditions the machines assert, on each implementation ------------------

def _swap_first_full_blocks(s: Surgery) -> None:
    first, second = s.ids(FULL)[:2]
    s.put(FULL, 0, second)
    s.put(FULL, 1, first)


def _real_block_in_dead_position(group: int) -> Callable[[Surgery], None]:
    def corrupt(s: Surgery) -> None:
        assert s.ids(group)[0] == 0
        s.put(group, 0, s.take())
    return corrupt


def _over_the_cap(group: int) -> Callable[[Surgery], None]:
    # Real blocks where the window left null ones: within the call's reach.
    def corrupt(s: Surgery) -> None:
        for position in range(3):
            s.put(group, position, s.take())
    return corrupt


def _check_allocation(manager: Any, request: Any) -> None:
    postconditions.check_allocation(manager, "a", len(PROMPT), 1, 0)


def _check_admission_cap(manager: Any, request: Any) -> None:
    postconditions.check_admission_cap(manager, "a", len(PROMPT), 1, 0)


def _check_hit_with_wrong_block(manager: Any, request: Any) -> None:
    # A hit over two full-attention groups, built by the same implementation.
    implementation = next(module for module in IMPLEMENTATIONS.values()
                          if isinstance(manager, module.KVCacheManager))
    groups = tuple(KVCacheGroupSpec((f"layer.{g}",), FullAttentionSpec(2, 1, 8, "float16")) for g in range(2))
    manager = implementation.KVCacheManager(KVCacheConfig(20, (), groups), 32)
    first = manager.make_request("a", PROMPT)
    manager.allocate_slots(first, len(PROMPT))
    other = manager.make_request("b", PROMPT + [10])
    hit, length = manager.get_computed_blocks(other)
    block_ids = hit.get_block_ids()
    assert length == 8
    postconditions.check_hit(manager, other, block_ids, length)  # the honest answer passes
    block_ids[0][0] = block_ids[1][0]  # the same tokens' block of the other group
    postconditions.check_hit(manager, other, block_ids, length)


def _check_reordered_hashes(manager: Any, request: Any) -> None:
    request.block_hashes.reverse()
    postconditions.check_block_hashes(request, "sha256", manager.hash_block_size, None)


def _checkpoint_manager(manager: Any) -> tuple[Any, Surgery, Any]:
    """A Mamba prefill-checkpoint model (spec/examples.md §7a) of ``manager``'s
    implementation, after a 64-token chunk that reserved ``(48, 0)``."""
    implementation = next(module for module in IMPLEMENTATIONS.values()
                          if isinstance(manager, module.KVCacheManager))
    mamba = MambaSpec(32, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align",
                      num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=16)
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(16, 1, 8, "float16")),
              KVCacheGroupSpec(("mamba",), mamba))
    checkpointed = implementation.KVCacheManager(KVCacheConfig(40, (), groups), 1024, hash_block_size=16)
    request = checkpointed.make_request("a", list(range(104)))
    assert checkpointed.allocate_slots(request, 64) is not None
    postconditions.check_mamba_checkpoint(checkpointed, "a")  # the honest state passes
    return checkpointed, Surgery(checkpointed), request


def _check_checkpoint_column_nulled(manager: Any, request: Any) -> None:
    checkpointed, surgery, _ = _checkpoint_manager(manager)
    surgery.put(1, 0, 0)
    postconditions.check_mamba_checkpoint(checkpointed, "a")


def _check_checkpoint_published(manager: Any, request: Any) -> None:
    checkpointed, surgery, _ = _checkpoint_manager(manager)
    surgery.set_key(surgery.ids(1)[0], b"planted", 1)
    postconditions.check_mamba_checkpoint(checkpointed, "a")


def _check_offer_kept_after_free(manager: Any, request: Any) -> None:
    checkpointed, surgery, request = _checkpoint_manager(manager)
    checkpointed.free(request)
    postconditions.check_offers_dropped(checkpointed, "a")  # the honest free drops them
    group = surgery.groups[1]
    if surgery.is_reference:
        group.offers.append(("a", surgery.pool.blocks[1], 32))
    else:
        group.offers.setdefault("a", []).append((1, 32))
    postconditions.check_offers_dropped(checkpointed, "a")


def _check_hit_from_a_replayed_window(manager: Any, request: Any) -> None:
    """A bounded-replay window group (spec/examples.md §12) handed a block in a hit."""
    implementation = next(module for module in IMPLEMENTATIONS.values()
                          if isinstance(manager, module.KVCacheManager))
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(4, 1, 8, "float16")),
              KVCacheGroupSpec(("swa",), SlidingWindowMLASpec(4, 1, 8, "float16", sliding_window=8,
                                                             bounded_replay=True)))
    replay = implementation.KVCacheManager(KVCacheConfig(40, (), groups), 256, hash_block_size=4)
    first = replay.make_request("a", list(range(25)))
    assert replay.allocate_slots(first, 25) is not None
    other = replay.make_request("b", list(range(25)))
    hit, length = replay.get_computed_blocks(other)
    block_ids = hit.get_block_ids()
    postconditions.check_hit(replay, other, block_ids, length)  # the honest answer passes
    block_ids[1].extend(replay.get_block_ids("a")[1][:length // 4])
    postconditions.check_hit(replay, other, block_ids, length)


POSTCONDITION_CORRUPTIONS: dict[str, tuple[Callable[[Surgery], None], Callable[[Any, Any], None]]] = {
    "REQ-7": (_swap_first_full_blocks, lambda m, r: postconditions.check_position_keys(m, [r])),
    "HASH-1": (lambda s: None, _check_reordered_hashes),
    "HYB-1": (lambda s: None, _check_hit_with_wrong_block),
    "SKIP-1": (_real_block_in_dead_position(SWA), _check_allocation),
    "MAMBA-1": (_real_block_in_dead_position(MAMBA), _check_allocation),
    "SWA-1": (_over_the_cap(SWA), _check_admission_cap),
    "CHUNK-1": (_over_the_cap(CHUNK), _check_admission_cap),
    "MCKPT-1": (lambda s: None, _check_checkpoint_column_nulled),
    "MCKPT-3": (lambda s: None, _check_checkpoint_published),
    "MOFF-1": (lambda s: None, _check_offer_kept_after_free),
    "PFX-1": (lambda s: None, _check_hit_from_a_replayed_window),
}


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("invariant", list(POSTCONDITION_CORRUPTIONS))
def test_postconditions_name_the_broken_invariant(invariant: str, implementation: str) -> None:
    corrupt, check = POSTCONDITION_CORRUPTIONS[invariant]
    manager, request = _hybrid(IMPLEMENTATIONS[implementation])
    postconditions.check_position_keys(manager, [request])
    postconditions.check_block_hashes(request, "sha256", manager.hash_block_size, None)
    _check_allocation(manager, request)  # the honest state passes
    corrupt(Surgery(manager))
    with pytest.raises(InvariantViolation, match=f"^{invariant}:"):
        check(manager, request)


def test_every_state_md_id_has_a_gate() -> None:
    """A new ID in spec/state.md needs a planted corruption here."""
    text = (Path(__file__).resolve().parents[1] / "spec" / "state.md").read_text()
    ids = set(re.findall(r"^\| ([A-Z]+-\d+) \|", text, flags=re.MULTILINE))
    assert ids, "no IDs found in spec/state.md"
    # RING-1's, RSWA-1's and MRET-1's gates plant their corruptions on their own models:
    # tests/test_ring_scenarios.py, tests/test_rswa_scenarios.py, tests/test_eagle_retention.py.
    gated = set(STATE_CORRUPTIONS) | set(POSTCONDITION_CORRUPTIONS) | {"POOL-4", "RING-1", "RSWA-1", "MRET-1"}
    assert ids <= gated, f"IDs without a gate: {sorted(ids - gated)}"


# -- the lockstep machine catches a behaviour bug and names the operation -------------

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


class MutantLockstep(differential.LockstepMachine):
    """The full-attention machine with the mutant in place of optimized."""

    implementations = {"reference": reference, "mutant": SimpleNamespace(KVCacheManager=HeadFirstFreeManager)}


def test_lockstep_machine_catches_a_planted_free_order_bug_and_names_the_operation(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError, match="snapshots differ") as caught:
        run_state_machine_as_test(  # type: ignore[no-untyped-call]
            MutantLockstep,
            settings=settings(max_examples=300, stateful_step_count=60, deadline=None, database=None,
                              derandomize=True, print_blob=False, phases=[Phase.generate],
                              suppress_health_check=list(HealthCheck)),
        )
    report = "\n".join(getattr(caught.value, "__notes__", [])) + capsys.readouterr().out
    steps = [line for line in report.splitlines() if re.match(r"(\w+ = )?state\.", line)
             and not line.startswith(("state.agree()", "state.teardown()"))]
    assert steps, report
    # The last step is the operation after which the states differ: a free,
    # shown by its own name with its arguments.
    assert steps[-1].startswith("state.free(data=data(...), finish="), report
    assert "mutant" in str(caught.value)


def test_the_optimized_implementation_is_one_of_the_machines_implementations() -> None:
    assert list(differential.Lockstep.implementations.values()) == [reference, optimized]
