"""Planning a HiSparse host tier beside the device plan (spec/config.md,
"Host tier", D-CFG-13).

HiSparse keeps every page of a sparse-MLA model's *source* layers (the
sparse attention caches, not the indexer) in a host pool; a host block holds
one block's pages of every source layer, so its size is the sum of their
page sizes (vLLM 0.33's stride for a pool that local ranks do not share).
The host pool gets ``host_memory // host_block_bytes`` blocks and must hold
one ``max_model_len`` request beside the null block and a copy-on-write tail
(``pagedkv.spec.hisparse.host_pool_num_blocks``, D-HOST-10).

Worked example (the ``deepseek-v3.2`` preset, blocks of 64): 61 source
layers of 656-byte fp8 tokens, 41,984 bytes a layer's page, 2,561,024 bytes
a host block; 64 GiB of host memory hold 26,832 blocks (1,717,184 tokens)
and a request of 8,192 tokens needs 128 (130 with the null block and a spare).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hisparse import host_pool_num_blocks
from pagedkv.spec.kv_cache_spec import KVCacheSpec, MLAAttentionSpec
from pagedkv.spec.setting import ModelSetting
from pagedkv.spec.sizing import cdiv

__all__ = ["HostTierPlan", "plan_host_tier"]


@dataclass(frozen=True, slots=True)
class HostTierPlan:
    """The host pool of a HiSparse deployment: its budget, the bytes of one
    host block (every source layer's page), its blocks and the block size."""

    host_memory: int
    source_layers: tuple[str, ...]
    host_block_bytes: int
    host_num_blocks: int
    block_size: int
    max_model_len: int

    @property
    def host_tokens(self) -> int:
        """Tokens the host pool holds (the null block excluded)."""
        return (self.host_num_blocks - 1) * self.block_size

    @property
    def blocks_per_request(self) -> int:
        """Host blocks one ``max_model_len`` request takes."""
        return cdiv(self.max_model_len, self.block_size)

    @property
    def min_host_blocks(self) -> int:
        """The least pool that is accepted: one request, the null block, a spare."""
        return self.blocks_per_request + 2

    @property
    def max_resident_requests(self) -> float:
        """``max_model_len`` requests whose every page fits on the host at once."""
        return (self.host_num_blocks - 1) / self.blocks_per_request


def plan_host_tier(setting: ModelSetting, specs: Mapping[str, KVCacheSpec], source_layers: Sequence[str],
                   host_memory: int) -> HostTierPlan:
    """The host pool for ``host_memory`` bytes whose blocks hold the pages of
    ``source_layers`` (each an MLA layer of ``specs``, one block size).

    Raises:
        InvalidConfigError: no source layer, one missing from ``specs`` or not
            MLA, block sizes that differ, ``host_memory`` below 1.
        InsufficientMemoryError: the pool cannot hold one ``max_model_len``
            request (D-HOST-10).
    """
    if type(host_memory) is not int or host_memory < 1:
        raise InvalidConfigError(f"host_memory must be an int >= 1, got {host_memory!r}")
    names = tuple(source_layers)
    if not names:
        raise InvalidConfigError("source_layers: a host tier needs at least one source layer")
    sources: list[MLAAttentionSpec] = []
    for name in names:
        spec = specs.get(name)
        if not isinstance(spec, MLAAttentionSpec):
            raise InvalidConfigError(
                f"source_layers: {name!r} is not an MLA layer of the model (HiSparse keeps sparse MLA "
                f"caches on the host), got {type(spec).__name__ if spec is not None else 'no layer'}")
        sources.append(spec)
    block_sizes = {spec.block_size for spec in sources}
    if len(block_sizes) != 1:
        raise InvalidConfigError(f"source_layers: one block size is needed, got {sorted(block_sizes)}")
    block_size = block_sizes.pop()
    host_block_bytes = sum(spec.page_size_bytes for spec in sources)
    num_blocks = host_pool_num_blocks(host_memory, host_block_bytes, block_size, setting.max_model_len)
    return HostTierPlan(host_memory, names, host_block_bytes, num_blocks, block_size, setting.max_model_len)
