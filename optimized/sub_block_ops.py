"""The facade's operations for sub-block (partial) hits and the per-step
Mamba state drains (spec/mamba.md: MPART-1..4, FPART-1..4, MOFF-1..2,
MTAIL-1): a mixin of :class:`pagedkv.optimized.KVCacheManager`, kept apart so
the facade stays one screenful per concern. Each method validates, then hands
the work to the coordinator or its Mamba groups."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.coordination.coordinator import KVCacheCoordinator
from pagedkv.spec.errors import InvalidArgumentError

__all__ = ["SubBlockOperations"]


class SubBlockOperations:
    """Mixin: needs ``_coordinator`` (the facade sets it)."""

    _coordinator: KVCacheCoordinator

    def enable_partial_hash_hits(self, dcp_world_size: int = 1, *, shared_prefix_checkpoint: bool = False) -> None:
        """Turn on sub-block hits with copy-on-write (spec/mamba.md, MPART-1..6,
        FPART-1..5); ``dcp_world_size``: the decode context parallelism the
        group block sizes already reflect (D-MAMBA-20); ``shared_prefix_checkpoint``:
        Mamba groups also publish the state at a request's observed junction,
        where an EAGLE sibling resumes (MPART-6, D-MAMBA-40).

        Raises:
            InvalidConfigError: unsupported configuration (D-MAMBA-15, D-MAMBA-21, D-MAMBA-40),
                requests already known, or a malformed ``dcp_world_size``.
        Cost: O(groups).
        """
        self._coordinator.enable_partial_hash_hits(dcp_world_size, shared_prefix_checkpoint=shared_prefix_checkpoint)

    def take_kv_cache_block_copies(self, *, hand_over: bool = False) -> tuple[list[tuple[int, int]], list[int]]:
        """Copy-on-write copies queued since the last call and the retained
        block ids (each pair's source then destination), released with
        :meth:`release_copy_retentions` once the copies ran (MPART-3), or
        with ``hand_over`` freed by the caller through the pool (D-MAMBA-19).
        Cost: O(groups + copies)."""
        pairs = self._coordinator.take_block_copies(hand_over=hand_over)
        return pairs, [block for pair in pairs for block in pair]

    def release_copy_retentions(self, block_ids: Sequence[int]) -> None:
        """Drop one retention reference per block id, in order.

        Raises:
            InvalidArgumentError: an id not retained by a taken copy (no change).
        Cost: O(len(block_ids)).
        """
        self._coordinator.release_copy_retentions(block_ids)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba ``align`` boundary states cached since the last call, for a KV
        connector to offload: request id -> ``(group id, block id, tokens)``
        by group, then oldest first (spec/mamba.md, MOFF-1). Cost: O(groups + offers)."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for group in self._coordinator.mamba_managers:
            for request_id, block, num_tokens in group.take_offers():
                offloads.setdefault(request_id, []).append((group.group_id, block, num_tokens))
        return offloads

    def finalize_partial_tail_offloads(self, request_id: str, num_computed_tokens: int,
                                       num_in_flight_tokens: int) -> list[tuple[int, int, int]]:
        """A finishing request's Mamba ``align`` prompt tails that no copy
        preserved, for a KV connector to offload from the block itself:
        ``(group id, block id, boundary)`` per group, in group order. Given only
        when ``num_in_flight_tokens == 0`` and ``num_computed_tokens`` is the
        boundary (no later token overwrote the state); the record is consumed
        either way, so a second call gives nothing (spec/mamba.md, MTAIL-1). Cost: O(groups).

        Raises:
            InvalidArgumentError: a count is not an int >= 0 (no change).
        """
        if not all(type(count) is int and count >= 0 for count in (num_computed_tokens, num_in_flight_tokens)):
            raise InvalidArgumentError(
                f"num_computed_tokens and num_in_flight_tokens must be ints >= 0, got "
                f"{num_computed_tokens!r} and {num_in_flight_tokens!r}")
        offloads: list[tuple[int, int, int]] = []
        for group in self._coordinator.mamba_managers:
            tail = group.finalize_partial_tail(request_id, num_computed_tokens, num_in_flight_tokens)
            if tail is not None:
                offloads.append((group.group_id, tail[0], tail[1]))
        return offloads
