"""``--router dynamo``: route with NVIDIA Dynamo's KV indexer, fed only by the wire.

Each replica gets a :class:`pagedkv.events.ZmqEventPublisher` on loopback;
its manager's events go out in vLLM 0.33's format after every step, exactly
as a vLLM replica's would. Dynamo's standalone indexer (``python -m
dynamo.indexer``, from ``ai-dynamo-runtime``, run from its own venv)
subscribes to all of them and decodes them with its own decoder; the
router knows nothing else about the caches. For each request it asks the
indexer (``POST /query``) how many leading tokens each replica holds and
picks the replica with the lowest cost of Dynamo's KV router (its default
``overlap_score_weight`` 1, temperature 0)::

    weight x prefill blocks + decode blocks

where prefill blocks are the tokens the replica would compute (its queued
prefill, plus the prompt less Dynamo's overlap) over the block size, and
decode blocks the KV blocks it holds for requests in flight plus the new
request's (cache mode, with nothing in flight: the recent routed load, as
``least-loaded`` measures it). Ties go to the fewest requests in flight,
then a turn that rotates.

Consistency: a real router reads events a little late. To make runs
repeatable, before each decision the router waits until the indexer has
applied every batch published so far: each replica with new events
publishes a *fence*, one block of tokens no prompt holds (ids >= 2**20),
removing the previous fence in the same batch, and the router polls
``/query`` for the fence tokens until the replica shows them. Fence
blocks never match a prompt. The fence wait is not counted in the
router's cost; the routing query and the choice are.
"""

from __future__ import annotations

import time
from typing import Final

from pagedkv.events import WireOptions, ZmqEventPublisher, group_metadata
from pagedkv.events.dynamo import DynamoIndexer
from pagedkv.simulate.replica import Replica
from pagedkv.simulate.requests import SimRequest
from pagedkv.spec.types import BlockHash, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["DynamoRouter"]

MODEL: Final = "pagedkv-simulate"
_FENCE_TOKEN: Final = 1 << 20


class DynamoRouter:
    """Routes on Dynamo's indexer's overlap scores (module docstring).

    Raises:
        pagedkv.events.dynamo.DynamoNotInstalled: no interpreter with Dynamo
            (the message says how to install it).
        ImportError: pyzmq or msgspec is missing (``pagedkv[events]``).
    """

    def __init__(self, replicas: list[Replica], *, overlap_weight: float = 1.0,
                 python: str | None = None, fence_timeout: float = 30.0) -> None:
        self.overlap_weight = overlap_weight
        self.fence_timeout = fence_timeout
        self.block_size = replicas[0].hash_block_size
        self.matched_tokens = 0
        self.fence_s = 0.0
        self.queries = 0
        self._turn = 0
        options = WireOptions(groups=group_metadata(replicas[0].manager.kv_cache_config))
        self.indexer = DynamoIndexer(python)
        self.publishers: list[ZmqEventPublisher] = []
        try:
            for replica in replicas:
                publisher = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", options=options)
                self.publishers.append(publisher)
                self.indexer.register(replica.index + 1, publisher.endpoint, publisher.replay_endpoint,
                                      model_name=MODEL, block_size=self.block_size)
            self.indexer.wait_listening(len(replicas))
            time.sleep(0.3)  # PUB drops what it sends before a subscription arrives
        except BaseException:
            self.close()
            raise
        self._fences: list[int | None] = [None] * len(replicas)
        self._dirty: set[int] = set()
        self._fence_count = 0

    def observe(self, replica: int, events: list[KVCacheEvent]) -> None:
        """Publish a replica's step events on its socket (the router's only input)."""
        self.publishers[replica].publish(events)
        self._dirty.add(replica)

    def _fence_tokens(self, number: int) -> list[int]:
        return [_FENCE_TOKEN + number % _FENCE_TOKEN, _FENCE_TOKEN + number // _FENCE_TOKEN,
                *([_FENCE_TOKEN] * (self.block_size - 2))]

    def _sync(self) -> None:
        """Wait until the indexer has applied every batch published so far."""
        if not self._dirty:
            return
        started = time.perf_counter()
        pending: dict[int, list[int]] = {}
        for replica in sorted(self._dirty):
            self._fence_count += 1
            number = self._fence_count
            tokens = self._fence_tokens(number)
            fence = BlockHash((0xFFFF_FFFF_0000_0000 | number).to_bytes(8, "big"))
            events: list[KVCacheEvent] = []
            previous = self._fences[replica]
            if previous is not None:
                events.append(BlockRemoved((BlockHash(previous.to_bytes(8, "big")),)))
            events.append(BlockStored(block_hashes=(fence,), parent_block_hash=None, token_ids=tuple(tokens),
                                      block_size=self.block_size, lora_id=None, group_idx=0))
            self._fences[replica] = int.from_bytes(fence, "big")
            self.publishers[replica].publish(events)
            pending[replica] = tokens
        self._dirty.clear()
        deadline = time.monotonic() + self.fence_timeout
        for replica, tokens in pending.items():
            while self.indexer.query(tokens, model_name=MODEL).get(replica + 1, 0) < self.block_size:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Dynamo's indexer did not apply replica {replica}'s events "
                                       f"within {self.fence_timeout} s")
                time.sleep(0.0005)
        self.fence_s += time.perf_counter() - started

    def choose(self, request: SimRequest, replicas: list[Replica], cache_mode: bool) -> int:
        """The replica of least Dynamo cost for ``request``."""
        self._sync()
        n = request.num_prompt_tokens
        overlap = self.indexer.query(list(request.all_token_ids[0:n]), model_name=MODEL)
        self.queries += 1
        b = self.block_size
        turn, count = self._turn, len(replicas)
        self._turn += 1
        new_blocks = -(-n // b)

        def cost(i: int) -> tuple[float, int, int]:
            replica = replicas[i]
            hit = min(overlap.get(i + 1, 0), n)
            if cache_mode:
                prefill, decode = (n - hit) / b, replica.routed_tokens / b
            else:
                usable = replica.manager.kv_cache_config.num_blocks - 1
                prefill = (replica.queued_prefill_tokens + n - hit) / b
                decode = replica.manager.usage * usable + new_blocks
            return (self.overlap_weight * prefill + decode, replica.outstanding, (i - turn) % count)

        chosen = min(range(count), key=cost)
        cap = (n - 1) // b
        self.matched_tokens += min(overlap.get(chosen + 1, 0) // b, cap) * b
        return chosen

    def close(self) -> None:
        """Stop the indexer and close the sockets."""
        self.indexer.close()
        for publisher in self.publishers:
            publisher.close()
