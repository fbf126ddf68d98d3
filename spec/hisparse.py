"""The vocabulary of host-resident (HiSparse) groups: spec/host_tier.md.

HiSparse keeps every page of a sparse-attention model in a host pool (the
*source* group, ``KVCacheGroupSpec.host_resident``) and a working set in the
device pool (*resident* pages plus a per-request *hot* region). This module
holds what both implementations share: the two derived specs, the group
roles, the transfer record, the configuration of a host tier and the
planning helpers that keep the host pool out of device bytes (D-HOST-3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InsufficientMemoryError, InvalidConfigError
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.setting import ModelSetting
from pagedkv.spec.types import BlockHash

__all__ = [
    "ACTIVE_TAIL_PAGES",
    "GROUP_ROLES",
    "HiSparseHotSpec",
    "HiSparseResidentSpec",
    "FenceHold",
    "HostAllocation",
    "HostCacheEvent",
    "HostTierSnapshot",
    "RequestResidency",
    "ResidencyUpdate",
    "RowMirror",
    "HostTierConfig",
    "PageTransfer",
    "device_groups",
    "host_groups",
    "host_pool_num_blocks",
    "steady_state_concurrency",
    "host_tier_config",
]

ACTIVE_TAIL_PAGES: Final = 2
"""Pages at a request's tail never unpinned: an in-flight step may still write them (HOST-10)."""

GROUP_ROLES: Final = ("default", "hisparse_source", "hisparse_indexer")
"""Values of ``KVCacheGroupSpec.role``."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _positive(owner: object, name: str, value: object) -> None:
    if type(value) is not int or value < 1:
        raise InvalidConfigError(
            f"{type(owner).__name__}.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class HiSparseHotSpec(KVCacheSpec):
    """A request's hot region: ``blocks_per_request`` device blocks of
    ``page_size`` bytes, taken once the request reads host-backed history.
    Never prefix-cached."""

    page_size: int
    blocks_per_request: int

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        _positive(self, "page_size", self.page_size)
        _positive(self, "blocks_per_request", self.blocks_per_request)

    @property
    def real_page_size_bytes(self) -> int:
        return self.page_size

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        """The hot region, whatever the context length."""
        return self.blocks_per_request * self.page_size


@dataclass(frozen=True, slots=True)
class HiSparseResidentSpec(KVCacheSpec):
    """Device pages of host-backed KV; a request keeps at most its in-flight
    window of them pinned (older clean pages are released to the pool)."""

    page_size: int

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        _positive(self, "page_size", self.page_size)

    @property
    def real_page_size_bytes(self) -> int:
        return self.page_size

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int,
                                         max_model_len: int) -> int:
        """``cdiv(min(max_num_batched_tokens, max_model_len), block_size)``."""
        return _cdiv(min(max_num_batched_tokens, max_model_len), self.block_size)

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        return self.max_admission_blocks_per_request(
            setting.max_num_batched_tokens, setting.max_model_len) * self.page_size


@dataclass(frozen=True, slots=True)
class PageTransfer:
    """One page moved between tiers. ``kind`` ``"writeback"`` copies device
    block ``device_block`` onto host block ``host_block``; ``"restore"`` the
    other way. The transfer holds a reference on both blocks until
    ``complete`` (HOST-2, HOST-3)."""

    transfer_id: int
    request_id: str
    page: int
    host_block: int
    device_block: int
    kind: Literal["writeback", "restore"]


@dataclass(frozen=True, slots=True)
class HostTierConfig:
    """The geometry of one host tier.

    ``host_num_blocks`` / ``device_num_blocks``: pool sizes, block 0 of each
    being its null block. ``hot_blocks_per_request``: the hot region.
    ``watermark``: below this many free device blocks a request without a hot
    region asks for one (``update_residency``); ``None`` is vLLM 0.33's
    ``max(hot_blocks_per_request, device_num_blocks // 10)``.
    ``admission_window``: resident pages a request may keep pinned before it
    must read from host (``HiSparseResidentSpec.max_admission_blocks_per_request``);
    ``None``: no such limit.
    ``num_reprefillable_tokens``: a request's last tokens the engine prefills
    again (multi-token prediction), never written back (``advance``).
    ``max_spill_pages``: transfers the outbox may hold before ``advance``
    plans no more write-backs; ``None`` is vLLM 0.33's ``max_model_len //
    block_size`` (``spill_budget``).
    """

    block_size: int
    host_num_blocks: int
    device_num_blocks: int
    hot_blocks_per_request: int
    max_model_len: int
    enable_caching: bool = True
    watermark: int | None = None
    admission_window: int | None = None
    num_reprefillable_tokens: int = 0
    max_spill_pages: int | None = None
    record_events: bool = False
    """Record the host cache's changes for ``take_host_events`` (D-HOST-26)."""

    def __post_init__(self) -> None:
        if type(self.num_reprefillable_tokens) is not int or self.num_reprefillable_tokens < 0:
            raise InvalidConfigError("HostTierConfig.num_reprefillable_tokens must be an int >= 0, "
                                     f"got {self.num_reprefillable_tokens!r}")
        if self.max_spill_pages is not None:
            _positive(self, "max_spill_pages", self.max_spill_pages)
        if self.admission_window is not None:
            _positive(self, "admission_window", self.admission_window)
        for name in ("block_size", "host_num_blocks", "device_num_blocks",
                     "hot_blocks_per_request", "max_model_len"):
            _positive(self, name, getattr(self, name))
        if type(self.record_events) is not bool:
            raise InvalidConfigError(
                f"HostTierConfig.record_events must be a bool, got {self.record_events!r}")
        if type(self.enable_caching) is not bool:
            raise InvalidConfigError(
                f"HostTierConfig.enable_caching must be a bool, got {self.enable_caching!r}")
        if self.watermark is not None and (type(self.watermark) is not int or self.watermark < 0):
            raise InvalidConfigError(
                f"HostTierConfig.watermark must be None or an int >= 0, got {self.watermark!r}")

    @property
    def device_watermark(self) -> int:
        """The resolved watermark (see the class docstring)."""
        if self.watermark is not None:
            return self.watermark
        return max(self.hot_blocks_per_request, self.device_num_blocks // 10)

    @property
    def spill_budget(self) -> int:
        """The resolved ``max_spill_pages`` (see the class docstring)."""
        if self.max_spill_pages is not None:
            return self.max_spill_pages
        return self.max_model_len // self.block_size


def host_groups(groups: Sequence[KVCacheGroupSpec]) -> tuple[int, ...]:
    """Indices of the host-resident groups."""
    return tuple(i for i, group in enumerate(groups) if group.host_resident)


def device_groups(groups: Sequence[KVCacheGroupSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """The groups planning counts against device memory: every group that is
    not host-resident (D-HOST-3). A host-resident group's bytes live in the
    host pool, sized by its own budget."""
    return tuple(group for group in groups if not group.host_resident)


def host_tier_config(config: KVCacheConfig, host_num_blocks: int, max_model_len: int,
                     enable_caching: bool = True,
                     max_num_batched_tokens: int | None = None,
                     num_reprefillable_tokens: int = 0) -> HostTierConfig:
    """The host tier a HiSparse ``KVCacheConfig`` describes.

    Exactly one group must be host-resident with role ``hisparse_source``;
    resident and hot groups must share its block size (vLLM 0.33 refuses the
    same configurations). The hot region is the sum over hot groups of
    ``blocks_per_request`` (D-HOST-2: one resident and one hot group are
    modelled; several are folded into one). With ``max_num_batched_tokens``
    the admission window is the resident spec's in-flight bound.
    ``num_reprefillable_tokens``: tokens ``advance`` never writes back (D-HOST-13).

    Raises:
        InvalidConfigError: no or several host groups, a host group that is
            not the source, a source after a resident group, block sizes
            that differ, no hot group.
    """
    groups = config.kv_cache_groups
    hosts = host_groups(groups)
    if len(hosts) != 1:
        raise InvalidConfigError(
            f"a HiSparse KVCacheConfig needs exactly one host_resident group, got {len(hosts)}")
    source = groups[hosts[0]]
    if source.role != "hisparse_source":
        raise InvalidConfigError(
            f"the host_resident group must have role 'hisparse_source', got {source.role!r}")
    residents = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiSparseResidentSpec)]
    hots = [g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, HiSparseHotSpec)]
    if residents and hosts[0] > min(residents):
        raise InvalidConfigError("the HiSparse source group must precede its resident groups")
    if not hots:
        raise InvalidConfigError("a HiSparse KVCacheConfig needs a HiSparseHotSpec group")
    block_size = source.kv_cache_spec.block_size
    for i in residents:
        if groups[i].kv_cache_spec.block_size != block_size:
            raise InvalidConfigError(
                f"resident group {i} has block_size {groups[i].kv_cache_spec.block_size}, "
                f"the source group {block_size}")
    window: int | None = None
    if residents and max_num_batched_tokens is not None:
        resident = groups[residents[0]].kv_cache_spec
        assert isinstance(resident, HiSparseResidentSpec)
        window = resident.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
    return HostTierConfig(
        admission_window=window,
        block_size=block_size, host_num_blocks=host_num_blocks,
        device_num_blocks=config.num_blocks,
        hot_blocks_per_request=sum(spec.blocks_per_request for spec in hots
                                   if isinstance(spec, HiSparseHotSpec)),
        max_model_len=max_model_len, enable_caching=enable_caching,
        num_reprefillable_tokens=num_reprefillable_tokens)


@dataclass(frozen=True, slots=True)
class RowMirror:
    """Token rows a step writes on the device, to be mirrored into the host
    pool: ``num_rows`` slots from device slot ``device_slot`` (block id *
    block size + offset) to host slot ``host_slot``."""

    device_slot: int
    host_slot: int
    num_rows: int


@dataclass(frozen=True, slots=True)
class HostAllocation:
    """What one successful ``allocate`` added: new host blocks (hit blocks
    first), new device blocks of resident pages, the hot region if taken."""

    host_blocks: tuple[int, ...]
    resident_blocks: tuple[int, ...]
    hot_blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FenceHold:
    """The blocks ``pop_for_free`` kept referenced for a step still in flight:
    host blocks of every page, device blocks of pages that are not clean (a
    step may still write them) and the hot region. ``release_fence`` drops
    them, resident pages tail first, then the hot region, then the host row."""

    fence_id: int
    host_blocks: tuple[int, ...]
    resident_blocks: tuple[int, ...]
    hot_blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RequestResidency:
    """One request's rows as both implementations report them (lockstep)."""

    host_row: tuple[int, ...]
    resident_row: tuple[int, ...]
    hot: tuple[int, ...]
    hot_required: bool
    clean: frozenset[int]
    pending: frozenset[int]
    unpinned: frozenset[int]
    published: int
    importing: int
    synced: int
    stale: frozenset[int]


@dataclass(frozen=True, slots=True)
class ResidencyUpdate:
    """What the worker must learn about one request's residency: for each
    page in ``pages`` (stale pages first, then pages it has never seen), the
    device block to read it from, 0 where the page is host-only."""

    pages: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HostCacheEvent:
    """A change of the host cache (``take_host_events``, D-HOST-26).

    ``stored``: ``block_hashes`` entered the cache on ``host_blocks``, pages
    ``first_page``.. of ``request_id`` (``detached``: a finished request's
    late publication), after the page whose hash is ``parent_hash``.
    ``removed``: ``block_hashes`` left it (evicted on reuse or by
    ``evict_host_blocks``); the other fields are empty.
    """

    kind: Literal["stored", "removed"]
    block_hashes: tuple[BlockHash, ...]
    host_blocks: tuple[int, ...] = ()
    request_id: str = ""
    first_page: int = 0
    parent_hash: BlockHash | None = None
    detached: bool = False


@dataclass(frozen=True, slots=True)
class HostTierSnapshot:
    """The observable state of a host tier: per pool the free queue (front
    first) and the cached hashes (hash -> block), and every request's rows."""

    host_free: tuple[int, ...]
    host_cached: tuple[tuple[bytes, int], ...]
    device_free: tuple[int, ...]
    requests: tuple[tuple[str, RequestResidency], ...]
    in_flight: tuple[PageTransfer, ...]
    copies: tuple[tuple[bytes, int], ...]
    detached: tuple[tuple[int, ...], ...]
    outbox: tuple[int, ...] = ()
    """Ids of the transfers planned and not yet taken (``take_transfers``), in order."""
    worker_counts: tuple[tuple[int, int, int], ...] = ()
    """(transfer id, expected, completed) worker counts reported so far, by id."""
    fences: tuple[FenceHold, ...] = ()
    """Blocks held for steps still in flight (``pop_for_free``), by fence id."""
    shared: tuple[int, ...] = ()
    """Device blocks other device groups hold (``take_shared``), ascending."""
    host_taken: tuple[int, ...] = ()
    """Host blocks callers outside any request hold (``take_host``), ascending."""


def host_pool_num_blocks(host_budget_bytes: int, host_block_bytes: int, block_size: int,
                         max_model_len: int) -> int:
    """Blocks of a host pool of ``host_budget_bytes`` whose blocks take
    ``host_block_bytes`` (the source group's pages of every layer).

    Every computed page needs a host block, so one request of
    ``max_model_len`` tokens must fit beside the null block and one spare
    (a copy-on-write tail): at least ``cdiv(max_model_len, block_size) + 2``.

    Raises:
        InvalidConfigError: a size below 1.
        InsufficientMemoryError: the budget holds fewer blocks than that.
    """
    for name, value in (("host_budget_bytes", host_budget_bytes),
                        ("host_block_bytes", host_block_bytes), ("block_size", block_size),
                        ("max_model_len", max_model_len)):
        if type(value) is not int or value < 1:
            raise InvalidConfigError(f"{name} must be an int >= 1, got {value!r}")
    num_blocks = host_budget_bytes // host_block_bytes
    needed = _cdiv(max_model_len, block_size) + 2
    if num_blocks < needed:
        raise InsufficientMemoryError(
            f"the host pool holds {num_blocks} blocks of {host_block_bytes} bytes; "
            f"max_model_len {max_model_len} needs {needed}: raise host_budget_bytes")
    return num_blocks


def steady_state_concurrency(config: KVCacheConfig, host_num_blocks: int,
                             setting: ModelSetting) -> float:
    """Requests of ``max_model_len`` tokens a HiSparse configuration serves
    at once once they read from host: each pins only its active tail of
    resident pages, but one being admitted takes its whole window; the host
    pool bounds it too (every page has a host block)."""
    admission = steady = host = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        required = _cdiv(spec.max_memory_usage_bytes(setting), spec.page_size_bytes)
        if group.host_resident:
            host += required
            continue
        admission += required
        steady += min(required, ACTIVE_TAIL_PAGES) if isinstance(
            spec, HiSparseResidentSpec) else required
    if host == 0 or steady == 0:
        raise InvalidConfigError("a HiSparse configuration needs host and device groups")
    if config.num_blocks < admission:
        device = config.num_blocks / admission
    else:
        device = 1 + (config.num_blocks - admission) / steady
    return min(device, host_num_blocks / host)
