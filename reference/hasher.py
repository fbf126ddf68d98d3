"""The request block hasher (spec/hashing.md): one normative hash per full
block, computed with :func:`pagedkv.spec.hashing.hash_block_tokens`."""

from __future__ import annotations

from pagedkv.spec.hashing import HashFnName, block_extra_keys, hash_block_tokens, need_extra_keys, seed_hash
from pagedkv.spec.request import BlockHasher, Request
from pagedkv.spec.types import BlockHash

__all__ = ["make_block_hasher"]


def make_block_hasher(hash_fn: HashFnName, hash_block_size: int, seed: str | None = None) -> BlockHasher:
    """A hasher that returns the hashes of the full blocks of a request that
    its ``block_hashes`` do not cover yet (HASH-1)."""
    seed_value = seed_hash(hash_fn, seed)

    def hash_new_blocks(request: Request) -> list[BlockHash]:
        tokens = request.all_token_ids
        done = len(request.block_hashes)
        parent = request.block_hashes[-1] if done else seed_value
        with_extra_keys = need_extra_keys(request)
        mm_index = 0
        new_hashes: list[BlockHash] = []
        for index in range(done, request.num_tokens // hash_block_size):
            start, end = index * hash_block_size, (index + 1) * hash_block_size
            extra_keys = None
            if with_extra_keys:
                extra_keys, mm_index = block_extra_keys(request, start, end, mm_index)
            parent = hash_block_tokens(hash_fn, parent, tokens[start:end], extra_keys)
            new_hashes.append(parent)
        return new_hashes

    return hash_new_blocks
