"""Dynamo's KV indexer reading a running vLLM engine on ``pagedkv.vllm.Scheduler``.

Run in the engine venv (vLLM 0.32 CPU, the one ``make verify-engine`` builds)
by ``verify_router.py --engine``; never imported by pagedkv. One vLLM engine
(the verify-engine Llama with seeded random weights, a small pool so that
requests evict) runs in this process with ``--kv-events-config``: vLLM's own
ZMQ publisher on local ipc sockets, with its replay socket. Dynamo's standalone
indexer (``python -m dynamo.indexer``, its own venv) subscribes to it as
worker 1. Requests go through the engine in phases: ``stores`` (prompts
sharing system prompts), ``hits`` (again, and continued), ``evictions``
(unique prompts that overflow the pool), ``reset`` (``reset_prefix_cache``),
``after-reset`` and ``mixed``.

After each phase three views of the cache must agree, each from its own source:

- the engine: the hashes the scheduler's block pool really holds (read in
  this process from ``scheduler.kv_cache_manager``, low 64 bits as on the wire);
- vLLM's decoder: the whole stream fetched again from the engine's replay
  socket, decoded with vLLM's ``KVEventBatch`` msgspec classes and applied in
  order (stored adds, removed drops, cleared empties);
- Dynamo: its ``/dump`` for the worker.

Then for a sample of prompts, one at a time: Dynamo's ``/query`` overlap (in
blocks) must equal the prefix hit the engine reports for the same prompt
(``num_cached_tokens`` of a one-token request on the prompt plus one token,
so the hit is not capped by the last token); each probe is itself a request,
so the views are brought to agreement again before the next prompt. vLLM
publishes a step's events at the end of the step, so a reset between steps
reaches subscribers with the next one; the check shows that lag and runs a
step that stores nothing before comparing. Any
difference is a disagreement; exit status 1 if there is one, 2 when a piece
is missing (the message says which and how to install it).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

for _key, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: its pool is readable
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)

ENGINE_TOOLS = Path(__file__).resolve().parent.parent / "verify_engine"
sys.path.insert(0, str(ENGINE_TOOLS))

from verify_router import Workload  # noqa: E402  (this folder, on the path when run as a script)

MODEL = "engine"
WORKER = 1
MASK = (1 << 64) - 1
SCHEDULERS = {"pagedkv": "pagedkv.vllm.Scheduler", "stock": "vllm.v1.core.sched.scheduler.Scheduler"}


class Engine:
    """The vLLM engine, its publisher's endpoints and its pool's contents."""

    def __init__(self, scheduler: str, model_dir: Path, num_blocks: int, block_size: int) -> None:
        from vllm import LLM
        from vllm.config import KVEventsConfig

        self.block_size = block_size
        # ipc sockets: vLLM's publisher binds only wildcard TCP endpoints (tcp://*:P, every
        # interface) and connects to a host address; ipc binds and stays on this machine.
        self.folder = tempfile.mkdtemp(prefix="pagedkv-engine-router-")
        self.endpoint = f"ipc://{self.folder}/kv-events"
        self.replay_endpoint = f"ipc://{self.folder}/kv-replay"
        self.llm = LLM(
            model=str(model_dir), tokenizer=str(model_dir), scheduler_cls=SCHEDULERS[scheduler],
            block_size=block_size, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512,
            enable_prefix_caching=True, num_gpu_blocks_override=num_blocks, load_format="auto",
            dtype="float32", seed=0, enforce_eager=True,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                            endpoint=self.endpoint, replay_endpoint=self.replay_endpoint))
        self.scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        manager = self.scheduler.kv_cache_manager
        self.served = sys.modules[manager.__class__.__module__].__file__

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        """Serve ``prompts`` as one batch; the cached prompt tokens of each."""
        from vllm import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [int(o.num_cached_tokens or 0) for o in outputs]

    def hit_blocks(self, tokens: list[int]) -> int:
        """The engine's prefix hit for ``tokens``, in blocks (a probe request:
        it caches its own blocks too)."""
        (cached,) = self.generate([[*tokens, 0]], [1])
        return cached // self.block_size

    def cached(self) -> set[int]:
        """The hashes the engine's block pool holds (low 64 bits, as on the wire)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        core = getattr(pool, "core", None)
        if core is not None:  # pagedkv's pool behind vLLM's BlockPool interface
            from pagedkv.spec.types import BlockHashWithGroupId, get_block_hash

            keys = [get_block_hash(BlockHashWithGroupId(key)) for key, _ in core.snapshot().cached]
        else:  # stock vLLM
            from vllm.v1.core.kv_cache_utils import get_block_hash as vllm_block_hash

            keys = [vllm_block_hash(key) for key in pool.cached_block_hash_to_block._cache]
        return {int.from_bytes(key, "big") & MASK for key in keys}


class VllmDecodedView:
    """The cache the engine's event stream describes, read with vLLM's own
    decoder from the engine's replay socket (the whole buffered stream)."""

    def __init__(self, replay_endpoint: str) -> None:
        import zmq
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self.zmq = zmq
        self.context = zmq.Context.instance()
        self.endpoint = replay_endpoint
        self.decoder = Decoder(type=KVEventBatch)
        self.batches = 0
        self.kinds: dict[str, int] = {}

    def cached(self, timeout_ms: int = 10_000) -> set[int]:
        """Replay from sequence 0 and apply every event in order."""
        sock = self.context.socket(self.zmq.DEALER)
        sock.setsockopt(self.zmq.LINGER, 0)
        sock.setsockopt(self.zmq.RCVTIMEO, timeout_ms)
        sock.connect(self.endpoint)
        held: set[int] = set()
        expected = 0
        kinds = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        try:
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                _, _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    break
                if seq != expected:
                    raise RuntimeError(f"replay skipped from sequence {expected} to {seq}")
                expected += 1
                for event in self.decoder.decode(payload).events:
                    kind = type(event).__name__
                    kinds[kind] = kinds.get(kind, 0) + 1
                    if kind == "BlockStored":
                        held.update(int(h) & MASK for h in event.block_hashes)
                    elif kind == "BlockRemoved":
                        held.difference_update(int(h) & MASK for h in event.block_hashes)
                    elif kind == "AllBlocksCleared":
                        held.clear()
        finally:
            sock.close()
        self.batches, self.kinds = expected, kinds
        return held


class Prompts(Workload):
    """The router check's prompts, smaller to fit the engine's pool, plus
    output lengths; token ids start at 3, above the toy model's special ids."""

    def __init__(self, block_size: int, seed: int, vocab: int) -> None:
        super().__init__(block_size, seed, vocab=vocab, low_token=3, systems=5, system_blocks=3,
                         turn_blocks=4, probe_blocks=1)

    def max_tokens(self, count: int) -> list[int]:
        """Output lengths: some fill a block during decode (decode-time stores)."""
        return [self.rng.choice([1, 4, 8, self.block_size + 3]) for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine_router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dynamo-python", default=None, metavar="PATH")
    parser.add_argument("--scheduler", choices=sorted(SCHEDULERS), default="pagedkv",
                        help="pagedkv (the check) or stock (the same check on stock vLLM)")
    parser.add_argument("--cache-dir", default=os.environ.get("PAGEDKV_ENGINE_CACHE",
                                                              str(Path.home() / ".cache/pagedkv")))
    parser.add_argument("--num-blocks", type=int, default=48, help="the engine's KV cache blocks")
    parser.add_argument("--samples", type=int, default=12, help="prompts probed per phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--converge-timeout", type=float, default=10.0, metavar="S")
    parser.add_argument("--indexer-log", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    started = time.monotonic()

    import models
    import workloads

    from pagedkv.events.dynamo import DynamoIndexer, DynamoNotInstalled

    block_size = workloads.BLOCK_SIZE
    model_dir = models.write_model("llama", Path(args.cache_dir) / "models")
    try:
        indexer = DynamoIndexer(args.dynamo_python, log_path=args.indexer_log)
    except DynamoNotInstalled as error:
        print(f"verify-router --engine: {error}", file=sys.stderr)
        return 2
    disagreements = 0
    try:
        engine = Engine(args.scheduler, model_dir, args.num_blocks, block_size)
        print(f"engine on {SCHEDULERS[args.scheduler]} (manager {engine.served}), block size {block_size}, "
              f"{args.num_blocks} blocks; publisher {engine.endpoint}, replay {engine.replay_endpoint}", flush=True)
        decoded = VllmDecodedView(engine.replay_endpoint)
        indexer.register(WORKER, engine.endpoint, engine.replay_endpoint, model_name=MODEL, block_size=block_size)
        indexer.wait_listening(1)
        time.sleep(0.3)  # PUB drops what it sends before a subscription arrives
        prompts = Prompts(block_size, args.seed, models.VOCAB)
        rng = random.Random(args.seed)

        def views() -> tuple[set[int], set[int], set[int]]:
            """Engine, vLLM-decoded and Dynamo views once they agree, or the
            last ones after the timeout."""
            deadline = time.monotonic() + args.converge_timeout
            while True:
                truth = engine.cached()
                got = decoded.cached()
                dump = indexer.dump(model_name=MODEL).get(WORKER, set())
                if (truth == got == dump) or time.monotonic() > deadline:
                    return truth, got, dump
                time.sleep(0.05)

        def phase(name: str) -> None:
            nonlocal disagreements
            bad: list[str] = []
            truth, got, dump = views()
            if got != truth:
                bad.append(f"vLLM's decoder of the stream: {len(got - truth)} blocks the engine does not hold, "
                           f"{len(truth - got)} it holds missing")
            if dump != truth:
                bad.append(f"Dynamo /dump: {len(dump - truth)} blocks the engine does not hold, "
                           f"{len(truth - dump)} it holds missing")
            blocks, batches = len(truth), decoded.batches
            kinds = "/".join(str(n) for n in decoded.kinds.values())
            queries = hits = 0
            for tokens in prompts.sample(args.samples):
                views()  # the previous probe's own blocks reached every view
                overlap = indexer.query(tokens, model_name=MODEL).get(WORKER, 0) // block_size
                real = engine.hit_blocks(tokens)
                queries += 1
                hits += real > 0
                if overlap != real:
                    bad.append(f"prompt of {len(tokens)} tokens: Dynamo says {overlap} blocks, the engine hit {real}")
            disagreements += len(bad)
            print(f"  {name:<12} engine holds {blocks:>3} blocks  stream {batches:>4} batches "
                  f"(stored/removed/cleared {kinds})  "
                  f"probes {queries:>3} (hits {hits:>3})  disagreements {len(bad)}", flush=True)
            for line in bad[:8]:
                print(f"    {line}", flush=True)

        def serve(batch: list[list[int]]) -> None:
            engine.generate(batch, prompts.max_tokens(len(batch)))

        serve([prompts.prompt() for _ in range(4)])
        phase("stores")
        serve([prompts.again() if rng.random() < 0.7 else prompts.prompt() for _ in range(6)])
        phase("hits")
        for _ in range(3):
            serve([prompts.prompt(shared=rng.random() < 0.3) for _ in range(5)])
        phase("evictions")
        if not engine.llm.reset_prefix_cache():
            print("    reset_prefix_cache refused (blocks in use)", flush=True)
            disagreements += 1
        # vLLM's scheduler publishes the manager's events only at the end of a step, so the
        # AllBlocksCleared of a reset between steps reaches subscribers with the next step
        # (stock vLLM alike: --engine-scheduler stock). Shown, then flushed by a step that
        # stores nothing (a prompt shorter than a block, one output token).
        truth, got = engine.cached(), decoded.cached()
        print(f"    after reset_prefix_cache, before the next step: engine holds {len(truth)} blocks, "
              f"the published stream still {len(got)}", flush=True)
        engine.generate([[3] * (block_size // 2)], [1])
        phase("reset")
        serve([prompts.again() for _ in range(5)])
        phase("after-reset")
        for _ in range(2):
            serve([prompts.again() if rng.random() < 0.5 else prompts.prompt() for _ in range(6)])
        phase("mixed")
    finally:
        indexer.close()
    print(f"verify-router --engine ({args.scheduler}): {disagreements} disagreements "
          f"({time.monotonic() - started:.1f} s)", flush=True)
    return 1 if disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
