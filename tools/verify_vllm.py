"""``make verify-vllm``: vLLM 0.33's own ``tests/v1/core``, stock and with pagedkv.

Runs vLLM's core test suite twice in vLLM's virtual environment -- once as
vLLM ships it, once with ``vllm.v1.core.kv_cache_manager.KVCacheManager``
replaced by ``pagedkv.vllm.KVCacheManager`` -- and prints the pass counts per
test file side by side.

- The venv: ``--venv`` or ``$VLLM_VENV`` (default ``~/.cache/pagedkv/vllm-venv``,
  as ``bench/locations.py``), with vLLM 0.33.0 importable on CPU plus
  ``pytest pytest-asyncio hypothesis``: ``make vllm-venv`` builds it
  (tools/vllm_venv/install.sh) and ``make verify-vllm`` does so first.
  pagedkv is installed into it, editable and with ``--no-deps``, on every run.
- vLLM's tests are not in its wheel. They are fetched at run time from the
  source distribution on the package index (the file itself: pip's sdist
  download fails while preparing metadata), checked against the index's
  sha256 and unpacked under ``--cache`` (default ``~/.cache/pagedkv``),
  outside this repository. Nothing of vLLM is committed here.
- Offline and on CPU: the scheduler tests read ``facebook/opt-125m``'s model
  config and the planning tests ``Qwen/Qwen3-0.6B``'s, so minimal
  ``config.json`` files (architecture only, no weights) are written to the
  cache and ``VLLM_MODEL_REDIRECT_PATH`` points vLLM at them. ``tools/vllm_core_plugin.py``
  stands in for vLLM's top-level conftest (``--noconftest``).
- Skipped files: ``*_e2e.py`` and ``prefix_cache/test_hybrid_prefix_cache_hit_rate.py``
  (they load real weights and need a GPU).

This script runs with any Python 3.11 (it only starts subprocesses); it is
outside the packages ``make typecheck`` checks, but typed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.33.0"
SDIST = f"vllm-{VLLM_VERSION}.tar.gz"
INDEX_PAGE = "https://pypi.org/simple/vllm/"
SKIPPED_FILES = ("prefix_cache/test_hybrid_prefix_cache_hit_rate.py",)
# Where `make vllm-venv` builds vLLM's venv (the Makefile's and bench/locations.py's default;
# this script runs on any Python, outside the packages, so it names the default itself).
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "pagedkv" / "vllm-venv"

# The model config the scheduler tests load (OPT-125m's architecture; no weights).
OPT_CONFIG: dict[str, Any] = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
    "hidden_size": 768, "ffn_dim": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 768,
    "do_layer_norm_before": True, "enable_bias": True, "layer_norm_elementwise_affine": True,
    "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "torch_dtype": "float16",
    "dropout": 0.1, "attention_dropout": 0.0, "layerdrop": 0.0, "init_std": 0.02,
    "use_cache": True,
}

# The planning tests read Qwen3-0.6B's config (its architecture; no weights).
QWEN3_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "torch_dtype": "bfloat16", "tie_word_embeddings": True, "hidden_act": "silu",
    "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
}
MODEL_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "facebook/opt-125m": ("opt-125m", OPT_CONFIG),
    "Qwen/Qwen3-0.6B": ("qwen3-0.6b", QWEN3_CONFIG),
}


def log(message: str) -> None:
    print(f"[verify-vllm] {message}", file=sys.stderr, flush=True)


def fetch_tests(cache: Path) -> Path:
    """vLLM's ``tests/`` unpacked under ``cache``; returns the sdist root."""
    root = cache / f"vllm-{VLLM_VERSION}"
    if (root / "tests" / "v1" / "core").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / SDIST
    if not archive.exists():
        log(f"fetching {SDIST} from the package index")
        with urllib.request.urlopen(INDEX_PAGE, timeout=60) as page:
            html = page.read().decode("utf-8")
        match = re.search(r'href="([^"]*/' + re.escape(SDIST) + r')#sha256=([0-9a-f]{64})"', html)
        if match is None:
            raise SystemExit(f"{SDIST} not listed on {INDEX_PAGE}")
        url, digest = match.groups()
        partial = archive.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=300) as response, open(partial, "wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
        actual = hashlib.sha256(partial.read_bytes()).hexdigest()
        if actual != digest:
            partial.unlink()
            raise SystemExit(f"{SDIST}: sha256 {actual} does not match the index's {digest}")
        partial.rename(archive)
    log(f"unpacking tests/ of {SDIST} into {cache}")
    prefix = f"vllm-{VLLM_VERSION}/tests/"
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(cache, members=members, filter="data")
    return root


def write_model_redirect(cache: Path) -> Path:
    """The model config folders and the redirect file naming them; returns the latter."""
    folders: dict[str, str] = {}
    for name, (folder, config) in MODEL_CONFIGS.items():
        model_dir = cache / "models" / folder
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        folders[name] = str(model_dir)
    redirect = cache / "model_redirect.json"
    redirect.write_text(json.dumps(folders), encoding="utf-8")
    return redirect


def check_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(
            f"no virtual environment at {venv} (set VLLM_VENV or --venv): `make vllm-venv` "
            f"builds vLLM {VLLM_VERSION} on CPU there (tools/vllm_venv/install.sh)")
    done = subprocess.run([str(python), "-c", "import vllm, pytest; print(vllm.__version__)"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0 or done.stdout.strip() != VLLM_VERSION:
        raise SystemExit(f"{python}: needs vllm=={VLLM_VERSION} and pytest "
                         f"(got {done.stdout.strip() or done.stderr.strip()[-500:]})")
    return python


def make_overlay(venv: Path, overlay: Path) -> Path:
    """A light venv that sees vLLM's packages but holds its own editable pagedkv.

    Several checkouts (git worktrees) can then run this script at once: each
    installs pagedkv into its own overlay instead of re-pointing the shared
    vLLM venv at itself. The overlay's ``_vllm_venv.pth`` adds the vLLM venv's
    site-packages after the overlay's own, whose ``.pth`` files (the shared
    venv's editable pagedkv among them) are then never processed.
    """
    python = overlay / "bin" / "python"
    if not python.exists():
        base = (venv / "bin" / "python").resolve()
        log(f"creating the overlay venv {overlay} over {venv}")
        subprocess.run([str(base), "-m", "venv", str(overlay)], check=True)
        # venv's bundled pip cannot build an editable pyproject install.
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-U", "pip", "setuptools",
                        "wheel"], check=True)
    found = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    own = subprocess.run([str(python), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    (Path(own) / "_vllm_venv.pth").write_text(found + "\n", encoding="utf-8")
    return python


def install_pagedkv(python: Path) -> None:
    """pagedkv into vLLM's venv: editable, no dependencies (torch stays as pinned there)."""
    log(f"installing pagedkv (editable, --no-deps) into {python.parent.parent}")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "-e", str(REPO)], check=True)


def test_files(root: Path, only: Sequence[str]) -> list[str]:
    core = root / "tests" / "v1" / "core"
    files = sorted(str(p.relative_to(core)) for p in core.rglob("test_*.py"))
    files = [f for f in files if not f.endswith("_e2e.py") and f not in SKIPPED_FILES]
    if only:
        files = [f for f in files if any(o in f for o in only)]
    return files


def run_suite(python: Path, root: Path, redirect: Path, files: Sequence[str], swap: bool,
              results: Path, extra: Sequence[str]) -> dict[str, Any]:
    env = dict(os.environ)
    env.update({
        "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_MODEL_REDIRECT_PATH": str(redirect), "PAGEDKV_RESULTS": str(results),
        "PAGEDKV_SWAP": "1" if swap else "0",
        "PYTHONPATH": os.pathsep.join([str(REPO / "tools"), str(root)]),
    })
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
               "-p", "vllm_core_plugin", "--rootdir", str(root), "-o", "addopts=",
               *extra, *(f"tests/v1/core/{f}" for f in files)]
    label = "pagedkv" if swap else "vLLM"
    log(f"running {len(files)} files on {label} ...")
    started = time.monotonic()
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=False)
    # pytest's summary line ("N failed, M passed, ... in S s"); warnings printed after it are skipped.
    lines = (done.stdout + done.stderr).strip().splitlines()
    summary = [line for line in lines if re.search(r"\d+ (passed|failed|error)", line)][-1:] or lines[-1:]
    log(f"{label}: {summary[0] if summary else '(no output)'} ({time.monotonic() - started:.0f} s)")
    if not results.exists():
        raise SystemExit(f"pytest wrote no results (exit {done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-4000:]}")
    data: dict[str, Any] = json.loads(results.read_text(encoding="utf-8"))
    return data


def table(stock: dict[str, Any], swapped: dict[str, Any], files: Sequence[str]) -> str:
    rows = ["| file | vLLM passed | pagedkv passed | pagedkv failed+errors | % of vLLM |",
            "|---|---:|---:|---:|---:|"]
    total_stock = total_swapped = total_bad = 0
    for f in files:
        key = f"tests/v1/core/{f}"
        s = stock.get(key, {})
        p = swapped.get(key, {})
        passed_stock, passed_swapped = s.get("passed", 0), p.get("passed", 0)
        bad = p.get("failed", 0) + p.get("error", 0)
        total_stock += passed_stock
        total_swapped += passed_swapped
        total_bad += bad
        share = f"{100 * passed_swapped / passed_stock:.0f}%" if passed_stock else "-"
        rows.append(f"| {f} | {passed_stock} | {passed_swapped} | {bad} | {share} |")
    share = f"{100 * total_swapped / total_stock:.1f}%" if total_stock else "-"
    rows.append(f"| **total** | {total_stock} | {total_swapped} | {total_bad} | {share} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/verify_vllm.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path,
                        default=Path(os.environ.get("VLLM_VENV") or DEFAULT_VLLM_VENV),
                        help=f"vLLM's venv (default $VLLM_VENV, else {DEFAULT_VLLM_VENV})")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pagedkv")
    parser.add_argument("--only", nargs="*", default=[], metavar="SUBSTRING",
                        help="run only the test files whose path contains one of these")
    parser.add_argument("--reuse-stock", action="store_true",
                        help="reuse the stock results of an earlier run in --cache if present")
    parser.add_argument("--skip-stock", action="store_true", help="run only the pagedkv side")
    parser.add_argument("--failures", type=Path, metavar="FILE",
                        help="write the node ids failing on pagedkv but passing on vLLM here")
    parser.add_argument("--overlay", type=Path, default=(Path(os.environ["VLLM_OVERLAY"])
                                                          if os.environ.get("VLLM_OVERLAY") else None),
                        help="install pagedkv into this light venv layered over --venv (created "
                             "if missing) instead of into --venv itself; lets several checkouts "
                             "run at once")
    parser.add_argument("--results", type=Path, default=None,
                        help="where result files go (default: CACHE/results)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)

    python = check_venv(args.venv)
    if args.overlay is not None:
        python = make_overlay(args.venv, args.overlay.resolve())
    root = fetch_tests(args.cache)
    redirect = write_model_redirect(args.cache)
    install_pagedkv(python)
    files = test_files(root, args.only)
    results_dir = args.results or args.cache / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    stock_path = results_dir / "stock.json"
    if args.reuse_stock and not stock_path.exists():
        stock_path = args.cache / "results" / "stock.json"
    stock: dict[str, Any] = {}
    if args.skip_stock:
        pass
    elif args.reuse_stock and stock_path.exists():
        stock = json.loads(stock_path.read_text(encoding="utf-8"))
        log(f"reusing stock results from {stock_path}")
    else:
        stock = run_suite(python, root, redirect, files, False, stock_path, args.pytest_args)
    swapped = run_suite(python, root, redirect, files, True, results_dir / "pagedkv.json",
                        args.pytest_args)
    print(f"vLLM {VLLM_VERSION} tests/v1/core on CPU: stock vs pagedkv.vllm.KVCacheManager swapped in")
    print(table(stock, swapped, files))
    if args.failures:
        failing = sorted(set(swapped.get("_failures", [])) - set(stock.get("_failures", [])))
        args.failures.write_text("\n".join(failing) + "\n", encoding="utf-8")
        log(f"{len(failing)} node ids failing only on pagedkv written to {args.failures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
