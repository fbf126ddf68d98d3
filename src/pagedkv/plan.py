"""``pagedkv plan``: plan a model's KV cache in a memory budget.

Given a model (a built-in preset or a JSON/YAML model file, see
``pagedkv.model_file``) and the memory left for the KV cache, prints the KV
cache groups, the tensors, ``num_blocks``, the KV cache size in tokens, the
maximum concurrency at ``--max-model-len`` and the largest
``max_model_len`` that fits. ``--json`` prints the same as one JSON object.

Exit status: 0 planned; 1 the memory cannot hold one request of
``--max-model-len`` tokens (the message gives the largest length that fits);
2 bad arguments or a malformed model file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import fields
from typing import Any, Final

from pagedkv.model_file import ModelDescription, load_model_file
from pagedkv.presets import PRESETS
from pagedkv.spec.capacity import (
    estimate_max_model_len,
    get_max_concurrency_for_kv_cache_config,
    kv_cache_size_tokens,
    max_memory_usage_bytes,
)
from pagedkv.spec.config import KVCacheConfig, check_kv_cache_config
from pagedkv.spec.errors import InsufficientMemoryError, InvalidConfigError
from pagedkv.spec.host_plan import HostTierPlan, plan_host_tier
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.planner import get_kv_cache_config, get_kv_cache_groups
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.setting import DEFAULT_MAX_NUM_BATCHED_TOKENS, ModelSetting
from pagedkv.spec.uniform_spec import UniformTypeKVCacheSpecs

__all__ = ["main", "parse_memory"]

_UNITS: Final[dict[str, int]] = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
GiB: Final = 1 << 30


def parse_memory(text: str) -> int:
    """Bytes from ``"42949672960"``, ``"40GiB"``, ``"40G"`` (binary),
    ``"42.9GB"`` (decimal), ``"512MiB"``...; raises ``ValueError``."""
    match = _SIZE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (examples: 40GiB, 512MiB, 42949672960)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _memory_arg(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv plan", description=__doc__.split("\n\n")[0] if __doc__ else None)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=sorted(PRESETS), help="a built-in model")
    model.add_argument("--model", metavar="FILE", help="a JSON or YAML model file")
    memory = parser.add_mutually_exclusive_group(required=True)
    memory.add_argument("--memory", type=_memory_arg, metavar="SIZE",
                        help="memory for the KV cache: bytes or 40GiB, 512MiB, 42GB...")
    memory.add_argument("--gpu-memory", type=_memory_arg, metavar="SIZE",
                        help="GPU memory; the KV cache gets --utilization of it")
    parser.add_argument("--utilization", type=float, default=0.9,
                        help="share of --gpu-memory for the KV cache (default 0.9)")
    parser.add_argument("--max-model-len", type=int, default=8192, help="default 8192")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help=f"default {DEFAULT_MAX_NUM_BATCHED_TOKENS}")
    parser.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                        help="cross-attention encoder length (default: --max-num-batched-tokens)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="block size of a preset's attention layers (default: the preset's)")
    parser.add_argument("--dcp", type=int, default=1, help="decode context parallel size")
    parser.add_argument("--pcp", type=int, default=1, help="prefill context parallel size")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true")
    parser.add_argument("--host-memory", type=_memory_arg, metavar="SIZE", default=None,
                        help="host memory for a HiSparse host tier of a sparse-MLA preset's MLA caches "
                             "(reported beside the device plan, spec/host_plan.py)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _spec_fields(spec: KVCacheSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(spec).__name__}
    if isinstance(spec, UniformTypeKVCacheSpecs):
        out["block_size"] = spec.block_size
        out["layers"] = {name: _spec_fields(s) for name, s in spec.kv_cache_specs}
    else:
        for f in fields(spec):
            out[f.name] = getattr(spec, f.name)
    out["page_size_bytes"] = spec.page_size_bytes
    return out


def _short_names(names: tuple[str, ...], limit: int = 6) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit - 2]) + f", ... ({len(names) - limit + 1} more), " + names[-1]


def _describe(spec: KVCacheSpec) -> str:
    parts = [f"{f.name}={getattr(spec, f.name)!r}" for f in fields(spec)
             if getattr(spec, f.name) is not None and f.name != "kv_cache_specs"]
    return f"{type(spec).__name__}({', '.join(parts)})"


def _report(name: str, setting: ModelSetting, available: int, config: KVCacheConfig,
            largest: int, needed: int) -> dict[str, Any]:
    concurrency = (get_max_concurrency_for_kv_cache_config(setting, config)
                   if config.kv_cache_groups else None)
    return {
        "model": name,
        "available_memory": available,
        "max_model_len": setting.max_model_len,
        "max_num_batched_tokens": setting.max_num_batched_tokens,
        "memory_per_request": needed,
        "num_blocks": config.num_blocks,
        "page_size_bytes": (config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
                            if config.kv_cache_groups else 0),
        "kv_cache_size_tokens": kv_cache_size_tokens(setting, config),
        "max_concurrency": concurrency,
        "largest_max_model_len": largest,
        "groups": [{"group_id": i, "manager_kind": manager_kind_for(g.kv_cache_spec),
                    "kv_cache_spec": _spec_fields(g.kv_cache_spec), "layer_names": list(g.layer_names)}
                   for i, g in enumerate(config.kv_cache_groups)],
        "tensors": [{"size": t.size, "shared_by": list(t.shared_by)} for t in config.kv_cache_tensors],
    }


def _print_text(report: dict[str, Any], config: KVCacheConfig, largest_limit: int) -> None:
    available = report["available_memory"]
    print(f"model                 {report['model']}")
    print(f"available memory      {available:,} bytes ({available / GiB:.2f} GiB)")
    print(f"max_model_len         {report['max_model_len']:,}"
          f"   (max_num_batched_tokens {report['max_num_batched_tokens']:,})")
    print(f"one request needs     {report['memory_per_request']:,} bytes")
    print(f"KV cache groups       {len(config.kv_cache_groups)}")
    for i, group in enumerate(config.kv_cache_groups):
        print(f"  group {i}: {manager_kind_for(group.kv_cache_spec)}, {len(group.layer_names)} layers, "
              f"{_describe(group.kv_cache_spec)}")
        print(f"    layers: {_short_names(group.layer_names)}")
    print(f"KV cache tensors      {len(config.kv_cache_tensors)}")
    for i, tensor in enumerate(config.kv_cache_tensors):
        print(f"  tensor {i}: {tensor.size:,} bytes, shared by {_short_names(tensor.shared_by)}")
    first = config.kv_cache_groups[0].kv_cache_spec if config.kv_cache_groups else None
    if isinstance(first, UniformTypeKVCacheSpecs):
        # One group of layers with their own pages: the figure is their sum.
        print(f"page size             {report['page_size_bytes']:,} bytes per block, summed over "
              f"the group's {len(first.kv_cache_specs)} layers")
    else:
        print(f"page size             {report['page_size_bytes']:,} bytes per block per layer")
    print(f"num_blocks            {report['num_blocks']:,}")
    print(f"KV cache size         {report['kv_cache_size_tokens']:,} tokens")
    concurrency = report["max_concurrency"]
    if concurrency is None:
        print("max concurrency       unbounded (attention-free model)")
    else:
        print(f"max concurrency       {concurrency:.2f}x at {report['max_model_len']:,} tokens per request")
    largest = report["largest_max_model_len"]
    suffix = " (the search limit: every length fits)" if largest == largest_limit else ""
    print(f"largest max_model_len {largest:,}{suffix}")


def _load(args: argparse.Namespace) -> ModelDescription:
    if args.preset is not None:
        preset = PRESETS[args.preset]
        return ModelDescription(preset.name, preset.build(args.max_model_len, args.block_size))
    return load_model_file(args.model, args.max_model_len)


def main(argv: list[str] | None = None) -> int:
    """Run ``pagedkv plan`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments, 0 on --help
        return int(exc.code or 0)
    try:
        if args.memory is not None:
            available = args.memory
        else:
            if not 0.0 < args.utilization <= 1.0:
                raise InvalidConfigError(f"--utilization must be in (0, 1], got {args.utilization}")
            available = int(args.gpu_memory * args.utilization)
        if args.block_size is not None and args.block_size <= 0:
            raise InvalidConfigError(f"--block-size must be a positive int, got {args.block_size}")
        setting = ModelSetting(
            max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
            dcp_world_size=args.dcp, pcp_world_size=args.pcp,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager)
        model = _load(args)
        _, layer_specs = get_kv_cache_groups(setting, model.specs)
        largest = estimate_max_model_len(setting, layer_specs, available)
        config = get_kv_cache_config(setting, model.specs, available)
        check_kv_cache_config(config)
        needed = max_memory_usage_bytes(setting, layer_specs.values())
        host = _host_tier(args, setting, model)
    except InsufficientMemoryError as exc:
        _fail(args.json, "insufficient_memory", str(exc))
        return 1
    except InvalidConfigError as exc:
        _fail(args.json, "invalid_config", str(exc))
        return 2
    report = _report(model.name, setting, available, config, largest, needed)
    report["host_tier"] = None if host is None else _host_report(host)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from pagedkv.spec.capacity import DEFAULT_SEARCH_LIMIT

        _print_text(report, config, DEFAULT_SEARCH_LIMIT)
        if host is not None:
            _print_host(report["host_tier"])
    return 0


def _host_tier(args: argparse.Namespace, setting: ModelSetting, model: ModelDescription) -> HostTierPlan | None:
    """The host tier ``--host-memory`` asks for, or ``None``."""
    if args.host_memory is None:
        return None
    preset = PRESETS.get(args.preset) if args.preset is not None else None
    sources = preset.host_source_layers(model.specs) if preset is not None else []
    if not sources:
        with_tier = sorted(name for name, p in PRESETS.items() if p.host_source_suffix)
        raise InvalidConfigError(
            f"--host-memory: {model.name} names no HiSparse source layers (presets with a host tier: "
            f"{', '.join(with_tier)})")
    return plan_host_tier(setting, model.specs, sources, args.host_memory)


def _host_report(host: HostTierPlan) -> dict[str, Any]:
    return {"host_memory": host.host_memory, "source_layers": len(host.source_layers),
            "host_block_bytes": host.host_block_bytes, "host_num_blocks": host.host_num_blocks,
            "host_tokens": host.host_tokens, "min_host_blocks": host.min_host_blocks,
            "max_resident_requests": host.max_resident_requests}


def _print_host(host: dict[str, Any]) -> None:
    print(f"host tier (HiSparse)  {host['host_memory']:,} bytes ({host['host_memory'] / GiB:.2f} GiB) for "
          f"the pages of {host['source_layers']} source layers")
    print(f"  host block          {host['host_block_bytes']:,} bytes (one page of every source layer)")
    print(f"  host blocks         {host['host_num_blocks']:,} ({host['host_tokens']:,} tokens; "
          f"one max_model_len request needs {host['min_host_blocks']:,} with the null block and a spare)")
    print(f"  host-resident       {host['max_resident_requests']:.2f} requests of max_model_len at once")
    print("  (the device plan above counts every layer; vLLM's HiSparse device layout is not planned here)")


def _fail(as_json: bool, kind: str, message: str) -> None:
    if as_json:
        print(json.dumps({"error": kind, "message": message}))
    print(f"pagedkv plan: error: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
