"""KV cache memory: the buffers of a ``KVCacheConfig`` and each layer's typed views.

Layout (block-major). Each ``KVCacheTensor`` of ``size`` bytes is one flat int8
buffer of ``num_blocks`` pages of ``page_size_bytes`` each: **block ``b`` of
every layer viewing the tensor is the contiguous byte range
``[b * page, (b + 1) * page)``**. That is what lets layers of different groups
share a tensor (a block id belongs to one group at a time, and each group's
layer sees the whole page), and what makes a block one contiguous run to copy
or swap. Within a page:

- attention (``FullAttentionSpec`` and the other ``AttentionSpec`` kinds):
  K as ``[block_size, num_kv_heads, head_size]`` then V as
  ``[block_size, num_kv_heads, head_size_v]``. Views: ``key`` and ``value``
  ``[num_blocks, block_size, num_kv_heads, head]``, and when K and V have the
  same head size ``kv`` ``[2, num_blocks, block_size, num_kv_heads, head_size]``
  (strides: K/V = half a page, block = one page);
- MLA (``MLAAttentionSpec``): one latent ``[block_size, head_size]`` (a
  heads dimension after ``block_size`` when ``num_kv_heads > 1``); view
  ``latent`` ``[num_blocks, block_size, head_size]``; with ``fp8_ds_mla`` the
  latent is uint8 ``[num_blocks, block_size, 656]``, packed for the kernel;
- Mamba (``MambaSpec``): the states one after another, state ``i`` of shape
  ``shapes[i]`` and dtype ``dtypes[i]``; views ``state0``, ``state1``, ...
  ``[num_blocks, *shapes[i]]``; the rest of a (padded) page is unused.

Tensors are allocated in *arenas*: all tensors with the same page size are
slices of one allocation viewed ``[num_tensors, num_blocks, page]``, so a
block copy or swap over every layer is one gather and one scatter per arena
(one arena in the uniform configurations the planner produces).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import torch

from pagedkv.optimized.tensor.checks import check_device, check_pin_memory
from pagedkv.spec.config import KVCacheConfig, KVCacheTensor
from pagedkv.spec.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.spec.kv_cache_spec import (
    FP8_DS_MLA,
    FP8_DS_MLA_BYTES_PER_TOKEN,
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    dtype_size,
)
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.uniform_spec import UniformTypeKVCacheSpecs

__all__ = ["TORCH_DTYPES", "ViewLayout", "page_layout", "layer_spec", "LayerCache", "Arena",
           "KVCacheMemory"]

TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
"""The torch dtype of each spec dtype name."""


@dataclass(frozen=True, slots=True)
class ViewLayout:
    """One typed view of a layer: ``block_shape`` elements of ``dtype`` per block,
    starting ``byte_offset`` bytes into the block's page. ``stacked_kv`` marks
    the ``[2, ...]`` K/V view (K at 0, V at ``kv_stride_bytes``)."""

    name: str
    dtype: str
    block_shape: tuple[int, ...]
    byte_offset: int
    kv_stride_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes one block of this view occupies (K and V for the stacked view)."""
        one = math.prod(self.block_shape) * dtype_size(self.dtype)
        return 2 * one if self.kv_stride_bytes else one


def page_layout(spec: KVCacheSpec) -> list[ViewLayout]:
    """The typed views of one block of a layer with ``spec`` (see the module
    docstring). Cost: O(number of views).

    Raises:
        InvalidConfigError: the spec kind has no layout here (e.g. a
            ``UniformTypeKVCacheSpecs``: ask for one layer's spec), a view is
            misaligned, or the views overflow ``page_size_bytes``.
    """
    views: list[ViewLayout]
    if isinstance(spec, MambaSpec):
        views, offset = [], 0
        for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes)):
            views.append(ViewLayout(f"state{i}", dtype, tuple(shape), offset))
            offset += views[-1].nbytes
    elif isinstance(spec, MLAAttentionSpec):
        if spec.cache_dtype_str == FP8_DS_MLA:
            # Packed fp8 values, scales and rope part: bytes, interpreted by the kernel.
            views = [ViewLayout("latent", "uint8", (spec.block_size, FP8_DS_MLA_BYTES_PER_TOKEN), 0)]
        else:
            heads = () if spec.num_kv_heads == 1 else (spec.num_kv_heads,)
            views = [ViewLayout("latent", spec.dtype, (spec.block_size, *heads, spec.head_size), 0)]
    elif isinstance(spec, AttentionSpec):
        head_v = spec.head_size
        if isinstance(spec, FullAttentionSpec) and spec.head_size_v is not None:
            head_v = spec.head_size_v
        k_shape = (spec.block_size, spec.num_kv_heads, spec.head_size)
        v_shape = (spec.block_size, spec.num_kv_heads, head_v)
        k_bytes = math.prod(k_shape) * dtype_size(spec.dtype)
        views = [ViewLayout("key", spec.dtype, k_shape, 0),
                 ViewLayout("value", spec.dtype, v_shape, k_bytes)]
        if head_v == spec.head_size:
            views.append(ViewLayout("kv", spec.dtype, k_shape, 0, kv_stride_bytes=k_bytes))
    else:
        raise InvalidConfigError(f"no tensor layout for spec type {type(spec).__name__}")
    page = spec.page_size_bytes
    for view in views:
        if view.dtype not in TORCH_DTYPES:
            raise InvalidConfigError(f"view {view.name}: dtype {view.dtype!r} has no torch dtype")
        if view.byte_offset % dtype_size(view.dtype) or page % dtype_size(view.dtype):
            raise InvalidConfigError(
                f"view {view.name}: offset {view.byte_offset} or page {page} is not a "
                f"multiple of the {view.dtype} size")
        if view.byte_offset + view.nbytes > page:
            raise InvalidConfigError(
                f"view {view.name} needs bytes [{view.byte_offset}, "
                f"{view.byte_offset + view.nbytes}) of a block but page_size_bytes is {page}")
    return views


@dataclass(frozen=True, slots=True)
class LayerCache:
    """One layer's cache: its spec, its raw pages (int8 ``[num_blocks, page]``,
    a view of its tensor) and its typed views by name (see the module docstring)."""

    layer_name: str
    group_id: int
    tensor_index: int
    spec: KVCacheSpec
    pages: torch.Tensor
    views: Mapping[str, torch.Tensor]

    def __getitem__(self, view_name: str) -> torch.Tensor:
        """The typed view ``view_name`` (``kv``, ``key``, ``value``, ``latent``, ``state0``...)."""
        return self.views[view_name]

    @property
    def states(self) -> tuple[torch.Tensor, ...]:
        """A Mamba layer's state views in spec order (empty for attention)."""
        return tuple(self.views[f"state{i}"] for i in range(len(self.views))
                     if f"state{i}" in self.views)


@dataclass(frozen=True, slots=True)
class Arena:
    """Tensors with the same page size allocated together: ``pages`` is int8
    ``[len(tensor_indices), num_blocks, page_bytes]``; row ``i`` backs tensor
    ``tensor_indices[i]`` of the config."""

    page_bytes: int
    tensor_indices: tuple[int, ...]
    pages: torch.Tensor


def _layer_views(flat: torch.Tensor, spec: KVCacheSpec, num_blocks: int) -> dict[str, torch.Tensor]:
    page = spec.page_size_bytes
    views: dict[str, torch.Tensor] = {}
    for layout in page_layout(spec):
        size = dtype_size(layout.dtype)
        typed = flat.view(TORCH_DTYPES[layout.dtype])
        inner = list(torch.empty(layout.block_shape, device="meta").stride())
        shape = [num_blocks, *layout.block_shape]
        stride = [page // size, *inner]
        if layout.kv_stride_bytes:
            shape, stride = [2, *shape], [layout.kv_stride_bytes // size, *stride]
        # as_strided's offset counts from the start of the storage, not of ``flat``.
        offset = typed.storage_offset() + layout.byte_offset // size
        views[layout.name] = typed.as_strided(shape, stride, offset)
    return views


def layer_spec(group_spec: KVCacheSpec, layer_name: str) -> KVCacheSpec:
    """The spec of one layer of a group: the group's spec, or the layer's own
    entry of a ``UniformTypeKVCacheSpecs``.

    Raises:
        InvalidConfigError: the uniform spec has no entry for the layer.
    """
    if not isinstance(group_spec, UniformTypeKVCacheSpecs):
        return group_spec
    for name, spec in group_spec.kv_cache_specs:
        if name == layer_name:
            return spec
    raise InvalidConfigError(
        f"layer {layer_name!r} is in a group whose UniformTypeKVCacheSpecs has no spec for it")


def _check_config(config: KVCacheConfig) -> tuple[dict[str, int], dict[str, KVCacheSpec]]:
    """Return each layer's tensor index and spec; raise unless the config is consistent."""
    group_of: dict[str, int] = {}
    spec_of: dict[str, KVCacheSpec] = {}
    for g, group in enumerate(config.kv_cache_groups):
        for name in group.layer_names:
            if name in group_of:
                raise InvalidConfigError(
                    f"layer {name!r} is in groups {group_of[name]} and {g}; expected one group")
            group_of[name] = g
            spec_of[name] = layer_spec(group.kv_cache_spec, name)
    tensor_of: dict[str, int] = {}
    for t, tensor in enumerate(config.kv_cache_tensors):
        groups_here: set[int] = set()
        for name in tensor.shared_by:
            if name not in group_of:
                raise InvalidConfigError(f"kv_cache_tensors[{t}] names layer {name!r}, in no group")
            if name in tensor_of:
                raise InvalidConfigError(
                    f"layer {name!r} is backed by kv_cache_tensors[{tensor_of[name]}] and [{t}]; "
                    f"expected one tensor")
            if group_of[name] in groups_here:
                raise InvalidConfigError(
                    f"kv_cache_tensors[{t}] is shared by two layers of group {group_of[name]}; "
                    f"layers of one group would overwrite each other")
            tensor_of[name] = t
            groups_here.add(group_of[name])
            spec = spec_of[name]
            expected = config.num_blocks * spec.page_size_bytes
            if tensor.size != expected:
                raise InvalidConfigError(
                    f"kv_cache_tensors[{t}].size for layer {name!r}: expected num_blocks "
                    f"{config.num_blocks} * page_size_bytes {spec.page_size_bytes} = {expected}, "
                    f"got {tensor.size}")
    missing = sorted(set(group_of) - set(tensor_of))
    if missing:
        raise InvalidConfigError(f"layers {missing} have no kv_cache_tensor")
    for spec in spec_of.values():
        page_layout(spec)  # raises for a spec without a layout
    return tensor_of, spec_of


class KVCacheMemory:
    """The KV cache of a model on one device: one flat int8 buffer per
    ``KVCacheTensor`` and, per layer, a :class:`LayerCache` of typed views.

    Block 0 is the null block like everywhere in pagedkv: it has storage
    (engines write padding there) but holds nothing meaningful.
    """

    def __init__(self, config: KVCacheConfig, device: torch.device | str = "cpu",
                 buffers: Sequence[torch.Tensor] | None = None,
                 pin_memory: bool = False) -> None:
        """Allocate (zeroed) or adopt the buffers of ``config`` on ``device``.

        ``buffers``: existing flat int8 buffers, one per ``kv_cache_tensors``
        entry, each of exactly ``size`` bytes on ``device``; each becomes its
        own arena. ``pin_memory``: page-lock a CPU allocation (host caches
        that CUDA swaps with).

        Cost: O(total size) to zero the memory, O(layers) views.

        Raises:
            InvalidConfigError: a layer is in two groups or backed by two (or
                no) tensors, two layers of one group share a tensor, a tensor
                size is not ``num_blocks * page_size_bytes`` of its layers, a
                spec has no layout, or a given buffer disagrees with the config
                (count, type, dtype, shape, size, device, contiguity).
            InvalidArgumentError: ``config`` is not a ``KVCacheConfig``,
                ``device`` is not a device present here, ``pin_memory`` is not
                a bool or is ``True`` without CUDA.
        """
        if not isinstance(config, KVCacheConfig):
            raise InvalidArgumentError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        self.config = config
        self.device = check_device("device", device)
        pin_memory = check_pin_memory("pin_memory", pin_memory)
        self.num_blocks = config.num_blocks
        tensor_of, spec_of = _check_config(config)
        tensors = config.kv_cache_tensors
        if buffers is not None:
            self.tensors = tuple(self._adopt(tensors, buffers))
            self.arenas = tuple(
                Arena(tensors[t].size // self.num_blocks, (t,),
                      buf.view(1, self.num_blocks, tensors[t].size // self.num_blocks))
                for t, buf in enumerate(self.tensors))
        else:
            self.arenas, self.tensors = self._allocate(tensors, pin_memory)
        self.layers: dict[str, LayerCache] = {}
        for g, group in enumerate(config.kv_cache_groups):
            for name in group.layer_names:
                t = tensor_of[name]
                flat = self.tensors[t]
                self.layers[name] = LayerCache(
                    name, g, t, spec_of[name], flat.view(self.num_blocks, -1),
                    _layer_views(flat, spec_of[name], self.num_blocks))
        self.group_tensors: tuple[tuple[int, ...], ...] = tuple(
            tuple(sorted({tensor_of[n] for n in group.layer_names}))
            for group in config.kv_cache_groups)
        """For each group, the tensors its layers view (what a block copy moves)."""

    def _allocate(self, tensors: Sequence[KVCacheTensor], pin_memory: bool
                  ) -> tuple[tuple[Arena, ...], tuple[torch.Tensor, ...]]:
        by_page: dict[int, list[int]] = {}
        for t, tensor in enumerate(tensors):
            by_page.setdefault(tensor.size // self.num_blocks, []).append(t)
        arenas: list[Arena] = []
        flats: dict[int, torch.Tensor] = {}
        for page, indices in by_page.items():
            pages = torch.zeros((len(indices), self.num_blocks, page), dtype=torch.int8,
                                device=self.device, pin_memory=pin_memory)
            arenas.append(Arena(page, tuple(indices), pages))
            for i, t in enumerate(indices):
                flats[t] = pages[i].view(-1)
        return tuple(arenas), tuple(flats[t] for t in range(len(tensors)))

    def _adopt(self, tensors: Sequence[KVCacheTensor],
               buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not isinstance(buffers, Sequence):
            raise InvalidConfigError(
                f"buffers must be a sequence of tensors, got {type(buffers).__name__}")
        if len(buffers) != len(tensors):
            raise InvalidConfigError(
                f"expected {len(tensors)} buffers (one per kv_cache_tensors entry), "
                f"got {len(buffers)}")
        for t, (tensor, buf) in enumerate(zip(tensors, buffers)):
            if not isinstance(buf, torch.Tensor):
                raise InvalidConfigError(
                    f"buffers[{t}] must be a torch.Tensor, got {type(buf).__name__}")
            if buf.dtype != torch.int8 or buf.dim() != 1 or not buf.is_contiguous():
                raise InvalidConfigError(
                    f"buffers[{t}] must be a contiguous 1-D int8 tensor, got dtype {buf.dtype}, "
                    f"shape {tuple(buf.shape)}")
            if buf.numel() != tensor.size:
                raise InvalidConfigError(
                    f"buffers[{t}] has {buf.numel()} bytes, kv_cache_tensors[{t}].size is "
                    f"{tensor.size}")
            if buf.device != self.device and not (
                    buf.device.type == self.device.type and self.device.index is None):
                raise InvalidConfigError(f"buffers[{t}] is on {buf.device}, expected {self.device}")
        return list(buffers)

    @classmethod
    def host_mirror(cls, other: KVCacheMemory, num_blocks: int,
                    pin_memory: bool | None = None) -> KVCacheMemory:
        """A CPU cache with the layers and layout of ``other`` and ``num_blocks``
        blocks: the other side of ``swap_blocks`` (offload / reload). Pinned
        by default when ``other`` is on CUDA.

        Cost: O(num_blocks * bytes per block) host memory, zeroed.

        Raises:
            InvalidArgumentError: ``other`` is not a ``KVCacheMemory``, or
                ``pin_memory`` not a bool (or ``None``) or ``True`` without CUDA.
            InvalidConfigError: ``num_blocks`` is not an int >= 1.
        """
        if not isinstance(other, KVCacheMemory):
            raise InvalidArgumentError(f"other must be a KVCacheMemory, got {type(other).__name__}")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidConfigError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        config = other.config
        tensors = tuple(KVCacheTensor(t.size // config.num_blocks * num_blocks, t.shared_by)
                        for t in config.kv_cache_tensors)
        host_config = KVCacheConfig(num_blocks, tensors, config.kv_cache_groups)
        if pin_memory is None:
            pin_memory = other.device.type == "cuda"
        return cls(host_config, "cpu", pin_memory=pin_memory)

    def layer(self, name: str) -> LayerCache:
        """The cache of layer ``name``.

        Raises:
            InvalidArgumentError: no layer is called ``name``.
        """
        found = self.layers.get(name) if isinstance(name, str) else None
        if found is None:
            raise InvalidArgumentError(
                f"name {name!r} is not a layer of this cache; layers: {sorted(self.layers)}")
        return found

    def forward_views(self) -> dict[str, torch.Tensor]:
        """Per layer, the one view an attention backend takes: ``kv`` (or
        ``key`` when K and V differ in head size), ``latent``, or ``state0``."""
        out: dict[str, torch.Tensor] = {}
        for name, layer in self.layers.items():
            for view in ("kv", "latent", "key", "state0"):
                if view in layer.views:
                    out[name] = layer.views[view]
                    break
        return out
