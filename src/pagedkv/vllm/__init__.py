"""pagedkv inside vLLM: ``pagedkv.vllm.KVCacheManager`` and ``pagedkv.vllm.Scheduler``.

Needs vLLM installed (``pip install 'pagedkv[vllm]'``); ``import pagedkv``
never imports this package. ``KVCacheManager`` has vLLM 0.33's constructor
and methods and translates them onto ``pagedkv.optimized.KVCacheManager``;
``Scheduler`` is vLLM's scheduler running on it
(``vllm serve MODEL --scheduler-cls pagedkv.vllm.Scheduler``). See docs/vllm.md.

The names load on first use, so the vLLM-free parts (``pagedkv.vllm.config``)
import without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVCacheManager", "Scheduler"]


def __getattr__(name: str) -> Any:
    if name == "KVCacheManager":
        from .manager import KVCacheManager
        return KVCacheManager
    if name == "Scheduler":
        from .scheduler import Scheduler
        return Scheduler
    raise AttributeError(f"module 'pagedkv.vllm' has no attribute {name!r}")
