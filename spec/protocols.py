"""The public API every implementation satisfies, as Protocols.

Semantic model (spec/state.md): a pool of ``num_blocks`` numbered blocks.
Block 0 is the *null block*, a placeholder never handed out. Every other
block is either *free* (in the free queue, ref count 0) or *in use* (ref
count = number of requests holding it). A block may carry a *hash* (its
tokens are a known, cached prefix); a free block with a hash is an eviction
candidate that a prefix hit can still revive. The manager keeps, per
request and per KV cache group, the list of blocks holding the request's
tokens, in token order.

Block lifecycle::

    free --allocate--> in use --(block full, cache)--> in use + hashed
      ^                                                    | free
      |                                                    v
      +---(no hash: front of queue)--- free <---- free + hashed (evictable)
                                         ^    hit  |  allocate pops it:
                                         |         v  hash evicted
                                         +----- in use again
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, Self

from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.request import Request, RequestView
from pagedkv.spec.snapshot import ManagerSnapshot, PoolSnapshot
from pagedkv.spec.types import KVCacheEvent, PrefixCacheStats

__all__ = ["KVCacheBlocksLike", "BlockPoolLike", "KVCacheManagerLike"]


class KVCacheBlocksLike(Protocol):
    """The blocks an allocation or a prefix hit returns, per KV cache group."""

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group, in token order."""
        ...

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks (single group only) that carry no hash now."""
        ...

    def __add__(self, other: Self) -> Self:
        """Group-wise concatenation."""
        ...

    def new_empty(self) -> Self:
        """The same number of groups, no blocks."""
        ...


class BlockPoolLike(Protocol):
    """The part of the block pool engines read."""

    @property
    def num_blocks(self) -> int: ...

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (evictable cached blocks included)."""
        ...

    def get_usage(self) -> float:
        """``1 - free / (num_blocks - 1)``: the fraction of usable blocks in use."""
        ...

    def take_events(self) -> list[KVCacheEvent]:
        """Events since the last call, oldest first; empties the queue."""
        ...

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the hashes of the given blocks (in the given order)."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Drop every hash if no block is in use; ``False`` (no change) otherwise."""
        ...

    def snapshot(self) -> PoolSnapshot:
        """Observable state (spec/state.md)."""
        ...


class KVCacheManagerLike(Protocol):
    """The KV cache manager facade: what an engine's scheduler calls."""

    max_model_len: int
    enable_caching: bool

    @property
    def block_pool(self) -> Any: ...

    @property
    def usage(self) -> float: ...

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], **extra: Any) -> Request: ...

    def get_computed_blocks(self, request: RequestView) -> tuple[Any, int]: ...

    def get_computed_blocks_per_group(self, request: RequestView) -> tuple[Any, tuple[int, ...]]: ...

    def shared_prefix_boundary(self, request: RequestView, num_hit_tokens: int) -> int: ...

    def allocate_slots(
        self,
        request: RequestView,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        num_in_flight_tokens: int = 0,
        watermark_blocks: int = 0,
    ) -> Any: ...

    def free(self, request: RequestView, *, missing_ok: bool = False) -> None: ...

    def evict_blocks(self, block_ids: Iterable[int]) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]: ...

    def take_events(self) -> list[KVCacheEvent]: ...

    def get_blocks(self, request_id: str) -> Any: ...

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]: ...

    def cache_blocks(self, request: RequestView, num_computed_tokens: int) -> None: ...

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None: ...

    def new_step_starts(self) -> None: ...

    def snapshot(self) -> ManagerSnapshot: ...

    @property
    def kv_cache_config(self) -> KVCacheConfig: ...
