"""How a feature plugs into the reference kernel (spec/managers.md §9, "Hooks").

The kernel (pool, hash chain, the seed attention types, the hybrid
coordinator, the facade, validation and invariants) imports no feature
module. The facade hands the coordinator the features of
``pagedkv.reference.features.enabled.FEATURES``, and the coordinator calls their
hooks. Every hook has a do-nothing default, so a feature states only the
ones it needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator
    from pagedkv.reference.single_type import SingleTypeManager

__all__ = ["Feature", "attention_types"]


class Feature:
    """One feature of ``pagedkv.reference.features``: the hooks it fills."""

    def attention_types(self) -> Mapping[str, type[SingleTypeManager]]:
        """H1: the manager kinds of ``pagedkv.spec.registry`` this feature
        serves, each with its manager class (which states the type's rules
        and its own per-request invariant, ``check_request_blocks``)."""
        return {}

    def configure(self, coordinator: KVCacheCoordinator) -> None:
        """H2: once, after the coordinator built its managers and before any
        request: set per-group switches (EAGLE marks, checkpoint alignment)."""

    def accepts_hit(self, coordinator: KVCacheCoordinator, manager: SingleTypeManager, num_tokens: int,
                    num_blocks: int, num_external_computed_tokens: int) -> bool:
        """H4: whether a hit of ``num_tokens`` tokens handed as ``num_blocks``
        blocks, a shape the kernel's rule (whole blocks) refuses, is valid
        for ``manager``'s group (``allocate_slots`` step 1f)."""
        return False


def attention_types(seed: Mapping[str, type[SingleTypeManager]],
                    features: Iterable[Feature]) -> dict[str, type[SingleTypeManager]]:
    """The kernel's seed kinds and every feature's (H1); a feature may not
    replace a kind another one serves."""
    kinds = dict(seed)
    for feature in features:
        for kind, manager_type in feature.attention_types().items():
            assert kind not in kinds, f"manager kind {kind!r} is served twice"
            kinds[kind] = manager_type
    return kinds
