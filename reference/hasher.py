"""The request block hasher (spec/hashing.md): one normative hash per full
block, computed with :func:`pagedkv.spec.hashing.hash_block_tokens`."""

from __future__ import annotations

from pagedkv.spec import hashing
from pagedkv.spec.request import BlockHasher, Request
from pagedkv.spec.types import BlockHash

__all__ = ["make_block_hasher"]


def make_block_hasher(hash_fn: hashing.HashFnName, hash_block_size: int, seed: str | None = None,
                      lookahead: int = 0) -> BlockHasher:
    """A hasher that returns the hashes of the full blocks of a request that
    its ``block_hashes`` do not cover yet (HASH-1). With ``lookahead`` L a
    block is hashed only once the L tokens after it exist, and its extra
    keys cover them (spec/hashing.md section 7)."""
    seed_value = hashing.seed_hash(hash_fn, seed)

    def hash_new_blocks(request: Request) -> list[BlockHash]:
        tokens, done = request.all_token_ids, len(request.block_hashes)
        parent = request.block_hashes[-1] if done else seed_value
        with_extra_keys = lookahead > 0 or hashing.need_extra_keys(request)
        new_hashes: list[BlockHash] = []
        for index in range(done, hashing.num_hashable_blocks(request.num_tokens, hash_block_size, lookahead)):
            start, end = index * hash_block_size, (index + 1) * hash_block_size
            extra_keys = hashing.lookahead_extra_keys(request, start, end, lookahead) if with_extra_keys else None
            parent = hashing.hash_block_tokens(hash_fn, parent, tokens[start:end], extra_keys)
            new_hashes.append(parent)
        return new_hashes

    return hash_new_blocks
