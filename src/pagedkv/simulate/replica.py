"""One serving replica: a real ``pagedkv`` manager driven as an engine drives it.

Two modes:

- ``cache``: requests one at a time in arrival order, each looked up,
  allocated, computed and freed before the next (the setting of the
  Mooncake paper's Fig. 9): the hit rate of the prefix cache alone.
- ``engine``: a scheduler loop in the manner of vLLM's: arrivals queue in
  FIFO order; each step first extends the running batch (a prefill chunk
  or one decode token per request, within ``max_num_batched_tokens``),
  preempting the most recently admitted request when an allocation is
  refused, then admits waiting requests (prefix lookup, then the first
  chunk) while the batch has room; a request that cannot fit in an empty
  pool is rejected. A step takes ``step_ms + prefill_ms_per_token x prefill
  tokens + decode_ms_per_seq x decode requests``; the prefill's last chunk
  produces the first output token, each decode step one more; a finished
  request is freed.

After every step (every request in ``cache`` mode) the replica takes the
manager's KV events, counts cached blocks and evictions from them and hands
them to its ``on_events`` listener (the prefix-aware router).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from pagedkv.optimized import KVCacheManager
from pagedkv.simulate.requests import SimRequest
from pagedkv.simulate.workload import TraceRequest
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.types import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["SchedulerConfig", "ReplicaStats", "Replica", "MODES"]

MODES: Final[tuple[str, ...]] = ("engine", "cache")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The engine loop's limits and its step-time model (milliseconds)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    step_ms: float = 5.0
    prefill_ms_per_token: float = 0.01
    decode_ms_per_seq: float = 0.1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {value!r}")
        for name in ("step_ms", "prefill_ms_per_token", "decode_ms_per_seq"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value!r}")
        if self.step_ms + self.prefill_ms_per_token == 0.0:
            raise ValueError("--step-ms and --prefill-ms-per-token cannot both be 0 (steps would take no time)")


@dataclass(slots=True)
class ReplicaStats:
    """What one replica saw; token and block counts are of first lookups
    (a preempted request's second lookup is counted in ``preemptions`` only)."""

    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    prefill_tokens_computed: int = 0
    preemptions: int = 0
    finished: int = 0
    steps: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    cached_blocks: int = 0
    busy_ms: float = 0.0
    queue_delay_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    # (time ms or request index, share of blocks in use, cached blocks, evictions so far)
    timeline: list[tuple[float, float, int, int]] = field(default_factory=list)


class _Job:
    """A request inside a replica."""

    __slots__ = ("request", "arrival_ms", "output_length", "admitted_ms", "first_token_ms",
                 "counted", "pending_hit")

    def __init__(self, request: SimRequest, arrival_ms: float, output_length: int) -> None:
        self.request = request
        self.arrival_ms = arrival_ms
        self.output_length = output_length
        self.admitted_ms: float | None = None
        self.first_token_ms: float | None = None
        self.counted = False
        self.pending_hit = 0


EventListener = Callable[[int, list[KVCacheEvent]], None]


class Replica:
    """A manager plus the engine state around it (see the module docstring).

    Args:
        index: the replica's number in its fleet.
        config: the KV cache configuration of its manager.
        max_model_len, hash_fn, hash_seed: for the manager.
        scheduler: limits and step-time model (engine mode).
        sample_every: timeline spacing, in ms (engine) or requests (cache).
    """

    def __init__(self, index: int, config: KVCacheConfig, max_model_len: int, *, hash_fn: str,
                 hash_seed: str | None, scheduler: SchedulerConfig, sample_every: float = 1.0,
                 on_events: EventListener | None = None) -> None:
        self.index = index
        self.manager = KVCacheManager(
            config, max_model_len, hash_fn=hash_fn, hash_seed=hash_seed,
            enable_kv_cache_events=True, max_num_batched_tokens=scheduler.max_num_batched_tokens)
        self.hash_block_size = self.manager.hash_block_size or 1
        self.scheduler = scheduler
        self.stats = ReplicaStats()
        self.now = 0.0
        self.on_events = on_events
        self._sample_every = sample_every
        self._next_sample = 0.0
        self._waiting: deque[_Job] = deque()
        self._running: list[_Job] = []
        self.queued_prefill_tokens = 0
        self.routed_tokens = 0.0

    # ----------------------------------------------------------------- events

    def _collect_events(self, clock: float) -> None:
        events = self.manager.take_events()
        stats = self.stats
        if events:
            for event in events:
                if type(event) is BlockStored:
                    stats.stored_blocks += len(event.block_hashes)
                    stats.cached_blocks += len(event.block_hashes)
                elif type(event) is BlockRemoved:
                    stats.evicted_blocks += len(event.block_hashes)
                    stats.cached_blocks -= len(event.block_hashes)
                elif type(event) is AllBlocksCleared:
                    stats.cached_blocks = 0
            if self.on_events is not None:
                self.on_events(self.index, events)
        if clock >= self._next_sample:
            stats.timeline.append((clock, self.manager.usage, stats.cached_blocks, stats.evicted_blocks))
            self._next_sample = clock + self._sample_every

    def _count_lookup(self, job: _Job, hit: int) -> None:
        if job.counted:
            return
        job.counted = True
        stats = self.stats
        request = job.request
        h = self.hash_block_size
        stats.requests += 1
        stats.prompt_tokens += request.num_prompt_tokens
        stats.prompt_blocks += -(-request.num_prompt_tokens // h)
        stats.hit_tokens += hit
        stats.hit_blocks += hit // h

    # ------------------------------------------------------------- cache mode

    def serve_alone(self, request: SimRequest) -> bool:
        """Cache mode: look ``request`` up, allocate it, compute it, free it.
        Returns False (rejected, nothing kept) when it cannot fit in the pool."""
        manager = self.manager
        self.routed_tokens += request.num_prompt_tokens
        manager.new_step_starts()  # each request is a step of its own (a no-op for full attention)
        blocks, hit = manager.get_computed_blocks(request)
        new = manager.allocate_slots(request, request.num_tokens - hit, hit, blocks)
        stats = self.stats
        if new is None:
            stats.rejected += 1
            self._collect_events(stats.requests + stats.rejected)
            return False
        job = _Job(request, 0.0, 0)
        self._count_lookup(job, hit)
        stats.prefill_tokens_computed += request.num_tokens - hit
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
        stats.finished += 1
        self._collect_events(stats.requests + stats.rejected)
        return True

    # ------------------------------------------------------------ engine mode

    @property
    def outstanding(self) -> int:
        """Requests waiting or running."""
        return len(self._waiting) + len(self._running)

    def submit(self, request: SimRequest, trace_request: TraceRequest) -> None:
        """Engine mode: queue a request that arrived at ``trace_request.arrival_ms``."""
        self._waiting.append(_Job(request, trace_request.arrival_ms, trace_request.output_length))
        self.queued_prefill_tokens += request.num_prompt_tokens
        self.routed_tokens += request.num_prompt_tokens

    def advance_to(self, clock: float) -> None:
        """Run steps until the replica's clock reaches ``clock`` or it runs out of work."""
        while self.now < clock and (self._running or self._waiting):
            self.step()
        if self.now < clock:
            self.now = clock

    def drain(self) -> None:
        """Run steps until every request finished or was rejected."""
        while self._running or self._waiting:
            self.step()

    def _preempt(self, job: _Job) -> None:
        request = job.request
        self.manager.free(request)
        self.queued_prefill_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self._waiting.appendleft(job)

    def _reject(self, job: _Job) -> None:
        request = job.request
        self.queued_prefill_tokens -= max(0, request.num_prompt_tokens - request.num_computed_tokens)
        if request.request_id in self.manager.coordinator.requests:
            self.manager.free(request)
        self.stats.rejected += 1

    def step(self) -> float:
        """One engine step; returns its duration in ms."""
        self.manager.new_step_starts()  # the per-step hook an engine calls (Mamba state caching)
        allocate = self.manager.allocate_slots  # bound locally: the per-request loop is hot
        budget = self.scheduler.max_num_batched_tokens
        running = self._running
        scheduled: list[tuple[_Job, int]] = []
        preempted = False
        prefill_tokens = decode_seqs = 0
        index = 0
        while index < len(running) and budget > 0:
            job = running[index]
            request = job.request
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if allocate(request, num_new) is None:
                preempted = True
                if not self._make_room(job, num_new, scheduled):
                    break  # the job itself left the batch: it was the last one
            scheduled.append((job, num_new))
            # A decode step computes the one token the last step produced.
            if num_new == 1 and request.num_output_tokens:
                decode_seqs += 1
            else:
                prefill_tokens += num_new
            budget -= num_new
            index += 1
        if not preempted:
            budget, admitted_tokens = self._admit(scheduled, budget)
            prefill_tokens += admitted_tokens
        return self._finish_step(scheduled, prefill_tokens, decode_seqs)

    def _make_room(self, job: _Job, num_new: int, scheduled: list[tuple[_Job, int]]) -> bool:
        """Preempt from the end of the batch until ``job``'s allocation of
        ``num_new`` tokens succeeds (True) or ``job`` itself was preempted
        or rejected (False)."""
        running = self._running
        while True:
            victim = running.pop()
            if victim is job and not running and not scheduled:
                self._reject(job)  # alone in the pool and still too large
                return False
            self._preempt(victim)
            if victim is job:
                return False
            if self.manager.allocate_slots(job.request, num_new) is not None:
                return True

    def _admit(self, scheduled: list[tuple[_Job, int]], budget: int) -> tuple[int, int]:
        """Admit waiting requests in FIFO order; returns the budget left and
        the prompt tokens scheduled."""
        manager = self.manager
        admitted_tokens = 0
        waiting, running = self._waiting, self._running
        while waiting and budget > 0 and len(running) < self.scheduler.max_num_seqs:
            job = waiting[0]
            request = job.request
            blocks, hit = manager.get_computed_blocks(request)
            chunk = min(request.num_tokens - hit, budget)
            if manager.allocate_slots(request, chunk, hit, blocks) is None:
                if not running and not scheduled:
                    waiting.popleft()
                    self._reject(job)  # cannot fit in an empty pool
                    continue
                break
            waiting.popleft()
            self._count_lookup(job, hit)
            self.queued_prefill_tokens -= hit
            if job.admitted_ms is None:
                job.admitted_ms = self.now
                self.stats.queue_delay_ms.append(self.now - job.arrival_ms)
            job.pending_hit = hit
            running.append(job)
            scheduled.append((job, chunk))
            budget -= chunk
            admitted_tokens += chunk
        return budget, admitted_tokens

    def _finish_step(self, scheduled: list[tuple[_Job, int]], prefill_tokens: int,
                     decode_seqs: int) -> float:
        config = self.scheduler
        stats = self.stats
        duration = (config.step_ms + config.prefill_ms_per_token * prefill_tokens
                    + config.decode_ms_per_seq * decode_seqs)
        now = self.now = self.now + duration
        stats.busy_ms += duration
        stats.steps += 1
        stats.prefill_tokens_computed += prefill_tokens
        self.queued_prefill_tokens = max(0, self.queued_prefill_tokens - prefill_tokens)
        finished: list[_Job] = []
        for job, num_new in scheduled:
            request = job.request
            computed = request.num_computed_tokens + job.pending_hit + num_new
            request.num_computed_tokens = computed
            job.pending_hit = 0
            if computed < request.num_tokens:
                continue  # a prefill chunk short of the end
            if job.first_token_ms is None:
                job.first_token_ms = now
                stats.ttft_ms.append(now - job.arrival_ms)
            if request.num_output_tokens < job.output_length:
                request.append_output_token_ids(1)
            if request.num_output_tokens >= job.output_length:
                finished.append(job)
        if finished:
            done = set(map(id, finished))
            self._running = [job for job in self._running if id(job) not in done]
            free = self.manager.free
            for job in finished:
                free(job.request)
            stats.finished += len(finished)
        self._collect_events(now)
        return duration
