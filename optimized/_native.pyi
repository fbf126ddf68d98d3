# Stub of the optional C module optimized/_native.c (D-PERF-26): the pool's per-block loops.
from collections.abc import Callable, Sequence

from pagedkv.spec.types import BlockHash

def release(ref: list[int], gids: list[int], prev: list[int], next: list[int], sentinel: int,
            blocks: list[int], /) -> int | None: ...
def touch(ref: list[int], prev: list[int], next: list[int], blocks: list[int], /) -> int | None: ...
def take(ref: list[int], hashes: Sequence[object] | None, prev: list[int], next: list[int], sentinel: int,
         n: int, evict: Callable[[int], object],
         maps: tuple[list[int], list[dict[bytes, int]], list[dict[bytes, list[int]]]] | None = None,
         /) -> list[int] | None: ...
def key_run(hashes: list[BlockHash | None], gids: list[int], key_tokens: list[int], run: list[int],
            keys: list[BlockHash], group_id: int, first_count: int, step: int, /) -> bool | None: ...
