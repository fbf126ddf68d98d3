"""`make verify-router`: NVIDIA Dynamo's KV indexer reads pagedkv replicas' events.

Four pagedkv replicas (``pagedkv.optimized`` managers, in this process) each
publish their KV events with :class:`pagedkv.events.ZmqEventPublisher` on
loopback ZMQ, exactly as vLLM 0.33 does. Dynamo's standalone indexer
(``python -m dynamo.indexer``, from ai-dynamo-runtime, in its own venv)
subscribes to all four, decodes with its own decoder and keeps its radix
tree. A workload runs through the replicas in phases:

1. ``stores``: prompts sharing system prompts, no eviction yet;
2. ``hits``: the same prompts again (hits) and new suffixes;
3. ``evictions``: unique prompts that overflow every pool (``BlockRemoved``);
4. ``reset``: two replicas reset their prefix cache (``AllBlocksCleared``),
   then serve more prompts;
5. ``gap``: the indexer's listener of one replica is paused while that
   replica serves prompts, then resumed: the indexer sees a sequence gap
   and fetches the missed batches from the replica's replay socket;
6. ``restart``: one replica restarts (a fresh, empty manager and publisher
   on new ports); it serves prompts before the indexer is told, then is
   re-registered: the indexer catches up from its replay socket;
7. ``mixed``: more of everything on all replicas.

After every phase, once the indexer has caught up (bounded wait), it
checks for every replica: the blocks ``/dump`` lists for it equal the
replica's cached block hashes (low 64 bits), and for a sample of prompts
the overlap ``/query`` reports equals the replica's real prefix hit in
blocks (``get_computed_blocks`` on the prompt plus one token, so the hit
is not capped at ``num_tokens - 1``). Any difference is a disagreement;
exit status 1 if there is one. Block sizes 16 and 512 by default.

With ``--engine`` the indexer reads a running vLLM engine instead: one
engine on ``pagedkv.vllm.Scheduler`` (the verify-engine venv, ``--engine-python``)
publishing with vLLM's own ``--kv-events-config`` ZMQ publisher;
``engine_router.py`` (run in that venv) says what it checks. Without an
engine venv it is skipped with a message saying how to build one.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pagedkv
from pagedkv.events import WireOptions, ZmqEventPublisher, external_hash, group_metadata
from pagedkv.events.dynamo import DynamoIndexer, DynamoNotInstalled, find_dynamo_python
from pagedkv.spec.types import BlockHashWithGroupId, get_block_hash
from pagedkv.trace import standard_kv_cache_config

MODEL = "pagedkv"
VOCAB = 32000


@dataclass
class Replica:
    """One pagedkv manager and its event publisher."""

    instance_id: int
    block_size: int
    num_blocks: int
    seed: str
    manager: pagedkv.KVCacheManager = field(init=False)
    publisher: ZmqEventPublisher = field(init=False)
    served: int = 0

    def __post_init__(self) -> None:
        self.start()

    def start(self) -> None:
        config = standard_kv_cache_config(self.num_blocks, self.block_size)
        self.manager = pagedkv.KVCacheManager(config, 64 * self.block_size, enable_kv_cache_events=True,
                                              hash_seed=self.seed)
        self.publisher = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                                           options=WireOptions(groups=group_metadata(config)))

    def restart(self) -> None:
        """A new process: empty cache, new sockets, sequence numbers from 0."""
        self.publisher.close()
        self.start()

    def serve(self, tokens: list[int]) -> None:
        """Prefill ``tokens`` in one step, finish, publish the step's events."""
        self.served += 1
        request = self.manager.make_request(f"r{self.instance_id}-{self.served}", tokens)
        hit, hit_tokens = self.manager.get_computed_blocks(request)
        if self.manager.allocate_slots(request, len(tokens) - hit_tokens, hit_tokens, hit) is not None:
            self.manager.free(request)
        self.publisher.publish(self.manager.take_events())

    def reset(self) -> None:
        assert self.manager.reset_prefix_cache()
        self.publisher.publish(self.manager.take_events())

    def cached(self) -> set[int]:
        """The wire hashes of every cached block (what Dynamo should hold)."""
        keys = [BlockHashWithGroupId(key) for key, _ in self.manager.block_pool.snapshot().cached]
        return {int(external_hash(get_block_hash(key))) for key in keys}

    def hit_blocks(self, tokens: list[int]) -> int:
        """The real prefix hit of ``tokens``, in blocks, not capped by the last token."""
        probe = self.manager.make_request(f"probe-{self.instance_id}", [*tokens, 0])
        _, hit_tokens = self.manager.get_computed_blocks(probe)
        return hit_tokens // self.block_size


class Workload:
    """Prompts: system prompts (shared prefixes) + user turns, random lengths.

    The shape is a parameter so the engine check (engine_router.py) draws its
    own smaller prompts from the same generator: ``systems`` shared prefixes
    of 1..``system_blocks`` blocks, user turns of 1..``turn_blocks`` blocks
    plus a partial block, token ids in ``[low_token, vocab)``, and probes that
    add ``probe_blocks`` unseen blocks to a system prompt.
    """

    def __init__(self, block_size: int, seed: int, *, vocab: int = VOCAB, low_token: int = 0,
                 systems: int = 6, system_blocks: int = 4, turn_blocks: int = 5, probe_blocks: int = 2) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.vocab, self.low_token = vocab, low_token
        self.turn_blocks, self.probe_blocks = turn_blocks, probe_blocks
        self.systems = [self._tokens(self.rng.randint(1, system_blocks) * block_size) for _ in range(systems)]
        self.seen: list[list[int]] = []

    def _tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(self.low_token, self.vocab) for _ in range(count)]

    def prompt(self, shared: bool = True) -> list[int]:
        """A new prompt (a system prompt + a user turn, a partial last block
        most of the time), remembered for the checks."""
        head = self.rng.choice(self.systems) if shared else []
        tail = self.rng.randint(1, self.turn_blocks) * self.block_size + self.rng.randrange(self.block_size)
        tokens = head + self._tokens(tail)
        self.seen.append(tokens)
        return tokens

    def again(self) -> list[int]:
        """A prompt served before, or a longer conversation that continues one."""
        tokens = self.rng.choice(self.seen)
        if self.rng.random() < 0.5:
            tokens = tokens + self._tokens(self.rng.randint(1, 2) * self.block_size)
            self.seen.append(tokens)
        return tokens

    def sample(self, count: int) -> list[list[int]]:
        """Prompts to query: served ones, their prefixes, and new ones."""
        picks = [self.rng.choice(self.seen) for _ in range(count)]
        picks += [p[:self.rng.randint(1, len(p))] for p in picks[:count // 4]]
        picks += [self.rng.choice(self.systems) + self._tokens(self.probe_blocks * self.block_size)
                  for _ in range(count // 4)]
        return picks


@dataclass
class Check:
    phase: str
    block_size: int
    dump_disagreements: int = 0
    query_disagreements: int = 0
    queries: int = 0
    nonzero: int = 0
    blocks: int = 0
    details: list[str] = field(default_factory=list)


def _converge(indexer: DynamoIndexer, replicas: list[Replica], timeout: float) -> dict[int, set[int]]:
    """The indexer's dump once it equals the replicas' caches, or the last one
    after ``timeout`` seconds (the checks then report the difference)."""
    deadline = time.monotonic() + timeout
    while True:
        held = indexer.dump(model_name=MODEL)
        if all(held.get(r.instance_id, set()) == r.cached() for r in replicas) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def check(phase: str, indexer: DynamoIndexer, replicas: list[Replica], workload: Workload,
          samples: int, timeout: float) -> Check:
    result = Check(phase, workload.block_size)
    held = _converge(indexer, replicas, timeout)
    for replica in replicas:
        want, got = replica.cached(), held.get(replica.instance_id, set())
        result.blocks += len(want)
        if want != got:
            result.dump_disagreements += 1
            result.details.append(f"replica {replica.instance_id}: /dump has {len(got - want)} blocks it does "
                                  f"not cache and misses {len(want - got)} it does")
    for tokens in workload.sample(samples):
        overlap = indexer.query(tokens, model_name=MODEL)
        for replica in replicas:
            result.queries += 1
            want_blocks = replica.hit_blocks(tokens)
            result.nonzero += want_blocks > 0
            got_blocks = overlap.get(replica.instance_id, 0) // workload.block_size
            if want_blocks != got_blocks:
                result.query_disagreements += 1
                if len(result.details) < 8:
                    result.details.append(f"replica {replica.instance_id}: prompt of {len(tokens)} tokens: "
                                          f"Dynamo says {got_blocks} blocks, the replica hits {want_blocks}")
    return result


def _expect_replay(result: Check, replica: Replica, before: int) -> None:
    """The phase must have made the indexer use the replica's replay socket."""
    served = replica.publisher.replays_served - before
    print(f"    replica {replica.instance_id} answered {served} replay request(s)", flush=True)
    if served < 1:
        result.dump_disagreements += 1
        result.details.append(f"replica {replica.instance_id}: the indexer never asked for a replay")


def run_block_size(block_size: int, args: argparse.Namespace) -> list[Check]:
    rng = random.Random(args.seed)
    workload = Workload(block_size, args.seed)
    replicas = [Replica(i + 1, block_size, args.num_blocks, seed="0") for i in range(args.replicas)]
    checks: list[Check] = []
    log = args.indexer_log.replace("{B}", str(block_size)) if args.indexer_log else None
    with DynamoIndexer(args.dynamo_python, test_endpoints=True, log_path=log) as indexer:
        for replica in replicas:
            indexer.register(replica.instance_id, replica.publisher.endpoint, replica.publisher.replay_endpoint,
                             model_name=MODEL, block_size=block_size)
        indexer.wait_listening(len(replicas))
        time.sleep(0.3)  # PUB drops what it sends before a subscription arrives

        def phase(name: str) -> None:
            result = check(name, indexer, replicas, workload, args.samples, args.converge_timeout)
            checks.append(result)
            bad = result.dump_disagreements + result.query_disagreements
            print(f"  B={block_size:<4} {name:<10} cached blocks {result.blocks:>4}  queries {result.queries:>4}  "
                  f"(hits {result.nonzero:>3})  disagreements {bad}", flush=True)
            for line in result.details:
                print(f"    {line}", flush=True)

        light = max(2, args.num_blocks // 12)  # prompts per replica that fit without eviction
        for replica in replicas:
            for _ in range(light):
                replica.serve(workload.prompt())
        phase("stores")
        for replica in replicas:
            for _ in range(light):
                replica.serve(workload.again() if rng.random() < 0.7 else workload.prompt())
        phase("hits")
        for replica in replicas:
            for _ in range(3 * light):
                replica.serve(workload.prompt(shared=rng.random() < 0.3))
        phase("evictions")
        for replica in replicas[:2]:
            replica.reset()
        phase("reset")
        for replica in replicas:
            for _ in range(light):
                replica.serve(workload.again())
        phase("after-reset")
        gap = replicas[1 % len(replicas)]
        indexer.pause(gap.instance_id)
        for _ in range(2 * light):
            gap.serve(workload.prompt(shared=rng.random() < 0.5))
        indexer.resume(gap.instance_id)
        indexer.wait_listening(len(replicas))
        time.sleep(0.3)
        replays = gap.publisher.replays_served
        gap.serve(workload.again())  # the next batch shows the indexer its gap
        phase("gap")
        _expect_replay(checks[-1], gap, replays)
        restarted = replicas[-1]
        indexer.unregister(restarted.instance_id, model_name=MODEL)
        restarted.restart()
        for _ in range(light):  # published before the indexer subscribes: only replay brings these
            restarted.serve(workload.prompt())
        indexer.register(restarted.instance_id, restarted.publisher.endpoint,
                         restarted.publisher.replay_endpoint, model_name=MODEL, block_size=block_size)
        indexer.wait_listening(len(replicas))
        time.sleep(0.3)
        restarted.serve(workload.again())
        phase("restart")
        _expect_replay(checks[-1], restarted, 0)
        for _ in range(len(replicas) * light):
            rng.choice(replicas).serve(workload.again() if rng.random() < 0.5 else workload.prompt())
        phase("mixed")
    for replica in replicas:
        replica.publisher.close()
    return checks


def run_engine(args: argparse.Namespace) -> int:
    """``--engine``: run engine_router.py in the engine venv against Dynamo's indexer."""
    engine_python = args.engine_python or os.environ.get("PAGEDKV_ENGINE_PYTHON") or str(
        Path("~/.cache/pagedkv/engine-venv/bin/python").expanduser())
    probe = subprocess.run([engine_python, "-c", "import vllm, pagedkv.vllm"], capture_output=True, check=False) \
        if Path(engine_python).exists() else None
    if probe is None or probe.returncode != 0:
        print(f"verify-router --engine: SKIPPED: {engine_python} cannot import vllm and pagedkv.vllm. Build the "
              "engine venv with `make verify-engine` (ENGINE_VENV, vLLM 0.32 CPU) and pass --engine-python "
              "ENGINE_VENV/bin/python (`make verify-router-engine` does both).", file=sys.stderr)
        return 0
    try:
        dynamo_python = find_dynamo_python(args.dynamo_python)
    except DynamoNotInstalled as error:
        print(f"verify-router --engine: {error}", file=sys.stderr)
        return 2
    command = [engine_python, str(Path(__file__).resolve().parent / "engine_router.py"),
               "--dynamo-python", dynamo_python, "--scheduler", args.engine_scheduler, "--seed", str(args.seed)]
    if args.indexer_log:
        command += ["--indexer-log", args.indexer_log.replace("{B}", "engine")]
    return subprocess.run(command, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verify_router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dynamo-python", default=None, metavar="PATH",
                        help="a python with ai-dynamo-runtime (default: $PAGEDKV_DYNAMO_PYTHON, then "
                             "~/.cache/pagedkv/router-venv)")
    parser.add_argument("--block-sizes", default="16,512")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=49, help="blocks per replica, the null block included")
    parser.add_argument("--samples", type=int, default=40, help="prompts queried per phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--converge-timeout", type=float, default=10.0, metavar="S",
                        help="how long a phase waits for the indexer to catch up")
    parser.add_argument("--indexer-log", default=None, metavar="FILE",
                        help="the indexer's log ({B} is replaced by the block size)")
    parser.add_argument("--engine", action="store_true",
                        help="check Dynamo against a running vLLM engine on pagedkv.vllm.Scheduler instead")
    parser.add_argument("--engine-python", default=None, metavar="PATH",
                        help="with --engine: the engine venv's python (default: $PAGEDKV_ENGINE_PYTHON, then "
                             "~/.cache/pagedkv/engine-venv)")
    parser.add_argument("--engine-scheduler", choices=["pagedkv", "stock"], default="pagedkv",
                        help="with --engine: stock runs the same check on stock vLLM's scheduler")
    args = parser.parse_args(argv)
    if args.engine:
        return run_engine(args)
    started = time.monotonic()
    checks: list[Check] = []
    try:
        for block_size in (int(b) for b in args.block_sizes.split(",")):
            print(f"Dynamo indexer against {args.replicas} pagedkv replicas, block size {block_size}:", flush=True)
            checks += run_block_size(block_size, args)
    except DynamoNotInstalled as error:
        print(f"verify-router: {error}", file=sys.stderr)
        return 2
    bad = sum(c.dump_disagreements + c.query_disagreements for c in checks)
    queries = sum(c.queries for c in checks)
    print(f"verify-router: {len(checks)} phase checks, {queries} replica x prompt overlaps, "
          f"{len(checks) * args.replicas} dump comparisons: {bad} disagreements "
          f"({time.monotonic() - started:.1f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
