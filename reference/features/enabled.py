"""The features the reference facade hands the kernel (spec/managers.md §9),
and the facade's methods that only features serve. The one module of
``pagedkv.reference.features`` the kernel imports (the facade, once).

In this order: each feature's H2 ``configure`` runs after the one before
it (managers are swapped before EAGLE marks the groups), and the
first H3 answer wins (a sub-block group's lookup before EAGLE's peek).
"""

from __future__ import annotations

from pagedkv.reference.features.connector_hits import ConnectorHits
from pagedkv.reference.features.eagle import Eagle
from pagedkv.reference.features.mamba_partial import SubBlockHits
from pagedkv.reference.features.mamba_states import MambaStates
from pagedkv.reference.features.operations import FeatureOperations
from pagedkv.reference.features.recovery import recover
from pagedkv.reference.features.retention_manager import RetentionOperations, make_pool
from pagedkv.reference.features.ring import Ring
from pagedkv.reference.features.rswa import RSWA
from pagedkv.reference.features.sparse_retention import SparseRetention
from pagedkv.reference.hooks import Feature

__all__ = ["FEATURES", "FeatureOperations", "RetentionOperations", "make_pool", "recover"]

FEATURES: tuple[type[Feature], ...] = (Ring, RSWA, SparseRetention, MambaStates, SubBlockHits, Eagle,
                                       ConnectorHits)
"""The feature classes; the coordinator makes one instance of each."""
