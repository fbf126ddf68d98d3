"""Single-type managers: one KV cache group's blocks per request
(spec/managers.md).

The base class holds the rules every attention type shares: which blocks an
allocation needs, how a new request takes its hit, how blocks attention no
longer reads are released, caching and freeing. An attention type states
its own rules by overriding three methods: ``skipped_tokens`` (what
it stops reading), ``hit_span`` (which blocks a hit of a given length
serves) and, where needed, ``can_hit``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference import rules
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import KVCacheSpec, SinkFullAttentionSpec
from pagedkv.spec.types import BlockHash

__all__ = ["SingleTypeManager", "FullAttentionManager", "SinkFullAttentionManager"]


class SingleTypeManager:
    """One group: per request, its blocks in token order (null blocks where
    attention no longer reads) and how many are cached.

    ``alignment`` is the hybrid hit granularity (the LCM of all groups'
    block sizes); ``use_eagle`` makes hits keep one block back for the
    drafter (spec/coordinators.md, EAGLE rule).
    """

    uses_eagle_rule = True
    """Whether the EAGLE rule applies to this type's hits."""

    def __init__(self, kv_cache_spec: KVCacheSpec, *, block_pool: BlockPool, group_id: int,
                 block_size: int, enable_caching: bool, alignment: int, use_eagle: bool,
                 retention_interval: int | None = None, admission_cap: int | None = None) -> None:
        self.admission_cap = admission_cap
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.group_id = group_id
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.alignment = alignment
        self.use_eagle = use_eagle and self.uses_eagle_rule
        # Whether the model drafts at all (its replay positions), whatever
        # this group's own EAGLE rule; the coordinator sets both (D-SWA-14).
        self.replay_eagle = use_eagle
        self.retention_interval = retention_interval
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    # -- the rules an attention type states -------------------------------------

    def skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens attention no longer reads once ``num_computed``
        tokens are computed (0: it reads them all)."""
        return 0

    def released_tokens(self, num_total_computed_tokens: int) -> int:
        """Leading tokens whose blocks ``remove_skipped_blocks`` releases once
        ``num_total_computed_tokens`` are computed: ``skipped_tokens`` of that
        count (Mamba discounts draft tokens first)."""
        return self.skipped_tokens(num_total_computed_tokens)

    def hit_span(self, length: int) -> tuple[int, int]:
        """``(first, end)``: a hit of ``length`` tokens serves cached blocks
        ``first..end-1`` and null blocks before ``first``."""
        return 0, length // self.block_size

    def can_hit(self, block_hashes: Sequence[BlockHash], length: int, max_length: int) -> bool:
        """Whether this group can serve a hit of exactly ``length`` tokens
        (a multiple of its block size) for a request with these hashes.

        The served blocks must be cached; with EAGLE the block right after the
        hit must be cached too and lie within ``max_length``, so the hit can
        give it back to be recomputed without shrinking further.
        """
        first, end = self.hit_span(length)
        if self.use_eagle:
            if length + self.block_size > max_length:
                return False
            end += 1
        if end > len(block_hashes):
            return False
        return all(self._lookup(block_hashes[index]) is not None for index in range(first, end))

    def lookup_limit(self, max_length: int, peek: int, num_hashed_tokens: int) -> int:
        """The ``max_length`` this group's ``can_hit`` and ``hit_blocks`` read
        in a search capped at ``max_length``: the coordinator's EAGLE peek
        for an EAGLE group (D-SWA-15), else the cap."""
        return peek if self.use_eagle else max_length

    def hit_blocks(self, block_hashes: Sequence[BlockHash], length: int,
                   max_length: int | None = None) -> list[KVCacheBlock]:
        """The blocks a hit of ``length`` tokens (found within ``max_length``) hands to the request."""
        first, end = self.hit_span(length)
        found = [self._lookup(block_hashes[index]) for index in range(first, end)]
        return [self.block_pool.null_block] * first + [block for block in found if block is not None]

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """This group alone: the blocks of the longest hit within ``max_length``."""
        length = max_length // self.alignment * self.alignment
        while length > 0 and not self.can_hit(block_hashes, length, max_length):
            length -= self.alignment
        return self.hit_blocks(block_hashes, length)

    def _lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        found = self.block_pool.get_cached_block(block_hash, [self.group_id])
        return None if found is None else found[0]

    # -- allocation ---------------------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], num_total_computed_tokens: int,
                                   num_main_tokens: int, num_external_computed_tokens: int = 0) -> int:
        """Free blocks this group consumes so ``num_tokens`` tokens have a slot:
        new blocks, plus hit blocks that leave the free queue when touched."""
        held = self.req_to_blocks.get(request_id)
        if held is not None:
            return rules.num_new_blocks_needed(num_tokens, self.block_size, len(held))
        num_skipped_blocks = self.skipped_tokens(num_total_computed_tokens) // self.block_size
        # Skipped positions become null blocks: they need no fresh block either.
        num_new = rules.num_new_blocks_needed(
            num_tokens, self.block_size, max(num_skipped_blocks, len(new_computed_blocks)))
        kept_hits = new_computed_blocks[num_skipped_blocks:]
        return num_new + sum(1 for block in kept_hits if block.ref_cnt == 0 and not block.is_null)

    def admit(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Start holding blocks for a new request: null blocks for skipped
        positions, then the remaining hit blocks (touched)."""
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.skipped_tokens(num_total) // self.block_size
        kept_hits = list(new_computed_blocks[num_skipped_blocks:])
        if self.enable_caching:
            self.block_pool.touch(kept_hits)
        blocks = [self.block_pool.null_block] * num_skipped_blocks + kept_hits
        self.req_to_blocks[request_id] = blocks
        self.num_cached_blocks[request_id] = len(blocks)

    def allocate_external(self, request_id: str, num_total_computed_tokens: int,
                          num_external_computed_tokens: int) -> None:
        """Fresh blocks for the tokens an external connector computed for a
        just-admitted request."""
        if num_external_computed_tokens > 0:
            blocks = self.req_to_blocks[request_id]
            missing = rules.num_new_blocks_needed(num_total_computed_tokens, self.block_size, len(blocks))
            blocks.extend(self.block_pool.get_new_blocks(missing))

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int) -> list[KVCacheBlock]:
        """Append fresh blocks until ``num_tokens`` tokens have a slot."""
        blocks = self.req_to_blocks[request_id]
        needed = rules.num_new_blocks_needed(num_tokens, self.block_size, len(blocks))
        new_blocks = self.block_pool.get_new_blocks(needed)
        blocks.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, request_id: str, num_total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Replace blocks attention no longer reads by the null block and
        release them, last first (uncached ones become the next to reuse).
        ``num_prompt_tokens`` (when the caller knows it) is for types whose
        unread blocks depend on the prompt (R-SWA)."""
        blocks = self.req_to_blocks.get(request_id)
        skipped = self.released_tokens(num_total_computed_tokens)
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
        """Real blocks this group needs at once to hold a whole request of
        ``num_tokens`` tokens (the full-sequence admission requirement)."""
        return rules.cdiv(num_tokens, self.block_size)

    def covered_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Real blocks the request already holds (known) or takes from its hit (new)."""
        held = self.req_to_blocks.get(request_id)
        blocks = new_computed_blocks if held is None else held
        return sum(1 for block in blocks if not block.is_null)

    # -- caching, freeing, queries ------------------------------------------------------

    def cache_mask(self, request: HashedRequest, num_cached: int, num_full: int) -> list[bool] | None:
        """Which of blocks ``[num_cached, num_full)`` are worth caching (``None``: all)."""
        return None

    def cache_blocks(self, request: HashedRequest, block_hashes: Sequence[BlockHash],
                     request_id: str, num_tokens: int) -> None:
        """Hand the full blocks among the first ``num_tokens`` tokens to the
        prefix cache; ``block_hashes`` is the request's hashes at this group's
        block size."""
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_blocks[request_id]
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request_id], block_hashes=block_hashes,
            num_cached_blocks=num_cached, num_full_blocks=num_full, block_size=self.block_size,
            group_id=self.group_id, mask=self.cache_mask(request, num_cached, num_full))
        self.num_cached_blocks[request_id] = num_full

    def release(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so the tail is evicted first (FREE-2)."""
        blocks = self.req_to_blocks.pop(request_id)
        del self.num_cached_blocks[request_id]
        self.block_pool.free_blocks(reversed(blocks))

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        """Leading blocks of ``request_id`` held by every known request
        (0 for types whose prefix is null blocks)."""
        return 0

    def check_request_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> str | None:
        """The type's own invariant on one request's blocks: ``"<ID>: <what>"``
        of a violation, or ``None`` (``check_invariants`` raises it)."""
        return None

    def new_step_starts(self) -> None:
        """A scheduler step begins."""


class FullAttentionManager(SingleTypeManager):
    """Full attention: every block is kept until the request ends; a hit of
    ``L`` tokens needs all of its ``L / block_size`` blocks cached."""

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        counts = [block.ref_cnt for block in self.req_to_blocks[request_id]]
        return rules.common_prefix_blocks(counts, len(self.req_to_blocks))

    def check_request_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> str | None:
        # REQ-4: full attention holds real blocks, each once.
        ids = [block.block_id for block in blocks]
        if 0 in ids or len(set(ids)) != len(ids):
            return f"REQ-4: request {request_id!r} holds the null block or a block twice"
        return None


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with attention sinks: ``sink_len / block_size`` blocks
    are taken when the manager is built and held for good (SINK-1); requests
    behave as under full attention."""

    def __init__(self, kv_cache_spec: KVCacheSpec, *, block_pool: BlockPool, group_id: int,
                 block_size: int, enable_caching: bool, alignment: int, use_eagle: bool,
                 retention_interval: int | None = None, admission_cap: int | None = None) -> None:
        super().__init__(kv_cache_spec, block_pool=block_pool, group_id=group_id,
                         block_size=block_size, enable_caching=enable_caching, alignment=alignment,
                         use_eagle=use_eagle, retention_interval=retention_interval,
                         admission_cap=admission_cap)
        spec, pool = kv_cache_spec, block_pool
        assert isinstance(spec, SinkFullAttentionSpec)
        if spec.sink_len is None or spec.sink_len <= 0 or spec.sink_len % block_size:
            raise InvalidConfigError(
                f"SinkFullAttentionSpec.sink_len must be a positive multiple of the block size "
                f"{block_size}, got {spec.sink_len!r}")
        if spec.sink_len // block_size > pool.get_num_free_blocks():
            raise InvalidConfigError(
                f"SinkFullAttentionSpec.sink_len={spec.sink_len} needs {spec.sink_len // block_size} "
                f"blocks, the pool has {pool.get_num_free_blocks()}")
        self.sink_blocks = pool.reserve(spec.sink_len // block_size)
