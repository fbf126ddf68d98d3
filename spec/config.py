"""KV cache configuration: groups of layers, tensors, number of blocks.

These are the value types; ``planner`` builds them from per-layer specs and
``capacity`` measures them. ``check_kv_cache_config`` checks the structural
invariants CFG-20..CFG-23 of spec/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.kv_cache_spec import KVCacheSpec

__all__ = ["KVCacheTensor", "KVCacheGroupSpec", "KVCacheConfig", "check_kv_cache_config"]


@dataclass(frozen=True, slots=True)
class KVCacheTensor:
    """One device buffer of ``size`` bytes shared by the layers ``shared_by``."""

    size: int
    shared_by: tuple[str, ...]

    def __post_init__(self) -> None:
        if type(self.size) is not int or self.size <= 0:
            raise InvalidConfigError(f"KVCacheTensor.size must be a positive int, got {self.size!r}")
        object.__setattr__(self, "shared_by", tuple(self.shared_by))


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table (same spec, same block ids)."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    # HiSparse (spec/host_tier.md): a host-resident group takes its blocks
    # from the host pool, never the device pool; ``role`` is one of
    # ``pagedkv.spec.hisparse.GROUP_ROLES``.
    host_resident: bool = False
    role: str = "default"
    # A draft (EAGLE/MTP) layer group: the EAGLE hit rule applies to it and
    # its same-spec siblings; with no group marked, to every group (D-SWA-14).
    is_eagle_group: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if type(self.host_resident) is not bool:
            raise InvalidConfigError(
                f"KVCacheGroupSpec.host_resident must be a bool, got {self.host_resident!r}")
        if type(self.is_eagle_group) is not bool:
            raise InvalidConfigError(
                f"KVCacheGroupSpec.is_eagle_group must be a bool, got {self.is_eagle_group!r}")
        if self.role not in ("default", "hisparse_source", "hisparse_indexer"):
            raise InvalidConfigError(
                "KVCacheGroupSpec.role must be 'default', 'hisparse_source' or "
                f"'hisparse_indexer', got {self.role!r}")
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise InvalidConfigError(
                f"KVCacheGroupSpec.kv_cache_spec must be a KVCacheSpec, got {self.kv_cache_spec!r}")


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The whole KV cache: ``num_blocks`` blocks (block 0 is the null block),
    the tensors backing them and the groups of layers using them."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self) -> None:
        if type(self.num_blocks) is not int or self.num_blocks < 1:
            raise InvalidConfigError(
                f"KVCacheConfig.num_blocks must be an int >= 1 (block 0 is the null block), "
                f"got {self.num_blocks!r}")
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
        for index, group in enumerate(self.kv_cache_groups):
            if not isinstance(group, KVCacheGroupSpec):
                raise InvalidConfigError(
                    f"KVCacheConfig.kv_cache_groups[{index}] must be a KVCacheGroupSpec, got {group!r}")


def check_kv_cache_config(config: KVCacheConfig) -> None:
    """Check the structural invariants of a configuration; raise
    ``InvariantViolation`` whose message starts with the broken ID.

    - CFG-20: every layer belongs to exactly one group.
    - CFG-21: a tensor is shared by at most one layer of each group.
    - CFG-22: when there are tensors, every layer is backed by exactly one.
    - CFG-23: every group's spec has the same page size, so one block id
      covers the same bytes in every tensor it indexes.

    Runtime complexity: O(layers + tensors).
    """
    from pagedkv.spec.errors import InvariantViolation

    group_of: dict[str, int] = {}
    for group_id, group in enumerate(config.kv_cache_groups):
        for name in group.layer_names:
            if name in group_of:
                raise InvariantViolation(
                    f"CFG-20: layer {name!r} is in groups {group_of[name]} and {group_id}; {config!r}")
            group_of[name] = group_id
    backed: set[str] = set()
    for index, tensor in enumerate(config.kv_cache_tensors):
        groups_seen: set[int] = set()
        for name in tensor.shared_by:
            group_id = group_of.get(name, -1)
            if group_id in groups_seen:
                raise InvariantViolation(
                    f"CFG-21: tensor {index} is shared by two layers of group {group_id}; {config!r}")
            groups_seen.add(group_id)
            if name in backed:
                raise InvariantViolation(
                    f"CFG-22: layer {name!r} is backed by more than one tensor; {config!r}")
            backed.add(name)
    if config.kv_cache_tensors and backed != set(group_of):
        missing = sorted(set(group_of) - backed)
        extra = sorted(backed - set(group_of))
        raise InvariantViolation(
            f"CFG-22: layers without a tensor {missing}, tensors naming unknown layers {extra}; {config!r}")
    pages = {group.kv_cache_spec.page_size_bytes for group in config.kv_cache_groups}
    if len(pages) > 1:
        raise InvariantViolation(
            f"CFG-23: groups have different page sizes {sorted(pages)}; {config!r}")
