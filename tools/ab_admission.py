"""Same-run A/B of the admission and decode paths across git revisions (issue 13's speed check).

    .venv/bin/python tools/ab_admission.py ROUNDS LABEL=REV ... [LABEL=work]

Each ``REV`` is exported (``git archive``) into a temporary package directory; ``work`` is the
installed checkout. Each round runs every label once, in its own interpreter, alternating the
order. A run times single calls with ``time.perf_counter_ns`` and keeps their 10th percentile and
median (robust on a loaded machine, where a total or a mean mostly measures the other load):
the optimized ``validation.allocate_args`` (step 1 of ``allocate_slots``, a 64-block hit of the
standard trace's shape), a whole admission (``allocate_slots`` of the first 512-token chunk with
that 1024-token hit), and the no-op decode step (one full-attention group; full attention beside
a sliding window). Prints, per label, the median over runs. A benchmark, not a test.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = r'''
import json, time, random
from pagedkv.trace import make_manager
from pagedkv.optimized import validation
import pagedkv.optimized
from pagedkv.spec import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec, SlidingWindowSpec
try:
    from pagedkv.spec.request import RequestFacts
except ImportError:
    RequestFacts = None
clock = time.perf_counter_ns
def pct(samples):
    samples.sort()
    return samples[len(samples) // 10] / 1000, samples[len(samples) // 2] / 1000
m = make_manager("optimized", hash_fn="sha256", num_blocks=65536)
system = list(range(1000, 2024))
a = m.make_request("a", system + list(range(5000, 5512)))
m.allocate_slots(a, 1536); a.num_computed_tokens = 1536; m.free(a)
c = m._coordinator
rng = random.Random(0)
b = m.make_request("b", system + [rng.randrange(32000) for _ in range(512)])
hit, n = m.get_computed_blocks(b)
facts = RequestFacts(b) if RequestFacts is not None else b
kw = dict(coordinator=c, request=facts, known_request=False, max_model_len=8192, num_new_tokens=512,
          num_new_computed_tokens=n, new_computed_blocks=hit, num_lookahead_tokens=0,
          num_external_computed_tokens=0, delay_cache_blocks=False, num_encoder_tokens=0)
f = validation.allocate_args
s = []
for _ in range(20000):
    t0 = clock(); f(**kw); s.append(clock() - t0)
out = {"step1": pct(s)}
s = []
for i in range(1000):
    r = m.make_request(f"c{i}", system + [rng.randrange(32000) for _ in range(512)])
    h, k = m.get_computed_blocks(r)
    t0 = clock(); res = m.allocate_slots(r, 512, k, h); s.append(clock() - t0)
    assert res is not None and k == 1024
    r.num_computed_tokens = 0; m.free(r)
out["admission"] = pct(s)
d = make_manager("optimized", hash_fn="sha256")
r = d.make_request("d", list(range(100))); d.allocate_slots(r, 100); r.num_computed_tokens = 100
r.append_output_token_ids(5)
alloc = d.allocate_slots
s = []
for _ in range(100000):
    t0 = clock(); alloc(r, 1); s.append(clock() - t0)
out["decode_single"] = pct(s)
specs = (FullAttentionSpec(16, 1, 8, "float16"), SlidingWindowSpec(16, 1, 8, "float16", 64))
groups = tuple(KVCacheGroupSpec((f"l{g}",), x) for g, x in enumerate(specs))
h = pagedkv.optimized.KVCacheManager(KVCacheConfig(1024, (), groups), 8192)
q = h.make_request("q", list(range(100))); h.allocate_slots(q, 100); q.num_computed_tokens = 100
q.append_output_token_ids(5)
alloc = h.allocate_slots
s = []
for _ in range(100000):
    t0 = clock(); alloc(q, 1); s.append(clock() - t0)
out["decode_probed"] = pct(s)
t0 = clock()
for _ in range(1000): pass
out["timer"] = ((clock() - t0) / 1000 / 1000, 0)
print(json.dumps(out))
'''


def export(revision: str, into: Path) -> str:
    """A directory holding ``pagedkv`` as of ``revision`` (the package layout of pyproject.toml)."""
    tree = into / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    package = into / "pkg" / "pagedkv"
    package.parent.mkdir(parents=True)
    (tree / "src" / "pagedkv").rename(package)
    for part in ("spec", "reference", "optimized"):
        (tree / part).rename(package / part)
    return str(into / "pkg")


def main() -> int:
    rounds = int(sys.argv[1])
    labels = [argument.split("=", 1) for argument in sys.argv[2:]]
    results: dict[str, list[dict[str, list[float]]]] = {label: [] for label, _ in labels}
    with tempfile.TemporaryDirectory() as scratch:
        paths = {label: "work" if revision == "work" else export(revision, Path(scratch) / label)
                 for label, revision in labels}
        for number in range(rounds):
            for label, _ in (labels if number % 2 == 0 else labels[::-1]):
                env = dict(os.environ)
                if paths[label] != "work":
                    env["PYTHONPATH"] = paths[label]
                out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
                if out.returncode:
                    print(out.stderr[-2000:], file=sys.stderr)
                    return 1
                results[label].append(json.loads(out.stdout))
    print(f"{rounds} rounds, alternating; per run the 10th percentile and median of single-call times "
          "(us); shown: the median over runs of each")
    for label, runs in results.items():
        cells = [f"{kind} p10 {statistics.median(run[kind][0] for run in runs):6.3f} "
                 f"p50 {statistics.median(run[kind][1] for run in runs):6.3f}"
                 for kind in ("step1", "admission", "decode_single", "decode_probed")]
        print(f"{label:6s} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
