"""The lockstep machine under decode context parallelism (DCP) with Mamba
groups (spec/mamba.md, "DCP and full-attention sub-block hits", FPART-1..5, and
the EAGLE resume checkpoint, MPART-5..6).

A DCP model's attention blocks span ``dcp`` times their spec's tokens while
a Mamba state keeps its own size, so full-attention groups here are 1, 2 or
4 hash blocks (2 tokens) long beside Mamba ``align`` groups of 1, 2 or 4
hash blocks; ``dcp`` is drawn from 1, 2 and 4 and handed to
``enable_partial_hash_hits``. Where DCP widens vLLM's condition (a Mamba
block equal to the hash block) the switch is on; where no implementation
supports it, every implementation must refuse it alike and the machine runs
block-granular. Hits end inside full-attention blocks, which are copied on
write like Mamba states: copies are drained, compared and released as in
``test_mamba_partial_lockstep``.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis.stateful import MultipleResults, initialize

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec
from tests.strategies import ALPHABET, Setup, manager_options, workloads
from tests.test_differential import LOCKSTEP_SETTINGS, Lockstep
from tests.test_mamba_partial_lockstep import MambaPartialHitLockstep


@st.composite
def dcp_setups(draw: st.DrawFn) -> Setup:
    dcp = draw(st.sampled_from([1, 2, 4]))
    mamba_block = draw(st.sampled_from([2, 4, 8]))
    checkpoints = draw(st.booleans())
    # Effective sizes: an attention spec's tokens per rank widened by DCP
    # (2, 4 or 8 tokens: 1 to 4 hash blocks); the Mamba state is
    # replicated and keeps its own size.
    per_rank = [2, 4] if dcp == 1 else [1, 2]
    specs: list[KVCacheSpec] = [FullAttentionSpec(draw(st.sampled_from(per_rank)) * dcp, 1, 8, "float16")
                                for _ in range(draw(st.integers(1, 2)))]
    specs += [MambaSpec(mamba_block, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align",
                        num_speculative_blocks=draw(st.integers(0, 1)),
                        num_prefill_checkpoint_blocks=int(checkpoints),
                        prefill_checkpoint_alignment=draw(st.sampled_from([1, 2, 4])) if checkpoints else None)
              for _ in range(draw(st.integers(1, 2)))]
    # Draft-layer marks now and then (D-SWA-14): an EAGLE group beside
    # unmarked ones, the full-attention group's one-hash-unit rewind inside
    # its block (FPART-5) or not.
    groups = tuple(KVCacheGroupSpec((f"layer.{index}",), spec, is_eagle_group=draw(st.booleans()))
                   for index, spec in enumerate(draw(st.permutations(specs))))
    max_model_len = draw(st.integers(16, 48))
    prefixes = draw(st.lists(st.lists(ALPHABET, min_size=5, max_size=30), min_size=1, max_size=2))
    alignment = max(spec.block_size for spec in specs)
    options = draw(manager_options(alignment=alignment, enable_caching=True,
                                   hash_fns=("sha256", "xxh3_128"), sparse=True))
    # EAGLE is drawn too (manager_options): with a full-attention block larger
    # than the hash block it gives back one hash block inside it (D-MAMBA-38).
    options["hash_block_size"] = 2
    options["dcp_world_size"] = dcp  # handed to enable_partial_hash_hits, not to the constructor
    # The EAGLE resume checkpoint (MPART-6): refused alike without EAGLE or
    # with re-prefilled tokens (D-MAMBA-40), which leaves the run block-granular.
    options["shared_prefix_checkpoint"] = draw(st.booleans())
    return Setup(config=KVCacheConfig(draw(st.integers(16, 80)), (), groups),
                 max_model_len=max_model_len, options=options, prefixes=prefixes,
                 workload=draw(workloads(prefixes, max_model_len)))


class DcpLockstep(MambaPartialHitLockstep):
    """Sub-block hits switched on with the drawn DCP size where supported."""

    @initialize(target=Lockstep.request_ids, setup=dcp_setups())
    def configure(self, setup: Setup) -> MultipleResults[str]:
        self.retained: list[list[int]] = []
        dcp = setup.options.pop("dcp_world_size")
        resume = setup.options.pop("shared_prefix_checkpoint")
        result = self.build(setup)
        setup.options["dcp_world_size"] = dcp  # back for the post-conditions (MRET-1 reads it)
        # Refused alike everywhere where unsupported (``each`` compares the
        # errors and the unchanged states): the run is then block-granular.
        self.each(lambda i, m: m.enable_partial_hash_hits(dcp, shared_prefix_checkpoint=resume))
        return result


DcpLockstep.TestCase.settings = LOCKSTEP_SETTINGS
test_dcp_lockstep = DcpLockstep.TestCase
