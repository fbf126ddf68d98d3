"""What the fast paths read of the coordinator that builds them: its tables, as a
:class:`typing.Protocol`.

The paths sit one layer below ``pagedkv.optimized.coordination`` (the coordinator
builds its decode, fill and admit steps from them at construction), so they name
the coordinator's state, not its class: an import of the class would close an
import circle. :class:`~pagedkv.optimized.coordination.coordinator.KVCacheCoordinator`
satisfies this protocol; mypy checks that where the coordinator passes itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from pagedkv.optimized.groups.dcp_partial import FullAttentionSubBlockManager
from pagedkv.optimized.groups.mamba import MambaManager
from pagedkv.optimized.groups.single_type import SingleTypeManager
from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.optimized.pool.blocks import KVCacheBlocks
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.request import RequestFacts

__all__ = ["CoordinatorState"]


class CoordinatorState(Protocol):
    """The coordinator's tables the fast paths and recovery read (each one is the
    attribute of the same name documented on ``KVCacheCoordinator``)."""

    managers: tuple[SingleTypeManager, ...]
    copy_managers: tuple[MambaManager | FullAttentionSubBlockManager, ...]
    block_pool: BlockPool
    requests: set[str]
    retained: Counter[int]
    enable_caching: bool
    hash_block_size: int
    block_sizes: tuple[int, ...]
    max_model_len: int
    cacheable: tuple[bool, ...]
    empty_blocks: KVCacheBlocks
    well_formed_request_types: set[type]
    request_facts_readers: dict[type, Callable[[Any], RequestFacts]]

    def cache_blocks(self, *, request: HashedRequest, request_id: str, num_tokens: int) -> None:
        """Cache the blocks ``num_tokens`` fill, in every group."""
