"""The lockstep machine over hybrid models.

Random mixes of 1-4 attention types from {full, sliding window (several
windows), chunked local, Mamba (all / align / none modes, speculative
blocks)}, 1-3 groups per type with mixed block sizes, EAGLE on and off,
sliding-window retention intervals, admission caps (max_num_batched_tokens),
plus cross-attention (encoder-decoder) and attention-sink groups now and then
(``tests/strategies.py``). Every rule of
:class:`tests.test_differential.Lockstep` runs against every implementation
with full-state comparison and every implementation's invariants after every
step.
"""

from __future__ import annotations

from hypothesis.stateful import MultipleResults, initialize

from tests.strategies import Setup, hybrid_setups
from tests.test_differential import LOCKSTEP_SETTINGS, Lockstep


class HybridLockstepMachine(Lockstep):
    """Hybrid configurations, prefix caching on (and sometimes off)."""

    @initialize(target=Lockstep.request_ids, setup=hybrid_setups())
    def configure(self, setup: Setup) -> MultipleResults[str]:
        return self.build(setup)


HybridLockstepMachine.TestCase.settings = LOCKSTEP_SETTINGS
test_hybrid_lockstep = HybridLockstepMachine.TestCase
