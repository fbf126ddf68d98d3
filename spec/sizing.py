"""The integer arithmetic of KV cache planning, as small pure functions.

Every formula the spec classes and the planner use to turn tokens into
blocks and bytes into blocks lives here, once, with a PEP 316 contract
(``pre:`` / ``post:``) that CrossHair checks symbolically (``make crosshair``
lists this module). The callers (``kv_cache_spec``, ``mamba_spec``,
``planner``, ``capacity``) restate none of it. spec/config.md cites each
function by the ``CFG-`` invariant it carries.
"""

from __future__ import annotations

__all__ = [
    "cdiv",
    "context_parallel_tokens",
    "full_attention_blocks",
    "sliding_window_admission_blocks",
    "chunked_local_admission_blocks",
    "mamba_blocks",
    "num_blocks_for_memory",
    "group_size_for",
    "num_groups_for",
    "kv_cache_size_tokens",
    "blocks_per_request",
    "padded_page_target",
]


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: how many blocks of ``denominator`` hold ``numerator``.

    pre: numerator >= 0
    pre: denominator > 0
    post: __return__ * denominator >= numerator
    post: __return__ == 0 or (__return__ - 1) * denominator < numerator
    """
    return -(-numerator // denominator)


def context_parallel_tokens(max_model_len: int, dcp_world_size: int, pcp_world_size: int) -> int:
    """Tokens of one request a single rank stores under decode / prefill
    context parallelism: the request is spread over ``dcp * pcp`` ranks (CFG-6).

    pre: max_model_len >= 1
    pre: dcp_world_size >= 1 and pcp_world_size >= 1
    post: 1 <= __return__ <= max_model_len
    post: __return__ * dcp_world_size * pcp_world_size >= max_model_len
    """
    ranks = dcp_world_size * pcp_world_size
    if ranks == 1:
        return max_model_len
    return cdiv(max_model_len, ranks)


def full_attention_blocks(max_model_len: int, block_size: int,
                          dcp_world_size: int, pcp_world_size: int) -> int:
    """Blocks one request of ``max_model_len`` tokens holds in a
    full-attention layer: every token keeps its slot until the end (CFG-6).

    pre: max_model_len >= 1 and block_size >= 1
    pre: dcp_world_size >= 1 and pcp_world_size >= 1
    post: __return__ >= 1
    post: __return__ * block_size * dcp_world_size * pcp_world_size >= max_model_len
    """
    return cdiv(context_parallel_tokens(max_model_len, dcp_world_size, pcp_world_size), block_size)


def sliding_window_admission_blocks(sliding_window: int, max_num_batched_tokens: int,
                                    max_model_len: int, block_size: int) -> int:
    """Most blocks a sliding-window request ever holds at once (CFG-7).

    While prefilling in chunks, the layer keeps the last ``sliding_window - 1``
    computed tokens plus the chunk being scheduled, and never more than
    ``max_model_len`` tokens. One extra block covers a window that does not
    start on a block boundary: with block_size 4 and a 4-token window, tokens
    C..F may span ``[. . C D] [E F . .]``.

    pre: sliding_window >= 1 and max_num_batched_tokens >= 1
    pre: max_model_len >= 1 and block_size >= 1
    post: __return__ >= 2
    post: __return__ <= cdiv(max_model_len, block_size) + 1
    post: (__return__ - 1) * block_size >= min(sliding_window - 1 + max_num_batched_tokens, max_model_len)
    """
    num_tokens = min(sliding_window - 1 + max_num_batched_tokens, max_model_len)
    return cdiv(num_tokens, block_size) + 1


def chunked_local_admission_blocks(attention_chunk_size: int, max_num_batched_tokens: int,
                                   max_model_len: int, block_size: int) -> int:
    """Most blocks a chunked-local-attention request holds at once (CFG-8):
    at most one whole chunk of computed tokens plus the scheduled chunk,
    capped at ``max_model_len`` tokens.

    pre: attention_chunk_size >= 1 and max_num_batched_tokens >= 1
    pre: max_model_len >= 1 and block_size >= 1
    post: 1 <= __return__ <= cdiv(max_model_len, block_size)
    post: __return__ * block_size >= min(attention_chunk_size + max_num_batched_tokens, max_model_len)
    """
    num_tokens = min(attention_chunk_size + max_num_batched_tokens, max_model_len)
    return cdiv(num_tokens, block_size)


def mamba_blocks(cache_mode: str, max_model_len: int, block_size: int,
                 num_speculative_blocks: int) -> int:
    """Blocks one request holds in a Mamba layer (CFG-9).

    ``"none"``: one state block plus one per speculative step; ``"align"``:
    one more (the state at the last block boundary is kept for prefix
    caching); ``"all"``: a state per block of the whole context.

    pre: cache_mode in ("none", "align", "all")
    pre: max_model_len >= 1 and block_size >= 1 and num_speculative_blocks >= 0
    post: __return__ >= 1
    post: cache_mode != "none" or __return__ == 1 + num_speculative_blocks
    post: cache_mode != "align" or __return__ == 2 + num_speculative_blocks
    """
    if cache_mode == "all":
        return cdiv(max_model_len, block_size)
    if cache_mode == "align":
        return 2 + num_speculative_blocks
    return 1 + num_speculative_blocks


def num_blocks_for_memory(available_memory: int, page_size: int, num_tensors: int) -> int:
    """How many blocks fit when each block takes ``page_size`` bytes in each of
    ``num_tensors`` tensors: the largest count that fits, never negative (CFG-12).

    pre: available_memory >= 0 and page_size >= 1 and num_tensors >= 1
    post: __return__ >= 0
    post: __return__ * page_size * num_tensors <= available_memory
    post: (__return__ + 1) * page_size * num_tensors > available_memory
    """
    return available_memory // page_size // num_tensors


def group_size_for(layers_per_type: list[int]) -> int:
    """Layers per KV cache group of a hybrid model with a uniform page size
    (CFG-14): the fewest layers of any attention type, so that type gets one
    group and every other type is cut into groups of at most that many --
    unless the largest type has fewer than 1.5 times the fewest (e.g. 12
    sliding-window + 13 full layers, a draft model adding one): then the
    largest, so the smaller types get one padded group each instead of the
    larger type being split in two (vLLM 0.33's rule).

    pre: len(layers_per_type) >= 1
    pre: all(n >= 1 for n in layers_per_type)
    post: __return__ >= 1
    post: __return__ in layers_per_type
    post: __return__ == min(layers_per_type) or __return__ == max(layers_per_type)
    """
    fewest, most = min(layers_per_type), max(layers_per_type)
    # 2 * most < 3 * fewest is most < 1.5 * fewest in integers.
    return most if 2 * most < 3 * fewest else fewest


def num_groups_for(num_layers: int, group_size: int) -> int:
    """Groups needed for ``num_layers`` layers of one type, the last one
    padded when ``group_size`` does not divide it (CFG-14).

    pre: num_layers >= 1 and group_size >= 1
    post: __return__ >= 1
    post: __return__ * group_size >= num_layers
    post: (__return__ - 1) * group_size < num_layers
    """
    return cdiv(num_layers, group_size)


def kv_cache_size_tokens(num_blocks: int, num_groups: int, min_block_size: int,
                         dcp_world_size: int, pcp_world_size: int) -> int:
    """Tokens the KV cache holds: the pool split evenly over the groups, each
    block holding ``min_block_size`` tokens, times the context-parallel ranks
    that each hold a slice of every request (CFG-24).

    pre: num_blocks >= 0 and num_groups >= 1 and min_block_size >= 1
    pre: dcp_world_size >= 1 and pcp_world_size >= 1
    post: __return__ >= 0
    post: __return__ <= num_blocks * min_block_size * dcp_world_size * pcp_world_size
    """
    return num_blocks // num_groups * min_block_size * dcp_world_size * pcp_world_size


def blocks_per_request(max_memory_usage_per_request: int, memory_per_block: int) -> int:
    """Pool blocks one request of the worst case needs (CFG-19).

    pre: max_memory_usage_per_request >= 1 and memory_per_block >= 1
    post: __return__ >= 1
    post: __return__ * memory_per_block >= max_memory_usage_per_request
    """
    return cdiv(max_memory_usage_per_request, memory_per_block)


def padded_page_target(lcm_of_scalable_pages: int, largest_fixed_page: int) -> int:
    """The common page size of a hybrid model whose pages differ (CFG-15): the
    smallest multiple of every block-size-scalable page (attention) that is
    at least the largest fixed page (Mamba state), which is then padded.

    pre: lcm_of_scalable_pages >= 1 and largest_fixed_page >= 0
    post: __return__ % lcm_of_scalable_pages == 0
    post: __return__ >= largest_fixed_page
    post: __return__ - lcm_of_scalable_pages < max(largest_fixed_page, 1)
    """
    return lcm_of_scalable_pages * max(cdiv(largest_fixed_page, lcm_of_scalable_pages), 1)
