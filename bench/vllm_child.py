# mypy: ignore-errors
"""Runs inside vLLM's interpreter (never imported by pagedkv): one replay
through vLLM 0.33's own KVCacheManager, printed as one JSON line.

    <vllm python> bench/vllm_child.py '<job json>'

The job names the workload (``trace``: the standard chat trace of
``src/pagedkv/trace.py``; ``prompts``: long prompts or a Mooncake trace
through ``bench/side_driver.py``), the model, the block size, the pool and
the hash. Both helper modules are loaded by path, so vLLM replays exactly
the steps and token lists pagedkv replays. vLLM is only called here; no
vLLM code is copied.
"""

import importlib.util
import json
import sys
import time


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _kv_config(model, block_size, num_blocks):
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    if model == "llama3":
        specs = [full]
    elif model == "gemma3":
        window = SlidingWindowSpec(block_size=block_size, num_kv_heads=8, head_size=128,
                                   dtype=torch.bfloat16, sliding_window=1024)
        specs = [window] * 5 + [full]
    elif model == "jamba":
        specs = [full, MambaSpec(block_size=block_size, shapes=((16, 64), (128, 16)),
                                 dtypes=(torch.bfloat16, torch.bfloat16), mamba_cache_mode="align")]
    else:
        raise SystemExit(f"unknown model {model!r}")
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)])


def _run_trace(job, manager, make):
    trace = _load("pagedkv_trace", job["trace_py"])
    config = trace.TraceConfig(num_requests=job["requests"])
    steps = list(trace.standard_trace(config))
    clock = time.perf_counter_ns
    ns = dict.fromkeys(trace.CALL_KINDS, 0)
    calls = dict.fromkeys(trace.CALL_KINDS, 0)
    requests, hits, prompt_tokens, hit_tokens = {}, {}, 0, []
    for step in steps:
        kind = type(step).__name__
        if kind == "AllocateSlots":
            request = requests[step.request_id]
            if step.uses_prefix_hit:
                blocks = hits.pop(step.request_id)
                t = clock()
                out = manager.allocate_slots(request, step.num_new_tokens, step.num_new_computed_tokens,
                                             blocks)
                ns["allocate_slots"] += clock() - t
            else:
                t = clock()
                out = manager.allocate_slots(request, step.num_new_tokens)
                ns["allocate_slots"] += clock() - t
            calls["allocate_slots"] += 1
            if out is None:
                raise SystemExit(f"vLLM refused {step}")
            request.num_computed_tokens += step.num_new_computed_tokens + step.num_new_tokens
        elif kind == "AppendToken":
            request = requests[step.request_id]
            t = clock()
            request.append_output_token_ids(step.token_id)
            ns["append_token"] += clock() - t
            calls["append_token"] += 1
        elif kind == "GetComputedBlocks":
            request = requests[step.request_id]
            manager.new_step_starts()  # as pagedkv's TraceDriver does, untimed
            t = clock()
            blocks, hit = manager.get_computed_blocks(request)[:2]
            ns["get_computed_blocks"] += clock() - t
            calls["get_computed_blocks"] += 1
            if hit != step.expected_hit_tokens:
                raise SystemExit(f"vLLM hit {hit} tokens at {step}")
            hit_tokens.append(hit)
            hits[step.request_id] = blocks
        elif kind == "AddRequest":
            prompt = list(step.prompt_token_ids)
            t = clock()
            request = make(step.request_id, prompt)
            ns["make_request"] += clock() - t
            calls["make_request"] += 1
            prompt_tokens += len(prompt)
            requests[step.request_id] = request
        elif kind == "Free":
            request = requests.pop(step.request_id)
            t = clock()
            manager.free(request)
            ns["free"] += clock() - t
            calls["free"] += 1
    return {"time_ns": ns, "calls": calls, "prompt_tokens": prompt_tokens, "hits": hit_tokens}


def main():
    job = json.loads(sys.argv[1])
    driver = _load("pagedkv_side_driver", job["driver_py"])
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    block_size = job["block_size"]
    hash_fn = get_hash_fn_by_name(job["hash"])
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)
    manager = KVCacheManager(_kv_config(job["model"], block_size, job["num_blocks"]), job["max_model_len"],
                             scheduler_block_size=block_size, hash_block_size=block_size)

    params = SamplingParams(max_tokens=job.get("max_tokens", 1))  # made once, untimed

    def make(request_id, prompt):
        return Request(request_id, prompt, sampling_params=params, pooling_params=None,
                       block_hasher=hasher)

    if job["kind"] == "trace":
        raw = _run_trace(job, manager, make)
    else:
        if job.get("mooncake"):
            requests = driver.mooncake_requests(job["mooncake"], job.get("limit"))
            prompts = driver.mooncake_prompts(requests)
        else:
            prompts = driver.long_prompts(job["prompt_tokens"], job["repeats"])
        raw = driver.replay_one_at_a_time(prompts, block_size, make, manager.get_computed_blocks,
                                          manager.allocate_slots,
                                          manager.free, job.get("skip_first", 0))
    raw["vllm_version"] = vllm.__version__
    raw["python"] = sys.version.split()[0]
    print(json.dumps(raw))


if __name__ == "__main__":
    main()
