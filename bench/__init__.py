"""pagedkv's benchmarks (``make bench`` = ``python -m bench``; see bench/README.md).

``bench.manager_bench``: the standard chat trace, its eviction-heavy variant and
allocate/free micro-benchmarks over the manager's public API.
``bench.tensor_bench`` (when present): the tensor path.
``bench.vllm_side_by_side``: the same trace through vLLM's own manager, optional.
"""
