"""Shared test configuration: Hypothesis profiles and the ``impl`` fixture.

- ``quick``: ``make test-quick``, the edit loop; a tenth of ``dev``'s examples
  and shorter lockstep runs. It finds shallow breakage in a minute or two; it
  is no substitute for ``make test``.
- ``dev``: the default for local runs (``make test``).
- ``ci``: selected when ``CI`` is set; derandomized, no example database,
  prints a reproduction blob on failure.
- ``thorough``: ``make verify-thorough``; 20x the examples of ``ci``.
- ``pure``: ``make test-pure`` (the lockstep machines on the Python loops, D-PERF-26).
- ``mutation``: ``make mutation``; a few derandomized examples per test.
``HYPOTHESIS_PROFILE`` overrides the choice.
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings

from tests.implementations import IMPLEMENTATIONS

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "quick", max_examples=10, stateful_step_count=30, deadline=None, suppress_health_check=_SLOW_OK,
)
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, database=None,
    print_blob=True, suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, print_blob=True,
    suppress_health_check=_SLOW_OK,
)
# ``make test-pure``: the lockstep machines on the Python loops the C module replaces (D-PERF-26);
# derandomized, so CI replays the start of the ``ci`` run's examples on the other build.
settings.register_profile(
    "pure", max_examples=25, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=_SLOW_OK,
)
# ``make mutation`` runs the suite once per mutant: few examples, reproducible.
settings.register_profile(
    "mutation", max_examples=8, deadline=None, derandomize=True, database=None,
    suppress_health_check=_SLOW_OK,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """The implementation a scenario runs over: every test that takes ``impl``
    runs once per entry of ``IMPLEMENTATIONS``."""
    module: ModuleType = IMPLEMENTATIONS[request.param]
    return module
