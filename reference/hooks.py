"""How a feature plugs into the reference kernel: the hooks H1..H8 of
spec/managers.md §9. Every hook has a do-nothing default, so a feature
states only the ones it needs. The coordinator makes one instance of each
feature class it is handed, so a feature may keep per-manager state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from pagedkv.spec.request import RequestFacts
from pagedkv.spec.types import BlockHash

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator
    from pagedkv.reference.single_type import SingleTypeManager

__all__ = ["Feature"]


class Feature:
    """One feature of ``pagedkv.reference.features``: the hooks it fills."""

    def attention_types(self) -> Mapping[str, type[SingleTypeManager]]:
        """H1: the manager kinds this feature serves, each with its class."""
        return {}

    def configure(self, coordinator: KVCacheCoordinator) -> None:
        """H2: once, after the managers are built, before any request."""

    def lookup(self, coordinator: KVCacheCoordinator, manager: SingleTypeManager,
               block_hashes: Sequence[BlockHash], max_length: int) -> tuple[Sequence[BlockHash], int] | None:
        """H3: the hashes ``manager``'s lookups read and their reach, if not its view and the cap (LOOKUP-3)."""
        return None

    def accepts_hit(self, coordinator: KVCacheCoordinator, manager: SingleTypeManager, num_tokens: int,
                    num_blocks: int, num_external_computed_tokens: int) -> bool:
        """H4: whether a hit shape the kernel refuses (not whole blocks) fits ``manager`` (ALLOC-1, step 1f)."""
        return False

    def step_blocks(self, coordinator: KVCacheCoordinator, request: RequestFacts, request_id: str,
                    query_start: int, query_end: int, reserve: bool) -> int:
        """H5: blocks the step ``[query_start, query_end)`` takes beside the
        groups' own demand (ALLOC-5); with ``reserve``, record them (ALLOC-7)."""
        return 0

    def caching(self, coordinator: KVCacheCoordinator, request_id: str, num_tokens: int) -> None:
        """H6: before the groups cache up to ``num_tokens`` (ALLOC-8, ``cache_blocks``)."""

    def held_blocks(self, coordinator: KVCacheCoordinator) -> Iterable[int]:
        """H7: ids of the blocks this feature holds, beside the requests', once per reference (REQ-1)."""
        return ()

    def check(self, coordinator: KVCacheCoordinator) -> str | None:
        """H8: ``"<ID>: <what>"`` of a broken invariant of this feature, or ``None``."""
        return None
