"""Groups outside prefix caching (PFX-1, D-API-40): a bounded-replay sliding
window next to full attention, as vLLM 0.33 serves DeepSeek-V4.1. Worked
example (spec/examples.md §12, "Bounded replay"): block size 4, window 8, a
25-token prompt cached by a first request; a second request with the same
prompt hits 24 tokens in the full-attention group and nothing in the window
group, and the engine replays the hit's last window (tokens 16..23)."""

from __future__ import annotations

from types import ModuleType

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowMLASpec

N = 0  # the null block
PROMPT = list(range(25))


def replay_manager(impl: ModuleType, window_block_size: int = 4) -> object:
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(4, 1, 8, "float16")),
              KVCacheGroupSpec(("swa",), SlidingWindowMLASpec(window_block_size, 1, 8, "float16",
                                                             sliding_window=8, bounded_replay=True)))
    manager: object = impl.KVCacheManager(KVCacheConfig(40, (), groups), 256, hash_block_size=4)
    return manager


def prefill(manager: object, request_id: str) -> None:
    request = manager.make_request(request_id, PROMPT)  # type: ignore[attr-defined]
    assert manager.allocate_slots(request, len(PROMPT)) is not None  # type: ignore[attr-defined]
    request.num_computed_tokens = len(PROMPT)


def test_the_window_group_never_hits_and_never_caches(impl: ModuleType) -> None:
    manager: object = replay_manager(impl)
    prefill(manager, "a")
    full, window = manager.get_block_ids("a")  # type: ignore[attr-defined]
    assert len(full) == len(window) == 7
    hit, length = manager.get_computed_blocks(  # type: ignore[attr-defined]
        manager.make_request("b", PROMPT))  # type: ignore[attr-defined]
    # The full group hits its 6 full blocks; the window group contributes nothing.
    assert length == 24
    assert hit.get_block_ids() == (full[:6], [])


def test_replay_adopts_the_hit_then_allocates_the_window(impl: ModuleType) -> None:
    manager: object = replay_manager(impl)
    prefill(manager, "a")
    full, _ = manager.get_block_ids("a")  # type: ignore[attr-defined]
    second = manager.make_request("b", PROMPT)  # type: ignore[attr-defined]
    hit, length = manager.get_computed_blocks(second)  # type: ignore[attr-defined]
    # A replay-only chunk: the engine recomputes tokens 16..23, which the hit
    # already covers, so it adopts the hit and asks for no slot past it.
    assert manager.allocate_slots(second, 0, length, hit) is not None  # type: ignore[attr-defined]
    second.num_computed_tokens = length - 8
    held_full, held_window = manager.get_block_ids("b")  # type: ignore[attr-defined]
    assert held_full == full[:6]
    # Positions the window skips at token 24 are null; the window gets fresh blocks.
    assert held_window[:4] == [N] * 4 and len(held_window) == 6
    assert not set(held_window[4:]) & ({N} | set(full))
    # The rest of the replay and the last token: one more block per group.
    assert manager.allocate_slots(second, 8) is not None  # type: ignore[attr-defined]
    second.num_computed_tokens = length
    assert manager.allocate_slots(second, 1) is not None  # type: ignore[attr-defined]
    held_full, held_window = manager.get_block_ids("b")  # type: ignore[attr-defined]
    assert len(held_full) == len(held_window) == 7


def test_window_block_size_does_not_bound_the_hit_alignment(impl: ModuleType) -> None:
    # A window group of 8-token blocks would align hits to 8 if it took part.
    manager: object = replay_manager(impl, window_block_size=8)
    prefill(manager, "a")
    hit, length = manager.get_computed_blocks(  # type: ignore[attr-defined]
        manager.make_request("b", PROMPT))  # type: ignore[attr-defined]
    assert length == 24 and len(hit.get_block_ids()[0]) == 6 and hit.get_block_ids()[1] == []


def test_hash_block_size_need_not_divide_the_window_block_size(impl: ModuleType) -> None:
    # Full attention hashed at its 8-token block; the replayed window's 4-token
    # blocks are never hashed, so the hash block need not divide them.
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(8, 1, 8, "float16")),
              KVCacheGroupSpec(("swa",), SlidingWindowMLASpec(4, 1, 8, "float16",
                                                             sliding_window=8, bounded_replay=True)))
    manager = impl.KVCacheManager(KVCacheConfig(40, (), groups), 256, hash_block_size=8)
    prefill(manager, "a")
    hit, length = manager.get_computed_blocks(manager.make_request("b", PROMPT))
    assert length == 24 and len(hit.get_block_ids()[0]) == 3 and hit.get_block_ids()[1] == []
