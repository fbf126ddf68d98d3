"""The OpenAI-compatible server the abuse check drives: started, watched and stopped by us.

`vllm serve` on 127.0.0.1 with a small pool (so the load preempts), chunked prefill in small
chunks (so a long prompt is mid-prefill for several steps), the development endpoints on (for
`POST /reset_prefix_cache`), and one of the probe schedulers of abuse_schedulers.py. Readiness and
stopping are verify-engine's (tools/verify_engine/server_check.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINE_TOOLS = HERE.parent / "verify_engine"
sys.path.insert(0, str(ENGINE_TOOLS))

import server_check  # noqa: E402
import workloads as wl  # noqa: E402
from engine_check import ENV as ENGINE_ENV  # noqa: E402

# Scheduler classes by variant name (abuse_schedulers.py, importable once HERE is on the path).
VARIANTS = {
    "stock": "abuse_schedulers.StockProbe",
    "pagedkv": "abuse_schedulers.PagedkvProbe",
    "pagedkv-leaky": "abuse_schedulers.PagedkvLeaky",
}


@dataclass(frozen=True)
class ServerShape:
    """The engine's limits; the workload is built from them."""

    max_model_len: int = 512
    num_blocks: int = 40  # the null block included: 39 usable, 1248 tokens
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    block_size: int = wl.BLOCK_SIZE

    @property
    def usable_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    state_path: Path
    model: str

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None


def start(scheduler_cls: str, model_dir: str, shape: ServerShape, work: Path, tag: str) -> Server:
    port = server_check._free_port()
    log_path = work / f"{tag}.log"
    state_path = work / f"{tag}-state.json"
    state_path.unlink(missing_ok=True)
    env = {**os.environ, **ENGINE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(ENGINE_TOOLS), env.get("PYTHONPATH", "")]))
    env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
    env["PAGEDKV_ABUSE_STATE"] = str(state_path)
    cli = Path(sys.executable).parent / "vllm"
    cmd = [str(cli), "serve", model_dir] if cli.exists() else [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    cmd += [
        "--host", "127.0.0.1", "--port", str(port),
        "--scheduler-cls", scheduler_cls,
        "--enable-prompt-tokens-details",
        "--block-size", str(shape.block_size),
        "--max-model-len", str(shape.max_model_len),
        "--max-num-seqs", str(shape.max_num_seqs),
        "--max-num-batched-tokens", str(shape.max_num_batched_tokens),
        "--num-gpu-blocks-override", str(shape.num_blocks),
        "--dtype", "float32",
        "--seed", "0",
        "--enable-prefix-caching",
        "--enforce-eager",
    ]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Server(proc, port, log_path, state_path, model_dir)


def wait_ready(server: Server) -> None:
    server_check.wait_ready(server.proc, server.port, server.log_path)


def stop(server: Server) -> None:
    server_check.stop(server.proc)


def metrics(server: Server) -> dict[str, float]:
    """The engine's Prometheus counters and gauges, summed over labels."""
    with urllib.request.urlopen(f"{server.base}/metrics", timeout=10) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if m and m.group(2) != "NaN":
            found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(2))
    return found


def tree_rss_kib(pid: int) -> dict[int, int]:
    """Resident set size (KiB) of `pid` and all its descendants, by pid (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    rss: dict[int, int] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss[p] = int(line.split()[1])
        except OSError:
            continue
        todo.extend(children.get(p, []))
    return rss


def process_name(pid: int) -> str:
    """`comm` of a process and its pid, e.g. "VLLM::EngineCor 1234"."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f"{f.read().strip()} {pid}"
    except OSError:
        return str(pid)
