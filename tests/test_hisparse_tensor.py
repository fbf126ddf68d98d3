"""The host tier's tensor path: host-resident groups in host memory, and the
page transfers of the optimized host tier moving real bytes (CPU, and CUDA
where present)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pagedkv.optimized.host_tier.hisparse import HostTierManager  # noqa: E402
from pagedkv.optimized.tensor.host_tier import (  # noqa: E402
    HostTierMemory,
    can_pin_host_memory,
    host_group_memory,
)
from pagedkv.optimized.tensor.memory import KVCacheMemory  # noqa: E402
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from pagedkv.spec.errors import InvalidArgumentError, InvalidConfigError  # noqa: E402
from pagedkv.spec.hisparse import HiSparseHotSpec, HostTierConfig, RowMirror  # noqa: E402
from pagedkv.spec.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec  # noqa: E402
from pagedkv.spec.types import BlockHash  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]
SPEC = FullAttentionSpec(4, 1, 2, "float32")  # 64-byte pages
DEVICE_BLOCKS, HOST_BLOCKS = 12, 16


def _device_cache(device: str, spec: KVCacheSpec = SPEC) -> KVCacheMemory:
    config = KVCacheConfig(
        DEVICE_BLOCKS, (KVCacheTensor(spec.page_size_bytes * DEVICE_BLOCKS, ("resident",)),),
        (KVCacheGroupSpec(("resident",), spec),))
    return KVCacheMemory(config, device)


def test_host_groups_live_in_host_memory_pinned_only_with_cuda() -> None:
    groups = (
        KVCacheGroupSpec(("source",), SPEC, host_resident=True, role="hisparse_source"),
        KVCacheGroupSpec(("hot",), HiSparseHotSpec(4, page_size=64, blocks_per_request=2)),
    )
    memory = host_group_memory(KVCacheConfig(64, (), groups), host_num_blocks=HOST_BLOCKS)
    assert set(memory.layers) == {"source"}  # the device groups are not allocated here
    assert memory.device.type == "cpu" and memory.num_blocks == HOST_BLOCKS
    assert memory.tensors[0].numel() == SPEC.page_size_bytes * HOST_BLOCKS
    assert memory.tensors[0].is_pinned() == can_pin_host_memory()
    # Asking for pinning on a CPU-only machine skips it instead of failing.
    forced = host_group_memory(KVCacheConfig(64, (), groups), HOST_BLOCKS, pin_memory=True)
    assert forced.tensors[0].is_pinned() == can_pin_host_memory()
    with pytest.raises(InvalidConfigError, match="host_resident"):
        host_group_memory(KVCacheConfig(64, (), groups[1:]), HOST_BLOCKS)


@pytest.mark.parametrize("device", DEVICES)
def test_writeback_and_restore_move_the_pages_the_manager_planned(device: str) -> None:
    tier = HostTierManager(HostTierConfig(block_size=4, host_num_blocks=HOST_BLOCKS,
                                          device_num_blocks=DEVICE_BLOCKS,
                                          hot_blocks_per_request=1, max_model_len=64))
    memory = HostTierMemory(_device_cache(device), HOST_BLOCKS)
    assert memory.pinned == (device == "cuda")
    hashes = [BlockHash(bytes([1, i])) for i in range(3)]
    allocation = tier.allocate("a", 12, block_hashes=hashes)
    assert allocation is not None
    pages = memory.device_cache.layer("resident").pages
    for page, block in enumerate(allocation.resident_blocks):
        pages[block].fill_(page + 1)  # the forward pass wrote page p's KV
    transfers = tier.plan_writebacks("a", 12)
    memory.run(transfers)
    tier.complete([t.transfer_id for t in transfers])
    host_pages = memory.host_cache.layer("resident").pages
    for page, block in enumerate(allocation.host_blocks):
        assert torch.all(host_pages[block] == page + 1)

    tier.free("a")
    assert tier.allocate("filler", 4 * (DEVICE_BLOCKS - 1)) is not None  # device copies reused
    tier.free("filler")
    hit = tier.lookup(hashes)
    assert hit == allocation.host_blocks
    assert tier.allocate("b", 12, hit=hit, block_hashes=hashes) is not None
    assert tier.residency("b").resident_row == (0, 0, 0)
    restore = tier.plan_restore("b", 2)
    assert restore is not None
    pages[restore.device_block].zero_()
    memory.run([restore])
    tier.complete([restore.transfer_id])
    assert torch.all(pages[tier.residency("b").resident_row[2]] == 3)


@pytest.mark.parametrize("device", DEVICES)
def test_row_mirrors_copy_just_the_rows_a_step_wrote(device: str) -> None:
    tier = HostTierManager(HostTierConfig(block_size=4, host_num_blocks=HOST_BLOCKS,
                                          device_num_blocks=DEVICE_BLOCKS,
                                          hot_blocks_per_request=1, max_model_len=64))
    memory = HostTierMemory(_device_cache(device), HOST_BLOCKS)
    allocation = tier.allocate("a", 8)
    assert allocation is not None
    device_layer = memory.device_cache.layer("resident")
    for block in allocation.resident_blocks:
        device_layer["key"][block].fill_(7.0)
        device_layer["value"][block].fill_(9.0)
    memory.mirror_rows(tier.row_mirrors("a", 2, 4))  # tokens 2..5: rows 2-3 and 0-1
    host = memory.host_cache.layer("resident")
    first, second = allocation.host_blocks
    assert host["key"][first, 2:].eq(7.0).all() and host["key"][first, :2].eq(0).all()
    assert host["value"][second, :2].eq(9.0).all() and host["value"][second, 2:].eq(0).all()
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        memory.mirror_rows([RowMirror(first * 4 + 3, second * 4 + 3, 2)])


def test_row_mirrors_copy_mla_latent_rows() -> None:
    # HiSparse serves sparse MLA models: their pages hold one latent row per token.
    spec = MLAAttentionSpec(4, 1, 8, "bfloat16")
    tier = HostTierManager(HostTierConfig(block_size=4, host_num_blocks=HOST_BLOCKS,
                                          device_num_blocks=DEVICE_BLOCKS,
                                          hot_blocks_per_request=1, max_model_len=64))
    memory = HostTierMemory(_device_cache("cpu", spec), HOST_BLOCKS)
    allocation = tier.allocate("a", 4)
    assert allocation is not None
    (block,), (host_block,) = allocation.resident_blocks, allocation.host_blocks
    memory.device_cache.layer("resident")["latent"][block].fill_(3.0)
    memory.mirror_rows(tier.row_mirrors("a", 1, 2))
    latent = memory.host_cache.layer("resident")["latent"][host_block]
    assert latent[1:3].eq(3.0).all() and latent[0].eq(0).all() and latent[3].eq(0).all()
