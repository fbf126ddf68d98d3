"""Single-type managers: one KV cache group's blocks per request
(spec/managers.md §1). The base class holds what every attention type
shares; a type states its own rules by overriding ``skipped_tokens``,
``hit_span`` and, where needed, ``can_hit`` (§2-§7).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.reference import rules
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import KVCacheSpec, SinkFullAttentionSpec
from pagedkv.spec.types import BlockHash, make_block_hash_with_group_id

__all__ = ["SingleTypeManager", "FullAttentionManager", "SinkFullAttentionManager"]


class SingleTypeManager:
    """One group: per request, its blocks in token order (null blocks where
    attention no longer reads) and how many are cached. ``alignment`` is the
    hybrid hit unit; ``use_eagle`` keeps one hit block back for the drafter
    (spec/coordinators.md §4), where the type ``uses_eagle_rule``."""

    uses_eagle_rule = True

    def __init__(self, kv_cache_spec: KVCacheSpec, *, block_pool: BlockPool, group_id: int,
                 block_size: int, enable_caching: bool, alignment: int, use_eagle: bool,
                 retention_interval: int | None = None, admission_cap: int | None = None) -> None:
        self.kv_cache_spec, self.block_pool, self.group_id = kv_cache_spec, block_pool, group_id
        self.block_size, self.enable_caching, self.alignment = block_size, enable_caching, alignment
        self.use_eagle = use_eagle and self.uses_eagle_rule
        self.replay_eagle = use_eagle  # whether the model drafts at all (D-SWA-14)
        self.retention_interval, self.admission_cap = retention_interval, admission_cap
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    def skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens attention no longer reads once ``num_computed`` are computed."""
        return 0

    def hit_span(self, length: int) -> tuple[int, int]:
        """``(first, end)``: a hit of ``length`` tokens serves cached blocks
        ``first..end-1`` and null blocks before ``first``."""
        return 0, length // self.block_size

    def can_hit(self, block_hashes: Sequence[BlockHash], length: int, max_length: int) -> bool:
        """Whether this group serves a hit of exactly ``length`` tokens: its
        blocks are cached; with EAGLE the block after them too, within
        ``max_length``, so the hit can give it back (coordinators.md §4)."""
        first, end = self.hit_span(length)
        if self.use_eagle:
            if length + self.block_size > max_length:
                return False
            end += 1
        return end <= len(block_hashes) and all(self._lookup(block_hashes[index]) is not None
                                                for index in range(first, end))

    def hit_blocks(self, block_hashes: Sequence[BlockHash], length: int,
                   max_length: int | None = None) -> list[KVCacheBlock]:
        """The blocks a hit of ``length`` tokens hands to the request."""
        first, end = self.hit_span(length)
        found = [self._lookup(block_hashes[index]) for index in range(first, end)]
        return [self.block_pool.null_block] * first + [block for block in found if block is not None]

    def holds_hit(self, block_hashes: Sequence[BlockHash], view: Sequence[BlockHash], index: int,
                  block: KVCacheBlock) -> bool:
        """Whether ``block``, at ``index`` of a hit, still caches that position (D-API-8)."""
        return index < len(view) and block.block_hash == make_block_hash_with_group_id(view[index], self.group_id)

    def _lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        found = self.block_pool.get_cached_block(block_hash, [self.group_id])
        return None if found is None else found[0]

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], num_total_computed_tokens: int,
                                   num_main_tokens: int, num_external_computed_tokens: int = 0) -> int:
        """ALLOC-5: new blocks, plus hit blocks that leave the free queue when touched."""
        held = self.req_to_blocks.get(request_id)
        if held is not None:
            return rules.num_new_blocks_needed(num_tokens, self.block_size, len(held))
        # Skipped positions become null blocks: no fresh block for them either.
        num_skipped_blocks = self.skipped_tokens(num_total_computed_tokens) // self.block_size
        num_new = rules.num_new_blocks_needed(
            num_tokens, self.block_size, max(num_skipped_blocks, len(new_computed_blocks)))
        kept_hits = new_computed_blocks[num_skipped_blocks:]
        return num_new + sum(1 for block in kept_hits if block.ref_cnt == 0 and not block.is_null)

    def admit(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """ALLOC-6: null blocks for skipped positions, then the other hit blocks, touched."""
        num_skipped_blocks = self.skipped_tokens(
            num_local_computed_tokens + num_external_computed_tokens) // self.block_size
        kept_hits = list(new_computed_blocks[num_skipped_blocks:])
        if self.enable_caching:
            self.block_pool.touch(kept_hits)
        self.req_to_blocks[request_id] = [self.block_pool.null_block] * num_skipped_blocks + kept_hits
        self.num_cached_blocks[request_id] = len(self.req_to_blocks[request_id])

    def allocate_external(self, request_id: str, num_total_computed_tokens: int,
                          num_external_computed_tokens: int) -> None:
        """Fresh blocks for the tokens a connector computed for a new request."""
        if num_external_computed_tokens > 0:
            blocks = self.req_to_blocks[request_id]
            missing = rules.num_new_blocks_needed(num_total_computed_tokens, self.block_size, len(blocks))
            blocks.extend(self.block_pool.get_new_blocks(missing))

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int) -> list[KVCacheBlock]:
        """ALLOC-7: fresh blocks until ``num_tokens`` tokens have a slot."""
        blocks = self.req_to_blocks[request_id]
        new_blocks = self.block_pool.get_new_blocks(
            rules.num_new_blocks_needed(num_tokens, self.block_size, len(blocks)))
        blocks.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, request_id: str, num_total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """ALLOC-3: null the blocks attention no longer reads and release
        them, last first (``num_prompt_tokens``: for R-SWA's gap, RSWA-1)."""
        blocks = self.req_to_blocks.get(request_id)
        skipped = self.skipped_tokens(num_total_computed_tokens)
        if blocks is None or skipped <= 0:
            return
        released: list[KVCacheBlock] = []
        for index in range(min(skipped // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[index].is_null:
                break  # everything before was nulled by an earlier call
            released.append(blocks[index])
            blocks[index] = self.block_pool.null_block
        self.block_pool.free_blocks(released)

    def admission_blocks(self, num_tokens: int) -> int:
        """Real blocks a whole request of ``num_tokens`` tokens needs at once (§8)."""
        return rules.cdiv(num_tokens, self.block_size)

    def covered_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Real blocks the request holds (known) or takes from its hit (new)."""
        held = self.req_to_blocks.get(request_id)
        return sum(1 for block in (new_computed_blocks if held is None else held) if not block.is_null)

    def cache_mask(self, request: HashedRequest, num_cached: int, num_full: int) -> list[bool] | None:
        """Which of blocks ``[num_cached, num_full)`` are worth caching (``None``: all)."""
        return None

    def cache_blocks(self, request: HashedRequest, block_hashes: Sequence[BlockHash],
                     request_id: str, num_tokens: int) -> None:
        """ALLOC-8: key the full blocks among the first ``num_tokens`` tokens
        (``block_hashes``: the request's hashes at this group's block size)."""
        num_full, num_cached = num_tokens // self.block_size, self.num_cached_blocks[request_id]
        if num_cached < num_full:
            self.block_pool.cache_full_blocks(
                request, self.req_to_blocks[request_id], block_hashes=block_hashes, num_cached_blocks=num_cached,
                num_full_blocks=num_full, block_size=self.block_size, group_id=self.group_id,
                mask=self.cache_mask(request, num_cached, num_full))
            self.num_cached_blocks[request_id] = num_full

    def release(self, request_id: str) -> None:
        """FREE-2: release the request's blocks tail first, so the tail is evicted first."""
        blocks = self.req_to_blocks.pop(request_id)
        del self.num_cached_blocks[request_id]
        self.block_pool.free_blocks(reversed(blocks))

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        """Leading blocks of ``request_id`` every known request holds (0: not counted)."""
        return 0

    def check_request_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> str | None:
        """The type's own invariant on one request's blocks: ``"<ID>: <what>"`` or ``None``."""
        return None

    def new_step_starts(self) -> None:
        """A scheduler step begins."""


class FullAttentionManager(SingleTypeManager):
    """Full attention (§2): every block is kept until the request ends."""

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        counts = [block.ref_cnt for block in self.req_to_blocks[request_id]]
        return rules.common_prefix_blocks(counts, len(self.req_to_blocks))

    def check_request_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> str | None:
        ids = [block.block_id for block in blocks]
        if 0 in ids or len(set(ids)) != len(ids):
            return f"REQ-4: request {request_id!r} holds the null block or a block twice"
        return None


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with sinks (§3): ``sink_len / block_size`` blocks are
    reserved when the manager is built and held for good (SINK-1)."""

    def __init__(self, kv_cache_spec: KVCacheSpec, **options: Any) -> None:
        super().__init__(kv_cache_spec, **options)
        assert isinstance(kv_cache_spec, SinkFullAttentionSpec)
        sink_len, size, pool = kv_cache_spec.sink_len, self.block_size, self.block_pool
        if sink_len is None or sink_len <= 0 or sink_len % size:
            raise InvalidConfigError(f"SinkFullAttentionSpec.sink_len must be a positive multiple of the "
                                     f"block size {size}, got {sink_len!r}")
        if sink_len // size > pool.get_num_free_blocks():
            raise InvalidConfigError(f"SinkFullAttentionSpec.sink_len={sink_len} needs {sink_len // size} "
                                     f"blocks, the pool has {pool.get_num_free_blocks()}")
        self.sink_blocks = pool.reserve(sink_len // size)
