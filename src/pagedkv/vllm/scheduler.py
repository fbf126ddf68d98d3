"""``pagedkv.vllm.Scheduler``: vLLM's scheduler with pagedkv as its KV cache manager.

``vllm serve MODEL --scheduler-cls pagedkv.vllm.Scheduler`` (or
``scheduler_cls="pagedkv.vllm.Scheduler"``). Everything but the manager is
vLLM's own scheduler, unchanged.
"""

from __future__ import annotations

from typing import Any

from . import _compat
from .manager import KVCacheManager

__all__ = ["Scheduler"]


class Scheduler(_compat.VllmScheduler):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's ``Scheduler``, building :class:`pagedkv.vllm.KVCacheManager`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _compat.scheduler_manager_class(KVCacheManager):
            super().__init__(*args, **kwargs)
