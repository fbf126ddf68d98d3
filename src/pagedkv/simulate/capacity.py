"""KV cache capacities to simulate: a block count, a sweep, or a planned model.

A capacity is a number of blocks (the null block included, as
``KVCacheConfig.num_blocks`` counts). ``--capacity`` takes a comma list of:

- ``inf``: more blocks than the replay can ever allocate, so no cached block
  is ever evicted (the unbounded cache of the upper bound);
- ``0.25x``: a multiple of the working set (the distinct full prompt blocks);
- a token count: ``1e6``, ``3M``, ``500k``, ``1000000`` (``k``/``M``/``G`` are
  powers of ten, as in the Mooncake paper's axis), rounded up to blocks.

``--preset``/``--model`` with ``--memory`` plan the pool through
``pagedkv.plan``'s planner instead: the model's own groups and block count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from pagedkv.simulate.analysis import WorkloadAnalysis
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidArgumentError

__all__ = ["Capacity", "parse_capacities", "single_group_config", "planned_config"]

_TOKENS: Final = re.compile(r"^(\d+(?:\.\d+)?(?:e\d+)?)([kmg]?)$")
_SCALE: Final[dict[str, int]] = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_MULTIPLE: Final = re.compile(r"^(\d+(?:\.\d+)?)x$")


@dataclass(frozen=True, slots=True)
class Capacity:
    """A pool size: ``num_blocks`` blocks (the null block included), named ``label``."""

    label: str
    num_blocks: int
    planned_tokens: int | None = None

    def tokens(self, block_size: int) -> int:
        """Tokens the usable blocks hold (a planned pool: the planner's KV
        cache size, which counts every group of a hybrid model)."""
        if self.planned_tokens is not None:
            return self.planned_tokens
        return (self.num_blocks - 1) * block_size


def parse_capacities(text: str, analysis: WorkloadAnalysis, block_size: int) -> list[Capacity]:
    """The capacities of a ``--capacity`` list (see the module docstring).

    Raises:
        InvalidArgumentError: an item that is none of the forms, or a size
            of less than one block.
    """
    out: list[Capacity] = []
    for item in (part.strip().lower() for part in text.split(",")):
        if item in ("inf", "unbounded"):
            out.append(Capacity("inf", analysis.total_blocks_allocated + 1))
            continue
        multiple = _MULTIPLE.match(item)
        tokens_match = _TOKENS.match(item)
        if multiple is not None:
            factor = float(multiple.group(1))
            blocks = int(analysis.distinct_blocks * factor + 0.5)
            label = f"{multiple.group(1)}x"
        elif tokens_match is not None:
            tokens = float(tokens_match.group(1)) * _SCALE[tokens_match.group(2)]
            blocks = -(-int(tokens) // block_size)
            label = item
        else:
            raise InvalidArgumentError(
                f"--capacity: {item!r} is not 'inf', a working-set multiple such as 0.25x, "
                "or a token count such as 1e6 or 3M")
        if blocks < 1:
            raise InvalidArgumentError(f"--capacity: {item!r} is less than one block of {block_size} tokens")
        out.append(Capacity(label, blocks + 1))
    if not out:
        raise InvalidArgumentError("--capacity: empty list")
    return out


def single_group_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    """One full-attention group of ``block_size``-token blocks, no tensors
    (the simulator needs block bookkeeping only)."""
    if num_blocks < 2:
        raise InvalidArgumentError(f"--num-blocks must be >= 2 (one is the null block), got {num_blocks}")
    spec = FullAttentionSpec(block_size, 8, 128, "bfloat16")
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=(),
                         kv_cache_groups=(KVCacheGroupSpec(("layer.0",), spec),))


def planned_config(preset: str | None, model_file: str | None, memory: int, max_model_len: int,
                   block_size: int | None, max_num_batched_tokens: int) -> tuple[str, KVCacheConfig, int]:
    """The model's name, the KV cache ``pagedkv plan`` gives it in ``memory``
    bytes and that cache's size in tokens (raises the planner's typed errors)."""
    from pagedkv.model_file import load_model_file
    from pagedkv.presets import PRESETS
    from pagedkv.spec.capacity import kv_cache_size_tokens
    from pagedkv.spec.config import check_kv_cache_config
    from pagedkv.spec.planner import get_kv_cache_config
    from pagedkv.spec.setting import ModelSetting

    setting = ModelSetting(max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
    if preset is not None:
        if preset not in PRESETS:
            raise InvalidArgumentError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
        name, specs = PRESETS[preset].name, PRESETS[preset].build(max_model_len, block_size)
    else:
        assert model_file is not None
        description = load_model_file(model_file, max_model_len)
        name, specs = description.name, description.specs
    config = get_kv_cache_config(setting, specs, memory)
    check_kv_cache_config(config)
    return name, config, kv_cache_size_tokens(setting, config)
