"""The lockstep machine over Mamba sub-block hits with copy-on-write
(spec/mamba.md "Sub-block hits", MPART-1..4).

Full-attention groups at the hash block (2 tokens) beside one or two Mamba
``align`` groups of 4 or 8 tokens, with or without prefill checkpoints,
sub-block hits switched on in every implementation. Prompts share prefixes,
so hits end inside Mamba blocks; the copies are drained and compared (source,
destination and retained ids) whenever the engine would, and their
retentions released later, in any order: every implementation must agree
and keep every invariant (REQ-1 counts the retentions) after every step.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis.stateful import MultipleResults, initialize, precondition, rule

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec
from tests.strategies import ALPHABET, Setup, manager_options, workloads
from tests.test_differential import LOCKSTEP_SETTINGS, Lockstep


@st.composite
def partial_setups(draw: st.DrawFn) -> Setup:
    mamba_block = draw(st.sampled_from([4, 8]))
    checkpoints = draw(st.booleans())
    specs: list[KVCacheSpec] = [FullAttentionSpec(2, 1, 8, "float16")
                                for _ in range(draw(st.integers(1, 2)))]
    specs += [MambaSpec(mamba_block, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align",
                        num_speculative_blocks=draw(st.integers(0, 2)),
                        num_prefill_checkpoint_blocks=int(checkpoints),
                        prefill_checkpoint_alignment=draw(st.sampled_from([1, 2, 4])) if checkpoints else None)
              for _ in range(draw(st.integers(1, 2)))]
    groups = tuple(KVCacheGroupSpec((f"layer.{index}",), spec)
                   for index, spec in enumerate(draw(st.permutations(specs))))
    max_model_len = draw(st.integers(16, 48))
    prefixes = draw(st.lists(st.lists(ALPHABET, min_size=6, max_size=30), min_size=1, max_size=2))
    options = draw(manager_options(alignment=mamba_block, enable_caching=True,
                                   hash_fns=("sha256", "xxh3_128"), sparse=True))
    # EAGLE is drawn too: allowed with sub-block hits since D-MAMBA-36.
    options["hash_block_size"] = 2
    # The EAGLE resume checkpoint (MPART-6, D-MAMBA-40), refused alike where unsupported.
    options["shared_prefix_checkpoint"] = draw(st.booleans())
    return Setup(config=KVCacheConfig(draw(st.integers(16, 80)), (), groups),
                 max_model_len=max_model_len, options=options, prefixes=prefixes,
                 workload=draw(workloads(prefixes, max_model_len)))


class MambaPartialHitLockstep(Lockstep):
    """Sub-block hits on in every implementation, copies drained and released."""

    @initialize(target=Lockstep.request_ids, setup=partial_setups())
    def configure(self, setup: Setup) -> MultipleResults[str]:
        self.retained: list[list[int]] = []
        resume = setup.options.pop("shared_prefix_checkpoint")
        result = self.build(setup)
        self.each(lambda i, m: m.enable_partial_hash_hits(shared_prefix_checkpoint=resume))
        return result

    @rule()
    def take_kv_cache_block_copies(self) -> None:
        """The engine drains the copies each step: the same pairs and retained
        ids everywhere; each retained id is held (MPART-3)."""
        copies, retained = self.each(lambda i, m: m.take_kv_cache_block_copies())[0]
        assert retained == [block for pair in copies for block in pair]
        for source, destination in copies:
            assert source != destination and 0 not in (source, destination)
        if retained:
            self.retained.append(retained)

    @precondition(lambda self: bool(self.retained))
    @rule(data=st.data())
    def release_copy_retentions(self, data: st.DataObject) -> None:
        """The step that ran some copies was processed: release its retentions."""
        batch = self.retained.pop(data.draw(st.integers(0, len(self.retained) - 1), label="batch"))
        self.each(lambda i, m: m.release_copy_retentions(batch))

    @precondition(lambda self: bool(self.managers))
    @rule(block_id=st.integers(-1, 8))
    def release_unretained(self, block_id: int) -> None:
        """A release naming a block no taken copy retains is refused with no change."""
        if any(block_id in batch for batch in self.retained):
            return
        self.each(lambda i, m: m.release_copy_retentions([block_id]))


MambaPartialHitLockstep.TestCase.settings = LOCKSTEP_SETTINGS
test_mamba_partial_hit_lockstep = MambaPartialHitLockstep.TestCase
