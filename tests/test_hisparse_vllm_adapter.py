"""pagedkv.vllm's HiSparse manager with vLLM 0.33's own classes (skipped without vLLM).

A HiSparse config (host source, indexer, resident, hot) goes to
``HiSparseKVCacheManager``; vLLM's ``get_hisparse_coordinator`` finds the
tier's coordinator view; the indexer and the tier share one device pool, so a
block the pool hands out elsewhere is lost to the page still reading it.
"""

from __future__ import annotations

from typing import Any

import pytest

B = 16


def _manager(num_blocks: int = 32, host_blocks: int = 16, **kwargs: Any) -> Any:
    pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make verify-vllm)")
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiSparseHotSpec,
        HiSparseResidentSpec,
        KVCacheConfig,
        KVCacheGroupRole,
        KVCacheGroupSpec,
    )

    from pagedkv.vllm import KVCacheManager

    full = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], hisparse_host_num_blocks=host_blocks,
                           kv_cache_groups=[
        KVCacheGroupSpec(["src"], full, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
        KVCacheGroupSpec(["idx"], full, role=KVCacheGroupRole.HISPARSE_INDEXER),
        KVCacheGroupSpec(["res"], HiSparseResidentSpec(block_size=B, page_size=4 * B)),
        KVCacheGroupSpec(["hot"], HiSparseHotSpec(block_size=B, page_size=4 * B,
                                                  blocks_per_request=2))])
    return KVCacheManager(config, max_model_len=128, scheduler_block_size=B, hash_block_size=B,
                          **kwargs)


def _request(request_id: str, num_tokens: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=4)
    params.update_from_generation_config({}, eos_token_id=100)
    return Request(request_id=request_id, prompt_token_ids=list(range(num_tokens)),
                   sampling_params=params, pooling_params=None,
                   block_hasher=get_request_block_hasher(B, sha256))


def test_a_hisparse_config_is_served_by_the_host_tier() -> None:
    manager = _manager(enable_caching=False, num_prefill_lookahead=3)
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    from pagedkv.vllm.hisparse_manager import HiSparseKVCacheManager

    assert isinstance(manager, HiSparseKVCacheManager)
    coordinator = get_hisparse_coordinator(manager)
    request = _request("r", 2 * B)
    assert manager.allocate_slots(request, 2 * B) is not None
    host, indexer, resident, hot = manager.get_block_ids("r")
    # One pool for the device groups: the indexer's blocks, then the resident pages.
    assert (host, indexer, resident, hot) == ([1, 2], [1, 2], [3, 4], [])
    coordinator.advance_scheduled([("r", 2 * B)])
    # 32 tokens, the last 2 prefilled again (lookahead 3): only page 0 is final.
    [transfer] = coordinator.build_offload_command().page_transfers
    assert (transfer.host_block_id, transfer.resident_block_ids) == (1, (3,))
    assert transfer.after_forward and not transfer.restore


def test_a_block_the_shared_pool_hands_out_is_lost_to_its_reader() -> None:
    manager = _manager(enable_caching=False)
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    coordinator = get_hisparse_coordinator(manager)
    request = _request("r", 4 * B)
    assert manager.allocate_slots(request, 4 * B) is not None
    coordinator.hot_managers[0].require_hot("r")
    assert manager.allocate_slots(request, 4 * B) is not None  # the hot region
    coordinator.advance_scheduled([("r", 4 * B)])
    commands = coordinator.build_offload_command().page_transfers
    counts = {t.transfer_id: 1 for t in commands}
    coordinator.update_spills(counts, counts)  # pages 0, 1 released (2, 3: the tail)
    coordinator.take_residency_updates(["r"])
    pool = manager.block_pool
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert not coordinator.all_context_pages_resident((("r", 4 * B - 1, 1),))
    update = coordinator.take_residency_updates(["r"])["r"]
    assert update.pages == [0, 1] and update.block_ids == ([0, 0],)


def test_a_deferred_free_holds_the_host_row_until_the_caller_frees_it() -> None:
    manager = _manager(enable_caching=False)
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    host_pool = get_hisparse_coordinator(manager).get_host_block_pool()
    host_free, device_free = host_pool.get_num_free_blocks(), manager.block_pool.get_num_free_blocks()
    request = _request("r", B)
    assert manager.allocate_slots(request, B, delay_cache_blocks=True) is not None
    blocks = manager.pop_blocks_for_free(request)
    assert manager.get_block_ids("r") == ([], [], [], [])  # forgotten...
    assert host_pool.get_num_free_blocks() == host_free - 1  # ...but its host page is held
    assert any(host_pool.blocks[b.block_id] is b for b in blocks)
    manager.block_pool.free_blocks(reversed(blocks))
    assert host_pool.get_num_free_blocks() == host_free
    assert manager.block_pool.get_num_free_blocks() == device_free


def test_device_group_events_carry_vllms_group_ids() -> None:
    manager = _manager(enable_caching=True, enable_kv_cache_events=True)
    assert manager.allocate_slots(_request("r", 2 * B), 2 * B) is not None
    stored = [event for event in manager.take_events() if hasattr(event, "token_ids")]
    assert stored and {event.group_idx for event in stored} == {1}  # the indexer is group 1


def test_a_whole_sequence_admission_needs_a_host_block_for_every_page() -> None:
    """vLLM's full-ISL gate counts the source group's whole sequence: a first
    chunk that fits the host pool is still refused when the prompt does not."""
    manager = _manager(enable_caching=False, host_blocks=4)  # 3 usable host blocks
    request = _request("r", 4 * B)
    before = manager.get_block_ids("r")
    assert manager.allocate_slots(request, B, full_sequence_must_fit=True) is None
    assert manager.get_block_ids("r") == before
    assert manager.allocate_slots(request, B) is not None  # the chunk alone fits


def test_the_host_hit_outlives_the_device_groups_and_bounds_a_connector() -> None:
    """D-HOST-22: the host group keeps its own, longer hit; the per-group
    lookup a connector bounds its load with answers it for the source group."""
    manager = _manager(enable_caching=True)
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    coordinator = get_hisparse_coordinator(manager)
    original = _request("a", 4 * B)
    assert manager.allocate_slots(original, 4 * B) is not None
    coordinator.advance_scheduled([("a", 4 * B)])
    counts = {t.transfer_id: 1 for t in coordinator.build_offload_command().page_transfers}
    coordinator.update_spills(counts, counts)
    indexer = manager.get_block_ids("a")[1]
    manager.free(original)
    manager.block_pool.evict_blocks({indexer[1]})  # the device groups lose page 1
    resumed = _request("b", 4 * B)
    blocks, lengths = manager.coordinator.find_longest_cache_hit_per_group(
        resumed.block_hashes, 4 * B - 1)
    assert lengths == (3 * B, B, 0, 0)
    assert [len(group) for group in blocks] == [3, 1, 0, 0]
    computed, num_local, _ = manager.get_computed_blocks(resumed)
    assert num_local == B and [len(group) for group in computed.blocks] == [3, 1, 0, 0]
    # A load of the indexer's pages 1..2 completes the prefix from the host hit.
    assert manager.allocate_slots(resumed, 1, num_new_computed_tokens=B,
                                  new_computed_blocks=computed,
                                  num_external_computed_tokens=2 * B) is not None
    host = manager.get_block_ids("b")[0]
    assert host[:3] == [b.block_id for b in computed.blocks[0]]
    coordinator.finish_host_import("b", failed=False)
    [restore] = coordinator.build_offload_command().page_transfers
    assert restore.restore and restore.host_block_id == host[2]


def test_per_group_answers_use_vllms_group_ids() -> None:
    """Engine-facing calls that return one entry per group answer for all four
    groups in vLLM's order, not the device adapter's one group."""
    manager = _manager(enable_caching=False)
    request = _request("r", 3 * B)
    assert manager.allocate_slots(request, 3 * B) is not None
    ids = manager.get_block_ids("r")
    assert manager.get_block_ids_for_computed_tokens("r", B + 1) == (
        ids[0][:2], ids[1][:2], ids[2], ids[3])
    assert manager.get_num_common_prefix_blocks("r") == [0, 0, 0, 0]
    blocks = manager.create_kv_cache_blocks(ids)
    assert tuple([b.block_id for b in group] for group in blocks.blocks) == ids
    host_pool = manager.hisparse_coordinator.get_host_block_pool()
    assert blocks.blocks[0][0] is host_pool.blocks[ids[0][0]]
    computed = manager.get_computed_blocks_for_connector(_request("s", 3 * B))
    assert computed[1:] == (0, 0, False) and len(computed[0].blocks) == 4


def test_a_deferred_free_may_be_given_back_in_parts() -> None:
    """The fence hold goes back to the tier once all of its blocks were
    named, whether in one ``free_blocks`` call or several (D-HOST-25)."""
    manager = _manager(enable_caching=False)
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    host_pool = get_hisparse_coordinator(manager).get_host_block_pool()
    host_free, device_free = host_pool.get_num_free_blocks(), manager.block_pool.get_num_free_blocks()
    request = _request("r", 2 * B)
    assert manager.allocate_slots(request, 2 * B, delay_cache_blocks=True) is not None
    blocks = manager.pop_blocks_for_free(request)
    manager.block_pool.free_blocks(blocks[:1])
    assert host_pool.get_num_free_blocks() < host_free  # the rest of the hold is still out
    manager.block_pool.free_blocks(blocks[1:])
    assert host_pool.get_num_free_blocks() == host_free
    assert manager.block_pool.get_num_free_blocks() == device_free


def test_host_publications_and_evictions_are_cpu_events_of_the_source_group() -> None:
    """D-HOST-26: the host cache's changes reach vLLM's event stream with
    medium CPU and the source group's id, tokens from the publishing request."""
    manager = _manager(enable_caching=True, enable_kv_cache_events=True)
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    coordinator = get_hisparse_coordinator(manager)
    request = _request("r", 2 * B + 3)
    assert manager.allocate_slots(request, 2 * B + 3) is not None
    coordinator.advance_scheduled([("r", 2 * B + 3)])
    counts = {t.transfer_id: 1 for t in coordinator.build_offload_command().page_transfers}
    coordinator.update_spills(counts, counts)
    host = [e for e in manager.take_events() if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert len(host) == 1 and host[0].group_idx == 0 and host[0].parent_block_hash is None
    assert host[0].token_ids == list(range(2 * B)) and len(host[0].block_hashes) == 2
    coordinator.get_host_block_pool().evict_blocks({manager.get_block_ids("r")[0][1]})
    [removed] = manager.take_events()
    assert isinstance(removed, BlockRemoved) and (removed.medium, removed.group_idx) == ("CPU", 0)
    assert removed.block_hashes == host[0].block_hashes[1:]


def _ids(blocks: Any) -> Any:
    return None if blocks is None else [list(group) for group in blocks.get_block_ids()]


# 128-token requests (8 pages of 16 tokens); each expected result is stock
# vLLM 0.33's for the same call on the same config (D-HOST-28).
@pytest.mark.parametrize(("num_blocks", "reserved", "chunk", "max_in_flight", "expected"), [
    # 8 indexer blocks + 8 resident pages > 9 free: pagedkv admitted before D-HOST-28.
    (10, 0, B, None, None),
    (16, 0, 4 * B, None, None),  # 16 > 15 free (also admitted before)
    (17, 0, B, None, [[1], [1], [2], []]),  # 16 = 16 free
    (17, 4, B, None, [[1], [1], [2], []]),  # reserved_blocks guards the step only
    # Admission cap cdiv(48, 16) = 3 resident pages: 8 + 3 = 11 free. pagedkv
    # refused before (8 + the step's 3 pages + 2 reserved), vLLM admits.
    (12, 2, 3 * B, 3 * B, [[1, 2, 3], [1, 2, 3], [4, 5, 6], []]),
    (11, 0, 3 * B, 3 * B, None),
])
def test_hisparse_whole_request_gate_counts_resident_pages_as_vllm(
        num_blocks: int, reserved: int, chunk: int, max_in_flight: int | None, expected: Any) -> None:
    """D-HOST-28: the whole-request gate counts the device groups' blocks of
    the whole sequence plus its resident pages up to the admission cap, and
    keeps only the watermark free; not reserved_blocks nor the step's pages."""
    manager = _manager(num_blocks=num_blocks, enable_caching=False, max_in_flight_tokens=max_in_flight)
    blocks = manager.allocate_slots(_request("r", 128), chunk, full_sequence_must_fit=True,
                                    reserved_blocks=reserved)
    assert _ids(blocks) == expected
    if expected is None:  # a refused call changes nothing
        assert manager.block_pool.get_num_free_blocks() == num_blocks - 1
        assert manager.get_block_ids("r") == ([], [], [], [])


@pytest.mark.parametrize(("num_blocks", "expected"), [(16, None), (17, [[2, 3], [3, 4], [5, 6], []])])
def test_hisparse_whole_request_gate_counts_what_a_known_request_holds(
        num_blocks: int, expected: Any) -> None:
    """A running request's second chunk (stock vLLM 0.33's results): it holds
    1 indexer block and 1 resident page, the whole sequence needs 7 more of
    each; 14 > 13 free refuses (pagedkv admitted before D-HOST-28), 14 = 14 fits."""
    manager = _manager(num_blocks=num_blocks, enable_caching=False)
    request = _request("r", 128)
    assert _ids(manager.allocate_slots(request, B)) == [[1], [1], [2], []]
    request.num_computed_tokens = B
    assert _ids(manager.allocate_slots(request, 2 * B, full_sequence_must_fit=True,
                                       reserved_blocks=2)) == expected


@pytest.mark.parametrize(("num_blocks", "scheduled", "admitted"),
                         [(20, True, False), (21, True, True), (17, False, True)])
def test_hisparse_whole_request_gate_keeps_the_watermark(
        num_blocks: int, scheduled: bool, admitted: bool) -> None:
    """vLLM's watermark (20%, a waiting request while others are scheduled)
    stays free beside the whole request's 16 blocks: 16 + 4 > 19 free, 16 +
    int(4.2) = 20 free, and 16 = 16 free with no request scheduled (stock
    vLLM 0.33's results; pagedkv admitted all three before D-HOST-28)."""
    manager = _manager(num_blocks=num_blocks, enable_caching=False, watermark=0.2)
    blocks = manager.allocate_slots(_request("r", 128), B, full_sequence_must_fit=True,
                                    has_scheduled_reqs=scheduled)
    assert _ids(blocks) == ([[1], [1], [2], []] if admitted else None)


@pytest.mark.parametrize(("argument", "value"), [
    ("num_new_tokens", 1.5), ("num_new_tokens", -1), ("reserved_blocks", -1),
    ("num_lookahead_tokens", True), ("num_new_computed_tokens", "16")])
@pytest.mark.parametrize("whole", [False, True])
def test_hisparse_malformed_counts_raise_the_typed_error_and_change_nothing(
        argument: str, value: Any, whole: bool) -> None:
    """A malformed count raises InvalidTokenCountError naming it, with or
    without the whole-request gate (which reads the counts before the device
    groups' adapter would check them), and changes nothing."""
    from pagedkv.spec.errors import InvalidTokenCountError

    manager = _manager(num_blocks=20, enable_caching=False)
    args: dict[str, Any] = {"num_new_tokens": B, argument: value}
    with pytest.raises(InvalidTokenCountError, match=argument):
        manager.allocate_slots(_request("r", 128), full_sequence_must_fit=whole, **args)
    assert manager.block_pool.get_num_free_blocks() == 19
    assert manager.get_block_ids("r") == ([], [], [], [])
