"""One group's single-type manager as vLLM's tests and scheduler read it
(:class:`GroupManagerView`), and the live per-request block lists it shows.

Apart from :mod:`pagedkv.vllm.coordinator` so that the Mamba views
(:mod:`pagedkv.vllm.mamba`), which extend it, and the coordinator view, which
builds both, import it without an import circle.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pagedkv.optimized.engine import SingleTypeManager as GroupManager

from .blocks import BlockPoolView, BlockView

__all__ = ["GroupManagerView", "LiveBlocks", "ZeroingBlockIds"]

# Ids of fresh blocks the engine must zero before use, drained once per step.
ZeroingBlockIds = list[int]

class LiveBlocks(Sequence[BlockView]):
    """One request's blocks in one group, read from pagedkv's table on every
    access: vLLM hands out its own list, which later allocations grow and
    edit in place, and callers keep it across steps (D-MAMBA-27). Once the
    request is freed the blocks it held last stay readable, as a list vLLM
    popped from its table does."""

    __slots__ = ("_table", "_request_id", "_last", "_pool")

    def __init__(self, table: dict[str, list[int]], request_id: str, pool: BlockPoolView) -> None:
        self._table = table
        self._request_id = request_id
        self._last = list(table[request_id])
        self._pool = pool

    @property
    def _ids(self) -> list[int]:
        ids = self._table.get(self._request_id)
        if ids is None:
            return self._last
        self._last = list(ids)
        return ids

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self._pool.views(self._ids[index])
        return self._pool.blocks[self._ids[index]]

    def __iter__(self) -> Iterator[BlockView]:
        return iter(self._pool.views(self._ids))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, LiveBlocks)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list

    def __repr__(self) -> str:
        return repr(list(self))


class _BlocksTable(Mapping[str, LiveBlocks]):
    """``req_to_blocks``: request id -> the group's blocks (live views)."""

    def __init__(self, table: dict[str, list[int]], pool: BlockPoolView) -> None:
        self._table = table
        self._pool = pool

    def __getitem__(self, request_id: str) -> LiveBlocks:
        return LiveBlocks(self._table, request_id, self._pool)

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


class GroupManagerView:
    """One group's single-type manager, as vLLM's tests and scheduler read it."""

    def __init__(self, core: GroupManager, vllm_spec: Any, group_id: int,
                 pool: BlockPoolView, dcp_world_size: int = 1) -> None:
        self.core = core
        self.dcp_world_size = dcp_world_size if getattr(vllm_spec, "dcp_sharded", True) else 1
        self.kv_cache_spec = vllm_spec
        self.kv_cache_group_id = group_id
        self.block_size = core.block_size
        self.block_pool = pool
        self.req_to_blocks = _BlocksTable(core.req_to_blocks, pool)
        self._null_block = pool.null_block
        # Copy-on-write pairs an engine (or a test) queues on the group itself;
        # ``take_kv_cache_block_copies`` drains them after the core's (MPART-3).
        self._pending_cow_copies: list[tuple[Any, Any]] = []
        self.num_cached_block: Mapping[str, int] = core.num_cached_blocks
        self.retains_longer_hit = False
        self.records_new_block_ids = False
        self.new_block_ids: list[int] = []

    def take_new_block_ids(self) -> ZeroingBlockIds:
        ids, self.new_block_ids = self.new_block_ids, []
        return ids
