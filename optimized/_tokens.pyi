# Stub of the optional C module optimized/_tokens.c (D-PERF-35): token checks and prompt hashing.
from collections.abc import Callable
from typing import Any

from pagedkv.spec.types import BlockHash

def pack(tokens: list[int], /) -> bytes | None: ...
def sha256_blocks(packed: bytes, start: int, end: int, size: int, parent: bytes,
                  sha256: Callable[[bytes], Any], /) -> list[BlockHash] | None: ...
