"""The lockstep machine: reference and optimized driven by the same calls.

Hypothesis plays an engine's scheduler against both implementations at once:
requests with shared prefixes (a tiny token alphabet, so full hits, partial
hits and duplicate blocks happen), chunked prefill with prefix hits and
external tokens, decode with lookahead, delayed caching, preemption,
eviction, prefix-cache resets, events and statistics, pool exhaustion, and
misuse. After every step both implementations must have returned the same
thing (or raised the same typed error, leaving their state unchanged) and
must expose equal snapshots; the reference's ``check_invariants()`` holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv.optimized as optimized
import pagedkv.reference as reference
from pagedkv.reference.mamba import MambaManager
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MMFeature, PagedKVError
from pagedkv.spec.request import Request
from pagedkv.spec.types import make_block_hash_with_group_id

ALPHABET = st.integers(0, 2)


def normalize(result: Any) -> Any:
    """A comparable value for whatever a manager call returned."""
    if result is None or isinstance(result, (bool, int, float, str)):
        return result
    if hasattr(result, "get_block_ids"):
        return ("blocks", result.get_block_ids())
    if isinstance(result, tuple):
        return tuple(normalize(item) for item in result)
    if isinstance(result, list):
        return [normalize(item) for item in result]
    return result


@dataclass
class Pair:
    """One logical request, as each implementation's own Request object."""

    ref: Request
    opt: Request
    known: bool = False
    finished: bool = False

    def set_computed(self, value: int) -> None:
        self.ref.num_computed_tokens = value
        self.opt.num_computed_tokens = value


class Lockstep(RuleBasedStateMachine):
    """Drives ``pagedkv.reference`` and ``pagedkv.optimized`` in lockstep;
    subclasses choose the configurations (one ``@initialize`` each)."""

    encoder_tokens = 0

    def __init__(self) -> None:
        super().__init__()
        self.pairs: dict[str, Pair] = {}
        self.next_id = 0
        self.steps = 0

    def build(self, config: KVCacheConfig, max_model_len: int, prefixes: list[list[int]],
              **kwargs: Any) -> None:
        """Both managers on the same configuration."""
        self.ref = reference.KVCacheManager(config, max_model_len, **kwargs)
        self.opt = optimized.KVCacheManager(config, max_model_len, **kwargs)
        self.max_model_len = max_model_len
        self.num_blocks = config.num_blocks
        self.prefixes = prefixes

    # -- the comparison core ---------------------------------------------------

    def both(self, call: Callable[[Any], Any]) -> tuple[Any, Any]:
        """Run ``call`` on both managers; same result or same typed error."""
        before = self.ref.snapshot()
        before_opt = self.opt.snapshot()
        outcomes = []
        for manager in (self.ref, self.opt):
            try:
                outcomes.append(("ok", call(manager)))
            except PagedKVError as error:
                outcomes.append(("error", error))
        (ref_kind, ref_value), (opt_kind, opt_value) = outcomes
        assert ref_kind == opt_kind, f"reference {ref_kind} {ref_value!r} vs optimized {opt_kind} {opt_value!r}"
        if ref_kind == "error":
            assert type(ref_value) is type(opt_value), f"{ref_value!r} vs {opt_value!r}"
            assert self.ref.snapshot() == before, "the reference changed state on a refused call"
            assert self.opt.snapshot() == before_opt, "the optimized changed state on a refused call"
            return ref_value, opt_value
        assert normalize(ref_value) == normalize(opt_value), f"{normalize(ref_value)} != {normalize(opt_value)}"
        return ref_value, opt_value

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "ref"):
            return
        self.steps += 1
        ref_state, opt_state = self.ref.snapshot(), self.opt.snapshot()
        assert ref_state == opt_state, _diff(ref_state, opt_state)
        assert self.ref.usage == self.opt.usage
        assert self.ref.block_pool.get_num_free_blocks() == self.opt.block_pool.get_num_free_blocks()
        self.ref.check_invariants()
        self.check_position_keys()

    def check_position_keys(self) -> None:
        """REQ-7: a hashed block a request holds carries the key of its own
        position (the request's hash there, in the group's view)."""
        coordinator = self.ref.coordinator
        for pair in self.pairs.values():
            if not pair.known:
                continue
            for manager in coordinator.managers:
                if isinstance(manager, MambaManager):
                    continue  # state blocks move between positions (align mode)
                view = coordinator.view(manager, pair.ref.block_hashes)
                for index, block in enumerate(manager.req_to_blocks[pair.ref.request_id]):
                    if block.block_hash is not None:
                        assert block.block_hash == make_block_hash_with_group_id(view[index], manager.group_id), (
                            f"REQ-7: request {pair.ref.request_id} group {manager.group_id} position {index}")

    # -- requests ----------------------------------------------------------------

    def new_request(self, data: st.DataObject) -> None:
        prefix = data.draw(st.sampled_from(self.prefixes))
        cut = data.draw(st.integers(0, len(prefix)))
        tail = data.draw(st.lists(ALPHABET, max_size=12))
        tokens = (prefix[:cut] + tail)[: self.max_model_len - 1] or [0]
        extra: dict[str, Any] = {}
        if data.draw(st.integers(0, 9)) == 0:
            extra["lora_name"] = data.draw(st.sampled_from(["adapter-a", "adapter-b"]))
        if data.draw(st.integers(0, 9)) == 0:
            extra["cache_salt"] = "salt"
        if data.draw(st.integers(0, 9)) == 0 and len(tokens) >= 2:
            offset = data.draw(st.integers(0, len(tokens) - 2))
            length = data.draw(st.integers(1, len(tokens) - offset))
            extra["mm_features"] = (MMFeature(data.draw(st.sampled_from(["img0", "img1"])), offset, length),)
        request_id = f"r{self.next_id}"
        self.next_id += 1
        pair = Pair(self.ref.make_request(request_id, tokens, **extra),
                    self.opt.make_request(request_id, tokens, **extra))
        assert pair.ref.block_hashes == pair.opt.block_hashes
        self.pairs[request_id] = pair

    def waiting(self) -> list[str]:
        return sorted(rid for rid, pair in self.pairs.items() if not pair.known and not pair.finished)

    def running(self) -> list[str]:
        return sorted(rid for rid, pair in self.pairs.items() if pair.known)

    def admit(self, data: st.DataObject) -> None:
        """A waiting request: look up its prefix hit, then allocate its first chunk."""
        lookahead, delay = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 4)) == 0
        whole = data.draw(st.integers(0, 3)) == 0
        pair = self.pairs[data.draw(st.sampled_from(self.waiting()))]
        (ref_hit, ref_n), (opt_hit, opt_n) = self.both(lambda m: m.get_computed_blocks(
            pair.ref if m is self.ref else pair.opt))
        remaining = pair.ref.num_tokens - ref_n
        external = data.draw(st.integers(0, max(0, remaining - 1))) if data.draw(st.booleans()) else 0
        chunk = data.draw(st.integers(1, remaining - external))
        ref_out, _ = self.both(lambda m: m.allocate_slots(
            pair.ref if m is self.ref else pair.opt, chunk, ref_n,
            ref_hit if m is self.ref else opt_hit, num_lookahead_tokens=lookahead,
            num_external_computed_tokens=external, delay_cache_blocks=delay,
            num_encoder_tokens=self.encoder_tokens, full_sequence_must_fit=whole))
        if ref_out is not None:
            pair.known = True
            pair.set_computed(ref_n + external + chunk)

    def step(self, data: st.DataObject) -> None:
        """A running request computes its next chunk (prefill) or token (decode)."""
        lookahead, delay = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 4)) == 0
        if not any(self.pairs[r].ref.num_computed_tokens < self.pairs[r].ref.num_tokens for r in self.running()):
            return
        candidates = [rid for rid in self.running()
                      if self.pairs[rid].ref.num_computed_tokens < self.pairs[rid].ref.num_tokens]
        pair = self.pairs[data.draw(st.sampled_from(candidates))]
        remaining = pair.ref.num_tokens - pair.ref.num_computed_tokens
        chunk = data.draw(st.integers(1, remaining))
        out, _ = self.both(lambda m: m.allocate_slots(pair.ref if m is self.ref else pair.opt, chunk,
                                                      num_lookahead_tokens=lookahead, delay_cache_blocks=delay))
        if out is not None:
            pair.set_computed(pair.ref.num_computed_tokens + chunk)

    def sample(self, data: st.DataObject) -> None:
        """The model emits tokens for a fully computed request (spec decode may emit several)."""
        tokens = data.draw(st.lists(ALPHABET, min_size=1, max_size=3))
        candidates = [rid for rid in self.running()
                      if self.pairs[rid].ref.num_computed_tokens == self.pairs[rid].ref.num_tokens
                      and self.pairs[rid].ref.num_tokens < self.max_model_len]
        if not candidates:
            return
        pair = self.pairs[data.draw(st.sampled_from(candidates))]
        tokens = tokens[: self.max_model_len - pair.ref.num_tokens]
        pair.ref.append_output_token_ids(tokens)
        pair.opt.append_output_token_ids(list(tokens))
        assert pair.ref.block_hashes == pair.opt.block_hashes

    def cache_blocks(self, data: st.DataObject) -> None:
        """A delayed cache (P/D: KV arrived) is committed."""
        pair = self.pairs[data.draw(st.sampled_from(self.running()))]
        self.both(lambda m: m.cache_blocks(pair.ref if m is self.ref else pair.opt, pair.ref.num_computed_tokens))

    def free(self, data: st.DataObject) -> None:
        """Finish a request, or preempt it (free now, re-admit from scratch later)."""
        finish = data.draw(st.booleans())
        pair = self.pairs[data.draw(st.sampled_from(self.running()))]
        self.both(lambda m: m.free(pair.ref if m is self.ref else pair.opt))
        pair.known = False
        pair.set_computed(0)
        if finish:
            pair.finished = True
        else:
            pair.ref.num_preemptions += 1
            pair.opt.num_preemptions += 1

    def evict(self, data: st.DataObject) -> None:
        block_ids = data.draw(st.lists(st.integers(0, 44), max_size=4))
        self.both(lambda m: m.evict_blocks(list(block_ids)))

    def reset_prefix_cache(self, data: st.DataObject) -> None:
        self.both(lambda m: m.reset_prefix_cache())

    def take_events(self, data: st.DataObject) -> None:
        self.both(lambda m: m.take_events())

    def new_step(self, data: st.DataObject) -> None:
        self.both(lambda m: m.new_step_starts())

    def stats(self, data: st.DataObject) -> None:
        self.both(lambda m: m.make_prefix_cache_stats())

    def inspect(self, data: st.DataObject) -> None:
        """Read-only calls on known and unknown request ids."""
        request_id = data.draw(st.sampled_from(sorted(self.pairs)))
        self.both(lambda m: m.get_block_ids(request_id))
        self.both(lambda m: m.get_num_common_prefix_blocks(request_id))

    # -- misuse: both refuse with the same typed error, state unchanged -------------

    def misuse_token_count(self, data: st.DataObject) -> None:
        count = data.draw(st.integers(-2, 0))
        pair = self.pairs[data.draw(st.sampled_from(sorted(self.pairs)))]
        self.both(lambda m: m.allocate_slots(pair.ref if m is self.ref else pair.opt, count))

    def misuse_too_long(self, data: st.DataObject) -> None:
        pair = self.pairs[data.draw(st.sampled_from(sorted(self.pairs)))]
        self.both(lambda m: m.allocate_slots(pair.ref if m is self.ref else pair.opt, self.max_model_len + 1))

    def misuse_free_unknown(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(r for r, p in self.pairs.items() if not p.known)))
        pair = self.pairs[request_id]
        self.both(lambda m: m.free(pair.ref if m is self.ref else pair.opt))
        self.both(lambda m: m.free(pair.ref if m is self.ref else pair.opt, missing_ok=True))

    # -- dispatch: engine work dominates, as in a real scheduler ---------------------

    ENGINE = ("new_request",) * 2 + ("admit",) * 4 + ("step",) * 5 + ("sample",) * 4
    MAINTENANCE = ("free",) * 4 + ("cache_blocks", "evict", "reset_prefix_cache", "take_events",
                                   "stats", "inspect", "new_step")
    MISUSE = ("misuse_token_count", "misuse_too_long", "misuse_free_unknown")

    def _run(self, data: st.DataObject, name: str) -> None:
        needs: dict[str, Callable[[], list[str]]] = {
            "admit": self.waiting, "step": self.running, "sample": self.running,
            "cache_blocks": self.running, "free": self.running, "inspect": lambda: list(self.pairs),
            "misuse_token_count": lambda: list(self.pairs), "misuse_too_long": lambda: list(self.pairs),
            "misuse_free_unknown": lambda: [r for r, p in self.pairs.items() if not p.known]}
        if name in needs and not needs[name]():
            name = "new_request"
        getattr(self, name)(data)

    @rule(data=st.data())
    def engine(self, data: st.DataObject) -> None:
        self._run(data, data.draw(st.sampled_from(self.ENGINE), label="engine"))

    @rule(data=st.data())
    def engine_more(self, data: st.DataObject) -> None:
        self._run(data, data.draw(st.sampled_from(self.ENGINE), label="engine"))

    @rule(data=st.data())
    def maintenance(self, data: st.DataObject) -> None:
        self._run(data, data.draw(st.sampled_from(self.MAINTENANCE), label="maintenance"))

    @precondition(lambda self: bool(self.pairs))
    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        self._run(data, data.draw(st.sampled_from(self.MISUSE), label="misuse"))


class LockstepMachine(Lockstep):
    """Full attention: one group with prefix caching, or any number without."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(1, 40),
        max_model_len=st.integers(8, 64),
        enable_caching=st.booleans(),
        num_groups=st.integers(0, 2),
        events=st.booleans(),
        log_stats=st.booleans(),
        hash_fn=st.sampled_from(["sha256", "xxh3_128", "sha256_cbor"]),
        use_eagle=st.booleans(),
        prefixes=st.lists(st.lists(ALPHABET, min_size=1, max_size=24), min_size=1, max_size=3),
    )
    def setup(self, block_size: int, num_blocks: int, max_model_len: int, enable_caching: bool,
              num_groups: int, events: bool, log_stats: bool, hash_fn: str, use_eagle: bool,
              prefixes: list[list[int]]) -> None:
        if enable_caching:
            num_groups = 1
        groups = tuple(KVCacheGroupSpec((f"layer.{g}",), FullAttentionSpec(block_size, 1, 8, "float16"))
                       for g in range(num_groups))
        self.build(KVCacheConfig(num_blocks, (), groups), max_model_len, prefixes,
                   enable_caching=enable_caching, hash_fn=hash_fn, use_eagle=use_eagle,
                   log_stats=log_stats, enable_kv_cache_events=events)


def _diff(ref_state: Any, opt_state: Any) -> str:
    lines = ["snapshots differ:"]
    for name in ("pool", "requests", "prefix_cache_stats"):
        mine, theirs = getattr(ref_state, name), getattr(opt_state, name)
        if mine == theirs:
            continue
        if name == "pool":
            for part in ("ref_counts", "block_hashes", "free_queue", "cached", "pending_events"):
                if getattr(mine, part) != getattr(theirs, part):
                    lines.append(f"  pool.{part}:\n    reference {getattr(mine, part)}\n"
                                 f"    optimized {getattr(theirs, part)}")
        else:
            lines.append(f"  {name}:\n    reference {mine}\n    optimized {theirs}")
    return "\n".join(lines)


LockstepMachine.TestCase.settings = settings(
    settings(), stateful_step_count=60, max_examples=settings().max_examples * 10)
test_lockstep = LockstepMachine.TestCase
