"""The lockstep machine: every implementation driven by the same calls.

Hypothesis plays an engine's scheduler against the implementations of
``tests/implementations.py`` at once: requests with shared prefixes (a tiny
token alphabet, so full hits, partial hits and duplicate blocks happen),
chunked prefill with prefix hits and external tokens, decode with lookahead,
delayed caching, preemption, eviction, prefix-cache resets, events and
statistics, pool exhaustion, full-sequence admission, and misuse.

One ``@rule`` per operation, gated by ``@precondition``; arguments that do
not depend on the state are rule arguments (drawn by ``tests/strategies.py``,
shown in a failure report), the others are drawn from ``data`` with a label.
The configuration and a starting workload of waiting requests are drawn once
(``@initialize``); request ids live in the ``request_ids`` bundle.
After every call all implementations must have returned the same thing (or
raised the same typed error, leaving their state unchanged); after every step
they expose equal snapshots and each one's ``check_invariants()`` holds, with
the post-conditions of ``tests/postconditions.py`` (REQ-7, HASH-1, HYB-1,
SKIP-1 (b), MAMBA-1, SWA-1, CHUNK-1) asserted on each.

Adding an operation: a rule below calling ``self.each(lambda i, m: ...)``
(``i`` indexes the implementation, e.g. ``pair.requests[i]``), its argument
strategies in ``tests/strategies.py``, a ``@precondition`` if it needs a
request in some state, a post-condition in ``tests/postconditions.py`` if the
spec states one, and a share in :func:`weight_rules` if an engine calls it
often. A new manager option is drawn in ``strategies.manager_options``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from pagedkv.spec import PagedKVError
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.request import Request
from tests import eagle_checks, postconditions
from tests.connector_hit import deeper_full_attention_hit
from tests.implementations import IMPLEMENTATIONS
from tests.strategies import (
    BAD_TOKEN_COUNTS,
    DELAY_CACHING,
    EVICT_IDS,
    LOOKAHEAD,
    OUTPUT_TOKENS,
    RESERVED_BLOCKS,
    WATERMARK_BLOCKS,
    WHOLE_SEQUENCE,
    Setup,
    full_attention_setups,
    headroom,
    prompts,
    request_extras,
)


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
class Tracked:
    """One logical request: each implementation's own ``Request`` object, in
    the order of :attr:`Lockstep.implementations`."""

    requests: list[Request]
    known: bool = False
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        return self.requests[0].num_tokens

    @property
    def num_computed(self) -> int:
        return self.requests[0].num_computed_tokens

    def set_computed(self, value: int) -> None:
        for request in self.requests:
            request.num_computed_tokens = value


class Lockstep(RuleBasedStateMachine):
    """Drives every implementation in lockstep; subclasses draw the
    configuration (one ``@initialize`` calling :meth:`build`)."""

    implementations: ClassVar[dict[str, Any]] = dict(IMPLEMENTATIONS)
    """Name -> module (or namespace) with a ``KVCacheManager``; the first is
    the one the others are compared with."""

    request_ids = Bundle("request_ids")

    def __init__(self) -> None:
        super().__init__()
        self.managers: list[Any] = []
        self.tracked: dict[str, Tracked] = {}
        self.next_id = 0

    def build(self, setup: Setup) -> MultipleResults[str]:
        """Every implementation's manager on the same configuration, and the
        starting workload (for the ``request_ids`` bundle)."""
        self.setup = setup
        self.managers = [implementation.KVCacheManager(setup.config, setup.max_model_len, **setup.options)
                         for implementation in self.implementations.values()]
        self.max_model_len = setup.max_model_len
        self.has_mamba = any(isinstance(group.kv_cache_spec, MambaSpec) for group in setup.config.kv_cache_groups)
        return multiple(*(self.add_request(tokens, extra) for tokens, extra in setup.workload))

    # -- the comparison core ---------------------------------------------------

    def each(self, call: Callable[[int, Any], Any]) -> list[Any]:
        """Run ``call(index, manager)`` on every implementation: the same
        result, or the same typed error with every state unchanged. Returns
        the results (or errors), one per implementation."""
        before = [manager.snapshot() for manager in self.managers]
        self.before = before  # for post-conditions comparing with the state before the call
        outcomes: list[tuple[str, Any]] = []
        for index, manager in enumerate(self.managers):
            try:
                outcomes.append(("ok", call(index, manager)))
            except PagedKVError as error:
                outcomes.append(("error", error))
        (first_kind, first_value), names = outcomes[0], list(self.implementations)
        for name, (kind, value) in zip(names[1:], outcomes[1:]):
            assert kind == first_kind, f"{names[0]} {first_kind} {first_value!r} vs {name} {kind} {value!r}"
            if kind == "error":
                assert type(value) is type(first_value), f"{names[0]} {first_value!r} vs {name} {value!r}"
            else:
                assert normalize(value) == normalize(first_value), (
                    f"{names[0]} {normalize(first_value)} != {name} {normalize(value)}")
        if first_kind == "error":
            for name, manager, state in zip(names, self.managers, before):
                assert manager.snapshot() == state, f"{name} changed state on a refused call"
        return [value for _, value in outcomes]

    @invariant()
    def agree(self) -> None:
        """Equal observable state, and every implementation's invariants."""
        if not self.managers:
            return
        first, names = self.managers[0], list(self.implementations)
        first_state = first.snapshot()
        known = [pair for pair in self.tracked.values() if pair.known]
        for index, (name, manager) in enumerate(zip(names, self.managers)):
            if index:
                state = manager.snapshot()
                assert state == first_state, _diff(names[0], first_state, name, state)
                assert manager.usage == first.usage
                assert manager.block_pool.get_num_free_blocks() == first.block_pool.get_num_free_blocks()
                assert postconditions.mamba_checkpoints(manager) == postconditions.mamba_checkpoints(first)
                assert postconditions.key_token_counts(manager) == postconditions.key_token_counts(first)
            manager.check_invariants()
            postconditions.check_position_keys(manager, [pair.requests[index] for pair in known])

    # -- who is where --------------------------------------------------------------

    def waiting(self) -> list[str]:
        return sorted(rid for rid, pair in self.tracked.items() if not pair.known and not pair.finished)

    def running(self) -> list[str]:
        return sorted(rid for rid, pair in self.tracked.items() if pair.known)

    def computing(self) -> list[str]:
        """Running requests with tokens left to compute."""
        return [rid for rid in self.running() if self.tracked[rid].num_computed < self.tracked[rid].num_tokens]

    def sampling(self) -> list[str]:
        """Running requests fully computed, with room for another token."""
        return [rid for rid in self.running() if self.tracked[rid].num_computed == self.tracked[rid].num_tokens
                and self.tracked[rid].num_tokens < self.max_model_len]

    def unknown(self) -> list[str]:
        return sorted(rid for rid, pair in self.tracked.items() if not pair.known)

    def check_hashes(self, pair: Tracked) -> None:
        """HASH-1 on each implementation's request, and byte-identical hashes."""
        options = self.setup.options
        hash_block_size = self.managers[0].hash_block_size
        for request in pair.requests:
            assert request.block_hashes == pair.requests[0].block_hashes
            if hash_block_size is not None:
                postconditions.check_block_hashes(request, options["hash_fn"], hash_block_size,
                                                  options.get("hash_seed"),
                                                  options.get("num_hash_lookahead_tokens", 0))

    def check_checkpoints(self, pair: Tracked) -> None:
        """MCKPT-1 after a successful allocation, in every implementation."""
        for index, manager in enumerate(self.managers):
            postconditions.check_mamba_checkpoint(manager, pair.requests[index].request_id)
            eagle_checks.check_mamba_retention(manager, pair.requests[index], self.before[index],
                                               self.setup.options)

    def check_allocation(self, pair: Tracked, total_computed: int, num_new_tokens: int, lookahead: int) -> None:
        for index, manager in enumerate(self.managers):
            request = pair.requests[index]
            postconditions.check_allocation(manager, request.request_id, total_computed,
                                            num_new_tokens, lookahead, request.num_prompt_tokens)

    # -- the engine's work -----------------------------------------------------------

    def add_request(self, tokens: list[int], extra: dict[str, Any]) -> str:
        """A waiting request, made by every implementation."""
        request_id = f"r{self.next_id}"
        self.next_id += 1
        pair = Tracked([manager.make_request(request_id, tokens, **extra) for manager in self.managers])
        self.check_hashes(pair)
        self.tracked[request_id] = pair
        return request_id

    @rule(target=request_ids, data=st.data())
    def new_request(self, data: st.DataObject) -> str:
        """A request arrives: a cut of a shared prefix, then its own tail."""
        tokens = data.draw(prompts(self.setup.prefixes, self.max_model_len), label="prompt")
        return self.add_request(tokens, data.draw(request_extras(len(tokens)), label="extras"))

    @precondition(lambda self: bool(self.waiting()))
    @rule(data=st.data(), lookahead=LOOKAHEAD, delay=DELAY_CACHING, whole=WHOLE_SEQUENCE)
    def admit(self, data: st.DataObject, lookahead: int, delay: bool, whole: bool) -> None:
        """A waiting request: look up its prefix hit, then allocate its first
        chunk (some tokens possibly computed elsewhere: external)."""
        pair = self.tracked[data.draw(st.sampled_from(self.waiting()), label="request")]
        hits = self.each(lambda i, m: m.get_computed_blocks(pair.requests[i]))
        hit_tokens = hits[0][1]
        for index, manager in enumerate(self.managers):
            postconditions.check_hit(manager, pair.requests[index], hits[index][0].get_block_ids(), hit_tokens)
        # Per-group hits and the shared-prefix boundary are pure queries; an
        # engine may pin the boundary on the request (D-SWA-11, D-SWA-12).
        self.each(lambda i, m: m.get_computed_blocks_per_group(pair.requests[i]))
        boundary = self.each(lambda i, m: m.shared_prefix_boundary(pair.requests[i], hit_tokens))[0]
        if boundary and data.draw(st.booleans(), label="pin shared_prefix_boundary"):
            for request in pair.requests:
                request.shared_prefix_boundary = boundary
        blocks = [hit[0] for hit in hits]
        external = 0
        deeper = deeper_full_attention_hit(self.setup.config, self.each, pair.requests) if self.has_mamba else None
        if deeper is not None and deeper[1] + 1 < pair.num_tokens and data.draw(st.booleans(), label="connector"):
            # The connector loads past a lagging Mamba hit, at least one token (D-API-46).
            blocks, hit_tokens = deeper
            external = data.draw(st.integers(1, pair.num_tokens - hit_tokens - 1), label="num_external_computed_tokens")
        elif data.draw(st.booleans(), label="external tokens"):
            external = data.draw(st.integers(0, max(0, pair.num_tokens - hit_tokens - 1)),
                                 label="num_external_computed_tokens")
        remaining = pair.num_tokens - hit_tokens
        # Adopting a hit or external tokens may bring no new token (D-API-12).
        chunk = data.draw(st.integers(0 if hit_tokens + external else 1, remaining - external),
                          label="num_new_tokens")
        # Headroom for other work (D-API-13) and the engine's watermark (D-API-48).
        free = self.managers[0].block_pool.get_num_free_blocks()
        reserved = data.draw(headroom(RESERVED_BLOCKS, free), label="reserved_blocks")
        watermark = data.draw(headroom(WATERMARK_BLOCKS, free), label="watermark_blocks")
        encoder_tokens = self.setup.encoder_tokens
        out = self.each(lambda i, m: m.allocate_slots(
            pair.requests[i], chunk, hit_tokens, blocks[i], num_lookahead_tokens=lookahead,
            num_external_computed_tokens=external, delay_cache_blocks=delay,
            num_encoder_tokens=encoder_tokens, full_sequence_must_fit=whole,
            reserved_blocks=reserved, watermark_blocks=watermark))
        if out[0] is not None:
            pair.known = True
            self.check_allocation(pair, hit_tokens + external, chunk, lookahead)
            self.check_checkpoints(pair)
            pair.set_computed(hit_tokens + external + chunk)

    @precondition(lambda self: bool(self.computing()))
    @rule(data=st.data(), lookahead=LOOKAHEAD, delay=DELAY_CACHING)
    def step(self, data: st.DataObject, lookahead: int, delay: bool) -> None:
        """A running request computes its next chunk (prefill) or token (decode)."""
        pair = self.tracked[data.draw(st.sampled_from(self.computing()), label="request")]
        chunk = data.draw(st.integers(1, pair.num_tokens - pair.num_computed), label="num_new_tokens")
        # An asynchronous engine: part of the computed tokens still in flight
        # (D-API-14), headroom kept for other work (D-API-13).
        in_flight = (data.draw(st.integers(0, pair.num_computed), label="num_in_flight_tokens")
                     if data.draw(st.integers(0, 3), label="asynchronous") == 0 else 0)
        reserved = data.draw(RESERVED_BLOCKS, label="reserved_blocks")
        watermark = data.draw(WATERMARK_BLOCKS, label="watermark_blocks")  # the decode fast path steps aside
        out = self.each(lambda i, m: m.allocate_slots(pair.requests[i], chunk, num_lookahead_tokens=lookahead,
                                                      delay_cache_blocks=delay, reserved_blocks=reserved,
                                                      num_in_flight_tokens=in_flight, watermark_blocks=watermark))
        # The in-flight tokens widen the live window like new ones (SWA-1 cap).
        self.check_allocation(pair, max(0, pair.num_computed - in_flight), chunk + in_flight, lookahead)
        if out[0] is not None:
            self.check_checkpoints(pair)
            pair.set_computed(pair.num_computed + chunk)

    @precondition(lambda self: bool(self.sampling()))
    @rule(data=st.data(), tokens=OUTPUT_TOKENS)
    def sample(self, data: st.DataObject, tokens: list[int]) -> None:
        """The model emits tokens for a fully computed request."""
        pair = self.tracked[data.draw(st.sampled_from(self.sampling()), label="request")]
        tokens = tokens[: self.max_model_len - pair.num_tokens]
        for request in pair.requests:
            request.append_output_token_ids(list(tokens))
        self.check_hashes(pair)

    @precondition(lambda self: bool(self.running()))
    @rule(data=st.data())
    def cache_blocks(self, data: st.DataObject) -> None:
        """A delayed cache (P/D: the KV arrived) is committed."""
        pair = self.tracked[data.draw(st.sampled_from(self.running()), label="request")]
        self.each(lambda i, m: m.cache_blocks(pair.requests[i], pair.num_computed))

    @precondition(lambda self: bool(self.running()))
    @rule(data=st.data(), finish=st.booleans())
    def free(self, data: st.DataObject, finish: bool) -> None:
        """Finish a request, or preempt it (free now, re-admit from scratch later)."""
        pair = self.tracked[data.draw(st.sampled_from(self.running()), label="request")]
        self.each(lambda i, m: m.free(pair.requests[i]))
        for index, manager in enumerate(self.managers):
            postconditions.check_offers_dropped(manager, pair.requests[index].request_id)
        pair.known = False
        pair.set_computed(0)
        if finish:
            pair.finished = True
        else:
            for request in pair.requests:
                request.num_preemptions += 1

    # -- the cache and the step ---------------------------------------------------------

    @rule(block_ids=EVICT_IDS)
    def evict_blocks(self, block_ids: list[int]) -> None:
        self.each(lambda i, m: m.evict_blocks(list(block_ids)))

    @precondition(lambda self: bool(self.managers[0].snapshot().pool.cached))
    @rule()
    def reset_prefix_cache(self) -> None:
        """Only with something cached: an engine resets a cache rarely, and
        a reset of an empty cache would mostly keep the next hits away."""
        self.each(lambda i, m: m.reset_prefix_cache())

    # The per-step calls: an engine makes them only where they do something
    # (a hook of Mamba groups, events or statistics asked for); elsewhere they
    # are constant no-ops that would only thin out the engine's work.

    @precondition(lambda self: self.setup.options["enable_kv_cache_events"])
    @rule()
    def take_events(self) -> None:
        self.each(lambda i, m: m.take_events())

    @precondition(lambda self: self.has_mamba)
    @rule()
    def new_step_starts(self) -> None:
        self.each(lambda i, m: m.new_step_starts())
        for manager in self.managers:  # MAMBA-2: nothing is remembered across steps
            for group in manager.coordinator.managers:
                assert not getattr(group, "cached_this_step", ()), "MAMBA-2: states kept past new_step_starts()"

    @precondition(lambda self: self.has_mamba)
    @rule()
    def take_boundary_state_offloads(self) -> None:
        """A KV connector drains the Mamba boundary-state offers (MOFF-1):
        the same requests, groups, block ids and token counts everywhere."""
        self.each(lambda i, m: m.take_boundary_state_offloads())

    @precondition(lambda self: self.has_mamba)
    @rule(rid=request_ids, in_flight=st.sampled_from([0, 0, 1]))
    def finalize_partial_tail_offloads(self, rid: str, in_flight: int) -> None:
        """A request finishing: its uncopied Mamba prompt tails, handed over once
        (MTAIL-1); the same groups, block ids and boundaries everywhere."""
        num_computed = self.tracked[rid].num_computed
        self.each(lambda i, m: m.finalize_partial_tail_offloads(rid, num_computed, in_flight))

    @precondition(lambda self: self.setup.options["log_stats"])
    @rule()
    def make_prefix_cache_stats(self) -> None:
        self.each(lambda i, m: m.make_prefix_cache_stats())

    # -- reads ---------------------------------------------------------------------------

    @rule()
    def get_num_free_blocks(self) -> None:
        """A read that changes nothing. Hypothesis leans towards the first
        valid rule in its order (no target, fewest arguments, then by name)
        when the drawn one is not valid; this harmless read sorts first, so
        the lean does not fall on a rule that empties the prefix cache."""
        self.each(lambda i, m: (m.block_pool.get_num_free_blocks(), m.usage))

    @rule(request_id=request_ids)
    def get_block_ids(self, request_id: str) -> None:
        self.each(lambda i, m: m.get_block_ids(request_id))

    @rule(request_id=request_ids)
    def get_num_common_prefix_blocks(self, request_id: str) -> None:
        self.each(lambda i, m: m.get_num_common_prefix_blocks(request_id))

    # -- misuse: all refuse with the same typed error, state unchanged ----------------

    @rule(request_id=request_ids, count=BAD_TOKEN_COUNTS,
          keyword=st.sampled_from(["num_new_tokens", "reserved_blocks", "watermark_blocks",
                                  "num_in_flight_tokens"]))
    def allocate_bad_token_count(self, request_id: str, count: int, keyword: str) -> None:
        pair = self.tracked[request_id]
        if keyword == "num_new_tokens":
            self.each(lambda i, m: m.allocate_slots(pair.requests[i], count))
        else:  # the engine-contract counts must be >= 0 (spec/operations.md 1b)
            self.each(lambda i, m: m.allocate_slots(pair.requests[i], 1, **{keyword: count - 1}))

    @rule(request_id=request_ids)
    def allocate_past_max_model_len(self, request_id: str) -> None:
        pair = self.tracked[request_id]
        self.each(lambda i, m: m.allocate_slots(pair.requests[i], self.max_model_len + 1))

    @precondition(lambda self: bool(self.unknown()))
    @rule(data=st.data())
    def free_unknown(self, data: st.DataObject) -> None:
        pair = self.tracked[data.draw(st.sampled_from(self.unknown()), label="request")]
        self.each(lambda i, m: m.free(pair.requests[i]))
        self.each(lambda i, m: m.free(pair.requests[i], missing_ok=True))


def weight_rules(machine: type[RuleBasedStateMachine], **weights: int) -> None:
    """Give rules a share of the steps: Hypothesis draws among the valid
    rules uniformly, but a scheduler mostly admits, computes and samples
    (without this the cheap rules, ``reset_prefix_cache`` above all, take
    most steps and prefix hits become rare). An alias of a rule is the same
    rule object listed once more: it widens the rule's share and still
    reports under the rule's own name."""
    for name, weight in weights.items():
        for copy in range(1, weight):
            setattr(machine, f"_{name}_weight_{copy}", getattr(machine, name))


weight_rules(Lockstep, new_request=3, admit=6, step=8, sample=6, free=4, cache_blocks=2)


class LockstepMachine(Lockstep):
    """Full attention: one group with prefix caching, or any number without."""

    @initialize(target=Lockstep.request_ids, setup=full_attention_setups())
    def configure(self, setup: Setup) -> MultipleResults[str]:
        return self.build(setup)


def _diff(first_name: str, first: Any, name: str, other: Any) -> str:
    lines = ["snapshots differ:"]
    for part in ("pool", "requests", "prefix_cache_stats"):
        mine, theirs = getattr(first, part), getattr(other, part)
        if mine == theirs:
            continue
        if part == "pool":
            for field in ("ref_counts", "block_hashes", "free_queue", "cached", "pending_events"):
                if getattr(mine, field) != getattr(theirs, field):
                    lines.append(f"  pool.{field}:\n    {first_name} {getattr(mine, field)}\n"
                                 f"    {name} {getattr(theirs, field)}")
        else:
            lines.append(f"  {part}:\n    {first_name} {mine}\n    {name} {theirs}")
    return "\n".join(lines)


LOCKSTEP_SETTINGS = settings(settings(), stateful_step_count=60, max_examples=settings().max_examples * 12)
"""Both machines: long runs (60 steps), 12 times the profile's examples (a
run costs less than under the former dispatching machine: this keeps the
two machines' CI time where it was, about 3 minutes on the shared 2 cores)."""

LockstepMachine.TestCase.settings = LOCKSTEP_SETTINGS
test_lockstep = LockstepMachine.TestCase
