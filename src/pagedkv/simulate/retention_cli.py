"""``pagedkv simulate TRACE --policy NAMES``: eviction policies on real traces.

Replays Mooncake-style traces (or the system-prompt workload built from the
first) through the block-level cache model of
:mod:`pagedkv.simulate.retention_model`, at each capacity (a fraction of the
workload's working set), once per policy:

- ``lru``: vLLM 0.33's free-queue order, unannotated (the baseline);
- ``lru+pin``: that order with the granted pins (priorities ignored);
- ``priority``: lowest retention priority first, LRU within a priority
  (spec/retention.md, RET-4), with the directives of ``--retention FILE``;
- ``lru-freq``: the online policy chosen by the study (frequency-extended
  LRU deadlines; annotations honoured too);
- ``optimal``: Belady's MIN, the offline upper bound (unannotated).

``lru`` and ``optimal`` always run unannotated and without quotas, so every
row states its share of the gap between them. ``--pin-budget X`` bounds pins to ``floor(X * capacity)`` blocks:
a directive whose pins would pass it is refused whole (RET-6; default 0, pins
off). ``--tenant-quota N`` caps the free cached blocks of each tenant (a
chain's root block id modulo ``--tenants``), evicting the tenant's own least
valuable blocks (RET-8).

The retention file (JSON): ``{"directives": [D, ...]}``, each ``D`` one target
-- ``"prefix": true`` (the system-prompt workload's shared prefix),
``"blocks": [ids]`` or ``"request": index`` (every block of that request) --
and ``"priority": 0..100`` and/or ``"pin": true``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.simulate.retention_model import (
    BLOCK_TOKENS,
    Result,
    Workload,
    load_trace,
    simulate,
    system_prompt_workload,
    table,
)
from pagedkv.simulate.retention_policies import (
    ChainShape,
    KeyedPolicy,
    KeyFn,
    Policy,
    VllmLru,
    key_lru,
    key_lru_freq,
    key_min,
)
from pagedkv.spec.errors import InvalidRetentionError
from pagedkv.spec.retention import check_pin_budget, check_priority, check_quota

__all__ = ["Annotations", "TenantQuotaPolicy", "load_annotations", "make_policy", "main", "POLICY_NAMES"]

POLICY_NAMES = ("lru", "lru+pin", "priority", "lru-freq", "optimal")


@dataclass
class Annotations:
    """Directives resolved to blocks: priorities, and pin groups (one per directive)."""

    priority: dict[int, int] = field(default_factory=dict)
    pin_groups: list[list[int]] = field(default_factory=list)

    def pins_within(self, budget_blocks: int) -> tuple[frozenset[int], int]:
        """The pins granted under the budget, in file order, and how many
        directives were refused whole (RET-6)."""
        granted: set[int] = set()
        refused = 0
        for group in self.pin_groups:
            if len(granted | set(group)) > budget_blocks:
                refused += 1
            else:
                granted.update(group)
        return frozenset(granted), refused


def load_annotations(data: object, workload: Workload) -> Annotations:
    """Resolve a parsed retention file against ``workload``.

    Raises:
        InvalidRetentionError: a malformed directive (the message names the field).
    """
    if not isinstance(data, dict) or not isinstance(data.get("directives"), list):
        raise InvalidRetentionError("retention file: expected {\"directives\": [...]}")
    annotations = Annotations()
    for index, directive in enumerate(data["directives"]):
        where = f"directives[{index}]"
        if not isinstance(directive, dict):
            raise InvalidRetentionError(f"{where}: expected an object, got {directive!r}")
        blocks: list[int]
        if directive.get("prefix") is True:
            blocks = list(workload.prefix)
        elif "blocks" in directive:
            raw = directive["blocks"]
            if not isinstance(raw, list) or not all(type(b) is int for b in raw):
                raise InvalidRetentionError(f"{where}.blocks: expected a list of block ids, got {raw!r}")
            blocks = list(raw)
        elif "request" in directive:
            request = directive["request"]
            if type(request) is not int or not 0 <= request < len(workload.requests):
                raise InvalidRetentionError(
                    f"{where}.request: expected an index in [0, {len(workload.requests)}), got {request!r}")
            blocks = list(workload.requests[request].blocks)
        else:
            raise InvalidRetentionError(f"{where}: name a target: \"prefix\": true, \"blocks\" or \"request\"")
        if "priority" not in directive and directive.get("pin") is not True:
            raise InvalidRetentionError(f"{where}: give \"priority\" and/or \"pin\": true")
        if "priority" in directive:
            priority = check_priority(directive["priority"], f"{where}.priority")
            for block in blocks:
                annotations.priority[block] = max(priority, annotations.priority.get(block, 0))  # RET-2
        if "pin" in directive:
            if type(directive["pin"]) is not bool:
                raise InvalidRetentionError(f"{where}.pin: expected true or false, got {directive['pin']!r}")
            if directive["pin"]:
                annotations.pin_groups.append(blocks)
    return annotations


class TenantQuotaPolicy(KeyedPolicy):
    """A keyed policy whose tenants each keep at most ``quota`` evictable
    blocks: past it, after a release, the tenant's own least-key blocks go
    (RET-8). Each tenant's evictable set stays near ``quota``, so finding its
    victim scans O(quota)."""

    def __init__(self, capacity: int, shape: ChainShape, name: str, key_fn: KeyFn, *, leaf_only: bool,
                 tenant_of: Mapping[int, int], quota: int, priority: Mapping[int, int] | None = None,
                 pins: frozenset[int] = frozenset()) -> None:
        super().__init__(capacity, shape, name, key_fn, leaf_only=leaf_only, priority=priority, pins=pins)
        self.tenant_of = tenant_of
        self.quota = quota
        self.evictable: dict[int, set[int]] = {}
        self.quota_evictions = 0

    def _on_hit(self, block: int) -> None:
        self.evictable.get(self.tenant_of[block], set()).discard(block)
        super()._on_hit(block)

    def _victim(self, incoming: int) -> int:
        victim = super()._victim(incoming)
        self.evictable.get(self.tenant_of[victim], set()).discard(victim)
        return victim

    def _on_release(self, blocks: Sequence[int]) -> None:
        super()._on_release(blocks)
        touched = set()
        for block in blocks:
            if block not in self.pins:
                tenant = self.tenant_of[block]
                self.evictable.setdefault(tenant, set()).add(block)
                touched.add(tenant)
        for tenant in touched:
            own = self.evictable[tenant]
            while len(own) > self.quota:
                candidates = [b for b in own if self._candidate(b)] or list(own)
                for victim in heapq.nsmallest(len(own) - self.quota, candidates, key=self.entry.__getitem__):
                    own.discard(victim)
                    del self.entry[victim]
                    self.count.pop(victim, None)
                    self._forget(victim)
                    self.quota_evictions += 1


@dataclass(frozen=True)
class Setting:
    """What every policy of one run shares."""

    annotations: Annotations
    pin_budget: float
    tenant_quota: int | None
    tenants: int


def _tenant_map(workload: Workload, tenants: int) -> dict[int, int]:
    """Each block's tenant: its chain's root block id modulo ``tenants``."""
    found: dict[int, int] = {}
    for request in workload.requests:
        if request.blocks:
            tenant = request.blocks[0] % tenants
            for block in request.blocks:
                found.setdefault(block, tenant)
    return found


def make_policy(name: str, capacity: int, shape: ChainShape, workload: Workload,
                setting: Setting) -> tuple[Policy, int]:
    """The policy ``name`` at ``capacity``, and how many pin directives the
    budget refused. ``lru`` and ``optimal`` are the unannotated baselines
    (vLLM's order, Belady's MIN); ``lru+pin`` is LRU with the granted pins;
    a quota adds ``+quota`` to the name."""
    if name == "lru":
        return VllmLru(capacity, shape), 0
    if name == "optimal":
        return KeyedPolicy(capacity, shape, "min", key_min, leaf_only=True), 0
    budget = min(capacity, math.floor(setting.pin_budget * capacity))
    pins, refused = setting.annotations.pins_within(budget)
    key: KeyFn = key_lru_freq if name == "lru-freq" else key_lru
    priority = None if name == "lru+pin" else setting.annotations.priority
    leaf_only = False  # lru-freq as the pools run it (RET-11): any free block may be the victim
    if setting.tenant_quota is not None:
        return TenantQuotaPolicy(capacity, shape, f"{name}+quota", key, leaf_only=leaf_only,
                                 tenant_of=_tenant_map(workload, setting.tenants), quota=setting.tenant_quota,
                                 priority=priority, pins=pins), refused
    return KeyedPolicy(capacity, shape, name, key, leaf_only=leaf_only, priority=priority, pins=pins), refused


def run_policies(workload: Workload, fractions: Sequence[float], names: Sequence[str],
                 setting: Setting) -> tuple[list[Result], list[str]]:
    """Every policy at every capacity; the results and one note per refused pin set."""
    shape = ChainShape([r.blocks for r in workload.requests])
    results: list[Result] = []
    notes: list[str] = []
    for fraction in fractions:
        capacity = max(1, round(fraction * workload.working_set))
        for name in names:
            policy, refused = make_policy(name, capacity, shape, workload, setting)
            result = simulate(workload, policy)
            if refused:
                notes.append(f"{workload.name} x{fraction} {name}: {refused} pin directive(s) refused "
                             f"(budget {math.floor(setting.pin_budget * capacity)} blocks)")
            print(f"{workload.name} x{fraction} {result.policy}: {result.block_hit_rate:.4f} "
                  f"({result.seconds:.1f} s)", file=sys.stderr)
            results.append(result)
    return results, notes


def _fraction_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected fractions like 0.1,0.25, got {text!r}") from None
    if not values or any(not 0 < value <= 1 for value in values):
        raise argparse.ArgumentTypeError(f"fractions must lie in (0, 1], got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """``pagedkv simulate TRACE [TRACE...] --policy NAMES [...]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="pagedkv simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="Mooncake JSONL traces")
    parser.add_argument("--policy", required=True, help=f"comma-separated, of {', '.join(POLICY_NAMES)}")
    parser.add_argument("--retention", default=None, metavar="FILE", help="retention directives (JSON)")
    parser.add_argument("--pin-budget", type=float, default=0.0, metavar="X", help="share of the cache pins may hold")
    parser.add_argument("--tenant-quota", type=int, default=None, metavar="N", help="free cached blocks per tenant")
    parser.add_argument("--tenants", type=int, default=4, metavar="K", help="tenants (chain root id mod K)")
    parser.add_argument("--fractions", type=_fraction_list, default=[0.1, 0.25], metavar="LIST")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="first N requests of each trace")
    parser.add_argument("--system-prompt", action="store_true",
                        help="the system-prompt workload built from the first trace, instead of the traces")
    parser.add_argument("--system-prompt-limit", type=int, default=1000, metavar="N")
    parser.add_argument("--out", default=None, metavar="FILE", help="also write the Markdown report here")
    args = parser.parse_args(argv)
    names = [name for name in args.policy.split(",") if name]
    unknown = [name for name in names if name not in POLICY_NAMES]
    if unknown or not names:
        parser.error(f"--policy: unknown {unknown}; known: {', '.join(POLICY_NAMES)}")
    try:
        pin_budget = check_pin_budget(args.pin_budget, "--pin-budget")
        tenant_quota = check_quota(args.tenant_quota, "--tenant-quota")
        if args.tenants < 1:
            raise InvalidRetentionError(f"--tenants must be >= 1, got {args.tenants}")
        if args.system_prompt:
            workloads = [system_prompt_workload(load_trace(args.traces[0], args.system_prompt_limit))]
        else:
            workloads = [load_trace(path, args.limit) for path in args.traces]
        raw = json.loads(Path(args.retention).read_text(encoding="utf-8")) if args.retention else {"directives": []}
        ordered = ["lru", *[n for n in names if n not in ("lru", "optimal")], "optimal"]
        report = ["# pagedkv simulate --policy", "",
                  "`pagedkv simulate " + " ".join(Path(a).name if a in args.traces else a
                                                 for a in (argv if argv is not None else sys.argv[1:])) + "`",
                  "", f"Blocks of {BLOCK_TOKENS} tokens; `min` is Belady's MIN (`optimal`)."]
        for workload in workloads:
            setting = Setting(load_annotations(raw, workload), pin_budget, tenant_quota, args.tenants)
            results, notes = run_policies(workload, args.fractions, ordered, setting)
            report += ["", f"## {workload.name}", "",
                       f"{len(workload.requests):,} requests, working set {workload.working_set:,} blocks",
                       table(results, args.fractions)]
            report += [f"\n- {note}" for note in notes]
    except (InvalidRetentionError, OSError, ValueError) as error:
        print(f"pagedkv simulate: error: {error}", file=sys.stderr)
        return 2
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0
