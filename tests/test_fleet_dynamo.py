"""pagedkv replicas behind NVIDIA Dynamo's KV indexer (``--router dynamo``,
``make verify-router``). Dynamo is an outside program in its own venv: where
it is not installed (CI), the tests that need it are skipped with the reason
and only the error path runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.events.dynamo import DynamoNotInstalled, find_dynamo_python
from pagedkv.simulate.capacity import single_group_config
from pagedkv.simulate.cli import main
from pagedkv.simulate.replica import Replica, SchedulerConfig
from pagedkv.simulate.requests import PrefixHasher, SimRequest, TokenSource
from pagedkv.simulate.workload import load_workload

pytest.importorskip("zmq", reason="pagedkv.events needs pyzmq (pagedkv[events])")
pytest.importorskip("msgspec", reason="pagedkv.events needs msgspec (pagedkv[events])")

ROOT = Path(__file__).resolve().parent.parent
CONVERSATION = str(ROOT / "tests" / "data" / "mooncake_conversation_excerpt.jsonl")


@pytest.fixture(scope="module")
def dynamo_python() -> str:
    try:
        return find_dynamo_python()
    except DynamoNotInstalled:
        pytest.skip("NVIDIA Dynamo (ai-dynamo-runtime) is not installed: `make verify-router` installs it")


def test_router_dynamo_without_dynamo_names_the_install(capsys: pytest.CaptureFixture[str]) -> None:
    # This interpreter has pagedkv, not Dynamo (CI's case, and the user's before installing it).
    status = main([CONVERSATION, "--capacity", "2e5", "--replicas", "2", "--router", "dynamo", "--limit", "5",
                   "--dynamo-python", sys.executable, "--json", "--no-progress"])
    out = capsys.readouterr()
    assert status == 2
    doc = json.loads(out.out)
    assert doc["error"] == "missing_dependency"
    assert "ai-dynamo-runtime" in doc["message"] and "make verify-router" in doc["message"]


def test_all_is_the_builtin_routers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([CONVERSATION, "--capacity", "2e5", "--replicas", "2", "--router", "all", "--limit", "5",
                 "--no-reuse", "--json", "--no-progress"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [run["router"] for run in runs] == ["round-robin", "least-loaded", "prefix-aware"]
    assert all(run["route_us_per_request"] > 0 for run in runs)


def test_dynamo_predicts_exactly_the_hits_replicas_find(dynamo_python: str) -> None:
    # Cache mode: Dynamo's overlap for the chosen replica, read from the wire
    # events alone, is the hit that replica then finds, request by request.
    from pagedkv.simulate.dynamo_router import DynamoRouter

    workload = load_workload(CONVERSATION).limited(200)
    config = single_group_config(60, 512)  # small: evictions happen
    source, hasher = TokenSource(512), PrefixHasher("xxh3_128", 512, 512, "0")
    fleet = [Replica(i, config, 131072, hash_fn="xxh3_128", hash_seed="0", scheduler=SchedulerConfig())
             for i in range(3)]
    router = DynamoRouter(fleet, python=dynamo_python)
    try:
        for replica in fleet:
            replica.on_events = router.observe
        mismatches = []
        for number, trace_request in enumerate(workload.requests):
            request = SimRequest(f"r{number}", trace_request.block_ids, trace_request.input_length, source, hasher)
            before = router.matched_tokens
            chosen = router.choose(request, fleet, cache_mode=True)
            hits = fleet[chosen].stats.hit_tokens
            fleet[chosen].serve_alone(request)
            if router.matched_tokens - before != fleet[chosen].stats.hit_tokens - hits:
                mismatches.append(number)
        assert sum(r.stats.evicted_blocks for r in fleet) > 0
        assert sum(r.stats.hit_tokens for r in fleet) > 0
        assert mismatches == []
    finally:
        router.close()


def test_dynamo_routes_as_well_as_pagedkvs_own_router(dynamo_python: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([CONVERSATION, "--capacity", "2e5", "--replicas", "4", "--router", "prefix-aware,dynamo",
                 "--mode", "cache", "--no-reuse", "--json", "--no-progress", "--dynamo-python", dynamo_python]) == 0
    own, dynamo = json.loads(capsys.readouterr().out)["runs"]
    assert dynamo["router"] == "dynamo"
    assert dynamo["hit_rate"] > 0.3 and abs(dynamo["hit_rate"] - own["hit_rate"]) < 0.05


def test_verify_router_finds_no_disagreement(dynamo_python: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "verify_router" / "verify_router.py"), "--dynamo-python",
         dynamo_python, "--block-sizes", "16", "--samples", "10"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 disagreements" in done.stdout


def test_router_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    assert main([CONVERSATION, "--capacity", "2e5", "--replicas", "3", "--router", "all", "--limit", "30",
                 "--no-reuse", "--no-progress", "--plot", str(out)]) == 0
    data = (out / "routers.png").read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5000
    assert "routers.png" in capsys.readouterr().out


def test_dynamos_view_equals_pagedkvs_own_router_in_engine_mode(dynamo_python: str) -> None:
    # Engine mode (batches, chunked prefill, decode, evictions): before every
    # decision, Dynamo's overlap per replica (from the wire) equals the match
    # pagedkv's prefix-aware router computes from the same events in-process.
    from pagedkv.simulate.dynamo_router import MODEL, DynamoRouter
    from pagedkv.simulate.fleet import PrefixAwareRouter
    from pagedkv.spec.types import KVCacheEvent

    workload = load_workload(CONVERSATION).limited(120)
    config = single_group_config(120, 512)
    source, hasher = TokenSource(512), PrefixHasher("xxh3_128", 512, 512, "0")
    fleet = [Replica(i, config, 131072, hash_fn="xxh3_128", hash_seed="0", scheduler=SchedulerConfig())
             for i in range(3)]
    router, shadow = DynamoRouter(fleet, python=dynamo_python), PrefixAwareRouter()

    def both(replica: int, events: list[KVCacheEvent]) -> None:
        router.observe(replica, events)
        shadow.observe(replica, events)

    try:
        for replica in fleet:
            replica.on_events = both
        compared = matched = 0
        for number, trace_request in enumerate(workload.requests):
            request = SimRequest(f"r{number}", trace_request.block_ids, trace_request.input_length, source, hasher)
            for replica in fleet:
                replica.advance_to(trace_request.arrival_ms)
            router._sync()
            tokens = list(request.all_token_ids[0:request.num_prompt_tokens])
            overlap = router.indexer.query(tokens, model_name=MODEL)
            own = shadow.match_blocks(request, len(fleet))
            assert [overlap.get(i + 1, 0) // 512 for i in range(len(fleet))] == own, f"request {number}"
            compared += len(fleet)
            matched += sum(1 for blocks in own if blocks)
            fleet[router.choose(request, fleet, cache_mode=False)].submit(request, trace_request)
        assert compared == 3 * len(workload.requests) and matched > 0
        assert sum(r.stats.evicted_blocks for r in fleet) > 0
    finally:
        router.close()


def test_verify_router_engine_without_an_engine_venv_is_skipped_with_the_way_to_build_one(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "verify_router" / "verify_router.py"), "--engine",
         "--engine-python", str(tmp_path / "no-venv" / "bin" / "python")],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0
    assert "SKIPPED" in done.stderr and "make verify-engine" in done.stderr
