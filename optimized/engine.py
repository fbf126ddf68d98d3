"""The engine surface of the optimized core: every name an engine adapter uses, and
the only module of ``pagedkv.optimized`` that ``pagedkv.vllm`` imports (an
import-linter contract in pyproject.toml). docs/vllm.md gives each name's contract
for an adapter of another engine (SGLang, TensorRT-LLM).
"""

from __future__ import annotations

from pagedkv.optimized.coordination.coordinator import KVCacheCoordinator
from pagedkv.optimized.coordination.coordinator_kinds import UnitaryCoordinator
from pagedkv.optimized.groups.hybrid_search import HashViews
from pagedkv.optimized.groups.mamba import MambaManager
from pagedkv.optimized.groups.mamba_partial import key_block
from pagedkv.optimized.groups.mamba_publish import publish_resume_state
from pagedkv.optimized.groups.single_type import FullAttentionManager, SingleTypeManager
from pagedkv.optimized.host_tier.hisparse import HostTierManager
from pagedkv.optimized.host_tier.hisparse_rules import full_sequence_need
from pagedkv.optimized.host_tier.hisparse_state import TierPool
from pagedkv.optimized.manager import KVCacheManager
from pagedkv.optimized.paths.decode_path import TAKE_GENERAL_PATH
from pagedkv.optimized.paths.recovery import recover
from pagedkv.optimized.pool.block_pool import NULL_BLOCK, BlockPool
from pagedkv.optimized.pool.blocks import KVCacheBlocks
from pagedkv.optimized.rules.mamba_partial_rules import state_key

__all__ = [
    "NULL_BLOCK", "TAKE_GENERAL_PATH", "BlockPool", "FullAttentionManager", "HashViews", "HostTierManager",
    "KVCacheBlocks", "KVCacheCoordinator", "KVCacheManager", "MambaManager", "SingleTypeManager", "TierPool",
    "UnitaryCoordinator", "full_sequence_need", "key_block", "publish_resume_state", "recover", "state_key",
]
