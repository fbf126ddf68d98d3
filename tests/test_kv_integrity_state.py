"""No request ever reads state or encoder KV it did not compute: the KV
integrity machine (tests/test_kv_integrity.py) on Mamba and cross-attention
groups, alone or beside attention groups.

Mamba (modes ``none``, ``all``, ``align``; with and without a speculative
block): the engine modelled here writes, for a step computing positions
``[start, stop)``, the state after position ``min((k + 1) * b, stop) - 1``
into the request's block ``k`` of every block position the step touches
(the running state in the last one; in ``all`` mode the state at each block
end it passes, which is what the manager caches under that block's hash).
Align mode's blocks before the state are padding, so an ``align`` engine
ends a step that completes a block exactly at a block boundary (as vLLM's
scheduler aligns Mamba chunks); then every completed block holds the state
at its end too. Before a step the state it reads (block ``(start - 1) //
b``, a prefix hit's state at admission) must be the state of the request's
own prefix; after every step every block a running request still holds up
to its state block must carry the state at its end (the state block: after
the last computed token).

Cross-attention: a request's encoder output (``num_encoder_tokens`` values
derived from the request) is written into its cross-attention blocks at
admission and must read back unchanged, every position kept, while the
request runs (the blocks are never cached or shared, XATTN-1).

Gates: the mislabelled-cache bug of tests/test_kv_integrity.py on Mamba
``all``/``align`` (a hit hands over a state block whose hash names another
position), and a use-after-free of encoder blocks (released after the first
step but still read), each caught by the values alone with the manager's own
invariant checks off.
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
from hypothesis.stateful import initialize, invariant, run_state_machine_as_test  # noqa: E402

import pagedkv.optimized as optimized  # noqa: E402
from pagedkv.optimized.groups.cross_attention import CrossAttentionManager  # noqa: E402
from pagedkv.optimized.tensor import BlockTables, KVCacheMemory  # noqa: E402
from pagedkv.spec.kv_cache_spec import (  # noqa: E402
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec  # noqa: E402
from pagedkv.spec.request import Request  # noqa: E402
from tests.test_kv_integrity import (  # noqa: E402
    MAX_MODEL_LEN,
    MAX_REQS,
    SCRATCH,
    KVIntegrityMachine,
    Running,
    _config,
    mislabelled_cache,
    prefix_value,
)


def encoder_value(request: Request, position: int) -> float:
    """What the encoder writes for ``position`` of ``request``'s encoder
    input: a function of the request (two requests never share an encoder
    output here), never zero, exact in float32."""
    digest = hashlib.blake2b(repr(("encoder", request.request_id, position)).encode(), digest_size=4).digest()
    return float(int.from_bytes(digest, "little") % (1 << 24) + 1)


def num_encoder_tokens(request: Request) -> int:
    """The request's encoder input length, 1 to 12, fixed per request."""
    return 1 + int(request.request_id[1:]) * 7 % 12


def _mamba(block_size: int, mode: str, speculative: int) -> MambaSpec:
    return MambaSpec(block_size, shapes=((1,),), dtypes=("float32",), mamba_cache_mode=mode,
                     num_speculative_blocks=speculative)


@st.composite
def state_models(draw: st.DrawFn, modes: tuple[str, ...] = ("none", "all", "align"),
                 encoder: bool = True) -> list[KVCacheSpec]:
    """A Mamba group (one of ``modes``) alone or after a full-attention
    group (hybrid models), or (``encoder``) an encoder-decoder: full
    attention, maybe a sliding window, and a cross-attention group."""
    block_size = draw(st.sampled_from([2, 4]))
    if not modes or (encoder and draw(st.integers(0, 2)) == 0):
        specs: list[KVCacheSpec] = [FullAttentionSpec(block_size, 1, 1, "float32")]
        if draw(st.booleans()):
            specs.append(SlidingWindowSpec(block_size, 1, 1, "float32", sliding_window=draw(st.integers(1, 6))))
        specs.append(CrossAttentionSpec(draw(st.sampled_from([2, 4])), 1, 1, "float32"))
        return specs
    mamba = _mamba(block_size * draw(st.sampled_from([1, 2])), draw(st.sampled_from(modes)),
                   draw(st.integers(0, 1)))
    return [FullAttentionSpec(block_size, 1, 1, "float32"), mamba] if draw(st.booleans()) else [mamba]


PREFIXES = st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=20), min_size=1, max_size=3)


class StateIntegrityMachine(KVIntegrityMachine):
    """The KV integrity machine with Mamba and cross-attention groups."""

    allow_external = False   # connector KV for Mamba state is not modelled

    @initialize(specs=state_models(), num_blocks=st.integers(12, 40), prefixes=PREFIXES, use_eagle=st.booleans())
    def setup(self, specs: list[KVCacheSpec], num_blocks: int,
              prefixes: list[list[int]], use_eagle: bool) -> None:
        self._build(specs, num_blocks, prefixes, use_eagle)

    def _build(self, specs: list[KVCacheSpec], num_blocks: int, prefixes: list[list[int]], use_eagle: bool) -> None:
        self.specs = specs  # type: ignore[assignment]
        self.model_specs = specs
        self.num_blocks = num_blocks
        self.manager = optimized.KVCacheManager(_config(specs, num_blocks), MAX_MODEL_LEN,  # type: ignore[arg-type]
                                                use_eagle=use_eagle)
        self.memory = KVCacheMemory(_config(specs, num_blocks + SCRATCH), "cpu")  # type: ignore[arg-type]
        self.host = KVCacheMemory.host_mirror(self.memory, num_blocks + SCRATCH)
        self.mamba_groups = [g for g, spec in enumerate(specs) if isinstance(spec, MambaSpec)]
        self.cross_groups = [g for g, spec in enumerate(specs) if isinstance(spec, CrossAttentionSpec)]
        self.attention_groups = [g for g in range(len(specs))
                                 if g not in self.mamba_groups and g not in self.cross_groups]
        self.keys = [self._values_view(g) for g in range(len(specs))]
        self.tables = BlockTables([s.block_size for s in specs], MAX_REQS,
                                  [MAX_MODEL_LEN // s.block_size + 3 for s in specs], num_blocks + SCRATCH)
        self.prefixes = prefixes
        self.encoded: set[str] = set()   # running requests whose encoder output is written

    # -- the engine's side ------------------------------------------------------------

    def _limit_chunk(self, start: int, chunk: int) -> int:
        stop = start + chunk
        for g in self.mamba_groups:
            spec = self.model_specs[g]
            assert isinstance(spec, MambaSpec)
            size = spec.block_size
            if spec.mamba_cache_mode == "align" and stop // size > start // size and stop % size:
                stop = stop // size * size   # completes a block: end the step on its boundary
        return stop - start

    def _admission_kwargs(self, request: Request) -> dict[str, Any]:
        return {"num_encoder_tokens": num_encoder_tokens(request)} if self.cross_groups else {}

    def _state(self, group_id: int, block: int) -> float:
        return float(self.keys[group_id][block, 0])

    def _write(self, entry: Running, start: int, stop: int) -> None:
        request = entry.request
        ids = self.manager.get_block_ids(request.request_id)
        if request.request_id not in self.encoded:
            # The encoder runs once per admission and fills the cross-attention blocks.
            self.encoded.add(request.request_id)
            for g in self.cross_groups:
                size = self.specs[g].block_size
                for position in range(num_encoder_tokens(request)):
                    block = ids[g][position // size]
                    self.keys[g][block, position % size, 0, 0] = encoder_value(request, position)
        if start < stop:
            for g in self.mamba_groups:
                size = self.specs[g].block_size
                if start > 0:   # the state this step continues from (a hit's, at admission)
                    block = ids[g][(start - 1) // size]
                    want = prefix_value(request, start - 1)
                    assert block and self._state(g, block) == want, (
                        f"KV mismatch: {request.request_id} group {g} (Mamba) continues from a state it did "
                        f"not compute: block {block} holds {self._state(g, block) if block else None}, "
                        f"expected {want} (after position {start - 1})")
                for index in range(start // size, (stop - 1) // size + 1):
                    if ids[g][index]:
                        self.keys[g][ids[g][index], 0] = prefix_value(request, min((index + 1) * size, stop) - 1)
        super()._write(entry, start, stop)

    def _drop(self, entry: Running, finished: bool) -> None:
        self.encoded.discard(entry.request.request_id)
        super()._drop(entry, finished)

    # -- the property ------------------------------------------------------------------

    @invariant()
    def every_running_request_reads_its_own_state_and_encoder_kv(self) -> None:
        if not hasattr(self, "manager"):
            return
        for request_id, entry in self.running.items():
            request = entry.request
            computed = request.num_computed_tokens
            ids = self.manager.get_block_ids(request_id)
            for g in self.mamba_groups:
                size = self.specs[g].block_size
                last = (computed - 1) // size
                assert last < len(ids[g]) and ids[g][last], (
                    f"{request_id} group {g} (Mamba): the state after position {computed - 1} is not kept")
                for index in range(last + 1):
                    block = ids[g][index]
                    if not block:
                        continue
                    position = min((index + 1) * size, computed) - 1
                    got, want = self._state(g, block), prefix_value(request, position)
                    assert got == want, (f"KV mismatch: {request_id} group {g} (Mamba) block {block} at index "
                                         f"{index} holds {got}, not its state after position {position} ({want})")
            for g in self.cross_groups:
                size = self.specs[g].block_size
                for position in range(num_encoder_tokens(request)):
                    index = position // size
                    assert index < len(ids[g]) and ids[g][index], (
                        f"{request_id} group {g} (cross-attention): encoder position {position} needed but not kept")
                    got = float(self.keys[g][ids[g][index], position % size, 0, 0])
                    want = encoder_value(request, position)
                    assert got == want, (f"KV mismatch: {request_id} group {g} (cross-attention) reads encoder KV "
                                         f"it did not compute at position {position}: {got}, expected {want}")


StateIntegrityMachine.TestCase.settings = settings(settings(), stateful_step_count=40,
                                                   max_examples=max(settings().max_examples // 2, 10))
test_state_integrity = StateIntegrityMachine.TestCase


# -- gates: planted bugs the values alone catch --------------------------------------------


class _UncheckedCachingMamba(StateIntegrityMachine):
    """Mamba groups whose states are cached (``all``, ``align``), no manager invariant checks."""

    check_manager_invariants = False

    @initialize(specs=state_models(("all", "align"), encoder=False), num_blocks=st.integers(12, 40),
                prefixes=PREFIXES, use_eagle=st.booleans())
    def setup(self, specs: list[KVCacheSpec], num_blocks: int,
              prefixes: list[list[int]], use_eagle: bool) -> None:
        self._build(specs, num_blocks, prefixes, use_eagle)


class _UncheckedEncoder(StateIntegrityMachine):
    """Encoder-decoder models only, no manager invariant checks."""

    check_manager_invariants = False

    @initialize(specs=state_models(()), num_blocks=st.integers(12, 40), prefixes=PREFIXES, use_eagle=st.booleans())
    def setup(self, specs: list[KVCacheSpec], num_blocks: int,
              prefixes: list[list[int]], use_eagle: bool) -> None:
        self._build(specs, num_blocks, prefixes, use_eagle)


def _gate_settings() -> settings:
    return settings(max_examples=300, stateful_step_count=40, database=None, derandomize=True, deadline=None,
                    print_blob=False, phases=(Phase.generate,))


def test_gate_mamba_mislabelled_state_is_caught() -> None:
    with mislabelled_cache(), pytest.raises(AssertionError, match="KV mismatch"):
        run_state_machine_as_test(_UncheckedCachingMamba, settings=_gate_settings())  # type: ignore[no-untyped-call]


@contextmanager
def encoder_blocks_freed_early() -> Iterator[None]:
    """Plant a bug: a cross-attention group gives its encoder blocks back to
    the pool at the request's first decoder step while the request still
    reads them (a use-after-free; ``free`` later skips what it gave back),
    so another request can take and overwrite them."""
    original_remove, original_release = CrossAttentionManager.remove_skipped_blocks, CrossAttentionManager.release
    given_back: dict[tuple[int, str], list[int]] = {}

    def remove(self: CrossAttentionManager, request_id: str, num_total_computed_tokens: int,
               num_prompt_tokens: int | None = None) -> None:
        key = (id(self), request_id)
        blocks = [block for block in self.req_to_blocks.get(request_id, []) if block]
        if key not in given_back and blocks:
            given_back[key] = blocks
            self.block_pool.free_blocks(blocks)

    def release(self: CrossAttentionManager, request_id: str) -> None:
        if given_back.pop((id(self), request_id), None) is not None:
            self.req_to_blocks[request_id] = []
        original_release(self, request_id)

    CrossAttentionManager.remove_skipped_blocks = remove  # type: ignore[method-assign,assignment]
    CrossAttentionManager.release = release  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        CrossAttentionManager.remove_skipped_blocks = original_remove  # type: ignore[method-assign]
        CrossAttentionManager.release = original_release  # type: ignore[method-assign]


def test_gate_encoder_use_after_free_is_caught() -> None:
    with encoder_blocks_freed_early(), pytest.raises(AssertionError, match="KV mismatch"):
        run_state_machine_as_test(_UncheckedEncoder, settings=_gate_settings())  # type: ignore[no-untyped-call]
