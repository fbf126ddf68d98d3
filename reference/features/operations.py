"""The facade's methods that only features serve: the per-group hits a KV
connector reads, the shared-prefix junction (D-SWA-11), sub-block hits
and their copies (MPART-1..6), and the Mamba states offered to a connector
(MOFF-1, MTAIL-1). :class:`~pagedkv.reference.manager.KVCacheManager`
inherits them; the kernel's own operations do not call them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.reference import rules, validation
from pagedkv.reference.block_pool import KVCacheBlock, KVCacheBlocks
from pagedkv.reference.features.mamba_partial import SubBlockHits
from pagedkv.reference.features.mamba_states import MambaStateManager
from pagedkv.reference.single_type import FullAttentionManager
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.request import RequestFacts, RequestView
from pagedkv.spec.types import BlockHash

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator

__all__ = ["FeatureOperations", "per_group_hits"]


def per_group_hits(coordinator: KVCacheCoordinator, block_hashes: Sequence[BlockHash],
                   max_length: int) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
    """Each group's own longest hit, not reconciled across groups: the
    largest ``L <= max_length`` (a multiple of the hit unit) the group alone
    can serve, and its blocks (spec/operations.md)."""
    blocks: list[list[KVCacheBlock]] = []
    lengths: list[int] = []
    unit = coordinator.hit_unit
    for manager, cacheable in zip(coordinator.managers, coordinator.cacheable):
        if not (cacheable and coordinator.enable_caching):
            # PFX-1: no hit; such a group may be finer than the hash block, so it has no view.
            blocks.append([])
            lengths.append(0)
            continue
        view, limit = coordinator.lookup(manager, block_hashes, max_length)
        length = max_length // unit * unit
        while length > 0 and not manager.can_hit(view, length, limit):
            length -= unit
        blocks.append(manager.hit_blocks(view, length, limit) if length else [])
        lengths.append(length)
    return tuple(blocks), tuple(lengths)


class FeatureOperations:
    """Mixed into the reference facade."""

    coordinator: KVCacheCoordinator
    enable_caching: bool

    def _lookup_cap(self, request: RequestFacts) -> int | None:
        """The hit cap (LOOKUP-2), or ``None`` when nothing may be looked up (LOOKUP-1)."""
        if not self.enable_caching or request.skip_reading_prefix_cache or not self.coordinator.managers:
            return None
        return rules.max_hit_tokens(validation.count("request.num_tokens", request.num_tokens, 1))

    def get_computed_blocks_per_group(self, request: RequestView) -> tuple[KVCacheBlocks, tuple[int, ...]]:
        """Each group's own longest hit (at most ``num_tokens - 1`` tokens),
        not reconciled across groups: what a KV connector reads. Pure; no stats."""
        facts = RequestFacts.capture(request)
        max_length = self._lookup_cap(facts)
        if max_length is None:
            return KVCacheBlocks([[] for _ in self.coordinator.managers]), tuple(
                0 for _ in self.coordinator.managers)
        hits, lengths = per_group_hits(self.coordinator, facts.block_hashes, max_length)
        return KVCacheBlocks(hits), lengths

    def shared_prefix_boundary(self, request: RequestView, num_hit_tokens: int) -> int:
        """The junction of a prefix ``request`` shares with an earlier request
        that the leading group (the first full-attention group, else the
        first cacheable one) caches beyond the common hit ``num_hit_tokens``
        of ``get_computed_blocks``; 0 if none or with one group. The engine
        may pin it as ``request.shared_prefix_boundary`` so that sparse
        retention keeps the window tail there (D-SWA-11). Pure."""
        facts = RequestFacts.capture(request)
        max_length = self._lookup_cap(facts)
        coordinator = self.coordinator
        candidates = [index for index, cacheable in enumerate(coordinator.cacheable) if cacheable]
        if max_length is None or len(coordinator.managers) < 2 or not candidates:
            return 0
        leading = next((index for index in candidates
                        if isinstance(coordinator.managers[index], FullAttentionManager)), candidates[0])
        _, lengths = per_group_hits(coordinator, facts.block_hashes, max_length)
        return lengths[leading] if lengths[leading] > num_hit_tokens else 0

    def enable_partial_hash_hits(self, dcp_world_size: int = 1, *, shared_prefix_checkpoint: bool = False) -> None:
        """Turn on sub-block hits with copy-on-write (spec/mamba.md, MPART-1..6,
        FPART-1..5); see :meth:`SubBlockHits.enable`.

        Raises:
            InvalidConfigError: unsupported configuration (D-MAMBA-15, D-MAMBA-21, D-MAMBA-40),
                requests already known, or a malformed ``dcp_world_size``.
        """
        self.coordinator.feature(SubBlockHits).enable(self.coordinator, dcp_world_size, shared_prefix_checkpoint)

    def take_kv_cache_block_copies(self, *, hand_over: bool = False) -> tuple[list[tuple[int, int]], list[int]]:
        """Copy-on-write copies queued since the last call, as ``(source id,
        destination id)``, and the retained block ids (each pair's source then
        destination): the caller runs the copies, then hands the ids to
        :meth:`release_copy_retentions` (MPART-3). With ``hand_over`` they are
        plain references the caller frees through the pool (D-MAMBA-19)."""
        pairs = self.coordinator.feature(SubBlockHits).take_copies(self.coordinator, hand_over)
        return ([(source.block_id, destination.block_id) for source, destination in pairs],
                [block.block_id for pair in pairs for block in pair])

    def release_copy_retentions(self, block_ids: Sequence[int]) -> None:
        """Drop the retention reference of each block id, in order (after the copies ran).

        Raises:
            InvalidArgumentError: an id not retained by a taken copy (no change).
        """
        self.coordinator.feature(SubBlockHits).release_retentions(self.coordinator, block_ids)

    def _mamba_groups(self) -> list[MambaStateManager]:
        return [group for group in self.coordinator.managers if isinstance(group, MambaStateManager)]

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba ``align`` boundary states cached since the last call, for a KV
        connector to offload: request id -> ``(group id, block id, tokens)``
        by group, then oldest first (MOFF-1)."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for group in self._mamba_groups():
            for request_id, block, num_tokens in group.take_offers():
                offloads.setdefault(request_id, []).append((group.group_id, block.block_id, num_tokens))
        return offloads

    def finalize_partial_tail_offloads(self, request_id: str, num_computed_tokens: int,
                                       num_in_flight_tokens: int) -> list[tuple[int, int, int]]:
        """A finishing request's Mamba ``align`` prompt tails that no copy
        preserved, ``(group id, block id, boundary)`` in group order: given
        only when ``num_in_flight_tokens == 0`` and ``num_computed_tokens`` is
        the boundary; the record is consumed either way (MTAIL-1).

        Raises:
            InvalidArgumentError: a count is not an int >= 0 (no change).
        """
        if not all(type(count) is int and count >= 0 for count in (num_computed_tokens, num_in_flight_tokens)):
            raise InvalidArgumentError(
                f"num_computed_tokens and num_in_flight_tokens must be ints >= 0, got "
                f"{num_computed_tokens!r} and {num_in_flight_tokens!r}")
        offloads: list[tuple[int, int, int]] = []
        for group in self._mamba_groups():
            tail = group.finalize_partial_tail(request_id, num_computed_tokens, num_in_flight_tokens)
            if tail is not None:
                offloads.append((group.group_id, tail[0].block_id, tail[1]))
        return offloads
