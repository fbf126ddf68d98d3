"""Per-group managers: one KV cache group's block lists, by attention type.

A single-type manager owns, for one KV cache group, each known request's
block list (token order; the null block 0 where attention no longer reads)
and its count of cached blocks (REQ-2). Attention types differ in which
leading tokens they stop reading (``skipped_tokens``), which blocks
a hit of ``L`` tokens needs cached (``first_hit_block``: blocks
``first..L/b-1``, the ones before it served as null blocks) and how the
longest hit under a bound is found (``longest_hit``). The rules are those of
``pagedkv.reference`` (spec/managers.md); the differential tests hold the
two equal.

This module: the base class, full attention (MLA too) and sink full
attention. ``windowed``, ``mamba`` and ``cross_attention`` hold the others;
:data:`pagedkv.optimized.coordination.coordinator.MANAGER_FOR_KIND` maps the manager
kinds of :mod:`pagedkv.spec.registry` to classes.

All methods assume validated arguments: the facade (``manager.py``)
validates (``validation.py``) and raises typed errors before calling in.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.native import NATIVE
from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.optimized.pool.hit_memo import same_prefix
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import KVCacheSpec, SinkFullAttentionSpec
from pagedkv.spec.types import BlockHash

__all__ = [
    "SingleTypeManager",
    "FullAttentionManager",
    "SinkFullAttentionManager",
]


class SingleTypeManager:
    """Block lists of one KV cache group.

    Args:
        kv_cache_spec: the group's spec.
        block_pool: the shared pool.
        group_id: this group's index.
        block_size: tokens per block (spec block size times dcp * pcp).
        enable_caching: prefix caching on (hit blocks are touched).
        alignment: hybrid hit granularity, the LCM of every group's block
            size.
        use_eagle: hits keep the next block cached too (EAGLE rule,
            spec/coordinators.md); ignored by types exempt from it.
        retention_interval: which sliding-window blocks are worth caching
            (see ``windowed``).
    """

    __slots__ = ("kv_cache_spec", "block_size", "block_pool", "group_id", "enable_caching",
                 "alignment", "use_eagle", "replay_eagle", "retention_interval", "req_to_blocks",
                 "num_cached_blocks")

    uses_eagle_rule = True
    """Whether the EAGLE rule applies to this type's hits."""

    always_empty_hit = False
    """Whether this type can only ever serve the empty hit."""

    holds_null_blocks = True
    """Whether a request's list may hold null blocks (full attention's never
    does, REQ-4: its release skips the filter)."""

    def __init__(self, kv_cache_spec: KVCacheSpec, *, block_pool: BlockPool, group_id: int,
                 block_size: int, enable_caching: bool, alignment: int, use_eagle: bool,
                 retention_interval: int | None = None) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.alignment = alignment
        self.use_eagle = use_eagle and self.uses_eagle_rule
        # Whether the model drafts at all (its replay positions), whatever
        # this group's own EAGLE rule; the coordinator sets both (D-SWA-14).
        self.replay_eagle = use_eagle
        self.retention_interval = retention_interval
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self._setup()

    def _setup(self) -> None:
        """Type-specific construction (read the spec, reserve blocks).
        Cost: O(1) unless a type says otherwise."""

    # ------------------------------------------------------------ the type's rules

    def skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens attention no longer reads once ``num_computed``
        are computed (0: it reads them all). Cost: O(1)."""
        return 0

    def released_tokens(self, num_total_computed_tokens: int) -> int:
        """Leading tokens whose blocks :meth:`remove_skipped_blocks` releases
        once ``num_total_computed_tokens`` are computed: ``skipped_tokens``
        of that count here (Mamba discounts draft tokens first). The one
        place the skip rule is applied at a step; the decode fast path
        (``decode.py``) calls it too. Cost: O(1)."""
        return self.skipped_tokens(num_total_computed_tokens)

    def first_hit_block(self, length: int) -> int:
        """The first block a hit of ``length`` tokens needs cached (blocks
        before it are served as null blocks). Non-decreasing in ``length``,
        which the hit search relies on. Cost: O(1)."""
        return 0

    def longest_hit(self, view: Sequence[BlockHash], bound: int, max_length: int) -> int:
        """The largest ``L <= bound`` (a multiple of the alignment) at which
        this group can serve a hit, or 0: blocks ``first_hit_block(L)`` up to
        ``L / b`` cached, with EAGLE also the next block, and
        ``L + b <= max_length`` (the reference's ``can_hit``).

        Searched right to left: a miss at block ``j`` rules out every ``L``
        whose span reaches ``j`` (spans start no later as ``L`` shrinks), so
        the next candidate is the largest aligned ``L`` ending before ``j``;
        no block is looked up twice.

        Cost: O(blocks looked up), at most the blocks between the result and
        ``bound``, plus one span.
        """
        block_size = self.block_size
        alignment = self.alignment
        shift = 1 if self.use_eagle else 0
        limit = min(bound, (len(view) - shift) * block_size)
        if shift:
            limit = min(limit, max_length - block_size)
        length = limit // alignment * alignment
        get = self.block_pool.cached_by_group[self.group_id].get
        first_hit_block = self.first_hit_block
        while length > 0:
            first = first_hit_block(length)
            index = length // block_size + shift - 1
            while index >= first and get(view[index]) is not None:
                index -= 1
            if index < first:
                return length
            length = (index - shift) * block_size // alignment * alignment
        return 0

    def lookup_limit(self, max_length: int, peek: int, num_hashed_tokens: int) -> int:
        """The ``max_length`` this group's ``longest_hit`` and ``hit_blocks``
        read in a search capped at ``max_length``: the coordinator's EAGLE
        peek for an EAGLE group (D-SWA-15), else the cap. Cost: O(1)."""
        return peek if self.use_eagle else max_length

    def hit_blocks(self, view: Sequence[BlockHash], length: int, max_length: int | None = None) -> list[int]:
        """The blocks a hit of ``length`` tokens (found within ``max_length``)
        hands to the request (its span found cached by :meth:`longest_hit`).
        Cost: O(L / b)."""
        first = self.first_hit_block(length) if length else 0
        pool = self.block_pool
        table = pool.cached_by_group[self.group_id]
        end = length // self.block_size
        scan = pool.last_scan
        if (scan is not None and scan[1] == self.group_id and scan[0] == pool.map_epoch
                and len(scan[3]) >= end and same_prefix(view, scan[2][:end])):
            # This lookup's own scan of these very hashes (FullAttentionManager.
            # longest_hit): no key has left the map or moved since, so the
            # map still serves those blocks (D-PERF-46, as D-PERF-44).
            return [0] * first + scan[3][first:end] if first else scan[3][:end]
        if NATIVE is not None and end > first:
            found = NATIVE.prefix_hits(table, view[first:end] if first else view, end - first)
            if found is not None and len(found) == end - first:  # else the lookup below raises
                return [0] * first + found if first else found
        return [0] * first + [table[view[index]] for index in range(first, end)]

    # --------------------------------------------------------------- allocation

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int],
                                   num_total_computed_tokens: int, num_main_tokens: int,
                                   num_external_computed_tokens: int = 0) -> int:
        """Free blocks this group consumes so ``num_tokens`` tokens have a
        slot: new blocks, plus hit blocks that leave the free queue when
        touched; skipped positions become null blocks and need none.

        Cost: O(1) for a known request, O(len(new_computed_blocks)) otherwise.
        """
        block_size = self.block_size
        required = -(-num_tokens // block_size)
        held = self.req_to_blocks.get(request_id)
        if held is not None:
            return max(required - len(held), 0)
        num_skipped_blocks = self.skipped_tokens(num_total_computed_tokens) // block_size
        num_new = max(required - max(num_skipped_blocks, len(new_computed_blocks)), 0)
        if len(new_computed_blocks) > num_skipped_blocks:
            # Hit blocks with no holder (they leave the free queue), in C
            # loops: the null block's count stays 0 (D-POOL-1), so the null
            # blocks among them are subtracted from the zero counts.
            kept = new_computed_blocks[num_skipped_blocks:]
            num_new += list(map(self.block_pool.ref_counts.__getitem__, kept)).count(0) - kept.count(0)
        return num_new

    def admit(self, request_id: str, new_computed_blocks: Sequence[int],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Start holding blocks for a new request: null blocks for skipped
        positions, then the remaining hit blocks (touched when caching).

        Cost: O(len(new_computed_blocks) + skipped blocks).
        """
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.skipped_tokens(num_total) // self.block_size
        kept = list(new_computed_blocks[num_skipped_blocks:])
        if kept and self.enable_caching:
            self.block_pool.touch_held(kept)
        blocks = [0] * num_skipped_blocks + kept if num_skipped_blocks > 0 else kept
        self.req_to_blocks[request_id] = blocks
        self.num_cached_blocks[request_id] = len(blocks)

    def allocate_external(self, request_id: str, num_total_computed_tokens: int,
                          num_external_computed_tokens: int) -> None:
        """Fresh blocks for the tokens an external connector computed for a
        just-admitted request. Cost: O(blocks allocated)."""
        if num_external_computed_tokens > 0:
            blocks = self.req_to_blocks[request_id]
            missing = -(-num_total_computed_tokens // self.block_size) - len(blocks)
            if missing > 0:
                blocks.extend(self.block_pool.get_new_blocks(missing))

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int) -> list[int]:
        """Append fresh blocks until ``num_tokens`` tokens have a slot;
        returns them. Cost: O(new blocks)."""
        blocks = self.req_to_blocks[request_id]
        missing = -(-num_tokens // self.block_size) - len(blocks)
        if missing <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(missing)
        blocks.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, request_id: str, num_total_computed_tokens: int) -> None:
        """Replace blocks attention no longer reads by the null block and
        release them, last first (uncached ones become the next to reuse);
        stops at the first null block (everything before was nulled by an
        earlier call).

        Cost: O(blocks released + 1).
        """
        skipped = self.released_tokens(num_total_computed_tokens)
        if skipped <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        index = min(skipped // self.block_size, len(blocks)) - 1
        if index < 0 or not blocks[index]:
            return
        released: list[int] = []
        while index >= 0 and blocks[index]:
            released.append(blocks[index])
            blocks[index] = 0
            index -= 1
        self.block_pool.free_held(released)

    # ------------------------------------------------------ caching, freeing

    def cache_mask(self, request: HashedRequest, num_cached: int, num_full: int) -> list[bool] | None:
        """Which of blocks ``[num_cached, num_full)`` are worth caching
        (``None``: all). Cost: O(1) here."""
        return None

    def cache_blocks(self, request: HashedRequest, view: Sequence[BlockHash] | None,
                     request_id: str, num_tokens: int) -> None:
        """Hash the request's blocks that ``num_tokens`` tokens fill and that
        are not cached yet; ``view`` is the request's hashes at this group's
        block size (``None``: the request's own hashes).

        Cost: O(blocks newly cached).
        """
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_blocks[request_id]
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request_id],
            block_hashes=request.block_hashes if view is None else view,
            num_cached_blocks=num_cached, num_full_blocks=num_full, block_size=self.block_size,
            group_id=self.group_id, mask=self.cache_mask(request, num_cached, num_full))
        self.num_cached_blocks[request_id] = num_full

    def release(self, request_id: str) -> None:
        """Release the request's blocks tail first and forget it.

        Cost: O(blocks held).
        """
        blocks = self.req_to_blocks.pop(request_id)
        del self.num_cached_blocks[request_id]
        blocks.reverse()  # FREE-2; the list is ours and dropped: reversing in place is free
        # Null blocks are never released; a type whose lists hold none
        # skips the filter (the per-request path of full attention).
        self.block_pool.free_held(blocks, with_null=self.holds_null_blocks)

    def get_num_common_prefix_blocks(self, request_id: str, num_requests: int) -> int:
        """Leading blocks of the request held by every known request (0 for
        types whose prefix is null blocks). Cost: O(1) here."""
        return 0

    def new_step_starts(self) -> None:
        """A scheduler step begins. Cost: O(1) here."""


class FullAttentionManager(SingleTypeManager):
    """Full (causal) attention, MLA included: every position keeps its
    block; a hit of ``L`` tokens needs its ``L / b`` leading blocks cached."""

    __slots__ = ()

    holds_null_blocks = False

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[int]:
        """This group's longest cached prefix of at most ``max_length``
        tokens, the group hashed at its block size. With ``use_eagle`` one
        matched block is dropped so the drafter recomputes its hidden
        states. Pure: touches nothing.

        Cost: O(blocks hit + 1).
        """
        # Probe the raw-hash table directly (no key bytes built per block).
        table = self.block_pool.cached_by_group[self.group_id]
        limit = max_length // self.block_size
        found = None if NATIVE is None else NATIVE.prefix_hits(table, block_hashes, limit)
        if found is not None:
            hit = found  # the same scan in C (D-PERF-41)
        else:
            table_get = table.get
            hit = []
            append = hit.append
            for block_hash in block_hashes[:limit]:
                block = table_get(block_hash)  # the key's first holder (an int)
                if block is None:
                    break
                append(block)
        if self.use_eagle and hit:
            hit.pop()
        return hit

    def longest_hit(self, view: Sequence[BlockHash], bound: int, max_length: int) -> int:
        """See the base class. The cached prefix is scanned left to right,
        once: below it every length qualifies, so a lower bound never needs
        another scan (the hybrid search calls this once per lookup).

        Cost: O(blocks of the cached prefix, up to the bound, + 1).
        """
        block_size = self.block_size
        shift = 1 if self.use_eagle else 0
        limit = min(bound, (len(view) - shift) * block_size)
        if shift:
            limit = min(limit, max_length - block_size)
        if limit <= 0:
            return 0
        pool = self.block_pool
        table = pool.cached_by_group[self.group_id]
        found = None if NATIVE is None else NATIVE.prefix_hits(table, view, limit // block_size + shift)
        if found is not None:
            prefix = len(found)  # the same scan in C (D-PERF-41)
            pool.last_scan = (pool.map_epoch, self.group_id, view[:prefix], found)  # for hit_blocks (D-PERF-46)
        else:
            get = table.get
            prefix = 0
            for block_hash in view[:limit // block_size + shift]:
                if get(block_hash) is None:
                    break
                prefix += 1
        limit = min(limit, (prefix - shift) * block_size)
        return max(0, limit // self.alignment * self.alignment)

    def get_num_common_prefix_blocks(self, request_id: str, num_requests: int) -> int:
        """Leading blocks with ref count ``num_requests``.
        Cost: O(common blocks + 1)."""
        ref = self.block_pool.ref_counts
        count = 0
        for block in self.req_to_blocks[request_id]:
            if ref[block] != num_requests:
                break
            count += 1
        return count


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with attention sinks: ``sink_len / b`` blocks are
    reserved when the manager is built and held for good (SINK-1); requests
    behave as under full attention.

    Raises:
        InvalidConfigError: ``sink_len`` is not a positive multiple of the
            block size, or the pool cannot hold the sink blocks.
    """

    __slots__ = ("sink_blocks",)

    def _setup(self) -> None:
        """Reserve the sink blocks. Cost: O(sink blocks)."""
        kv_cache_spec, block_size, block_pool = self.kv_cache_spec, self.block_size, self.block_pool
        assert isinstance(kv_cache_spec, SinkFullAttentionSpec)
        sink_len = kv_cache_spec.sink_len
        if sink_len is None or sink_len <= 0 or sink_len % block_size:
            raise InvalidConfigError(
                f"SinkFullAttentionSpec.sink_len must be a positive multiple of the block size "
                f"{block_size}, got {sink_len!r}")
        free = block_pool.get_num_free_blocks()
        if sink_len // block_size > free:
            raise InvalidConfigError(
                f"SinkFullAttentionSpec.sink_len={sink_len} needs {sink_len // block_size} "
                f"blocks, the pool has {free}")
        self.sink_blocks = block_pool.reserve(sink_len // block_size)
