"""The lockstep machine over Mamba prefill-checkpoint models (spec/mamba.md).

The hybrid machine draws checkpoint specs now and then; this one always
does: one or two full-attention groups hashed at 2 tokens beside one or two
Mamba ``align`` groups with checkpoints, Mamba blocks of 4 or 8 (so most
checkpoints land inside a block, MCKPT-4), speculative blocks, EAGLE, and
retention interval 0 (checkpoints only on the prefill-end chunk). Every rule
of :class:`tests.test_differential.Lockstep` runs with the checkpoint tables,
the boundary-state offers (MOFF-1) and the full state compared after every step.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis.stateful import MultipleResults, initialize

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec
from tests.strategies import ALPHABET, Setup, manager_options, workloads
from tests.test_differential import LOCKSTEP_SETTINGS, Lockstep


@st.composite
def checkpoint_setups(draw: st.DrawFn) -> Setup:
    mamba_block = draw(st.sampled_from([4, 8]))
    specs: list[KVCacheSpec] = [FullAttentionSpec(2, 1, 8, "float16")
                                for _ in range(draw(st.integers(1, 2)))]
    specs += [MambaSpec(mamba_block, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align",
                        num_speculative_blocks=draw(st.integers(0, 2)), num_prefill_checkpoint_blocks=1,
                        prefill_checkpoint_alignment=draw(st.sampled_from([1, 2, 4])))
              for _ in range(draw(st.integers(1, 2)))]
    groups = tuple(KVCacheGroupSpec((f"layer.{index}",), spec)
                   for index, spec in enumerate(draw(st.permutations(specs))))
    max_model_len = draw(st.integers(24, 64))
    prefixes = draw(st.lists(st.lists(ALPHABET, min_size=12, max_size=40), min_size=1, max_size=2))
    options = draw(manager_options(alignment=mamba_block, enable_caching=True,
                                   hash_fns=("sha256", "xxh3_128"), sparse=True))
    return Setup(config=KVCacheConfig(draw(st.integers(24, 120)), (), groups),
                 max_model_len=max_model_len, options=options, prefixes=prefixes,
                 workload=draw(workloads(prefixes, max_model_len)))


class MambaCheckpointLockstep(Lockstep):
    """Models with Mamba prefill checkpoints, caching on."""

    @initialize(target=Lockstep.request_ids, setup=checkpoint_setups())
    def configure(self, setup: Setup) -> MultipleResults[str]:
        return self.build(setup)


MambaCheckpointLockstep.TestCase.settings = LOCKSTEP_SETTINGS
test_mamba_checkpoint_lockstep = MambaCheckpointLockstep.TestCase
