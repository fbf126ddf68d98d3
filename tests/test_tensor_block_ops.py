"""Differential tests: batched block copy and swap (torch) against
``reference_copy_blocks`` / ``reference_swap_blocks``, including the errors,
which must come before any byte moves."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedkv.optimized.tensor import KVCacheMemory, check_block_pairs, copy_blocks, swap_blocks  # noqa: E402,E501
from pagedkv.reference.features.tensor_model import (  # noqa: E402
    ReferenceCache,
    reference_copy_blocks,
    reference_swap_blocks,
)
from pagedkv.reference.features.tensor_model import check_block_pairs as reference_check  # noqa: E402
from pagedkv.spec.errors import InvalidArgumentError, PagedKVError, UnknownBlockError  # noqa: E402
from pagedkv.spec.kv_cache_spec import FullAttentionSpec, KVCacheSpec  # noqa: E402
from pagedkv.spec.mamba_spec import MambaSpec  # noqa: E402
from tests.test_tensor_memory import make_config  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]

ATTENTION = FullAttentionSpec(2, 1, 4, "float16")  # 32-byte pages
MAMBA = MambaSpec(2, ((2, 2),), ("float32",), page_size_padded=32)
WIDE = FullAttentionSpec(2, 2, 4, "float16")       # 64-byte pages: a second arena
LARGE = FullAttentionSpec(2, 16, 256, "float16")  # 32 KiB pages: copied block by block on the CPU


def _random_cache(specs: list[KVCacheSpec], num_blocks: int, shared: bool, seed: int,
                  device: str) -> KVCacheMemory:
    memory = KVCacheMemory(make_config(specs, 2, num_blocks, shared), device)
    generator = torch.Generator().manual_seed(seed)
    for tensor in memory.tensors:
        tensor.copy_(torch.randint(-128, 128, tensor.shape, dtype=torch.int8,
                                   generator=generator))
    return memory


def _as_reference(memory: KVCacheMemory) -> ReferenceCache:
    return ReferenceCache([[bytes(page.cpu().numpy().tobytes()) for page in
                            tensor.view(memory.num_blocks, -1)] for tensor in memory.tensors])


def _pairs(num_src: int, num_dst: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    valid = st.tuples(st.integers(0, num_src - 1), st.integers(1, num_dst - 1))
    anything = st.tuples(st.integers(-1, num_src + 1), st.integers(-1, num_dst + 1))
    return st.one_of(
        st.lists(valid, max_size=8, unique_by=lambda p: p[1]),   # mostly valid batches
        st.lists(st.one_of(valid, anything), max_size=8))


def _outcome(call: object) -> object:
    try:
        assert callable(call)
        call()
        return None
    except PagedKVError as error:
        return type(error)


CONFIGS = st.sampled_from([([ATTENTION], False), ([ATTENTION, MAMBA], True),
                           ([ATTENTION, WIDE], False), ([MAMBA], False),
                           ([LARGE], False), ([LARGE, ATTENTION], False)])


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60)
@given(config=CONFIGS, num_blocks=st.integers(2, 9), seed=st.integers(0, 2**16),
       data=st.data())
def test_copy_blocks_matches_reference(device: str, config: tuple[list[KVCacheSpec], bool],
                                       num_blocks: int, seed: int, data: st.DataObject) -> None:
    specs, shared = config
    memory = _random_cache(specs, num_blocks, shared, seed, device)
    ref = _as_reference(memory)
    pairs = data.draw(_pairs(num_blocks, num_blocks))
    group_id = data.draw(st.one_of(st.none(), st.integers(0, len(specs) - 1)))
    tensor_ids = range(len(memory.tensors)) if group_id is None else memory.group_tensors[group_id]
    got = _outcome(lambda: copy_blocks(memory, pairs, group_id))
    expected = _outcome(lambda: reference_copy_blocks(ref, pairs, tensor_ids))
    assert got == expected
    assert _as_reference(memory).pages == ref.pages  # unchanged on error, equal otherwise


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40)
@given(config=CONFIGS, num_blocks=st.integers(2, 9), num_host=st.integers(2, 6),
       seed=st.integers(0, 2**16), data=st.data())
def test_swap_blocks_matches_reference(device: str, config: tuple[list[KVCacheSpec], bool],
                                       num_blocks: int, num_host: int, seed: int,
                                       data: st.DataObject) -> None:
    specs, shared = config
    gpu = _random_cache(specs, num_blocks, shared, seed, device)
    host = KVCacheMemory.host_mirror(gpu, num_host)
    for t in host.tensors:
        t.fill_(5)
    ref_gpu, ref_host = _as_reference(gpu), _as_reference(host)
    out_pairs = data.draw(_pairs(num_blocks, num_host))
    assert _outcome(lambda: swap_blocks(gpu, host, out_pairs)) == _outcome(
        lambda: reference_swap_blocks(ref_gpu, ref_host, out_pairs))
    in_pairs = data.draw(_pairs(num_host, num_blocks))
    assert _outcome(lambda: swap_blocks(host, gpu, in_pairs)) == _outcome(
        lambda: reference_swap_blocks(ref_host, ref_gpu, in_pairs))
    assert _as_reference(gpu).pages == ref_gpu.pages
    assert _as_reference(host).pages == ref_host.pages


@given(pairs=st.lists(st.tuples(st.integers(-2, 7), st.integers(-2, 7)), max_size=6),
       num_src=st.integers(1, 6), num_dst=st.integers(1, 6))
def test_pair_checks_agree(pairs: list[tuple[int, int]], num_src: int, num_dst: int) -> None:
    assert _outcome(lambda: check_block_pairs(pairs, num_src, num_dst)) == _outcome(
        lambda: reference_check(pairs, num_src, num_dst))


def test_copy_reads_every_source_before_writing() -> None:
    memory = _random_cache([ATTENTION], 4, False, 0, "cpu")
    pages = memory.layer("g0.l0").pages
    before = pages.clone()
    copy_blocks(memory, [(1, 2), (2, 3), (3, 1)])  # a rotation
    assert torch.equal(pages[2], before[1]) and torch.equal(pages[3], before[2])
    assert torch.equal(pages[1], before[3]) and torch.equal(pages[0], before[0])


def test_typed_errors() -> None:
    memory = _random_cache([ATTENTION], 4, False, 0, "cpu")
    with pytest.raises(InvalidArgumentError):
        copy_blocks(memory, [(1, 0)])               # null block as destination
    with pytest.raises(InvalidArgumentError):
        copy_blocks(memory, [(1, 2), (3, 2)])       # duplicate destination
    with pytest.raises(UnknownBlockError):
        copy_blocks(memory, [(4, 2)])               # out of range
    with pytest.raises(InvalidArgumentError):
        copy_blocks(memory, [(1, 2)], group_id=1)   # no such group
    other = _random_cache([WIDE], 4, False, 0, "cpu")
    with pytest.raises(InvalidArgumentError):
        swap_blocks(memory, other, [(1, 2)])        # different layouts


@pytest.mark.parametrize("device", DEVICES)
def test_large_pages_copy_and_swap_block_by_block(device: str) -> None:
    """Pages >= 16 KiB take the per-block path on the CPU (no destination is
    also a source here); the results must equal the plain-Python model."""
    memory = _random_cache([LARGE, ATTENTION], 6, False, 7, device)
    ref = _as_reference(memory)
    copy_blocks(memory, [(1, 3), (2, 4)])
    reference_copy_blocks(ref, [(1, 3), (2, 4)], range(len(memory.tensors)))
    assert _as_reference(memory).pages == ref.pages
    host = _random_cache([LARGE, ATTENTION], 5, False, 8, "cpu")
    ref_host = _as_reference(host)
    swap_blocks(memory, host, [(3, 1), (4, 2)])
    reference_swap_blocks(ref, ref_host, [(3, 1), (4, 2)])
    assert _as_reference(host).pages == ref_host.pages
