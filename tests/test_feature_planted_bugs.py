"""Each reference feature module's rules are checked: a planted bug in each is caught.

The rules that used to live in ``pagedkv.spec`` (imported by both
implementations, so a mistake there was invisible to the lockstep machines)
are now written twice: in ``pagedkv.reference.features`` and in
``pagedkv.optimized``. For every module of ``reference/features/`` this file
plants one wrong rule on the reference side and requires an existing test --
a lockstep machine, a scenario suite, or a test of the rule against its
definition -- to fail on it.

A bug is planted by swapping the code object of the reference function (or
method), so every name bound to it, in the kernel, the feature modules and
the tests, runs the wrong rule; the optimized twin is untouched. The catching
tests run in a subprocess with the bug in place, so nothing leaks into this
session.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings

ROOT = Path(__file__).resolve().parent.parent

# -- the planted rules: same signature as the rule they replace, wrong answer ---------
# A planted body runs with the globals of the module it is planted in, so it uses
# only builtins and its arguments.


def _peek_without_lookahead(max_length: int, num_hashed_tokens: int, num_groups: int) -> int:
    return max_length  # the several-group peek (D-SWA-15) forgotten


def _tail_boundary_reaching_the_last_token(num_prompt_tokens: int, num_block_hashes: int,
                                           hash_block_size: int, use_eagle: bool = False) -> int:
    # FPART-2's "leave one prompt token to compute" dropped.
    return max(0, min(num_prompt_tokens // hash_block_size, num_block_hashes)) * hash_block_size


def _every_configuration_supported(kinds: Any, specs: Any, block_sizes: Any, hash_block_size: int, *,
                                   enable_caching: bool, use_eagle: bool, configured: bool) -> str | None:
    return None  # D-MAMBA-15's refusals gone: sub-block hits turned on anywhere


def _checkpoint_column_one_late(query_end: int, block_size: int) -> int:
    return -(-query_end // block_size) - 1  # MCKPT-1's column off by one


def _connector_completes_without_external_tokens(num_tokens: int, num_blocks: int, block_size: int,
                                                 hash_block_size: int, sub_block: bool,
                                                 num_external_computed_tokens: int) -> bool:
    # D-API-46 without its condition: any shorter Mamba hit accepted.
    expected = -(-num_tokens // block_size) if sub_block else num_tokens // block_size
    return num_blocks < expected


def _writeback_of_reprefilled_tokens(cfg: Any, num_tokens: int) -> int:
    return max(0, num_tokens)  # the re-prefilled tokens written back, stale


def _evict_nothing(self: Any, block_ids: Any) -> list[Any]:
    return []  # evict_host_blocks keeps every hash (D-HOST-17 broken)


def _ring_admits_nothing(self: Any, num_tokens: int) -> int:
    return 0  # RING-1's one block forgotten by the admission requirement


def _gap_one_block_early(self: Any, num_prompt_tokens: int, num_settled_tokens: int) -> tuple[int, int]:
    # RSWA-1: the gap starts inside the prompt's last block.
    window_start = max(num_prompt_tokens, num_settled_tokens - self.kv_cache_spec.rswa_window)
    return num_prompt_tokens // self.block_size, window_start // self.block_size


def _eagle_groups_unmarked(managers: Any, groups: Any, block_sizes: Any, use_eagle: bool) -> None:
    for manager in managers:  # D-SWA-14 ignored: every group applies the EAGLE rule
        manager.use_eagle = use_eagle and manager.uses_eagle_rule


def _partial_keys_never_found(self: Any, partial: Any) -> Any:
    return None  # FPART-1: a hit never ends inside a full-attention block


def _hit_padding_one_more(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)  # one null block too many before a Mamba sub-block hit


def _retention_keeps_everything(manager: Any, request: Any, num_cached: int, num_full: int) -> list[bool] | None:
    return None  # MRET-1's sparse retention off


def _host_lookup_finds_nothing(self: Any, block_hashes: Any) -> tuple[int, ...]:
    return ()  # the host tier never hits


def _host_take_from_the_back(self: Any, n: int) -> list[int]:
    blocks: list[int] = self.free[len(self.free) - n:]  # the most recently released first: the wrong LRU order
    del self.free[len(self.free) - n:]
    self.evicted = []
    for b in blocks:
        self.ref[b] += 1
        if b in self.hash_of:
            self.evicted.append(self.hash_of.pop(b))
            del self.cached[self.evicted[-1]]
    return blocks


def _host_tier_checks_nothing(tier: Any) -> None:
    return None


def _slot_one_block_off(table: Any, block_size: int, token_rows: Any, positions: Any) -> list[int]:
    return [(table[r][p // block_size] + 1) * block_size + p % block_size for r, p in zip(token_rows, positions)]


def _every_block_at_the_default(ranges: Any, generated: Any, first_token: int, num_prompt_tokens: int) -> Any:
    return (35, None)  # RETM-1 dropped: no directive reaches a block


def _last_directive_wins(old: Any, priority: int, duration: Any) -> Any:
    return (priority, duration)  # RET-2's maximum rule dropped: a lower directive demotes


def _priorities_ignored(self: Any, block: Any) -> int:
    return 35  # RET-4 under priority: every block ranked at the default


def _no_checkpoint(self: Any, request_id: str, query_start: int, query_end: int, prefill_end: int) -> Any:
    return None  # MCKPT-1: no chunk ever reserves a checkpoint


def _per_group_hits_of_nothing(coordinator: Any, block_hashes: Any, max_length: int) -> Any:
    empty: list[Any] = [[] for _ in coordinator.managers]
    return tuple(empty), tuple(0 for _ in coordinator.managers)  # a connector sees no hit


def _recover_nothing(coordinator: Any) -> None:
    return None  # D-API-24: an interrupted change leaves the manager as it fell


def _every_window_block_worth_caching(start_block: int, end_block: int, block_size: int, alignment: int,
                                      need: int, shift: int, retention_interval: Any, boundaries: Any) -> Any:
    return None  # sparse retention off: every sliding-window block keeps its key


@dataclass(frozen=True)
class Plant:
    """Where a bug goes and which tests must catch it."""

    module: str
    """The reference feature module (``pagedkv.reference.features.<module>``)."""
    target: str
    """The function, or ``Class.method``, whose code is swapped."""
    planted: Callable[..., Any]
    catchers: tuple[str, ...]
    """pytest arguments: the tests that fail on the bug."""


PLANTS: dict[str, Plant] = {plant.module: plant for plant in (
    Plant("eagle_rules", "eagle_peek_limit", _peek_without_lookahead, ("tests/test_eagle_groups.py",)),
    Plant("dcp_rules", "prompt_tail_boundary", _tail_boundary_reaching_the_last_token,
          ("tests/test_eagle_sub_block.py",)),
    Plant("mamba_partial_rules", "partial_hits_supported", _every_configuration_supported,
          ("tests/test_mamba_partial_hits.py",)),
    Plant("mamba_checkpoint_rules", "checkpoint_column", _checkpoint_column_one_late,
          ("tests/test_mamba_checkpoints.py",)),
    Plant("connector_hits", "connector_completes_state", _connector_completes_without_external_tokens,
          ("tests/test_connector_completes_state.py",)),
    Plant("hisparse_rules", "writeback_tokens", _writeback_of_reprefilled_tokens, ("tests/test_hisparse_rules.py",)),
    Plant("hisparse_steps", "HostTierSteps.evict_host_blocks", _evict_nothing, ("tests/test_hisparse_steps.py",)),
    Plant("ring", "RingManager.admission_blocks", _ring_admits_nothing, ("tests/test_ring_scenarios.py",)),
    Plant("rswa", "RSWAManager.gap", _gap_one_block_early, ("tests/test_rswa_scenarios.py",)),
    Plant("eagle", "apply_eagle_groups", _eagle_groups_unmarked, ("tests/test_eagle_groups.py",)),
    Plant("dcp_partial", "FullAttentionSubBlockManager._partial_lookup", _partial_keys_never_found,
          ("tests/test_dcp_partial_hits.py",)),
    Plant("mamba_partial", "hit_padding", _hit_padding_one_more, ("tests/test_mamba_partial_hits.py",)),
    Plant("mamba_publish", "retention_mask", _retention_keeps_everything, ("tests/test_eagle_retention.py",)),
    Plant("hisparse", "HostTierManager.lookup", _host_lookup_finds_nothing, ("tests/test_hisparse.py",)),
    Plant("hisparse_state", "TierPool.take", _host_take_from_the_back, ("tests/test_hisparse_steps.py",)),
    Plant("hisparse_invariants", "check_host_tier", _host_tier_checks_nothing, ("tests/test_hisparse_config.py",)),
    Plant("retention_rules", "merged_record", _last_directive_wins, ("tests/test_retention_lockstep.py",)),
    Plant("retention", "RetentionBlockPool.effective_priority", _priorities_ignored,
          ("tests/test_retention_lockstep.py",)),
    Plant("retention_manager", "directive_of", _every_block_at_the_default,
          ("tests/test_retention_manager_lockstep.py::test_retm_1_a_range_maps_onto_the_blocks_holding_its_first_tokens",)),
    Plant("mamba_states", "MambaStateManager.checkpoint_for", _no_checkpoint, ("tests/test_mamba_checkpoints.py",)),
    Plant("operations", "per_group_hits", _per_group_hits_of_nothing,
          ("tests/test_connector_completes_state.py", "tests/test_retention.py")),
    Plant("recovery", "recover", _recover_nothing, ("tests/test_fault_injection.py",)),
    Plant("sparse_retention", "reachable_block_mask", _every_window_block_worth_caching,
          ("tests/test_retention.py",)),
    Plant("tensor_model", "reference_slot_mapping", _slot_one_block_off,
          ("tests/test_tensor_manager_trace.py", "tests/test_tensor_block_table.py")),
)}


def plant(name: str) -> Callable[[], None]:
    """Put the bug of ``PLANTS[name]`` in place, in this process; the
    callable returned takes it out again."""
    spec = PLANTS[name]
    owner: Any = importlib.import_module(f"pagedkv.reference.features.{spec.module}")
    *path, attribute = spec.target.split(".")
    for part in path:
        owner = getattr(owner, part)
    target = getattr(owner, attribute)
    assert (target.__code__.co_argcount, target.__code__.co_kwonlyargcount) == (
        spec.planted.__code__.co_argcount, spec.planted.__code__.co_kwonlyargcount), spec
    original = target.__code__
    target.__code__ = spec.planted.__code__

    def remove() -> None:
        target.__code__ = original

    return remove


def catch_all() -> dict[str, int]:
    """Each bug planted in turn, its catchers run with it in place (pytest's
    exit code per bug; 1 means tests ran and some failed), then removed.
    Run in a fresh interpreter (:func:`planted_results`)."""
    # A failure is all this needs, not its smallest example: no shrinking.
    # The examples of the ``quick`` profile (tests/conftest.py).
    settings.register_profile("planted", max_examples=10, stateful_step_count=30, deadline=None, database=None,
                              suppress_health_check=list(HealthCheck),
                              phases=[Phase.explicit, Phase.generate])
    os.environ["HYPOTHESIS_PROFILE"] = "planted"
    results: dict[str, int] = {}
    for name, spec in PLANTS.items():
        remove = plant(name)
        try:
            results[name] = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *spec.catchers]))
        finally:
            remove()
    return results


@pytest.fixture(scope="module")
def planted_results() -> dict[str, int]:
    """:func:`catch_all` in a subprocess, so no bug leaks into this session
    (one interpreter for all bugs: the imports cost more than the tests)."""
    code = ("import json, sys\n"
            "from tests.test_feature_planted_bugs import catch_all\n"
            "print('RESULTS ' + json.dumps(catch_all()))\n")
    environment = dict(os.environ, HYPOTHESIS_PROFILE=os.environ.get("HYPOTHESIS_PROFILE", "quick"))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environment, capture_output=True,
                            text=True, timeout=1800, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    assert result.returncode == 0 and lines, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    parsed: dict[str, int] = json.loads(lines[-1].removeprefix("RESULTS "))
    return parsed


def test_every_reference_feature_module_has_a_planted_bug() -> None:
    modules = {path.stem for path in (ROOT / "reference" / "features").glob("*.py")
               if path.stem not in ("__init__", "enabled")}
    assert modules == set(PLANTS), f"modules without a planted bug: {sorted(modules - set(PLANTS))}"


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_planted_bug_in_the_feature_module_is_caught(name: str, planted_results: dict[str, int]) -> None:
    # pytest's exit code 1: tests ran and some failed (not a crash, not "no tests").
    assert planted_results[name] == 1, (
        f"the bug planted in reference/features/{PLANTS[name].module}.py ({PLANTS[name].target}) was not "
        f"caught by {PLANTS[name].catchers} (pytest exit code {planted_results[name]})")
