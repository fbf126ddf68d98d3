"""A fleet of replicas behind a router, and the replay loop.

Each replica is its own manager (``pagedkv.simulate.replica``). Requests
arrive in trace order; before routing one, every replica runs the steps
that start before its arrival, so a router sees the fleet as it is at that
moment. Routers:

- ``round-robin``: replica ``i mod N`` for the ``i``-th request.
- ``least-loaded``: the replica with the least queued prefill work (engine
  mode: prompt tokens waiting or mid-prefill, then the fewest requests in
  flight; cache mode: the prompt tokens routed to it recently, an
  exponentially decayed sum over the last ~N requests).
- ``prefix-aware``: scores replicas only from the KV events they publish,
  as KV-aware routers of vLLM fleets do: it keeps, per block hash, the set
  of replicas whose ``BlockStored`` events announced it and whose
  ``BlockRemoved`` events have not withdrawn it (``AllBlocksCleared`` drops
  a replica from every block). A request's match on a replica is the
  longest prefix of its block hashes that replica holds; the replica with
  the least ``tokens to prefill + balance x (load - least load)`` wins
  (load as for ``least-loaded``), fewest requests in flight breaking ties,
  then a turn that rotates with each request.
  The events arrive after each step, so the router's view lags the caches
  by at most one step, as a real event stream does.
- ``dynamo``: NVIDIA Dynamo's KV indexer, fed only by the replicas' events
  on vLLM's wire (``pagedkv.simulate.dynamo_router``; needs Dynamo
  installed, see docs/fleet.md). Not part of ``all``.

Each router's cost is the wall time of its decisions (``FleetResult.route_s``;
for ``dynamo`` without the wait that keeps its view in step, see its module).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final, Protocol

from pagedkv.simulate.replica import Replica, ReplicaStats, SchedulerConfig
from pagedkv.simulate.requests import PrefixHasher, SimRequest, TokenSource
from pagedkv.simulate.workload import TraceRequest, Workload
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.types import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["ROUTERS", "BUILTIN_ROUTERS", "Router", "RoundRobinRouter", "LeastLoadedRouter", "PrefixAwareRouter",
           "make_router", "FleetResult", "run_fleet"]

BUILTIN_ROUTERS: Final[tuple[str, ...]] = ("round-robin", "least-loaded", "prefix-aware")
"""The routers ``--router all`` runs: no dependency outside pagedkv."""
ROUTERS: Final[tuple[str, ...]] = (*BUILTIN_ROUTERS, "dynamo")


class Router(Protocol):
    """Picks a replica for each request; may listen to the replicas' events."""

    def choose(self, request: SimRequest, replicas: list[Replica], cache_mode: bool) -> int: ...

    def observe(self, replica: int, events: list[KVCacheEvent]) -> None: ...


def _load(replica: Replica, cache_mode: bool) -> float:
    return replica.routed_tokens if cache_mode else float(replica.queued_prefill_tokens)


class RoundRobinRouter:
    """Replica ``i mod N`` for the ``i``-th request."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: SimRequest, replicas: list[Replica], cache_mode: bool) -> int:
        chosen = self._next % len(replicas)
        self._next += 1
        return chosen

    def observe(self, replica: int, events: list[KVCacheEvent]) -> None:
        return None


class LeastLoadedRouter:
    """The replica with the least load (see the module docstring); ties go
    round-robin, so an idle fleet is not all sent to replica 0."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: SimRequest, replicas: list[Replica], cache_mode: bool) -> int:
        turn, count = self._turn, len(replicas)
        self._turn += 1
        return min(range(count),
                   key=lambda i: (_load(replicas[i], cache_mode), replicas[i].outstanding, (i - turn) % count))

    def observe(self, replica: int, events: list[KVCacheEvent]) -> None:
        return None


class PrefixAwareRouter:
    """Routes on the block hashes the replicas' KV events announce.

    ``holders[h]`` is a bit mask of the replicas holding block hash ``h``.
    Cost: O(blocks in the event) per event, O(request blocks + replicas)
    per decision.
    """

    def __init__(self, balance: float = 1.0) -> None:
        self.balance = balance
        self.holders: dict[bytes, int] = {}
        self.matched_tokens = 0
        self._turn = 0

    def observe(self, replica: int, events: list[KVCacheEvent]) -> None:
        bit = 1 << replica
        holders = self.holders
        for event in events:
            if type(event) is BlockStored:
                for block_hash in event.block_hashes:
                    holders[block_hash] = holders.get(block_hash, 0) | bit
            elif type(event) is BlockRemoved:
                for block_hash in event.block_hashes:
                    mask = holders.get(block_hash, 0) & ~bit
                    if mask:
                        holders[block_hash] = mask
                    else:
                        holders.pop(block_hash, None)
            elif type(event) is AllBlocksCleared:
                for key in [key for key, held in holders.items() if held & bit]:
                    mask = holders[key] & ~bit
                    if mask:
                        holders[key] = mask
                    else:
                        del holders[key]

    def match_blocks(self, request: SimRequest, num_replicas: int) -> list[int]:
        """Blocks of ``request``'s prefix each replica holds, by the events seen."""
        matched = [0] * num_replicas
        alive = (1 << num_replicas) - 1
        holders = self.holders
        hashes = request.block_hashes
        for position, block_hash in enumerate(hashes):
            mask = holders.get(block_hash, 0) & alive
            dropped = alive & ~mask
            while dropped:
                low = dropped & -dropped
                matched[low.bit_length() - 1] = position
                dropped ^= low
            alive = mask
            if not alive:
                break
        while alive:
            low = alive & -alive
            matched[low.bit_length() - 1] = len(hashes)
            alive ^= low
        return matched

    def choose(self, request: SimRequest, replicas: list[Replica], cache_mode: bool) -> int:
        matched = self.match_blocks(request, len(replicas))
        loads = [_load(replica, cache_mode) for replica in replicas]
        least = min(loads)
        n = request.num_prompt_tokens
        cap = (n - 1) // replicas[0].hash_block_size
        turn, count = self._turn, len(replicas)
        self._turn += 1

        def cost(i: int) -> tuple[float, int, int]:
            hit = min(matched[i], cap) * replicas[i].hash_block_size
            return (n - hit + self.balance * (loads[i] - least), replicas[i].outstanding, (i - turn) % count)

        chosen = min(range(len(replicas)), key=cost)
        self.matched_tokens += min(matched[chosen], cap) * replicas[chosen].hash_block_size
        return chosen


def make_router(name: str, balance: float = 1.0) -> Router:
    """The router called ``name`` (one of :data:`ROUTERS`)."""
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "least-loaded":
        return LeastLoadedRouter()
    if name == "prefix-aware":
        return PrefixAwareRouter(balance)
    if name == "dynamo":
        raise ValueError("the dynamo router needs the fleet: run_fleet builds it")
    raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {name!r}")


@dataclass(slots=True)
class FleetResult:
    """One replay: each replica's stats, the router's name, the wall time."""

    mode: str
    router: str
    num_blocks: int
    block_size: int
    replicas: list[ReplicaStats]
    routed: list[int]
    span_ms: float
    wall_s: float
    hashed_blocks: int
    memoised_blocks: int
    route_s: float = 0.0
    """Wall time of the routing decisions (without ``dynamo``'s fence waits)."""
    decisions: int = 0


def _progress(requests: Iterable[TraceRequest], total: int, label: str,
              enabled: bool) -> Iterator[TraceRequest]:
    if enabled and total >= 2000:
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm is a dev extra: run without a bar
            return iter(requests)
        bar: Iterator[TraceRequest] = tqdm(requests, total=total, desc=label, unit="req",
                                           file=sys.stderr, mininterval=0.5, leave=False)
        return bar
    return iter(requests)


def run_fleet(workload: Workload, config: KVCacheConfig, *, mode: str, replicas: int = 1,
              router: str = "round-robin", scheduler: SchedulerConfig | None = None,
              hash_fn: str = "xxh3_128", seed: int = 0, max_model_len: int | None = None,
              balance: float = 1.0, progress: bool = False, label: str = "simulate",
              hasher: PrefixHasher | None = None, source: TokenSource | None = None,
              dynamo_python: str | None = None, dynamo_overlap_weight: float = 1.0) -> FleetResult:
    """Replay ``workload`` through ``replicas`` managers built on ``config``.

    ``mode`` is "cache" or "engine" (``pagedkv.simulate.replica``).
    ``hasher``/``source`` may be passed to share their memo across replays
    of the same workload. ``dynamo_python`` is the interpreter with Dynamo
    for ``router="dynamo"`` (default: see ``pagedkv.events.dynamo``).

    Raises:
        ValueError: an unknown mode or router, fewer than one replica.
        pagedkv.spec.errors.InvalidConfigError: the manager refuses ``config``.
        pagedkv.events.dynamo.DynamoNotInstalled: ``router="dynamo"`` without Dynamo.
    """
    if mode not in ("cache", "engine"):
        raise ValueError(f"--mode must be 'cache' or 'engine', got {mode!r}")
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    scheduler = scheduler or SchedulerConfig()
    chooser = (None if router == "dynamo" and replicas > 1
               else make_router("round-robin" if router == "dynamo" else router, balance))
    cache_mode = mode == "cache"
    requests = workload.requests
    if max_model_len is None:
        max_model_len = max(r.input_length + (0 if cache_mode else r.output_length) for r in requests)
    span = requests[-1].arrival_ms - requests[0].arrival_ms if requests else 0.0
    sample_every = max(1.0, len(requests) / 1000) if cache_mode else max(1.0, span / 1000)
    fleet = [Replica(i, config, max_model_len, hash_fn=hash_fn, hash_seed=str(seed),
                     scheduler=scheduler, sample_every=sample_every,
                     on_events=None if chooser is None else chooser.observe)
             for i in range(replicas)]
    if chooser is None:
        from pagedkv.simulate.dynamo_router import DynamoRouter

        dynamo = DynamoRouter(fleet, overlap_weight=dynamo_overlap_weight, python=dynamo_python)
        for replica in fleet:
            replica.on_events = dynamo.observe
        chooser = dynamo
    try:
        return _replay(workload, fleet, chooser, mode=mode, router=router, config=config, hash_fn=hash_fn,
                       seed=seed, progress=progress, label=label, hasher=hasher, source=source)
    finally:
        close = getattr(chooser, "close", None)
        if close is not None:
            close()


def _replay(workload: Workload, fleet: list[Replica], chooser: Router, *, mode: str, router: str,
            config: KVCacheConfig, hash_fn: str, seed: int, progress: bool, label: str,
            hasher: PrefixHasher | None, source: TokenSource | None) -> FleetResult:
    cache_mode = mode == "cache"
    requests = workload.requests
    replicas = len(fleet)
    h = fleet[0].hash_block_size
    source = source or TokenSource(workload.block_tokens, seed)
    if hasher is None or hasher.hash_block_size != h:
        hasher = PrefixHasher(hash_fn, h, workload.block_tokens, str(seed))
    hashed_before, memoised_before = hasher.hashed, hasher.memoised
    routed = [0] * replicas
    decay = 1.0 - 1.0 / replicas
    route_s = 0.0
    clock = time.perf_counter
    started = clock()
    for number, trace_request in enumerate(_progress(requests, len(requests), label, progress)):
        request = SimRequest(f"r{number}", trace_request.block_ids, trace_request.input_length,
                             source, hasher)
        if not cache_mode:
            for replica in fleet:
                replica.advance_to(trace_request.arrival_ms)
        if replicas == 1:
            chosen = 0
        else:
            before = clock()
            chosen = chooser.choose(request, fleet, cache_mode)
            route_s += clock() - before
        routed[chosen] += 1
        if cache_mode:
            for replica in fleet:  # recent load: an exponentially decayed sum
                replica.routed_tokens *= decay
            fleet[chosen].serve_alone(request)
        else:
            fleet[chosen].submit(request, trace_request)
    if not cache_mode:
        for replica in fleet:
            replica.drain()
    wall = time.perf_counter() - started
    return FleetResult(
        mode=mode, router=router if replicas > 1 else "-",
        num_blocks=config.num_blocks, block_size=h, replicas=[r.stats for r in fleet],
        routed=routed, span_ms=max((r.now for r in fleet), default=0.0) if not cache_mode else 0.0,
        wall_s=wall, hashed_blocks=hasher.hashed - hashed_before,
        memoised_blocks=hasher.memoised - memoised_before,
        route_s=max(0.0, route_s - getattr(chooser, "fence_s", 0.0)),
        decisions=len(requests) if replicas > 1 else 0)
