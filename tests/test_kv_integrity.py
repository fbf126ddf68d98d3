"""No request ever reads KV it did not compute: the manager and the tensor
path driven together, end to end, on the CPU.

A Hypothesis state machine plays an engine: it admits requests (prefix hits,
external tokens, lookahead, delayed caching), runs chunked prefill and
decode, samples tokens, preempts and finishes requests, evicts blocks,
resets the prefix cache, offloads blocks to a host mirror and back
(``swap_blocks``) and moves them through scratch blocks (``copy_blocks``).
Every token a step computes is written through the slot mapping as a value
derived from its whole prefix (tokens, cache salt, LoRA): what attention
would have produced there. After every step each running request's KV is
read back through its block-table row, and every position it still keeps
must hold its own prefix's value; the positions its attention still needs
must be kept. A prefix hit that handed over a block computed for another
prefix (or another salt) shows up as a wrong value.

Attention types: full, sliding window, chunked local, attention sinks, and
hybrids of them (windowed groups check only what they keep). Mamba state and
cross-attention (encoder) blocks: tests/test_kv_integrity_state.py, a
subclass of this machine (the hooks ``_limit_chunk``, ``_admission_kwargs``,
``_write`` and ``attention_groups`` are there for it).

The gate (``test_gate_mislabelled_cached_block_is_caught``) plants a bug that
caches a block under the hash of the next position, so that a later hit
hands out a block whose hash does not match its content, and checks the
machine fails on the values alone (the manager's own invariant checks off).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import hypothesis.strategies as st  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import pagedkv.optimized as optimized  # noqa: E402
from pagedkv.optimized.pool.block_pool import BlockPool  # noqa: E402
from pagedkv.optimized.tensor import BlockTables, KVCacheMemory, copy_blocks, swap_blocks  # noqa: E402
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from pagedkv.spec.kv_cache_spec import (  # noqa: E402
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.request import Request  # noqa: E402

MAX_MODEL_LEN = 40
MAX_REQS = 6
SCRATCH = 8          # blocks past the manager's pool, for copy round trips
ALPHABET = st.integers(0, 2)


def prefix_value(request: Request, position: int) -> float:
    """What attention writes for ``position``: a function of everything
    before and at it (and of the salt and adapter), never zero, exact in
    float32."""
    digest = hashlib.blake2b(repr((request.cache_salt, request.lora_name,
                                   request.all_token_ids[:position + 1])).encode(), digest_size=4).digest()
    return float(int.from_bytes(digest, "little") % (1 << 24) + 1)


def _spec(kind: str, block_size: int, size: int) -> AttentionSpec:
    if kind == "full":
        return FullAttentionSpec(block_size, 1, 1, "float32")
    if kind == "sliding_window":
        return SlidingWindowSpec(block_size, 1, 1, "float32", sliding_window=size)
    if kind == "chunked_local":
        return ChunkedLocalAttentionSpec(block_size, 1, 1, "float32", attention_chunk_size=block_size * size)
    return SinkFullAttentionSpec(block_size, 1, 1, "float32", sink_len=block_size * size)


@st.composite
def attention_groups(draw: st.DrawFn) -> list[AttentionSpec]:
    """One to three groups of full, sliding-window, chunked-local or sink attention."""
    kinds = draw(st.lists(st.sampled_from(["full", "sliding_window", "chunked_local", "sink"]),
                          min_size=1, max_size=3))
    return [_spec(kind, draw(st.sampled_from([2, 4])), draw(st.integers(1, 6))) for kind in kinds]


def _config(specs: list[AttentionSpec], num_blocks: int) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks,
        tuple(KVCacheTensor(num_blocks * spec.page_size_bytes, (f"layer.{g}",)) for g, spec in enumerate(specs)),
        tuple(KVCacheGroupSpec((f"layer.{g}",), spec) for g, spec in enumerate(specs)))


class Running:
    """What the engine tracks for one admitted request."""

    def __init__(self, request: Request, row: int) -> None:
        self.request = request
        self.row = row
        self.last_start = 0   # first position computed by the latest step


class KVIntegrityMachine(RuleBasedStateMachine):
    """The optimized manager, block tables and KV memory in one engine loop."""

    check_manager_invariants = True
    allow_external = True
    """Draw externally computed (connector) tokens at admission."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: list[Request] = []
        self.running: dict[str, Running] = {}
        self.next_id = 0

    @initialize(specs=attention_groups(), num_blocks=st.integers(10, 40),
                prefixes=st.lists(st.lists(ALPHABET, min_size=4, max_size=20), min_size=1, max_size=3),
                use_eagle=st.booleans())
    def setup(self, specs: list[AttentionSpec], num_blocks: int, prefixes: list[list[int]], use_eagle: bool) -> None:
        sinks = sum(s.sink_len // s.block_size for s in specs if isinstance(s, SinkFullAttentionSpec) and s.sink_len)
        num_blocks += sinks
        self.specs = specs
        self.num_blocks = num_blocks
        self.manager = optimized.KVCacheManager(_config(specs, num_blocks), MAX_MODEL_LEN, use_eagle=use_eagle)
        memory_config = _config(specs, num_blocks + SCRATCH)
        self.memory = KVCacheMemory(memory_config, "cpu")
        self.host = KVCacheMemory.host_mirror(self.memory, num_blocks + SCRATCH)
        self.attention_groups = list(range(len(specs)))
        """Groups holding one K/V slot per token position (the others: the subclass's)."""
        self.keys = [self._values_view(g) for g in range(len(specs))]
        # Two spare columns: a Mamba row may hold speculative blocks past the positions.
        self.tables = BlockTables([s.block_size for s in specs], MAX_REQS,
                                  [MAX_MODEL_LEN // s.block_size + 3 for s in specs], num_blocks + SCRATCH)
        self.prefixes = prefixes

    def _values_view(self, group_id: int) -> Any:
        """The tensor the machine writes group ``group_id``'s values into:
        ``[num_blocks, block_size, heads, head]`` keys, or a Mamba state
        ``[num_blocks, 1]``."""
        views = self.memory.layer(f"layer.{group_id}").views
        return views["key"] if "key" in views else views["state0"]

    def _limit_chunk(self, start: int, chunk: int) -> int:
        """The engine's chunk from position ``start`` (the subclass aligns Mamba steps)."""
        return chunk

    def _admission_kwargs(self, request: Request) -> dict[str, Any]:
        """Extra ``allocate_slots`` arguments at admission (encoder tokens)."""
        return {}

    # -- the engine's side ------------------------------------------------------------

    def _refresh_row(self, entry: Running) -> None:
        if self.tables.is_occupied(entry.row):
            self.tables.remove_request(entry.row)
        self.tables.add_request(entry.row, self.manager.get_block_ids(entry.request.request_id))
        self.tables.commit()

    def _write(self, entry: Running, start: int, stop: int) -> None:
        """The forward pass computes positions ``[start, stop)``: each
        group's layer writes the prefix value through the slot mapping."""
        if start >= stop:
            return
        positions = torch.arange(start, stop)
        rows = torch.full_like(positions, entry.row)
        slots = self.tables.slot_mapping(rows, positions)
        values = torch.tensor([prefix_value(entry.request, p) for p in range(start, stop)], dtype=torch.float32)
        for g in self.attention_groups:
            spec = self.specs[g]
            group_slots = slots[g]
            self.keys[g][group_slots // spec.block_size, group_slots % spec.block_size, 0, 0] = values

    def _free_row(self) -> int | None:
        used = {entry.row for entry in self.running.values()}
        return next((row for row in range(MAX_REQS) if row not in used), None)

    @rule(data=st.data())
    def new_request(self, data: st.DataObject) -> None:
        prefix = data.draw(st.sampled_from(self.prefixes))
        tokens = (prefix[:data.draw(st.integers(0, len(prefix)))] + data.draw(st.lists(ALPHABET, max_size=10)))
        tokens = tokens[:MAX_MODEL_LEN - 4] or [0]
        extra: dict[str, Any] = {}
        if data.draw(st.integers(0, 3)) == 0:
            extra["cache_salt"] = data.draw(st.sampled_from(["s1", "s2"]))
        if data.draw(st.integers(0, 5)) == 0:
            extra["lora_name"] = "adapter"
            extra["lora_id"] = 1
        self.waiting.append(self.manager.make_request(f"r{self.next_id}", tokens, **extra))
        self.next_id += 1

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        row = self._free_row()
        if row is None:
            return
        request = self.waiting[data.draw(st.integers(0, len(self.waiting) - 1))]
        hit, num_hit = self.manager.get_computed_blocks(request)
        remaining = request.num_tokens - num_hit
        external = (data.draw(st.integers(0, remaining - 1))
                    if self.allow_external and data.draw(st.integers(0, 3)) == 0 else 0)
        chunk = self._limit_chunk(num_hit + external, data.draw(st.integers(1, remaining - external)))
        delay = data.draw(st.integers(0, 4)) == 0
        lookahead = data.draw(st.integers(0, 2))
        out = self.manager.allocate_slots(request, chunk, num_hit, hit, num_lookahead_tokens=lookahead,
                                          num_external_computed_tokens=external, delay_cache_blocks=delay,
                                          **self._admission_kwargs(request))
        if out is None:
            return
        self.waiting.remove(request)
        entry = Running(request, row)
        self.running[request.request_id] = entry
        self._refresh_row(entry)
        # External KV (P/D) arrives through the connector: the same values.
        self._write(entry, num_hit, num_hit + external + chunk)
        entry.last_start = num_hit + external
        request.num_computed_tokens = num_hit + external + chunk

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self.manager.new_step_starts()
        entry = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        request = entry.request
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= MAX_MODEL_LEN - 2:
                return self._drop(entry, finished=True)
            request.append_output_token_ids(data.draw(st.lists(ALPHABET, min_size=1, max_size=2)))
        start = request.num_computed_tokens
        chunk = self._limit_chunk(start, data.draw(st.integers(1, request.num_tokens - start)))
        out = self.manager.allocate_slots(request, chunk, num_lookahead_tokens=data.draw(st.integers(0, 2)),
                                          delay_cache_blocks=data.draw(st.integers(0, 5)) == 0)
        if out is None:
            return self._drop(entry, finished=False)   # preempted: recompute later
        self._refresh_row(entry)
        self._write(entry, start, start + chunk)
        entry.last_start = start
        request.num_computed_tokens = start + chunk

    def _drop(self, entry: Running, finished: bool) -> None:
        self.manager.free(entry.request)
        self.tables.remove_request(entry.row)
        self.tables.commit()
        del self.running[entry.request.request_id]
        entry.request.num_computed_tokens = 0
        if not finished:
            entry.request.num_preemptions += 1
            self.waiting.append(entry.request)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        entry = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        self._drop(entry, finished=data.draw(st.booleans()))

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def cache_delayed(self, data: st.DataObject) -> None:
        entry = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        self.manager.cache_blocks(entry.request, entry.request.num_computed_tokens)

    @rule(block_ids=st.lists(st.integers(0, 60), max_size=4))
    def evict(self, block_ids: list[int]) -> None:
        self.manager.evict_blocks([b for b in block_ids if b < self.num_blocks])

    @rule()
    def reset_prefix_cache(self) -> None:
        self.manager.reset_prefix_cache()

    def _held_blocks(self, entry: Running) -> list[int]:
        ids = self.manager.get_block_ids(entry.request.request_id)
        return sorted({block for group in ids for block in group if block})

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def offload_and_reload(self, data: st.DataObject) -> None:
        """Swap a request's blocks out to the host mirror, let the device
        pages be overwritten, swap them back."""
        entry = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        blocks = self._held_blocks(entry)
        if not blocks:
            return
        pairs = [(block, block) for block in blocks]
        swap_blocks(self.memory, self.host, pairs)
        for key in self.keys:
            key[blocks] = -1.0
        swap_blocks(self.host, self.memory, pairs)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def copy_round_trip(self, data: st.DataObject) -> None:
        """Copy a request's blocks to scratch blocks, scribble, copy back."""
        entry = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        blocks = self._held_blocks(entry)[:SCRATCH]
        if not blocks:
            return
        scratch = list(range(self.num_blocks, self.num_blocks + len(blocks)))
        copy_blocks(self.memory, list(zip(blocks, scratch)))
        for key in self.keys:
            key[blocks] = -2.0
        copy_blocks(self.memory, list(zip(scratch, blocks)))

    # -- the property ------------------------------------------------------------------

    def _first_needed(self, spec: AttentionSpec, start: int) -> int:
        """The first position the token at ``start`` attends to."""
        if isinstance(spec, SlidingWindowSpec):
            return max(0, start - spec.sliding_window + 1)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return start // spec.attention_chunk_size * spec.attention_chunk_size
        return 0

    @invariant()
    def every_running_request_reads_its_own_kv(self) -> None:
        if not hasattr(self, "manager"):
            return
        if self.check_manager_invariants:
            self.manager.check_invariants()
        for request_id, entry in self.running.items():
            request = entry.request
            computed = request.num_computed_tokens
            ids = self.manager.get_block_ids(request_id)
            for g, spec in enumerate(self.specs):
                row = self.tables.host_table(g)[entry.row]
                assert list(row[:len(ids[g])]) == list(ids[g]), f"table row of {request_id} group {g}"
                if g not in self.attention_groups:
                    continue
                assert isinstance(spec, AttentionSpec)
                first_needed = self._first_needed(spec, entry.last_start)
                positions = [p for p in range(computed) if p // spec.block_size < len(ids[g])
                             and ids[g][p // spec.block_size]]
                missing = [p for p in range(first_needed, computed) if p not in set(positions)]
                assert not missing, f"{request_id} group {g}: positions {missing} needed but not kept"
                if not positions:
                    continue
                index = torch.tensor(positions)
                blocks = torch.tensor([ids[g][p // spec.block_size] for p in positions])
                got = self.keys[g][blocks, index % spec.block_size, 0, 0].tolist()
                expected = [prefix_value(request, p) for p in positions]
                wrong = [(p, got_value, want) for p, got_value, want in zip(positions, got, expected)
                         if got_value != want]
                assert not wrong, (f"KV mismatch: {request_id} group {g} ({type(spec).__name__}) reads KV it "
                                   f"did not compute at (position, found, expected) {wrong[:4]}")


KVIntegrityMachine.TestCase.settings = settings(settings(), stateful_step_count=40,
                                                max_examples=max(settings().max_examples // 2, 10))
test_kv_integrity = KVIntegrityMachine.TestCase


@contextmanager
def mislabelled_cache() -> Iterator[None]:
    """Plant a bug: position ``i``'s key goes to the block of position
    ``i + 1``, so a hit hands out a block whose hash does not match what it
    holds (and the hit's freshness check, which compares keys, passes)."""
    original = BlockPool.cache_full_blocks_unchecked

    def planted(self: Any, request: Any, blocks: Any, **kwargs: Any) -> None:
        shifted = list(blocks[1:]) + list(blocks[-1:])
        original(self, request, shifted, **kwargs)

    BlockPool.cache_full_blocks_unchecked = planted  # type: ignore[method-assign]
    try:
        yield
    finally:
        BlockPool.cache_full_blocks_unchecked = original  # type: ignore[method-assign]


class UncheckedMachine(KVIntegrityMachine):
    """The machine without the manager's own invariant checks: the gate
    shows the KV values alone catch the planted bug."""

    check_manager_invariants = False


def test_gate_mislabelled_cached_block_is_caught() -> None:
    with mislabelled_cache(), pytest.raises(AssertionError, match="KV mismatch"):
        run_state_machine_as_test(UncheckedMachine, settings=settings(  # type: ignore[no-untyped-call]
            max_examples=300, stateful_step_count=40, database=None, derandomize=True, deadline=None,
            print_blob=False, phases=(Phase.generate,)))
