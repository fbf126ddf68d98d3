"""KV cache memory: typed views at the offsets of the documented layout
(checked against ``reference_byte_offset``), sharing, and config errors."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedkv.optimized.tensor import KVCacheMemory  # noqa: E402
from pagedkv.reference.features.tensor_model import reference_byte_offset  # noqa: E402
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from pagedkv.spec.errors import InvalidConfigError  # noqa: E402
from pagedkv.spec.kv_cache_spec import (  # noqa: E402
    FP8_DS_MLA,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec  # noqa: E402
from pagedkv.spec.uniform_spec import UniformTypeKVCacheSpecs  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]


def make_config(specs: list[KVCacheSpec], num_layers: int, num_blocks: int,
                shared: bool) -> KVCacheConfig:
    """One group per spec with ``num_layers`` layers each. ``shared``: layer
    ``i`` of every group views tensor ``i`` (the hybrid planner's layout; the
    pages must then be equal), else one tensor per layer."""
    groups = tuple(KVCacheGroupSpec(tuple(f"g{g}.l{i}" for i in range(num_layers)), spec)
                   for g, spec in enumerate(specs))
    if shared:
        tensors = tuple(KVCacheTensor(num_blocks * specs[0].page_size_bytes,
                                      tuple(f"g{g}.l{i}" for g in range(len(specs))))
                        for i in range(num_layers))
    else:
        tensors = tuple(KVCacheTensor(num_blocks * spec.page_size_bytes, (f"g{g}.l{i}",))
                        for g, spec in enumerate(specs) for i in range(num_layers))
    return KVCacheConfig(num_blocks, tensors, groups)


def _specs() -> st.SearchStrategy[KVCacheSpec]:
    bs = st.sampled_from([1, 2, 4])
    heads = st.integers(1, 3)
    head = st.sampled_from([2, 4, 8])
    dtype = st.sampled_from(["float16", "bfloat16", "float32", "int8", "fp8_e4m3"])
    full = st.builds(FullAttentionSpec, bs, heads, head, dtype,
                     head_size_v=st.one_of(st.none(), head))
    window = st.builds(SlidingWindowSpec, bs, heads, head, dtype, sliding_window=st.integers(1, 8))
    mla = st.builds(MLAAttentionSpec, bs, heads, head, dtype)
    shapes = st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple),
                      min_size=1, max_size=3).map(tuple)
    # States in decreasing element size and the page padded to 8 bytes keep every
    # view aligned (as real Mamba layers are); misaligned specs raise, tested below.
    mamba = st.tuples(bs, shapes).flatmap(lambda bs_s: st.lists(
        st.sampled_from(["float32", "float16", "int8"]), min_size=len(bs_s[1]),
        max_size=len(bs_s[1])).map(lambda d: _aligned_mamba(bs_s[0], bs_s[1], d)))
    return st.one_of(full, window, mla, mamba)


def _aligned_mamba(block_size: int, shapes: tuple[tuple[int, ...], ...],
                   dtypes: list[str]) -> MambaSpec:
    order = {"float32": 0, "float16": 1, "int8": 2}
    dtypes = sorted(dtypes, key=order.__getitem__)
    real = MambaSpec(block_size, shapes, tuple(dtypes)).real_page_size_bytes
    return MambaSpec(block_size, shapes, tuple(dtypes), page_size_padded=-(-real // 8) * 8)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60)
@given(spec=_specs(), num_blocks=st.integers(1, 5), data=st.data())
def test_views_follow_the_documented_layout(device: str, spec: KVCacheSpec, num_blocks: int,
                                           data: st.DataObject) -> None:
    memory = KVCacheMemory(make_config([spec], 2, num_blocks, shared=False), device)
    for name in ("g0.l0", "g0.l1"):
        layer = memory.layer(name)
        base = memory.tensors[layer.tensor_index].data_ptr()
        assert layer.pages.shape == (num_blocks, spec.page_size_bytes)
        for view_name, view in layer.views.items():
            index = [data.draw(st.integers(0, n - 1)) for n in view.shape]
            element = view[tuple(index)]
            assert element.data_ptr() - base == reference_byte_offset(spec, view_name, index)
            # Every byte of the view lies within the tensor.
            last = view[tuple(n - 1 for n in view.shape)]
            assert last.data_ptr() + view.element_size() - base <= num_blocks * spec.page_size_bytes
    # Distinct layers never alias.
    assert memory.tensors[0].data_ptr() != memory.tensors[1].data_ptr()


def test_attention_view_shapes_and_kv_stacking() -> None:
    spec = FullAttentionSpec(4, 2, 8, "bfloat16")
    memory = KVCacheMemory(make_config([spec], 1, 3, shared=False))
    layer = memory.layer("g0.l0")
    assert layer["kv"].shape == (2, 3, 4, 2, 8) and layer["kv"].dtype == torch.bfloat16
    layer["kv"][1, 2].fill_(1.5)  # V of block 2
    assert bool((layer["value"][2] == 1.5).all()) and not bool(layer["key"].any())
    assert memory.forward_views()["g0.l0"] is layer["kv"]
    mla = MLAAttentionSpec(4, 1, 576, "fp8_e4m3", cache_dtype_str=FP8_DS_MLA)
    latent = KVCacheMemory(make_config([mla], 1, 2, shared=False)).layer("g0.l0")["latent"]
    assert latent.shape == (2, 4, 656) and latent.dtype == torch.uint8


def test_layers_of_different_groups_share_a_tensor() -> None:
    attn = FullAttentionSpec(2, 1, 8, "float32")           # page 128 bytes
    mamba = MambaSpec(2, ((2, 4),), ("float32",), page_size_padded=attn.page_size_bytes)
    memory = KVCacheMemory(make_config([attn, mamba], 2, 4, shared=True))
    assert len(memory.tensors) == 2 and len(memory.arenas) == 1
    a, m = memory.layer("g0.l1"), memory.layer("g1.l1")
    assert a.tensor_index == m.tensor_index == 1
    m.states[0][3].fill_(2.0)                             # block 3, owned by the Mamba group
    assert bool((a["key"][3].flatten()[:8] == 2.0).all())  # same bytes, same page
    assert not bool(a["key"][2].any())
    assert memory.group_tensors == ((0, 1), (0, 1))


def test_uniform_type_group_gives_each_layer_its_spec() -> None:
    small, big = FullAttentionSpec(2, 1, 4, "float16"), FullAttentionSpec(2, 4, 4, "float16")
    group = KVCacheGroupSpec(("a", "b"), UniformTypeKVCacheSpecs(2, (("a", small), ("b", big))))
    tensors = (KVCacheTensor(3 * small.page_size_bytes, ("a",)),
               KVCacheTensor(3 * big.page_size_bytes, ("b",)))
    memory = KVCacheMemory(KVCacheConfig(3, tensors, (group,)))
    assert memory.layer("a")["kv"].shape == (2, 3, 2, 1, 4)
    assert memory.layer("b")["kv"].shape == (2, 3, 2, 4, 4)
    assert len(memory.arenas) == 2


def test_misaligned_mamba_states_raise() -> None:
    misaligned = [MambaSpec(1, ((3,), (1,)), ("int8", "float32"), page_size_padded=8),  # offset 3
                  MambaSpec(1, ((3,),), ("float32",), page_size_padded=13)]  # block stride 13 B
    for spec in misaligned:
        with pytest.raises(InvalidConfigError):
            KVCacheMemory(make_config([spec], 1, 2, shared=False))


def test_adopted_buffers() -> None:
    spec = FullAttentionSpec(2, 1, 4, "float16")
    config = make_config([spec], 2, 3, shared=False)
    buffers = [torch.arange(t.size, dtype=torch.int8) for t in config.kv_cache_tensors]
    memory = KVCacheMemory(config, buffers=buffers)
    assert memory.tensors[1].data_ptr() == buffers[1].data_ptr()
    assert int(memory.layer("g0.l1").pages[1, 0]) == spec.page_size_bytes
    bad_cases = [buffers[:1], [buffers[0], buffers[1][:-1]], [buffers[0], buffers[1].float()],
                 [buffers[0], buffers[1].view(2, -1)]]
    for bad in bad_cases:
        with pytest.raises(InvalidConfigError):
            KVCacheMemory(config, buffers=bad)


def _bad_configs() -> list[KVCacheConfig]:
    spec = FullAttentionSpec(2, 1, 4, "float16")
    page = spec.page_size_bytes
    group = KVCacheGroupSpec(("a", "b"), spec)
    return [
        KVCacheConfig(3, (KVCacheTensor(3 * page + 2, ("a",)),
                          KVCacheTensor(3 * page, ("b",))), (group,)),          # size
        KVCacheConfig(3, (KVCacheTensor(3 * page, ("a",)),), (group,)),          # b has none
        KVCacheConfig(3, (KVCacheTensor(3 * page, ("a", "b")),), (group,)),      # same group
        KVCacheConfig(3, (KVCacheTensor(3 * page, ("a",)), KVCacheTensor(3 * page, ("b",)),
                          KVCacheTensor(3 * page, ("c",))), (group,)),          # unknown layer
        KVCacheConfig(3, (KVCacheTensor(3 * page, ("a",)), KVCacheTensor(3 * page, ("a",)),
                          KVCacheTensor(3 * page, ("b",))), (group,)),          # a twice
        KVCacheConfig(3, (KVCacheTensor(3 * page, ("a",)), KVCacheTensor(3 * page, ("b",))),
                      (group, KVCacheGroupSpec(("a",), spec))),                 # a in 2 groups
    ]


@pytest.mark.parametrize("config", _bad_configs())
def test_inconsistent_configs_raise(config: KVCacheConfig) -> None:
    with pytest.raises(InvalidConfigError):
        KVCacheMemory(config)


def test_host_mirror_has_the_same_layout() -> None:
    spec = MambaSpec(4, ((3, 2), (5,)), ("float32", "float16"), page_size_padded=40)
    device = KVCacheMemory(make_config([spec], 2, 6, shared=False))
    host = KVCacheMemory.host_mirror(device, 3)
    assert host.num_blocks == 3 and not host.tensors[0].is_pinned()
    assert [s.shape[1:] for s in host.layer("g0.l0").states] == [(3, 2), (5,)]
    assert host.layer("g0.l0").pages.shape == (3, spec.page_size_bytes)
    assert math.prod(host.layer("g0.l0").pages.shape) == host.config.kv_cache_tensors[0].size
