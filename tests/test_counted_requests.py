"""The single-group decode step reads ``num_tokens`` only from request
classes it does not count on (``well_formed_request_types``, D-PERF-22).

An adapter adds its engine's request class when that class's count is an
int >= 1 by construction (``pagedkv.vllm`` adds vLLM's ``Request``); the
step then answers a no-op decode without the property call. Any other
class, a subclass of a counted one included, is read and checked as the
general path checks it (check 1b′), so a malformed count still raises.
"""

from __future__ import annotations

import pytest

from pagedkv.optimized import KVCacheManager
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, Request
from pagedkv.spec.errors import InvalidTokenCountError


class _CountingRequest(Request):
    """pagedkv's Request that counts reads of ``num_tokens`` and can break it."""

    __slots__ = ("reads", "broken")

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.reads = 0
        self.broken = False

    @property
    def num_tokens(self) -> int:
        self.reads += 1
        return 0 if self.broken else len(self.all_token_ids)


def _manager() -> KVCacheManager:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=(),
                           kv_cache_groups=(KVCacheGroupSpec(("layer0",), spec),))
    return KVCacheManager(config, 64)


def _running(manager: KVCacheManager) -> _CountingRequest:
    """A request of 6 tokens, all computed, holding 2 blocks: a decode step of
    one token fits its blocks and fills none (the no-op step)."""
    request = _CountingRequest("r", [1, 2, 3, 4, 5, 6], block_hasher=manager._hasher)
    assert manager.allocate_slots(request, 6) is not None
    request.num_computed_tokens = 6
    request.append_output_token_ids(7)
    return request


def test_a_class_not_counted_on_is_read_and_checked() -> None:
    manager = _manager()
    request = _running(manager)
    request.reads = 0
    result = manager.allocate_slots(request, 1)
    assert result is not None and result.get_block_ids() == ([],)
    assert request.reads >= 1
    request.broken = True
    with pytest.raises(InvalidTokenCountError):
        manager.allocate_slots(request, 1)


def test_a_counted_class_is_not_read_on_the_no_op_step() -> None:
    manager = _manager()
    request = _running(manager)
    manager.coordinator.well_formed_request_types.add(_CountingRequest)
    request.reads = 0
    before = manager.snapshot()
    result = manager.allocate_slots(request, 1)
    assert result is not None and result.get_block_ids() == ([],)
    assert request.reads == 0
    assert manager.snapshot() == before


def test_the_managers_own_request_type_is_counted() -> None:
    """make_request's class (spec's Request, or its subclass with the C token
    checks, D-PERF-35) is counted in single-group and hybrid coordinators alike:
    a no-op decode step of a request the manager made reads no num_tokens."""
    from pagedkv.optimized.pool.hasher import REQUEST_TYPE
    from pagedkv.spec.kv_cache_spec import SlidingWindowSpec

    full = KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16"))
    window = KVCacheGroupSpec(("swa",), SlidingWindowSpec(4, 1, 8, "float16", sliding_window=8))
    for groups in ((full,), (full, window)):
        manager = KVCacheManager(KVCacheConfig(num_blocks=32, kv_cache_tensors=(), kv_cache_groups=groups), 64)
        assert REQUEST_TYPE in manager.coordinator.well_formed_request_types
        request = manager.make_request("a", [1, 2, 3, 4, 5])
        assert type(request) is REQUEST_TYPE
        assert manager.allocate_slots(request, 5) is not None
        request.num_computed_tokens = 5
        request.append_output_token_ids(6)
        decode_step = manager.coordinator.decode_step
        assert decode_step is not None
        # Caching off for the step (delayed): only the counted shortcut keeps num_tokens unread.
        assert decode_step(request, 1, True) is manager.coordinator.empty_blocks
