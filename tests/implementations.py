"""The implementations every behavioural test runs over (one suite, several
implementations, as trio tests its locks)."""

from __future__ import annotations

from types import ModuleType

import pagedkv.optimized
import pagedkv.reference

IMPLEMENTATIONS: dict[str, ModuleType] = {
    "reference": pagedkv.reference,
    "optimized": pagedkv.optimized,
}
