"""The features the reference facade hands the kernel (spec/managers.md §9).

In this order: each feature's H2 ``configure`` runs after the one before it.
Imported by the facade only, after the kernel's modules are loaded.
"""

from __future__ import annotations

from pagedkv.reference.features.connector_hits import ConnectorHits
from pagedkv.reference.features.eagle import Eagle
from pagedkv.reference.features.mamba_partial import SubBlockHits
from pagedkv.reference.features.mamba_publish import MambaCheckpoints
from pagedkv.reference.features.ring import Ring
from pagedkv.reference.features.rswa import RSWA
from pagedkv.reference.hooks import Feature

__all__ = ["FEATURES"]

FEATURES: tuple[Feature, ...] = (Ring(), RSWA(), Eagle(), MambaCheckpoints(), SubBlockHits(),
                                ConnectorHits())
"""The features the facade hands the kernel (spec/managers.md §9)."""
