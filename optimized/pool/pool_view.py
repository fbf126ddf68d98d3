"""Read-only views of the block pool: accessors, snapshot, and the invariant
check beside the tables it reads.

Split from :mod:`.block_pool` so the pool module holds only the operations
that change state. Nothing here mutates the pool.

Representation (everything indexed by block id, plain lists for speed):

- ``_ref[b]``: ref count.
- ``_hash[b]``: the raw :data:`BlockHash` (no group id) or ``None``;
  ``_gid[b]``: the group id of that key, ``-1`` exactly when unhashed.
  Storing the group id apart means lookups never build ``hash + group id``
  byte strings; :meth:`snapshot` rebuilds the keys. The hot loops test
  ``_gid[b] < 0`` rather than ``_hash[b] is None``: reading the hash
  touches (increfs) a bytes object scattered in memory, a cache miss per
  block, while ``-1`` and the small group ids are shared, always-hot ints.
- ``cached_by_group[g]``: ``{raw hash: first block id}``, what a lookup
  returns; ``dup_by_group[g]``: ``{raw hash: [later block ids]}``, only for
  the rare keys that several identical blocks carry (insertion order kept:
  the first of them takes over when the first holder is evicted). A plain
  int per key allocates no container per cached block: a list per key made
  the garbage collector's full collections, which walk the pool-sized
  lists, dominate prompt allocation in large pools (D-PERF-10).
- ``_queue``: :class:`FreeBlockQueue` (its link arrays are read directly in
  the pool's hot loops, bound to locals).
- ``map_epoch``: bumped whenever a key leaves a map or a map entry moves to
  another block (adding keys leaves it), and ``last_hit``, the last
  full-attention lookup's memo ``(epoch, hashes, hit)``: while the epoch
  stands, the map still serves that hit for those hashes, so admitting it
  needs no second probe per block (:mod:`.hit_memo`, D-PERF-44).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from pagedkv.optimized.pool.free_queue import FreeBlockQueue
from pagedkv.spec.errors import InvalidArgumentError, InvariantViolation, UnknownBlockError
from pagedkv.spec.snapshot import PoolSnapshot
from pagedkv.spec.types import BlockHash, KVCacheEvent

__all__ = ["NULL_BLOCK", "PoolTables", "PoolView", "group_suffix"]

NULL_BLOCK = 0
"""Id of the null block."""


def group_suffix(group_id: int) -> bytes:
    """The 4 big-endian bytes a cache key appends to the block hash."""
    return group_id.to_bytes(4, "big")


class PoolTables(Protocol):
    """The pool's tables as the modules that rebuild or memoize them write them
    (``pool_recover``, ``hit_memo``; :class:`.BlockPool` has each): a protocol, as
    those modules sit below ``block_pool``, which imports them."""

    num_blocks: int
    num_groups: int
    enable_caching: bool
    enable_kv_cache_events: bool
    _ref: list[int]
    _hash: list[BlockHash | None]
    _gid: list[int]
    _key_tokens: list[int]
    _ids: list[int]
    _queue: FreeBlockQueue
    _events: list[KVCacheEvent]
    cached_by_group: list[dict[bytes, int]]
    dup_by_group: list[dict[bytes, list[int]]]
    reserved: list[int]
    map_epoch: int
    last_hit: tuple[int, list[BlockHash], list[int]] | None


class PoolView:
    """Accessors and observation over the pool's state (see :class:`.BlockPool`)."""

    __slots__ = ()

    num_blocks: int
    num_groups: int
    _ref: list[int]
    _hash: list[BlockHash | None]
    _gid: list[int]
    _key_tokens: list[int]
    cached_by_group: list[dict[bytes, int]]
    dup_by_group: list[dict[bytes, list[int]]]
    _queue: FreeBlockQueue
    _events: list[KVCacheEvent]
    _ids: list[int]
    enable_caching: bool
    enable_kv_cache_events: bool
    reserved: list[int]

    # ------------------------------------------------------------------ reads

    @property
    def null_block(self) -> int:
        """The null block's id (0). Cost: O(1)."""
        return NULL_BLOCK

    @property
    def ref_counts(self) -> list[int]:
        """Ref count per block id (live list; do not mutate). Cost: O(1)."""
        return self._ref

    @property
    def block_hashes(self) -> list[BlockHash | None]:
        """Raw hash per block id (live list; do not mutate). Cost: O(1)."""
        return self._hash

    @property
    def block_group_ids(self) -> list[int]:
        """Group id of each block's key, ``-1`` where unhashed (live list).
        Cost: O(1)."""
        return self._gid

    @property
    def free_queue(self) -> FreeBlockQueue:
        """The free queue itself (do not mutate). Cost: O(1)."""
        return self._queue

    @property
    def pending_events(self) -> list[KVCacheEvent]:
        """Events not yet taken (live list; do not mutate). Cost: O(1)."""
        return self._events

    def ref_count(self, block_id: int) -> int:
        """Ref count of one block. Cost: O(1).

        Raises:
            UnknownBlockError: ``block_id`` outside ``[0, num_blocks)``.
        """
        self._check_ids((block_id,))
        return self._ref[block_id]

    # ------------------------------------------------------- introspection

    def free_queue_ids(self) -> list[int]:
        """The free queue, front first. Cost: O(free blocks)."""
        return self._queue.to_list()

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (evictable cached blocks included). Cost: O(1)."""
        return self._queue.size

    def get_usage(self) -> float:
        """``1 - free / (num_blocks - 1)``; 0.0 when ``num_blocks == 1``. Cost: O(1)."""
        if self.num_blocks == 1:
            return 0.0
        return 1.0 - self._queue.size / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[int] | None:
        """For each group id, the first block cached under ``block_hash`` in
        that group; ``None`` if any group misses.

        Cost: O(len(group_ids)).

        Raises:
            InvalidArgumentError: a group id outside ``[0, num_groups)``.
        """
        cached = self.cached_by_group
        out: list[int] = []
        for group_id in group_ids:
            if not 0 <= group_id < self.num_groups:
                raise InvalidArgumentError(
                    f"group id must lie in [0, {self.num_groups}), got {group_id!r}")
            first = cached[group_id].get(block_hash)
            if first is None:
                return None
            out.append(first)
        return out

    def key_tokens(self, block_id: int) -> int | None:
        """Tokens the key of ``block_id`` covers (KEYTOK-1); ``None`` when unkeyed. Cost: O(1)."""
        return None if self._gid[block_id] < 0 else self._key_tokens[block_id]

    def cache_key(self, block_id: int) -> bytes | None:
        """The cache key (hash + group id) of a block, or None. Cost: O(1)."""
        block_hash = self._hash[block_id]
        if block_hash is None:
            return None
        return block_hash + group_suffix(self._gid[block_id])

    def snapshot(self) -> PoolSnapshot:
        """Observable state (spec/snapshot.py); pending events are copied,
        not taken. Cost: O(num_blocks + cached keys * log)."""
        cached: list[tuple[bytes, tuple[int, ...]]] = []
        for group_id, table in enumerate(self.cached_by_group):
            suffix = group_suffix(group_id)
            dups = self.dup_by_group[group_id]
            cached.extend((block_hash + suffix, (first, *dups.get(block_hash, ())))
                          for block_hash, first in table.items())
        cached.sort()
        return PoolSnapshot(
            num_blocks=self.num_blocks,
            ref_counts=tuple(self._ref),
            block_hashes=tuple(self.cache_key(b) for b in range(self.num_blocks)),
            free_queue=tuple(self._queue.to_list()),
            cached=tuple(cached),
            pending_events=tuple(self._events),
        )

    def holders(self, group_id: int, block_hash: bytes) -> list[int]:
        """The blocks cached under ``block_hash`` in group ``group_id``, in
        insertion order (empty when none). Cost: O(holders)."""
        first = self.cached_by_group[group_id].get(block_hash)
        if first is None:
            return []
        return [first, *self.dup_by_group[group_id].get(block_hash, ())]

    def check_invariants(self) -> None:
        """Check POOL-1..4, CACHE-1..3 and EVT-1; "an expensive no-op" when
        all is well. Cost: O(num_blocks + cached ids).

        Raises:
            InvariantViolation: the message starts with the invariant's ID.
        """
        self._check_tables()
        # A block's key ``hash[b]`` is stored as two lists, and the hot loops
        # test the group id, not the hash: group id -1 exactly where no key.
        # A disagreement means the key the pool acts on differs from the one
        # it reports, so it is reported as a hash/map disagreement (CACHE-1).
        for block, (block_hash, group_id) in enumerate(zip(self._hash, self._gid)):
            if (block_hash is None) != (group_id == -1):
                raise InvariantViolation(
                    f"CACHE-1: block {block}: stored hash {block_hash!r} and group id "
                    f"{group_id} disagree (group id -1 exactly where no key)"
                    f"\nstate: {self.snapshot()!r}")

    def _check_tables(self) -> None:
        """POOL-1..4, CACHE-1..3 and EVT-1 over the tables the pool reports
        (spec/state.md; the reference's ``reference/invariants.py`` checks the same
        IDs over its own representation). Cost: O(num_blocks + cached ids).

        Raises:
            InvariantViolation: the message starts with the invariant's ID.
        """
        def fail(inv: str, what: str) -> None:
            raise InvariantViolation(f"{inv}: {what}\nstate: {self.snapshot()!r}")

        n = self.num_blocks
        try:
            self.free_queue.check()
        except AssertionError as exc:
            fail("POOL-2", f"free queue links broken: {exc}")
        queue = self.free_queue.to_list()
        if len(self.ref_counts) != n or len(self.block_hashes) != n or len(self.block_group_ids) != n:
            fail("POOL-1", f"per-block tables do not cover exactly the ids 0..{n - 1}")
        if self.ref_counts[0] != 0 or self.block_hashes[0] is not None or 0 in queue or 0 in self.reserved:
            fail("POOL-1", "null block queued, referenced, hashed or reserved")
        queued = set(queue)
        if any(not 0 < b < n for b in queue):
            fail("POOL-2", "free queue holds an id outside [1, num_blocks)")
        for b in range(1, n):
            if self.ref_counts[b] < 0:
                fail("POOL-3", f"block {b} has ref count {self.ref_counts[b]}")
            if (b in queued) != (self.ref_counts[b] == 0):
                fail("POOL-2", f"block {b}: queued={b in queued} ref={self.ref_counts[b]}")
        usage = 0.0 if n == 1 else 1 - len(queue) / (n - 1)
        if self.get_num_free_blocks() != len(queue) or self.get_usage() != usage:
            fail("POOL-4", f"free count {self.get_num_free_blocks()} or usage {self.get_usage()} "
                           f"disagrees with the queue's {len(queue)} blocks")
        seen: set[int] = set()
        if len(self.dup_by_group) != len(self.cached_by_group):
            fail("CACHE-1", f"{len(self.dup_by_group)} duplicate tables for {len(self.cached_by_group)} groups")
        for group_id, table in enumerate(self.cached_by_group):
            dups = self.dup_by_group[group_id]
            for block_hash, later in dups.items():
                if not later or block_hash not in table:
                    fail("CACHE-1", f"map entry {block_hash.hex()} lists later holders {later} "
                                    f"{'but no first one' if later else 'that are none'}")
            for block_hash, first in table.items():
                ids = [first, *dups.get(block_hash, ())]
                if len(set(ids)) != len(ids):
                    fail("CACHE-1", f"map entry {block_hash.hex()} holds {ids}")
                for b in ids:
                    if self.block_hashes[b] != block_hash or self.block_group_ids[b] != group_id:
                        fail("CACHE-1", f"block {b} in map under another key")
                    seen.add(b)
        for b in range(n):
            if self.block_hashes[b] is not None and not 0 <= self.block_group_ids[b] < self.num_groups:
                fail("CACHE-3", f"block {b} has group id {self.block_group_ids[b]}")
            if self.block_hashes[b] is not None and b not in seen:
                fail("CACHE-1", f"block {b} hashed but not in the map")
            if self.block_hashes[b] is None and self.block_group_ids[b] != -1:
                fail("CACHE-1", f"block {b} carries no hash but group id {self.block_group_ids[b]}")
        if not self.enable_caching and seen:
            fail("CACHE-2", "caching disabled but blocks carry hashes")
        if not self.enable_kv_cache_events and self.pending_events:
            fail("EVT-1", "events disabled but events pending")

    def _check_ids(self, ids: Iterable[object]) -> None:
        n = self.num_blocks
        for block in ids:
            if type(block) is not int or not 0 <= block < n:
                raise UnknownBlockError(
                    f"block id must be an int in [0, {n}), got {block!r}")
