"""pagedkv inside vLLM: ``pagedkv.vllm.KVCacheManager`` and ``pagedkv.vllm.Scheduler``.

Needs vLLM installed (``pip install 'pagedkv[vllm]'``); ``import pagedkv``
never imports this package. ``KVCacheManager`` has vLLM 0.33's constructor
and methods and translates them onto ``pagedkv.optimized.KVCacheManager``;
``Scheduler`` is vLLM's scheduler running on it
(``vllm serve MODEL --scheduler-cls pagedkv.vllm.Scheduler``). See docs/vllm.md.
"""

from __future__ import annotations

from ._compat import VLLM_VERSION
from .manager import KVCacheManager
from .scheduler import Scheduler

__all__ = ["KVCacheManager", "Scheduler", "VLLM_VERSION"]
