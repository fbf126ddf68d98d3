"""What a workload allows, whatever the cache: the ideal hit rate, the
working set, and the reuse distances of its blocks.

Computed from the block ids alone, never through a manager, so the
simulator's results can be checked against it. A *block* here is a hash
block of ``hash_block_size`` tokens; its identity is its content and
everything before it (the chain of :func:`content_key`), exactly what makes
two block hashes equal.

- **Upper bound** (an unbounded prefix cache, requests one at a time): a
  request hits the longest prefix of its full blocks that earlier requests
  computed, in whole blocks and at most ``n - 1`` of its ``n`` prompt tokens
  (the last token is always recomputed).
- **Working set**: the distinct full blocks of every prompt, in tokens.
- **Reuse distance** of a block access that could hit: the number of
  distinct blocks accessed since the block's previous access, itself
  included (LRU stack distance). A block is still in an LRU cache of ``C``
  blocks exactly when its reuse distance is at most ``C``, so the
  distribution reads as "the hit rate an LRU cache of this size allows".
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.simulate.requests import content_key
from pagedkv.simulate.workload import Workload

__all__ = ["WorkloadAnalysis", "analyze"]


@dataclass(slots=True)
class WorkloadAnalysis:
    """The figures of :func:`analyze`; hit rates are shares of prompt tokens
    and of prompt blocks (a partial last block counts as one)."""

    hash_block_size: int
    requests: int
    prompt_tokens: int
    prompt_blocks: int
    distinct_blocks: int
    max_request_blocks: int
    total_blocks_allocated: int
    ideal_hit_tokens: int
    ideal_hit_blocks: int
    reuse_distances: list[int] = field(default_factory=list)

    @property
    def working_set_tokens(self) -> int:
        """Tokens of the distinct full blocks."""
        return self.distinct_blocks * self.hash_block_size

    @property
    def ideal_hit_rate(self) -> float:
        """Upper bound of the token hit rate."""
        return self.ideal_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ideal_block_hit_rate(self) -> float:
        """Upper bound of the block hit rate."""
        return self.ideal_hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    def lru_capacity_for(self, share: float) -> int | None:
        """Tokens an LRU cache needs to keep ``share`` of the reusable block
        accesses (None when nothing is reusable). Cost: O(1) (sorted)."""
        distances = self.reuse_distances
        if not distances:
            return None
        index = min(len(distances) - 1, max(0, int(share * len(distances) + 0.999999) - 1))
        return distances[index] * self.hash_block_size

    def reuse_cdf(self, capacities_tokens: Sequence[float]) -> list[float]:
        """Share of reusable accesses with a reuse distance of at most each
        capacity (in tokens)."""
        distances = self.reuse_distances
        if not distances:
            return [0.0 for _ in capacities_tokens]
        h = self.hash_block_size
        return [bisect_left(distances, int(c // h) + 1) / len(distances) for c in capacities_tokens]


def analyze(workload: Workload, hash_block_size: int, *, output_blocks: bool = True,
            reuse: bool = True) -> WorkloadAnalysis:
    """Analyse ``workload`` at ``hash_block_size`` tokens per block.

    ``total_blocks_allocated`` bounds the blocks a replay can ever take from
    the pool: every prompt block, plus output blocks when ``output_blocks``
    (a pool one larger never evicts a cached block). ``reuse`` computes the
    reuse distances (sorted).

    Cost: O(blocks log blocks) with ``reuse``, O(blocks) without.
    """
    h, b = hash_block_size, workload.block_tokens
    chain: dict[tuple[int, ...], int] = {}
    seen: set[int] = set()
    # LRU stack distances with a Fenwick tree over access times: a 1 marks
    # the latest access of each block, so the distinct blocks accessed after
    # time p are (distinct so far) - (marks up to p).
    last_access: dict[int, int] = {}
    total_accesses = sum(r.input_length // h for r in workload.requests) if reuse else 0
    tree = [0] * (total_accesses + 1)
    distances: list[int] = []
    now = 0
    prompt_tokens = prompt_blocks = max_blocks = allocated = hit_tokens = hit_blocks = 0
    for request in workload.requests:
        n = request.input_length
        full = n // h
        blocks = -(-n // h)
        prompt_tokens += n
        prompt_blocks += blocks
        total = -(-(n + request.output_length) // h) if output_blocks else blocks
        allocated += total
        max_blocks = max(max_blocks, total)
        ids = request.block_ids
        parent = -1
        identities: list[int] = []
        for index in range(full):
            key = (parent, *content_key(ids, index, h, b))
            parent = chain.setdefault(key, len(chain))
            identities.append(parent)
        limit = (n - 1) // h
        hit = 0
        while hit < limit and identities[hit] in seen:
            hit += 1
        hit_blocks += hit
        hit_tokens += hit * h
        if reuse:
            for position, identity in enumerate(identities):
                previous = last_access.get(identity)
                if previous is not None:
                    marks = 0
                    i = previous + 1
                    while i > 0:
                        marks += tree[i]
                        i -= i & -i
                    if position < hit:
                        distances.append(len(last_access) - marks + 1)
                    i = previous + 1
                    while i <= total_accesses:
                        tree[i] -= 1
                        i += i & -i
                last_access[identity] = now
                i = now + 1
                while i <= total_accesses:
                    tree[i] += 1
                    i += i & -i
                now += 1
        seen.update(identities)
    distances.sort()
    return WorkloadAnalysis(
        hash_block_size=h, requests=len(workload.requests), prompt_tokens=prompt_tokens,
        prompt_blocks=prompt_blocks, distinct_blocks=len(seen), max_request_blocks=max_blocks,
        total_blocks_allocated=allocated, ideal_hit_tokens=hit_tokens, ideal_hit_blocks=hit_blocks,
        reuse_distances=distances)
