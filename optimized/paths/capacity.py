"""The capacity check of ``allocate_slots`` (ALLOC-5), for every path.

One function decides whether a step's blocks fit the free queue: the general
path (``manager.py``), the admission fast path (``admit_path.py``) and the
decode step's filling branch (``fill_path.py``) all ask it; nothing in C
decides capacity.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["refuses"]


def refuses(num_free: int, demand: int, hit: Sequence[int] = (), ref_counts: Sequence[int] = ()) -> bool:
    """Whether ``demand`` more blocks than the free queue's ``num_free`` are
    needed: ``demand`` counts the new blocks and every block kept free beside
    them (``reserved_blocks``, the watermark); a new request's prefix ``hit``
    adds its blocks no request holds (``ref_counts`` 0), which leave the free
    queue when the request takes them (D-API-13, D-API-48). The hit's counts
    are read only when the bound with every hit block free would not fit.
    Cost: O(1), or O(hit blocks) near the bound.
    """
    if demand + len(hit) <= num_free:
        return False
    return demand + list(map(ref_counts.__getitem__, hit)).count(0) > num_free
