"""A catalogue of bad inputs, each tried on both implementations.

An engine integrator's mistakes, one row each: malformed constructor
arguments, malformed requests, token counts, prefix hits and block ids, calls
on unknown requests, misuse of the pool and of ``KVCacheBlocks``. Every row
must raise a typed error from :mod:`pagedkv.spec.errors` (never a bare
``TypeError``/``AttributeError``), of the same class in the reference and
the optimized implementation, whose message names the offending parameter,
and must leave the manager (and the requests it was handed) exactly as
before (spec/operations.md, "Error behaviour").

``python -m tests.test_bad_input`` prints the tally (untyped errors,
disagreements, state changes, silent acceptances).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pagedkv.spec import errors
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from pagedkv.spec.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.request import MMFeature, Request
from tests.implementations import IMPLEMENTATIONS

BLOCK_SIZE = 4
NUM_BLOCKS = 16
MAX_MODEL_LEN = 32


def full_config(num_groups: int = 1, num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    spec = FullAttentionSpec(BLOCK_SIZE, 1, 8, "float16")
    return KVCacheConfig(num_blocks, (), tuple(KVCacheGroupSpec((f"l{g}",), spec) for g in range(num_groups)))


def hybrid_config() -> KVCacheConfig:
    specs = (FullAttentionSpec(BLOCK_SIZE, 1, 8, "float16"), SlidingWindowSpec(BLOCK_SIZE, 1, 8, "float16", 8))
    return KVCacheConfig(NUM_BLOCKS, (), tuple(KVCacheGroupSpec((f"l{g}",), spec) for g, spec in enumerate(specs)))


def config_with(spec: Any) -> KVCacheConfig:
    """A one-group configuration around whatever ``spec`` is (possibly not a spec)."""
    return KVCacheConfig(NUM_BLOCKS, (), (KVCacheGroupSpec(("l0",), spec),))


class World:
    """One implementation in a known state: a running request ``run`` (10
    tokens, 2 cached blocks), the cached free blocks of a finished request,
    a waiting request ``wait`` whose prefix hits them, and a second manager
    ``nc`` with caching off and one running request."""

    def __init__(self, impl: str) -> None:
        self.impl = impl
        self.mod: ModuleType = IMPLEMENTATIONS[impl]
        self.m = self.mod.KVCacheManager(full_config(), MAX_MODEL_LEN)
        m = self.m
        old = m.make_request("old", [7] * 9)
        assert m.allocate_slots(old, 9) is not None
        old.num_computed_tokens = 9
        m.free(old)
        self.run = m.make_request("run", list(range(10)))
        assert m.allocate_slots(self.run, 10) is not None
        self.run.num_computed_tokens = 10
        self.wait = m.make_request("wait", [7] * 8 + [1, 2])
        self.done = m.make_request("done", [3] * 6)   # never allocated
        self.nc = self.mod.KVCacheManager(full_config(2), MAX_MODEL_LEN, enable_caching=False)
        self.nc_run = self.nc.make_request("nc_run", [1] * 6)
        assert self.nc.allocate_slots(self.nc_run, 6) is not None
        self.nc_run.num_computed_tokens = 6
        # Full attention beside a sliding window, caching on: the decode fast
        # path that probes each group (the single-group path is m's).
        self.hy = self.mod.KVCacheManager(hybrid_config(), MAX_MODEL_LEN)
        self.hy_run = self.hy.make_request("hy_run", list(range(10)))
        assert self.hy.allocate_slots(self.hy_run, 10) is not None
        self.hy_run.num_computed_tokens = 10
        self.requests = (self.run, self.wait, self.done, self.nc_run, self.hy_run)
        self.stale_hit: tuple[Any, int] = (None, 0)

    def state(self) -> Any:
        """Everything a refused call must leave alone."""
        return (self.m.snapshot(), self.nc.snapshot(), self.hy.snapshot(),
                [(r.request_id, list(r.all_token_ids), list(r.block_hashes), r.num_computed_tokens,
                  r.num_preemptions) for r in self.requests])

    def hit(self, *groups: list[int]) -> Any:
        """A hand-built ``KVCacheBlocks`` naming the given block ids, in this
        implementation's own representation."""
        if self.impl == "reference":
            pool = self.m.block_pool
            return self.mod.KVCacheBlocks(
                [[pool.blocks[i] if type(i) is int and 0 <= i < pool.num_blocks
                  else self.mod.KVCacheBlock(i) for i in group] for group in groups])
        return self.mod.KVCacheBlocks(tuple(list(group) for group in groups), self.m.block_pool.block_hashes)

    def blocks(self, num_groups: int) -> Any:
        """An empty ``KVCacheBlocks`` of ``num_groups`` groups."""
        return self.hit(*([] for _ in range(num_groups)))

    def real_hit(self) -> tuple[Any, int]:
        return self.m.get_computed_blocks(self.wait)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Case:
    """One bad input: what to call, the parameter the error must name, and
    the error class expected (a typed error of that class or a subclass)."""

    name: str
    param: str
    call: Callable[[World], object]
    expected: type[errors.PagedKVError] = errors.InvalidArgumentError
    prepare: Callable[[World], None] | None = None


def _fake_request(**attrs: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(request_id="fake", all_token_ids=[1, 2, 3], num_tokens=3, num_prompt_tokens=3,
                                num_computed_tokens=0, block_hashes=[], num_preemptions=0, lora_id=None,
                                lora_name=None, cache_salt=None, mm_features=(), skip_reading_prefix_cache=False)
    base.update(attrs)
    return SimpleNamespace(**base)


class _ForeignBlocks:
    """Not a KVCacheBlocks, but has ``get_block_ids``."""

    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([1, 2],)


def _alloc_new(w: World, n: Any = 1, *args: Any, **kwargs: Any) -> object:
    return w.m.allocate_slots(w.wait, n, *args, **kwargs)


def _make_stale(w: World) -> None:
    hit, n = w.real_hit()
    w.m.evict_blocks(hit.get_block_ids()[0][:1])   # legal on its own; makes the hit stale
    w.stale_hit = (hit, n)


def _new_copy(w: World, **attrs: Any) -> SimpleNamespace:
    """A view of the never-allocated request ``done`` with some attributes replaced."""
    return _fake_request(request_id="done", all_token_ids=list(w.done.all_token_ids), num_tokens=w.done.num_tokens,
                         num_prompt_tokens=w.done.num_prompt_tokens, block_hashes=list(w.done.block_hashes),
                         **attrs)


def _known_copy(w: World, manager: str, **attrs: Any) -> SimpleNamespace:
    """A view of the running request of manager ``m``, ``nc`` or ``hy``
    (10 tokens, all computed) with some attributes replaced: a decode step of
    it takes that manager's decode fast path when well formed."""
    request = {"m": w.run, "nc": w.nc_run, "hy": w.hy_run}[manager]
    base: dict[str, Any] = dict(
        request_id=request.request_id, all_token_ids=list(request.all_token_ids), num_tokens=request.num_tokens,
        num_prompt_tokens=request.num_prompt_tokens, num_computed_tokens=request.num_computed_tokens,
        block_hashes=list(request.block_hashes))
    base.update(attrs)
    return _fake_request(**base)


def _decode(manager: str, **attrs: Any) -> Callable[[World], object]:
    """``allocate_slots(known request, 1)`` on manager ``manager`` with the
    request's attributes replaced: the no-op decode fast path for a well-formed request."""
    def call(w: World) -> object:
        return getattr(w, manager).allocate_slots(_known_copy(w, manager, **attrs), 1)
    return call


class _ZeroTokens(Request):
    """pagedkv's Request with a broken count: a subclass is read like any
    foreign request on the decode fast path (only the exact class is trusted)."""

    __slots__ = ()

    @property
    def num_tokens(self) -> int:
        return 0


def _zero_tokens_run(w: World) -> object:
    request = _ZeroTokens("run", list(w.run.all_token_ids), block_hasher=None)
    request.num_computed_tokens = w.run.num_computed_tokens
    return w.m.allocate_slots(request, 1)


def _ctor(config: Any = None, max_model_len: Any = MAX_MODEL_LEN, **kwargs: Any) -> Callable[[World], object]:
    """A constructor call; ``config`` may be a thunk (built inside the call,
    so that a malformed configuration is refused there)."""
    def call(w: World) -> object:
        built = full_config() if config is None else config() if callable(config) else config
        return w.mod.KVCacheManager(built, max_model_len, **kwargs)
    return call


def _make(*args: Any, **kwargs: Any) -> Callable[[World], object]:
    return lambda w: w.m.make_request(*args, **kwargs)


def _append(tokens: Any) -> Callable[[World], object]:
    return lambda w: w.run.append_output_token_ids(tokens)


def _evict(block_ids: Any) -> Callable[[World], object]:
    return lambda w: w.m.evict_blocks(block_ids)


E = errors
CONFIG, TOKENS = E.InvalidConfigError, E.InvalidTokenCountError
UNKNOWN, BLOCK = E.UnknownRequestError, E.UnknownBlockError

CASES: list[Case] = [
    # --- constructor -------------------------------------------------------------------------
    Case("ctor_config_dict", "kv_cache_config", _ctor({"num_blocks": 4}), CONFIG),
    Case("ctor_config_none", "kv_cache_config", lambda w: w.mod.KVCacheManager(None, MAX_MODEL_LEN), CONFIG),
    Case("ctor_config_str", "kv_cache_config", _ctor("config"), CONFIG),
    Case("ctor_max_model_len_zero", "max_model_len", _ctor(max_model_len=0), CONFIG),
    Case("ctor_max_model_len_negative", "max_model_len", _ctor(max_model_len=-3), CONFIG),
    Case("ctor_max_model_len_float", "max_model_len", _ctor(max_model_len=8.5), CONFIG),
    Case("ctor_max_model_len_str", "max_model_len", _ctor(max_model_len="32"), CONFIG),
    Case("ctor_max_model_len_none", "max_model_len", _ctor(max_model_len=None), CONFIG),
    Case("ctor_max_model_len_bool", "max_model_len", _ctor(max_model_len=True), CONFIG),
    Case("ctor_dcp_zero", "dcp_world_size", _ctor(dcp_world_size=0), CONFIG),
    Case("ctor_dcp_float", "dcp_world_size", _ctor(dcp_world_size=1.0), CONFIG),
    Case("ctor_pcp_zero", "pcp_world_size", _ctor(pcp_world_size=0), CONFIG),
    Case("ctor_pcp_none", "pcp_world_size", _ctor(pcp_world_size=None), CONFIG),
    Case("ctor_hash_fn_unknown", "hash_fn", _ctor(hash_fn="md5")),
    Case("ctor_hash_fn_none", "hash_fn", _ctor(hash_fn=None)),
    Case("ctor_hash_fn_int", "hash_fn", _ctor(hash_fn=3)),
    Case("ctor_hash_fn_unhashable", "hash_fn", _ctor(hash_fn=["sha256"])),
    Case("ctor_hash_block_size_zero", "hash_block_size", _ctor(hash_block_size=0), CONFIG),
    Case("ctor_hash_block_size_not_divisor", "hash_block_size", _ctor(hash_block_size=3), CONFIG),
    Case("ctor_hash_block_size_float", "hash_block_size", _ctor(hash_block_size=2.0), CONFIG),
    Case("ctor_hash_block_size_str", "hash_block_size", _ctor(hash_block_size="4"), CONFIG),
    Case("ctor_retention_negative", "retention_interval", _ctor(retention_interval=-4), CONFIG),
    Case("ctor_retention_not_multiple", "retention_interval", _ctor(retention_interval=3), CONFIG),
    Case("ctor_retention_float", "retention_interval", _ctor(retention_interval=4.0), CONFIG),
    Case("ctor_batched_tokens_zero", "max_num_batched_tokens", _ctor(max_num_batched_tokens=0), CONFIG),
    Case("ctor_batched_tokens_float", "max_num_batched_tokens", _ctor(max_num_batched_tokens=8.0), CONFIG),
    Case("ctor_group_spec_str", "kv_cache_spec", _ctor(lambda: config_with("full")), CONFIG),
    Case("ctor_group_spec_none", "kv_cache_spec", _ctor(lambda: config_with(None)), CONFIG),
    Case("ctor_group_not_group_spec", "kv_cache_groups[0]",
         _ctor(lambda: KVCacheConfig(NUM_BLOCKS, (), ("l0",))), CONFIG),  # type: ignore[arg-type]
    Case("ctor_cp_sliding_window", "kv_cache_groups[0]",
         _ctor(lambda: config_with(SlidingWindowSpec(4, 1, 8, "float16", sliding_window=8)), dcp_world_size=2),
         CONFIG),
    Case("ctor_sink_len_not_multiple", "sink_len",
         _ctor(lambda: config_with(SinkFullAttentionSpec(4, 1, 8, "float16", sink_len=3))), CONFIG),
    Case("ctor_sink_len_too_many_blocks", "sink_len",
         _ctor(lambda: KVCacheConfig(3, (), (KVCacheGroupSpec(("l0",), SinkFullAttentionSpec(
             4, 1, 8, "float16", sink_len=16)),))), CONFIG),
    Case("ctor_hash_seed_int", "hash_seed", _ctor(hash_seed=5), CONFIG),
    Case("ctor_block_stored_events_unknown", "block_stored_events", _ctor(block_stored_events="per-step"), CONFIG),
    Case("ctor_block_stored_events_bool", "block_stored_events", _ctor(block_stored_events=True), CONFIG),
    # --- specs and configuration values (shared vocabulary) --------------------------------------
    Case("spec_block_size_zero", "block_size", lambda w: FullAttentionSpec(0, 1, 8, "float16"), CONFIG),
    Case("spec_block_size_float", "block_size", lambda w: FullAttentionSpec(2.0, 1, 8, "float16"), CONFIG),  # type: ignore[arg-type]
    Case("spec_num_kv_heads_zero", "num_kv_heads", lambda w: FullAttentionSpec(4, 0, 8, "float16"), CONFIG),
    Case("spec_head_size_negative", "head_size", lambda w: FullAttentionSpec(4, 1, -8, "float16"), CONFIG),
    Case("spec_dtype_unknown", "dtype", lambda w: FullAttentionSpec(4, 1, 8, "float99"), CONFIG),
    Case("spec_window_zero", "sliding_window",
         lambda w: SlidingWindowSpec(4, 1, 8, "float16", sliding_window=0), CONFIG),
    Case("spec_chunk_zero", "attention_chunk_size",
         lambda w: ChunkedLocalAttentionSpec(4, 1, 8, "float16", attention_chunk_size=0), CONFIG),
    Case("spec_mamba_mode", "mamba_cache_mode",
         lambda w: MambaSpec(4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="some"), CONFIG),
    Case("config_num_blocks_zero", "num_blocks", lambda w: KVCacheConfig(0, (), ()), CONFIG),
    Case("config_num_blocks_float", "num_blocks", lambda w: KVCacheConfig(4.0, (), ()), CONFIG),  # type: ignore[arg-type]
    Case("config_tensor_size_zero", "size", lambda w: KVCacheTensor(0, ("l0",)), CONFIG),
    # --- make_request ------------------------------------------------------------------------
    Case("request_id_none", "request_id", _make(None, [1])),
    Case("request_id_empty", "request_id", _make("", [1])),
    Case("request_id_int", "request_id", _make(5, [1])),
    Case("request_id_bytes", "request_id", _make(b"r", [1])),
    Case("request_id_duplicate_live", "request_id", _make("run", [1, 2])),
    Case("prompt_none", "prompt_token_ids", _make("x", None)),
    Case("prompt_empty", "prompt_token_ids", _make("x", [])),
    Case("prompt_int", "prompt_token_ids", _make("x", 5)),
    Case("prompt_negative", "prompt_token_ids", _make("x", [1, -1])),
    Case("prompt_float", "prompt_token_ids", _make("x", [1, 1.5])),
    Case("prompt_str_token", "prompt_token_ids", _make("x", ["a"])),
    Case("prompt_str", "prompt_token_ids", _make("x", "abc")),
    Case("prompt_bool", "prompt_token_ids", _make("x", [True])),
    Case("prompt_none_token", "prompt_token_ids", _make("x", [None])),
    Case("prompt_numpy_float", "prompt_token_ids", _make("x", [np.float32(1.0)])),
    Case("lora_id_negative", "lora_id", _make("x", [1], lora_id=-1)),
    Case("lora_id_str", "lora_id", _make("x", [1], lora_id="a")),
    Case("lora_id_float", "lora_id", _make("x", [1], lora_id=1.0)),
    Case("lora_name_int", "lora_name", _make("x", [1], lora_name=3)),
    Case("cache_salt_int", "cache_salt", _make("x", [1], cache_salt=3)),
    Case("mm_overlapping", "mm_features",
         _make("x", [1] * 8, mm_features=(MMFeature("a", 0, 4), MMFeature("b", 2, 2)))),
    Case("mm_beyond_prompt", "mm_features", _make("x", [1] * 4, mm_features=(MMFeature("a", 2, 4),))),
    Case("mm_zero_length", "mm_features", _make("x", [1] * 4, mm_features=(MMFeature("a", 1, 0),))),
    Case("mm_negative_offset", "mm_features", _make("x", [1] * 4, mm_features=(MMFeature("a", -1, 2),))),
    Case("mm_not_feature", "mm_features", _make("x", [1] * 4, mm_features=((0, 2),))),
    Case("mm_none", "mm_features", _make("x", [1] * 4, mm_features=None)),
    Case("mm_identifier_int", "mm_features", _make("x", [1] * 4, mm_features=(MMFeature(7, 0, 2),))),  # type: ignore[arg-type]
    Case("skip_reading_not_bool", "skip_reading_prefix_cache", _make("x", [1], skip_reading_prefix_cache="no")),
    Case("request_unknown_keyword", "colour", _make("x", [1], colour="blue")),
    # --- Request.append_output_token_ids -------------------------------------------------------
    Case("append_float", "output token ids", _append(1.5)),
    Case("append_numpy_int", "output token ids", _append(np.int64(3))),
    Case("append_bool", "output token ids", _append(True)),
    Case("append_none", "output token ids", _append(None)),
    Case("append_str", "output token ids", _append("a")),
    Case("append_negative", "output token ids", _append(-1)),
    Case("append_list_float", "output token ids", _append([1, 1.5])),
    Case("append_list_none", "output token ids", _append([None])),
    Case("append_list_bool", "output token ids", _append([1, False])),
    Case("append_object", "output token ids", _append(object())),
    # --- allocate_slots: counts ----------------------------------------------------------------
    Case("alloc_new_zero", "num_new_tokens", lambda w: _alloc_new(w, 0), TOKENS),
    Case("alloc_new_negative", "num_new_tokens", lambda w: _alloc_new(w, -2), TOKENS),
    Case("alloc_new_float", "num_new_tokens", lambda w: _alloc_new(w, 1.5), TOKENS),
    Case("alloc_new_str", "num_new_tokens", lambda w: _alloc_new(w, "1"), TOKENS),
    Case("alloc_new_none", "num_new_tokens", lambda w: _alloc_new(w, None), TOKENS),
    Case("alloc_new_bool", "num_new_tokens", lambda w: _alloc_new(w, True), TOKENS),
    Case("alloc_decode_float", "num_new_tokens", lambda w: w.m.allocate_slots(w.run, 1.0), TOKENS),
    Case("alloc_computed_negative", "num_new_computed_tokens",
         lambda w: _alloc_new(w, 1, num_new_computed_tokens=-4), TOKENS),
    Case("alloc_computed_float", "num_new_computed_tokens",
         lambda w: _alloc_new(w, 1, num_new_computed_tokens=4.0), TOKENS),
    Case("alloc_lookahead_negative", "num_lookahead_tokens",
         lambda w: _alloc_new(w, 1, num_lookahead_tokens=-1), TOKENS),
    Case("alloc_lookahead_float", "num_lookahead_tokens",
         lambda w: _alloc_new(w, 1, num_lookahead_tokens=0.5), TOKENS),
    Case("alloc_lookahead_none", "num_lookahead_tokens",
         lambda w: _alloc_new(w, 1, num_lookahead_tokens=None), TOKENS),
    Case("alloc_decode_lookahead_none", "num_lookahead_tokens",
         lambda w: w.m.allocate_slots(w.run, 1, num_lookahead_tokens=None), TOKENS),
    Case("alloc_external_negative", "num_external_computed_tokens",
         lambda w: _alloc_new(w, 1, num_external_computed_tokens=-1), TOKENS),
    Case("alloc_external_str", "num_external_computed_tokens",
         lambda w: _alloc_new(w, 1, num_external_computed_tokens="1"), TOKENS),
    Case("alloc_encoder_negative", "num_encoder_tokens",
         lambda w: _alloc_new(w, 1, num_encoder_tokens=-1), TOKENS),
    # The watermark (D-API-48): checked after reserved_blocks, before num_in_flight_tokens (1b),
    # on the admission step, the general path and a decode step alike.
    Case("alloc_watermark_negative", "watermark_blocks",
         lambda w: _alloc_new(w, 1, watermark_blocks=-1), TOKENS),
    Case("alloc_watermark_float", "watermark_blocks",
         lambda w: _alloc_new(w, 1, watermark_blocks=2.0, full_sequence_must_fit=True), TOKENS),
    Case("alloc_decode_watermark_bool", "watermark_blocks",
         lambda w: w.m.allocate_slots(w.run, 1, watermark_blocks=True), TOKENS),
    Case("alloc_reserved_before_watermark", "reserved_blocks",
         lambda w: _alloc_new(w, 1, reserved_blocks=-1, watermark_blocks=-1), TOKENS),
    Case("alloc_watermark_before_in_flight", "watermark_blocks",
         lambda w: _alloc_new(w, 1, watermark_blocks=None, num_in_flight_tokens=-1), TOKENS),
    Case("alloc_computed_attr_negative", "num_computed_tokens",
         lambda w: w.m.allocate_slots(_new_copy(w, num_computed_tokens=-1), 1), TOKENS),
    Case("alloc_computed_attr_float", "num_computed_tokens",
         lambda w: w.m.allocate_slots(_new_copy(w, num_computed_tokens=1.5), 1), TOKENS),
    Case("alloc_computed_attr_none", "num_computed_tokens",
         lambda w: w.m.allocate_slots(_new_copy(w, num_computed_tokens=None), 1), TOKENS),
    Case("alloc_stale_computed_unknown", "num_computed_tokens",
         lambda w: w.m.allocate_slots(_new_copy(w, num_computed_tokens=4), 1)),
    Case("alloc_exceeds_max_model_len", "max_model_len",
         lambda w: _alloc_new(w, MAX_MODEL_LEN + 1), E.ExceedsMaxModelLenError),
    Case("alloc_hit_exceeds_max_model_len", "max_model_len",
         lambda w: _alloc_new(w, MAX_MODEL_LEN - 4, 8, w.real_hit()[0]), E.ExceedsMaxModelLenError),
    Case("alloc_external_exceeds_max_model_len", "max_model_len",
         lambda w: _alloc_new(w, MAX_MODEL_LEN - 2, num_external_computed_tokens=4), E.ExceedsMaxModelLenError),
    Case("alloc_every_count_negative", "num_new_computed_tokens",
         lambda w: w.m.allocate_slots(_new_copy(w, num_computed_tokens=-1), 1, -1, None, -1, -1,
                                      num_encoder_tokens=-1, reserved_blocks=-1, num_in_flight_tokens=-1), TOKENS),
    Case("alloc_decode_exceeds_max_model_len", "max_model_len",
         lambda w: w.m.allocate_slots(w.run, MAX_MODEL_LEN), E.ExceedsMaxModelLenError),
    # --- allocate_slots: the request object ------------------------------------------------------
    Case("alloc_request_none", "request", lambda w: w.m.allocate_slots(None, 1)),
    Case("alloc_request_id_int", "request_id", lambda w: w.m.allocate_slots(_fake_request(request_id=5), 1)),
    Case("alloc_request_id_unhashable", "request_id",
         lambda w: w.m.allocate_slots(_fake_request(request_id=["a"]), 1)),
    Case("alloc_request_num_tokens_none", "num_tokens",
         lambda w: w.m.allocate_slots(_fake_request(num_tokens=None), 1)),
    # --- allocate_slots: a known request's own counts on the decode fast paths ------------------
    # (one group, several groups without and with caching: each must refuse what the general path
    # refuses, 1b and 1b′, though a well-formed step there changes nothing)
    *(Case(f"decode_{manager}_num_tokens_{label}", "num_tokens", _decode(manager, num_tokens=value), TOKENS)
      for manager in ("m", "nc", "hy")
      for label, value in (("none", None), ("zero", 0), ("negative", -1), ("float", 11.0), ("str", "11"),
                           ("bool", True))),
    *(Case(f"decode_{manager}_computed_{label}", "num_computed_tokens",
           _decode(manager, num_computed_tokens=value), TOKENS)
      for manager in ("m", "nc", "hy") for label, value in (("negative", -1), ("float", 10.0))),
    Case("decode_m_request_subclass_num_tokens_zero", "num_tokens", _zero_tokens_run, TOKENS),
    # --- allocate_slots: prefix hits -------------------------------------------------------------
    Case("hit_known_request", "new_computed_blocks",
         lambda w: w.m.allocate_slots(w.run, 1, BLOCK_SIZE, w.real_hit()[0].new_empty() + w.hit([1]))),
    Case("hit_list", "new_computed_blocks", lambda w: _alloc_new(w, 2, 8, [[1, 2]])),
    Case("hit_dict", "new_computed_blocks", lambda w: _alloc_new(w, 2, 0, {})),
    Case("hit_str", "new_computed_blocks", lambda w: _alloc_new(w, 2, 0, "blocks")),
    Case("hit_int", "new_computed_blocks", lambda w: _alloc_new(w, 2, 0, 5)),
    Case("hit_foreign_object", "new_computed_blocks", lambda w: _alloc_new(w, 2, 8, _ForeignBlocks())),
    Case("hit_wrong_group_count", "new_computed_blocks", lambda w: _alloc_new(w, 2, 0, w.blocks(2))),
    Case("hit_count_mismatch", "num_new_computed_tokens",
         lambda w: _alloc_new(w, 2, 4, w.real_hit()[0])),
    Case("hit_tokens_without_blocks", "num_new_computed_tokens", lambda w: _alloc_new(w, 2, 4)),
    Case("hit_null_block", "new_computed_blocks", lambda w: _alloc_new(w, 2, 4, w.hit([0]))),
    Case("hit_block_out_of_range", "new_computed_blocks", lambda w: _alloc_new(w, 2, 4, w.hit([999])), BLOCK),
    Case("hit_block_negative", "new_computed_blocks", lambda w: _alloc_new(w, 2, 4, w.hit([-1])), BLOCK),
    Case("hit_block_float", "new_computed_blocks", lambda w: _alloc_new(w, 2, 4, w.hit([1.0])), BLOCK),  # type: ignore[list-item]
    Case("hit_stale_evicted", "new_computed_blocks",
         lambda w: w.m.allocate_slots(w.wait, 2, w.stale_hit[1], w.stale_hit[0]), prepare=_make_stale),
    Case("hit_wrong_position", "new_computed_blocks",
         lambda w: _alloc_new(w, 2, 8, w.hit(list(reversed(w.real_hit()[0].get_block_ids()[0]))))),
    # The real hit with one id in a form the optimized whole-list check must not pass (the hash
    # lookup itself would accept it), and a stale block before an id outside the pool (1h first).
    Case("hit_block_numpy_int", "new_computed_blocks",
         lambda w: _alloc_new(w, 2, 8, w.hit([np.int64(b) for b in w.real_hit()[0].get_block_ids()[0]])),  # type: ignore[misc]
         BLOCK),
    Case("hit_block_bool", "new_computed_blocks",
         lambda w: _alloc_new(w, 2, 8, w.hit([True] + w.real_hit()[0].get_block_ids()[0][1:])), BLOCK),
    Case("hit_stale_then_out_of_range", "new_computed_blocks",
         lambda w: _alloc_new(w, 2, 8, w.hit(list(reversed(w.real_hit()[0].get_block_ids()[0]))[:1] + [999])),
         BLOCK),
    Case("hit_block_in_use_uncached", "new_computed_blocks",
         lambda w: _alloc_new(w, 2, 4, w.hit([w.m.get_block_ids("run")[0][2]]))),
    Case("hit_caching_disabled", "caching",
         lambda w: w.nc.allocate_slots(w.nc.make_request("y", [1] * 6), 2, 4, w.nc.get_blocks("nc_run"))),
    # --- cache_blocks, free ----------------------------------------------------------------------
    Case("cache_unknown", "wait", lambda w: w.m.cache_blocks(w.wait, 4), UNKNOWN),
    Case("cache_negative", "num_computed_tokens", lambda w: w.m.cache_blocks(w.run, -1), TOKENS),
    Case("cache_float", "num_computed_tokens", lambda w: w.m.cache_blocks(w.run, 4.0), TOKENS),
    Case("cache_none", "num_computed_tokens", lambda w: w.m.cache_blocks(w.run, None), TOKENS),
    Case("cache_beyond_held", "num_computed_tokens", lambda w: w.m.cache_blocks(w.run, 40)),
    Case("cache_request_none", "request", lambda w: w.m.cache_blocks(None, 4)),
    Case("free_unknown", "wait", lambda w: w.m.free(w.wait), UNKNOWN),
    Case("free_none", "request", lambda w: w.m.free(None)),
    Case("free_unhashable_id", "request_id", lambda w: w.m.free(_fake_request(request_id=["a"]))),
    # --- evict_blocks ----------------------------------------------------------------------------
    Case("evict_none", "block_ids", _evict(None)),
    Case("evict_int", "block_ids", _evict(5)),
    Case("evict_str", "block id", _evict("12"), BLOCK),
    Case("evict_out_of_range", "999", _evict([1, 999]), BLOCK),
    Case("evict_negative", "-1", _evict([-1]), BLOCK),
    Case("evict_float", "1.0", _evict([1.0]), BLOCK),
    Case("evict_str_id", "'a'", _evict(["a"]), BLOCK),
    Case("evict_none_id", "None", _evict([None]), BLOCK),
    Case("evict_bool_id", "True", _evict([True]), BLOCK),
    Case("evict_numpy_array", "block id", _evict(np.array([[1, 2]])), BLOCK),
    # --- per-request queries ---------------------------------------------------------------------
    Case("block_ids_unknown", "nope", lambda w: w.m.get_block_ids("nope"), UNKNOWN),
    Case("block_ids_unhashable", "request_id", lambda w: w.m.get_block_ids(["run"])),
    Case("blocks_unknown", "nope", lambda w: w.m.get_blocks("nope"), UNKNOWN),
    Case("blocks_unhashable", "request_id", lambda w: w.m.get_blocks({})),
    Case("common_prefix_unknown", "nope", lambda w: w.m.get_num_common_prefix_blocks("nope"), UNKNOWN),
    Case("common_prefix_unhashable", "request_id", lambda w: w.m.get_num_common_prefix_blocks(["run"])),
    Case("computed_blocks_none", "request", lambda w: w.m.get_computed_blocks(None)),
    # --- the pool and KVCacheBlocks --------------------------------------------------------------
    Case("pool_new_float", "num_blocks", lambda w: w.m.block_pool.get_new_blocks(1.5)),
    Case("pool_new_negative", "num_blocks", lambda w: w.m.block_pool.get_new_blocks(-1)),
    Case("pool_new_str", "num_blocks", lambda w: w.m.block_pool.get_new_blocks("1")),
    Case("pool_new_none", "num_blocks", lambda w: w.m.block_pool.get_new_blocks(None)),
    Case("pool_new_too_many", "100", lambda w: w.m.block_pool.get_new_blocks(100), E.PoolExhaustedError),
    Case("pool_evict_out_of_range", "16", lambda w: w.m.block_pool.evict_blocks([16]), BLOCK),
    Case("blocks_add_group_mismatch", "groups", lambda w: w.blocks(1) + w.blocks(2)),
    Case("blocks_add_not_blocks", "other", lambda w: w.blocks(1) + 5),
    Case("blocks_unhashed_two_groups", "group", lambda w: w.blocks(2).get_unhashed_block_ids()),
]

#: Rows that still fail on this branch, with why (removed as the fixes land).
KNOWN_FAILING: dict[str, str] = {
}


@dataclass
class Outcome:
    """What one implementation did with one row."""

    kind: str          # "typed", "untyped", "accepted"
    error: BaseException | None
    changed: bool


def _changed(world: World, before: Any) -> bool:
    try:
        return bool(world.state() != before)
    except Exception:  # noqa: BLE001 - a state that cannot even be observed has changed
        return True


def run_case(case: Case, impl: str) -> Outcome:
    world = World(impl)
    if case.prepare is not None:
        case.prepare(world)
    before = world.state()
    try:
        case.call(world)
    except errors.PagedKVError as error:
        return Outcome("typed", error, _changed(world, before))
    except Exception as error:  # noqa: BLE001 - untyped errors are what this catalogue hunts
        return Outcome("untyped", error, _changed(world, before))
    return Outcome("accepted", None, _changed(world, before))


def test_catalogue_is_large_enough() -> None:
    names = [case.name for case in CASES]
    assert len(names) == len(set(names)), "duplicate case names"
    assert len(CASES) >= 110


@pytest.mark.parametrize(
    "case", [pytest.param(case, id=case.name, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_FAILING[case.name])]
                          if case.name in KNOWN_FAILING else []) for case in CASES])
def test_bad_input_is_refused_alike(case: Case) -> None:
    outcomes = {impl: run_case(case, impl) for impl in IMPLEMENTATIONS}
    for impl, outcome in outcomes.items():
        assert outcome.kind == "typed", f"{impl}: {outcome.kind} {outcome.error!r}"
        assert isinstance(outcome.error, case.expected), f"{impl}: {outcome.error!r}, expected {case.expected.__name__}"
        assert case.param.lower() in str(outcome.error).lower(), (
            f"{impl}: message does not name {case.param!r}: {outcome.error}")
        assert not outcome.changed, f"{impl}: the refused call changed the state"
    classes = {impl: type(outcome.error) for impl, outcome in outcomes.items()}
    assert len(set(classes.values())) == 1, f"implementations disagree: {classes}"


def tally() -> dict[str, list[str]]:
    """Rows per failure kind (a row may appear under several)."""
    found: dict[str, list[str]] = {"untyped": [], "accepted": [], "state_changed": [], "disagree": [],
                                   "wrong_class": [], "unnamed_param": []}
    for case in CASES:
        outcomes = {impl: run_case(case, impl) for impl in IMPLEMENTATIONS}
        for impl, outcome in outcomes.items():
            tag = f"{case.name}[{impl}]"
            if outcome.kind != "typed":
                found[outcome.kind].append(f"{tag}: {outcome.error!r}")
            elif not isinstance(outcome.error, case.expected):
                found["wrong_class"].append(f"{tag}: {outcome.error!r}")
            elif case.param.lower() not in str(outcome.error).lower():
                found["unnamed_param"].append(f"{tag}: {outcome.error}")
            if outcome.changed:
                found["state_changed"].append(tag)
        kinds = {(o.kind, type(o.error).__name__) for o in outcomes.values()}
        if len(kinds) > 1:
            found["disagree"].append(f"{case.name}: {sorted(kinds)}")
    return found


if __name__ == "__main__":
    result = tally()
    print(f"{len(CASES)} rows x {len(IMPLEMENTATIONS)} implementations")
    for kind, rows in result.items():
        print(f"{kind}: {len(rows)}")
        for row in rows:
            print("   ", row)
    sys.exit(1 if any(result.values()) else 0)
