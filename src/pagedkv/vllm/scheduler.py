"""``pagedkv.vllm.Scheduler``: vLLM's scheduler with pagedkv as its KV cache manager.

``vllm serve MODEL --scheduler-cls pagedkv.vllm.Scheduler`` (or
``scheduler_cls="pagedkv.vllm.Scheduler"``). Everything but the manager is
vLLM's own scheduler, unchanged. Retention (docs/retention.md) is on when
vLLM's ``additional_config["pagedkv_retention"]`` or ``$PAGEDKV_RETENTION``
holds a setting (:func:`pagedkv.vllm.retention_wiring.setup_from_vllm`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from . import _compat
from .manager import KVCacheManager
from .retention_wiring import setup_from_vllm

__all__ = ["Scheduler"]


class Scheduler(_compat.VllmScheduler):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's ``Scheduler``, building :class:`pagedkv.vllm.KVCacheManager`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        setup = setup_from_vllm(kwargs.get("vllm_config", args[0] if args else None))
        manager = KVCacheManager if setup is None else partial(KVCacheManager, retention=setup)
        with _compat.scheduler_manager_class(manager):
            super().__init__(*args, **kwargs)
