"""The reference and optimized host tiers in lockstep (spec/host_tier.md).

A Hypothesis state machine drives both with the same operations (allocate
with and without host hits, write-back planning, completion in any order,
restores, residency updates, frees, cache resets) on small pools, so host
exhaustion, device exhaustion and page loss happen often. After every step
the two must agree on every result and on their snapshots, and the
reference's HOST-* invariants must hold.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.optimized.host_tier.hisparse import HostTierManager as OptimizedTier
from pagedkv.reference.features.hisparse import HostTierManager as ReferenceTier
from pagedkv.spec.hisparse import HostTierConfig
from pagedkv.spec.types import BlockHash

BLOCK_SIZE = 4
REQUEST_IDS = ("a", "b", "c", "d")


def _hashes(prompt: int, num_pages: int) -> list[BlockHash]:
    # Prompts 0 and 1 share their first two pages, so host hits are partial too.
    return [BlockHash(bytes([0 if page < 2 and prompt < 2 else prompt, page]))
            for page in range(num_pages)]


def _same(ref: Any, opt: Any, what: str) -> Any:
    """Both outcomes (result or exception type) must be equal."""
    assert ref == opt, f"{what}: reference {ref!r} != optimized {opt!r}"
    return ref


def _outcome(call: Any) -> Any:
    try:
        return ("ok", call())
    except Exception as error:  # the error type is the observable outcome
        return ("error", type(error).__name__)


class HostTierMachine(RuleBasedStateMachine):
    ref: ReferenceTier
    opt: OptimizedTier

    @initialize(host=st.integers(3, 14), device=st.integers(3, 14), hot=st.integers(1, 3),
                caching=st.booleans(), window=st.one_of(st.none(), st.integers(1, 6)),
                reprefill=st.integers(0, 5), spill=st.one_of(st.none(), st.integers(1, 3)),
                events=st.booleans())
    def setup(self, host: int, device: int, hot: int, caching: bool, window: int | None,
              reprefill: int, spill: int | None, events: bool) -> None:
        config = HostTierConfig(block_size=BLOCK_SIZE, host_num_blocks=host,
                                device_num_blocks=device, hot_blocks_per_request=hot,
                                max_model_len=32, enable_caching=caching,
                                admission_window=window, num_reprefillable_tokens=reprefill,
                                max_spill_pages=spill, record_events=events)
        self.ref = ReferenceTier(config)
        self.opt = OptimizedTier(config)
        self.prompt: dict[str, int] = {}
        self.tokens: dict[str, int] = {}

    def _both(self, what: str, method: str, *args: Any) -> Any:
        ref = _outcome(lambda: getattr(self.ref, method)(*args))
        opt = _outcome(lambda: getattr(self.opt, method)(*args))
        return _same(ref, opt, what)

    def _allocate(self, what: str, *args: Any) -> Any:
        """``allocate`` on both, after ``blocks_needed`` predicted its outcome."""
        before = self.ref.snapshot()
        need = self._both("blocks_needed", "blocks_needed", *args)
        assert self.ref.snapshot() == before, "blocks_needed changed the state"
        if need[0] == "ok":
            # A capacity query counts a valid hit exactly as blocks_needed does.
            capacity = self._both("capacity_needed", "capacity_needed", *args[:3], *args[4:])
            assert capacity == need, (capacity, need)
        free = (self.ref.num_free_host_blocks(), self.ref.num_free_device_blocks())
        result = self._both(what, "allocate", *args)
        if need[0] == "ok":
            fits = need[1][0] <= free[0] and need[1][1] <= free[1]
            assert result[0] == "ok" and (result[1] is not None) == fits, (need, free, result)
            if result[1] is not None:
                after = (self.ref.num_free_host_blocks(), self.ref.num_free_device_blocks())
                adopted = sum(1 for page, b in enumerate(self.ref.residency(args[0]).resident_row)
                              if page < len(args[2]) and b != 0)
                assert free[0] - after[0] == need[1][0]
                assert free[1] - after[1] >= need[1][1]  # adopted copies come on top
                assert free[1] - after[1] <= need[1][1] + adopted
        else:
            assert result == need, "blocks_needed and allocate refuse alike"
        return result

    @rule(request_id=st.sampled_from(REQUEST_IDS), prompt=st.integers(0, 3),
          num_tokens=st.integers(1, 32), use_hit=st.booleans())
    def admit(self, request_id: str, prompt: int, num_tokens: int, use_hit: bool) -> None:
        if request_id in self.ref.requests:
            return
        hashes = _hashes(prompt, num_tokens // BLOCK_SIZE)
        hit = _same(self.ref.lookup(hashes), self.opt.lookup(hashes), "lookup")
        hit = hit[: -(-num_tokens // BLOCK_SIZE)] if use_hit else ()
        result = self._allocate("allocate", request_id, num_tokens, hit, hashes)
        if result[0] == "ok" and result[1] is not None:
            self.prompt[request_id] = prompt
            self.tokens[request_id] = num_tokens

    @rule(request_id=st.sampled_from(REQUEST_IDS), prompt=st.integers(0, 3),
          num_tokens=st.integers(1, 32), external=st.integers(1, 32), use_hit=st.booleans(),
          local=st.integers(0, 8))
    def admit_import(self, request_id: str, prompt: int, num_tokens: int, external: int,
                     use_hit: bool, local: int) -> None:
        if request_id in self.ref.requests:
            return
        hashes = _hashes(prompt, num_tokens // BLOCK_SIZE)
        hit = self.ref.lookup(hashes)[: num_tokens // BLOCK_SIZE] if use_hit else ()
        # The engine may count fewer hit pages as computed than the host holds;
        # the import then covers the others (HOST-14), and the hit is cut to
        # the import's pages as vLLM cuts its retained host hit.
        local = min(local, len(hit)) * BLOCK_SIZE
        external = min(external, num_tokens - local) or 1
        hit = hit[: -(-(local + external) // BLOCK_SIZE)]
        result = self._allocate("allocate (import)", request_id, num_tokens, hit, hashes,
                                external, local)
        if result[0] == "ok" and result[1] is not None:
            self.prompt[request_id] = prompt
            self.tokens[request_id] = num_tokens

    @precondition(lambda self: sum(r not in self.ref.requests for r in REQUEST_IDS) >= 2)
    @rule(data=st.data(), prompt=st.integers(0, 3), pages=st.integers(1, 6),
          extra=st.integers(0, 12), external=st.integers(1, 16), free_donor=st.booleans())
    def resume_import(self, data: st.DataObject, prompt: int, pages: int, extra: int,
                      external: int, free_donor: bool) -> None:
        """A donor publishes a prompt (written back, maybe freed: its clean
        pages stay copies); a taker resumes it counting fewer hit pages as
        computed than the host holds, and a load covers the rest (HOST-14):
        the hit pages past the computed ones must not adopt copies."""
        idle = [r for r in REQUEST_IDS if r not in self.ref.requests]
        donor, taker = data.draw(st.permutations(idle))[:2]
        hashes = _hashes(prompt, pages)
        result = self._allocate("allocate (donor)", donor, pages * BLOCK_SIZE, (), hashes)
        if result[0] != "ok" or result[1] is None:
            return
        planned = self._both("plan_writebacks", "plan_writebacks", donor, pages * BLOCK_SIZE)
        self._both("complete", "complete", [t.transfer_id for t in planned[1]])
        if free_donor:
            self._both("free", "free", donor, True)
        else:
            self.prompt[donor], self.tokens[donor] = prompt, pages * BLOCK_SIZE
        hit = self.ref.lookup(_hashes(prompt, 8))
        if not hit:
            return
        local = data.draw(st.integers(0, len(hit) - 1)) * BLOCK_SIZE
        num_tokens = min(max(len(hit) * BLOCK_SIZE, local + external) + extra, 32)
        external = max(min(external, num_tokens - local), 1)
        hit = hit[: min(num_tokens // BLOCK_SIZE, -(-(local + external) // BLOCK_SIZE))]
        result = self._allocate("allocate (resume import)", taker, num_tokens, hit,
                                _hashes(prompt, num_tokens // BLOCK_SIZE), external, local)
        if result[0] == "ok" and result[1] is not None:
            self.prompt[taker], self.tokens[taker] = prompt, num_tokens

    @precondition(lambda self: any(r.importing for r in self.ref.requests.values()))
    @rule(data=st.data(), failed=st.booleans())
    def finish_import(self, data: st.DataObject, failed: bool) -> None:
        request_id = data.draw(st.sampled_from(
            sorted(r for r, req in self.ref.requests.items() if req.importing)))
        self._both("finish_import", "finish_import", request_id, failed)
        if failed:
            self.tokens.pop(request_id, None)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), grow=st.integers(1, 12))
    def grow(self, data: st.DataObject, grow: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        num_tokens = min(self.tokens[request_id] + grow, 32)
        hashes = _hashes(self.prompt[request_id], num_tokens // BLOCK_SIZE)
        result = self._allocate("grow", request_id, num_tokens, (), hashes)
        if result[0] == "ok" and result[1] is not None:
            self.tokens[request_id] = num_tokens

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), budget=st.one_of(st.none(), st.integers(0, 3)))
    def write_back(self, data: st.DataObject, budget: int | None) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self._both("plan_writebacks", "plan_writebacks", request_id,
                   self.tokens[request_id], budget)

    @precondition(lambda self: bool(self.ref.transfers))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.ref.transfers)), unique=True,
                                 min_size=1))
        self._both("complete", "complete", ids)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), extra=st.integers(-2, 6))
    def advance(self, data: st.DataObject, extra: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self._both("advance", "advance", request_id, max(self.tokens[request_id] + extra, 0))

    @rule()
    def take_transfers(self) -> None:
        self._both("take_transfers", "take_transfers")

    @rule(data=st.data())
    def report_transfers(self, data: st.DataObject) -> None:
        # Worker counts for in-flight ids and a few unknown ones (ignored), as
        # two or three tensor-parallel workers would send them, in any order.
        ids = st.sampled_from(sorted(self.ref.transfers) + [97, 98])
        enqueued = data.draw(st.dictionaries(ids, st.integers(0, 3), max_size=3))
        completed = data.draw(st.dictionaries(ids, st.integers(0, 2), max_size=3))
        self._both("report_transfers", "report_transfers", enqueued, completed)

    @rule(ids=st.lists(st.integers(0, 40), max_size=2))
    def complete_unknown(self, ids: list[int]) -> None:
        self._both("complete (maybe unknown)", "complete", ids)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), page=st.integers(0, 7))
    def restore(self, data: st.DataObject, page: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self._both("plan_restore", "plan_restore", request_id, page)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), hot=st.booleans())
    def residency(self, data: st.DataObject, hot: bool) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        if hot:
            self._both("require_hot", "require_hot", request_id)
        self._both("update_residency", "update_residency", request_id)

    @rule(request_id=st.sampled_from(REQUEST_IDS), tokens=st.integers(0, 34))
    def full_sequence(self, request_id: str, tokens: int) -> None:
        self._both("full_sequence_blocks", "full_sequence_blocks", request_id, tokens)

    @rule(request_id=st.sampled_from(REQUEST_IDS), start=st.integers(0, 34),
          count=st.integers(0, 12))
    def mirrors(self, request_id: str, start: int, count: int) -> None:
        self._both("row_mirrors", "row_mirrors", request_id, start, count)

    @rule(ids=st.lists(st.sampled_from(REQUEST_IDS), max_size=3))
    def residency_updates(self, ids: list[str]) -> None:
        self._both("take_residency_updates", "take_residency_updates", ids)
        for request_id in ids:
            self._both("fully_resident", "fully_resident", request_id)

    @rule(request_id=st.sampled_from(REQUEST_IDS), finished=st.booleans())
    def free(self, request_id: str, finished: bool) -> None:
        self._both("free", "free", request_id, finished)
        self.tokens.pop(request_id, None)

    @rule(request_id=st.sampled_from(REQUEST_IDS), finished=st.booleans())
    def pop_for_free(self, request_id: str, finished: bool) -> None:
        self._both("pop_for_free", "pop_for_free", request_id, finished)
        self.tokens.pop(request_id, None)

    @rule(fence_id=st.integers(0, 6))
    def release_fence(self, fence_id: int) -> None:
        self._both("release_fence", "release_fence", fence_id)

    @rule(block_ids=st.lists(st.integers(0, 15), max_size=3))
    def evict_host_blocks(self, block_ids: list[int]) -> None:
        self._both("evict_host_blocks", "evict_host_blocks", block_ids)

    @rule(num_blocks=st.integers(0, 4))
    def take_shared(self, num_blocks: int) -> None:
        self._both("take_shared", "take_shared", num_blocks)

    @rule(data=st.data())
    def free_shared(self, data: st.DataObject) -> None:
        held = sorted(self.ref.shared) + [0, 99]
        ids = data.draw(st.lists(st.sampled_from(held), max_size=3))
        self._both("free_shared", "free_shared", ids)

    @rule(num_blocks=st.integers(0, 4))
    def take_host(self, num_blocks: int) -> None:
        self._both("take_host", "take_host", num_blocks)

    @rule(data=st.data())
    def free_host(self, data: st.DataObject) -> None:
        held = sorted(self.ref.host_taken) + [0, 99]
        self._both("free_host", "free_host", data.draw(st.lists(st.sampled_from(held), max_size=3)))

    @rule(request_id=st.sampled_from(REQUEST_IDS), num_tokens=st.integers(0, 34),
          hit=st.lists(st.integers(1, 13), max_size=3), external=st.integers(0, 12),
          local=st.one_of(st.none(), st.integers(0, 14)))
    def capacity(self, request_id: str, num_tokens: int, hit: list[int], external: int,
                 local: int | None) -> None:
        before = self.ref.snapshot()
        self._both("capacity_needed", "capacity_needed", request_id, num_tokens,
                   [b for b in hit if b < self.ref.config.host_num_blocks], external, local)
        assert self.ref.snapshot() == before, "capacity_needed changed the state"

    @rule()
    def take_host_events(self) -> None:
        self._both("take_host_events", "take_host_events")

    @rule()
    def reset(self) -> None:
        self._both("reset_host_cache", "reset_host_cache")

    @invariant()
    def agree_and_hold(self) -> None:
        if not hasattr(self, "ref"):
            return
        _same(self.ref.snapshot(), self.opt.snapshot(), "snapshot")
        self.ref.check_invariants()


TestHostTierLockstep = HostTierMachine.TestCase
