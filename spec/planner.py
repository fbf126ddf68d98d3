"""The KV cache planner: from per-layer specs and a memory budget to a
``KVCacheConfig`` (groups of layers, tensors, number of blocks).

``get_kv_cache_config`` decides in this order (spec/config.md, CFG-12..CFG-16):

1. no layers: an attention-free configuration, 1 block, no group;
2. all specs merge into one: one group, one tensor per layer;
3. all layers of one uniform type (same manager kind and token slots, page
   sizes may differ): one group whose spec is ``UniformTypeKVCacheSpecs``,
   one tensor per layer sized by its own page;
4. otherwise (a hybrid model): make the page sizes equal
   (``unify_kv_cache_spec_page_size``), cut the layers of each spec into
   groups of equal layer count and let each tensor be shared by one layer
   of each group.

Grouping example: 10 full-attention layers and 20 sliding-window layers
repeat the pattern (1 full, 2 sliding) 10 times. The group size is 10, the
fewest layers of any type, giving three groups (full.0-9, the even sw
layers, the odd sw layers: a type's layers are dealt out in turn) and 10
tensors, tensor ``i`` shared by layer ``i`` of each group: each group has its
own block table, so the three layers use different blocks of the same
tensor and never collide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Final

from pagedkv.spec import sizing
from pagedkv.spec.attention_variants import EncoderOnlyAttentionSpec
from pagedkv.spec.capacity import (
    _check_specs,
    check_available_memory,
    check_enough_kv_cache_memory,
)
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from pagedkv.spec.errors import IncompatibleSpecError, InsufficientMemoryError, InvalidConfigError
from pagedkv.spec.kv_cache_spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.setting import ModelSetting
from pagedkv.spec.uniform_spec import UniformTypeKVCacheSpecs

__all__ = [
    "MAX_UNIFIED_BLOCK_SIZE",
    "is_kv_cache_type_attention_free",
    "is_kv_cache_spec_uniform",
    "is_kv_cache_page_size_uniform",
    "unify_hybrid_kv_cache_specs",
    "unify_kv_cache_spec_page_size",
    "get_kv_cache_groups",
    "get_kv_cache_config",
    "unify_kv_cache_configs",
]

MAX_UNIFIED_BLOCK_SIZE: Final = 8192
"""The largest block size ``unify_kv_cache_spec_page_size`` gives a layer
when it grows block sizes to make pages match."""


def is_kv_cache_type_attention_free(specs: Mapping[str, KVCacheSpec]) -> bool:
    """A model without KV cache layers."""
    return not specs


def is_kv_cache_spec_uniform(specs: Mapping[str, KVCacheSpec]) -> bool:
    """Whether all layers' specs merge into one (CFG-11); false when empty."""
    return bool(specs) and _merge_failure(specs) is None


def _merge_failure(specs: Mapping[str, KVCacheSpec]) -> IncompatibleSpecError | None:
    values = list(specs.values())
    try:
        type(values[0]).merge(values)
    except IncompatibleSpecError as exc:
        return exc
    return None


def is_kv_cache_page_size_uniform(specs: Mapping[str, KVCacheSpec]) -> bool:
    """Whether all layers have the same page size."""
    return len({spec.page_size_bytes for spec in specs.values()}) == 1


def unify_hybrid_kv_cache_specs(specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """The specs with the hybrid manager disabled (CFG-26): when full-attention
    layers sit beside sliding-window or chunked-local ones, the latter become
    ``FullAttentionSpec`` recording their window, so the model has one type.

    Memory is then spent on every token of those layers (nothing outside the
    window is freed); the model still computes over the window only.
    Raises ``IncompatibleSpecError`` when the result is still not uniform.
    """
    result = dict(specs)
    if not result or is_kv_cache_spec_uniform(result):
        return result
    has_full = any(isinstance(s, FullAttentionSpec) for s in result.values())
    has_local = any(isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) for s in result.values())
    if has_full and has_local:
        for name, spec in result.items():
            if isinstance(spec, SlidingWindowSpec):
                result[name] = FullAttentionSpec(
                    spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
                    sliding_window=spec.sliding_window, page_size_padded=spec.page_size_padded)
            elif isinstance(spec, (ChunkedLocalAttentionSpec,)):
                chunk = spec.attention_chunk_size
                result[name] = FullAttentionSpec(
                    spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
                    attention_chunk_size=chunk, page_size_padded=spec.page_size_padded)
    failure = _merge_failure(result)
    if failure is not None:
        raise IncompatibleSpecError(
            f"disable_hybrid_kv_cache_manager is set but the layers' specs cannot be unified "
            f"into one type (only sliding-window and chunked-local layers beside full-attention "
            f"layers can): {failure}")
    return result


def _block_scalable(spec: KVCacheSpec) -> bool:
    """Attention pages grow linearly with the block size (unless padded or
    rounded up to an alignment, or compressed: then they do not)."""
    return (isinstance(spec, AttentionSpec) and spec.page_size_padded is None
            and getattr(spec, "alignment", None) is None
            and getattr(spec, "tokens_per_state", 1) == 1)


def without_encoder_only_layers(specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """The layers that need KV cache memory: encoder-only layers keep nothing
    between steps, so they join no group and take no bytes (D-SPEC-15)."""
    return {name: spec for name, spec in specs.items()
            if not isinstance(spec, EncoderOnlyAttentionSpec)}


def unify_kv_cache_spec_page_size(specs: Mapping[str, KVCacheSpec], *,
                                  max_block_size: int = MAX_UNIFIED_BLOCK_SIZE) -> dict[str, KVCacheSpec]:
    """The specs with one common page size (CFG-15), or ``IncompatibleSpecError``.

    The common page is the largest page (vLLM 0.33's rule, D-SPEC-17). A
    smaller page is made that size by, in this order: padding a Mamba state;
    multiplying the block size of an attention layer whose page scales with
    it and divides the largest; padding any other non-MLA attention page.
    MLA pages cannot be padded (sparse MLA addresses whole token rows).

    Example (a Jamba-like model): attention pages of 65,536 bytes (block 16,
    4,096 bytes a token) and a Mamba state of 311,296 bytes: 65,536 does not
    divide 311,296, so the attention pages are padded to 311,296 bytes and
    keep blocks of 16 tokens.
    """
    result = dict(specs)
    pages = {name: spec.page_size_bytes for name, spec in result.items()}
    if len(set(pages.values())) <= 1:
        return result
    target = max(pages.values())
    for name, spec in result.items():
        page = pages[name]
        if page == target:
            continue
        if isinstance(spec, MambaSpec):
            result[name] = dataclasses.replace(spec, page_size_padded=target)
        elif _block_scalable(spec) and target % page == 0:
            new_block_size = spec.block_size * (target // page)
            if new_block_size > max_block_size:
                raise IncompatibleSpecError(
                    f"cannot unify page sizes: layer {name!r} would need field 'block_size' = "
                    f"{new_block_size} (> {max_block_size}) for its page of {page} bytes to "
                    f"reach the common page of {target} bytes")
            result[name] = spec.copy_with_new_block_size(new_block_size)
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            result[name] = dataclasses.replace(spec, page_size_padded=target)
        else:
            raise IncompatibleSpecError(
                f"cannot unify page sizes: layer {name!r} ({type(spec).__name__}) has field "
                f"'page_size_bytes' = {page}, which neither divides the common page of "
                f"{target} bytes nor can be padded to it (MLA pages cannot be padded)")
    return result


def _group(layer_names: Sequence[str], specs: Mapping[str, KVCacheSpec]) -> KVCacheGroupSpec:
    layer_specs = [specs[name] for name in layer_names]
    return KVCacheGroupSpec(tuple(layer_names), type(layer_specs[0]).merge(layer_specs))


def get_kv_cache_groups(setting: ModelSetting, specs: Mapping[str, KVCacheSpec]
                        ) -> tuple[tuple[KVCacheGroupSpec, ...], dict[str, KVCacheSpec]]:
    """The KV cache groups of the model, and the per-layer specs they use
    (after unification of hybrid specs and of page sizes) (CFG-14, CFG-15).

    Layers keep their input order inside each group; groups come in the
    order of the first layer of each spec.
    """
    _check_specs(specs)
    layer_specs = without_encoder_only_layers(specs)
    if setting.disable_hybrid_kv_cache_manager:
        layer_specs = unify_hybrid_kv_cache_specs(layer_specs)
    if is_kv_cache_type_attention_free(layer_specs):
        return (), layer_specs
    if is_kv_cache_spec_uniform(layer_specs):
        return (_group(list(layer_specs), layer_specs),), layer_specs
    uniform = UniformTypeKVCacheSpecs.from_specs(layer_specs)
    if uniform is not None:
        return (KVCacheGroupSpec(tuple(layer_specs), uniform),), layer_specs
    layer_specs = unify_kv_cache_spec_page_size(layer_specs)
    buckets = _mergeable_buckets(layer_specs)
    group_size = sizing.group_size_for([len(names) for names in buckets])
    groups: list[KVCacheGroupSpec] = []
    for names in buckets:
        # Strided, not consecutive: under pipeline parallelism each stage then
        # holds about the same share of every group (vLLM 0.33's assignment).
        num_groups = sizing.num_groups_for(len(names), group_size)
        for index in range(num_groups):
            groups.append(_group(names[index::num_groups], layer_specs))
    return tuple(groups), layer_specs


def _mergeable_buckets(specs: Mapping[str, KVCacheSpec]) -> list[list[str]]:
    """Layers bucketed by equal spec (in order of first appearance), then
    buckets whose specs merge joined, so e.g. full-attention layers that
    differ only in a recorded window share groups (CFG-14)."""
    same_spec_layers: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        same_spec_layers.setdefault(spec, []).append(name)
    buckets: list[tuple[list[str], list[KVCacheSpec]]] = []
    for spec, names in same_spec_layers.items():
        for bucket_names, bucket_specs in buckets:
            try:
                type(bucket_specs[0]).merge([*bucket_specs, spec])
            except IncompatibleSpecError:
                continue
            bucket_names.extend(names)
            bucket_specs.append(spec)
            break
        else:
            buckets.append((list(names), [spec]))
    return [names for names, _ in buckets]


def get_kv_cache_config(setting: ModelSetting, specs: Mapping[str, KVCacheSpec],
                        available_memory: int,
                        ) -> KVCacheConfig:
    """Plan the KV cache of a model in ``available_memory`` bytes.

    Groups the layers (``get_kv_cache_groups``), checks that one request of
    ``setting.max_model_len`` tokens fits in the specs actually used
    (``check_enough_kv_cache_memory``, CFG-17), then sizes the pool (CFG-12,
    CFG-16): with one uniform-type group, ``available // sum of pages``
    blocks and one tensor per layer; otherwise, with ``G`` the most layers
    in a group, ``available // page // G`` blocks and ``G`` tensors of
    ``page * num_blocks`` bytes, tensor ``i`` shared by layer ``i`` of each
    group that has one. ``setting.num_gpu_blocks_override`` replaces the
    block count if it fits (CFG-27).

    Tensor sizes sum to at most ``available_memory``; the result satisfies
    ``check_kv_cache_config``.

    Raises ``InvalidConfigError`` (bad inputs), ``IncompatibleSpecError``
    (specs that cannot be grouped), ``InsufficientMemoryError``.
    """
    if not isinstance(setting, ModelSetting):
        raise InvalidConfigError(f"setting must be a ModelSetting, got {setting!r}")
    check_available_memory(available_memory)
    groups, layer_specs = get_kv_cache_groups(setting, specs)
    if not groups:
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=(), kv_cache_groups=())
    check_enough_kv_cache_memory(setting, layer_specs, available_memory)
    first = groups[0].kv_cache_spec
    if len(groups) == 1 and isinstance(first, UniformTypeKVCacheSpecs):
        num_blocks = sizing.num_blocks_for_memory(available_memory, first.page_size_bytes, 1)
        num_blocks = _override(setting, num_blocks)
        tensors = tuple(KVCacheTensor(spec.page_size_bytes * num_blocks, (name,))
                        for name, spec in first.kv_cache_specs)
    else:
        group_size = max(len(group.layer_names) for group in groups)
        page_size = first.page_size_bytes
        num_blocks = sizing.num_blocks_for_memory(available_memory, page_size, group_size)
        num_blocks = _override(setting, num_blocks)
        tensors = tuple(
            KVCacheTensor(page_size * num_blocks, tuple(
                group.layer_names[i] for group in groups if i < len(group.layer_names)))
            for i in range(group_size))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def _override(setting: ModelSetting, num_blocks: int) -> int:
    override = setting.num_gpu_blocks_override
    if override is not None:
        if override > num_blocks:
            raise InsufficientMemoryError(
                f"ModelSetting.num_gpu_blocks_override={override} blocks do not fit: "
                f"the available memory holds {num_blocks} blocks")
        return override
    if num_blocks < 1:
        raise InsufficientMemoryError(
            "available_memory holds no block of every layer; raise the memory")
    return num_blocks


def _group_sort_key(group: KVCacheGroupSpec) -> tuple[str, str]:
    return type(group.kv_cache_spec).__name__, repr(group.kv_cache_spec)


def unify_kv_cache_configs(configs: Sequence[KVCacheConfig]) -> list[KVCacheConfig]:
    """Make the configurations of several workers agree (CFG-25), so one
    manager can drive them all: groups sorted by (spec type name, spec repr)
    in each, the same specs required group by group, and every ``num_blocks``
    lowered to the smallest. Tensors are left as they are: using only the
    first ``num_blocks`` blocks of a tensor is valid.

    Raises ``InvalidConfigError`` for an empty list, ``IncompatibleSpecError``
    naming the worker and group whose groups differ.
    """
    if not configs:
        raise InvalidConfigError("unify_kv_cache_configs needs at least one KVCacheConfig, got none")
    sorted_groups = [tuple(sorted(c.kv_cache_groups, key=_group_sort_key)) for c in configs]
    reference = sorted_groups[0]
    for worker, groups in enumerate(sorted_groups[1:], start=1):
        if len(groups) != len(reference):
            raise IncompatibleSpecError(
                f"worker {worker}: field 'kv_cache_groups' has {len(groups)} groups, "
                f"worker 0 has {len(reference)}")
        for index, (mine, theirs) in enumerate(zip(reference, groups)):
            if mine.kv_cache_spec != theirs.kv_cache_spec:
                raise IncompatibleSpecError(
                    f"worker {worker}: field 'kv_cache_spec' of group {index} is "
                    f"{theirs.kv_cache_spec!r}, worker 0 has {mine.kv_cache_spec!r}")
    num_blocks = min(c.num_blocks for c in configs)
    return [KVCacheConfig(num_blocks, c.kv_cache_tensors, groups)
            for c, groups in zip(configs, sorted_groups)]
