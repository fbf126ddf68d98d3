"""PNG plots of a simulation report, through matplotlib (``pagedkv[plot]``).

Three figures, from the dict :func:`pagedkv.simulate.report.report` builds:

- ``hit_rate.png``: hit rate against capacity in tokens (log axis), the
  ideal as a line, the LRU reuse-distance curve dashed beside it;
- ``occupancy.png``: blocks cached (and, in engine mode, in use) over time
  (engine) or requests (cache), and the evictions so far, one line per
  capacity, of the first replica;
- ``reuse_cdf.png``: the reuse-distance CDF in tokens (log axis);
- ``routers.png`` (with ``--replicas`` > 1): per router, the hit rate, the
  load imbalance and the router's wall time per decision (log axis).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["plot_report", "matplotlib_available"]


def matplotlib_available() -> bool:
    """Whether ``import matplotlib`` works."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_report(doc: dict[str, Any], directory: str) -> list[str]:
    """Write the three PNGs into ``directory`` (created if missing); return their paths.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'pagedkv[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    title = os.path.splitext(doc["workload"]["name"])[0]
    ideal = doc["ideal"]
    runs = doc["runs"]
    paths: list[str] = []

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    singles = sorted((r for r in runs if r["replicas"] == 1 and r["capacity"] != "inf"),
                     key=lambda r: r["capacity_tokens"])
    if singles:
        axes.plot([r["capacity_tokens"] for r in singles], [r["hit_rate"] for r in singles],
                  "o-", label="pagedkv manager (replayed)")
    cdf = doc["reuse_distance_tokens"]["cdf"]
    if cdf and doc["reuse_distance_tokens"]["accesses"]:
        axes.plot([p[0] for p in cdf], [p[1] * ideal["hit_rate"] for p in cdf], "--", alpha=0.6,
                  label="LRU model (reuse distances)")
    axes.axhline(ideal["hit_rate"], color="grey", linestyle=":", label=f"ideal {ideal['hit_rate']:.3f}")
    axes.set_xscale("log")
    axes.set_xlabel("KV cache capacity (tokens)")
    axes.set_ylabel("prefix hit rate (share of prompt tokens)")
    axes.set_title(f"{title}: hit rate vs capacity ({doc['settings']['mode']} mode)", fontsize=10)
    axes.set_ylim(0, max(0.05, ideal["hit_rate"] * 1.15))
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)
    paths.append(_save(figure, directory, "hit_rate.png"))

    figure, (axes, lower) = plt.subplots(2, 1, figsize=(7.0, 6.0), sharex=True,
                                         gridspec_kw={"height_ratios": [2, 1]})
    engine = doc["settings"]["mode"] == "engine"
    for run in runs:
        points = run["timeline"]
        if not points:
            continue
        x = [p[0] / 1000.0 if engine else p[0] for p in points]
        label = f"{run['capacity']}" + (f" ({run['router']})" if run["replicas"] > 1 else "")
        usable = max(1, run["num_blocks"] - 1)
        line = axes.plot(x, [p[2] / usable for p in points], label=f"{label} cached")[0]
        if engine:  # in cache mode nothing is in use between requests
            axes.plot(x, [p[1] for p in points], linestyle="--", color=line.get_color(),
                      label=f"{label} in use")
        lower.plot(x, [p[3] for p in points], color=line.get_color())
    axes.set_ylabel("share of the pool (replica 0)")
    axes.set_title(f"{title}: occupancy and evictions")
    axes.set_ylim(0, 1.05)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="best", fontsize=7, ncol=2)
    lower.set_xlabel("simulated time (s)" if engine else "request")
    lower.set_ylabel("blocks evicted so far")
    lower.grid(True, alpha=0.3)
    paths.append(_save(figure, directory, "occupancy.png"))

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    if cdf:
        axes.plot([p[0] for p in cdf], [p[1] for p in cdf])
    axes.set_xscale("log")
    axes.set_xlabel("reuse distance (tokens of distinct blocks in between)")
    axes.set_ylabel("share of reusable block accesses")
    axes.set_title(f"{title}: reuse-distance CDF")
    axes.set_ylim(0, 1.02)
    axes.grid(True, which="both", alpha=0.3)
    paths.append(_save(figure, directory, "reuse_cdf.png"))
    fleet = [r for r in runs if r["replicas"] > 1]
    if fleet:
        paths.append(_plot_routers(plt, fleet, title, directory))
    return paths


def _plot_routers(plt: Any, runs: list[dict[str, Any]], title: str, directory: str) -> str:
    figure, panels = plt.subplots(1, 3, figsize=(10.5, 3.6))
    labels = [f"{r['router']}\n{r['capacity']}" if len({x['capacity'] for x in runs}) > 1 else r["router"]
              for r in runs]
    positions = range(len(runs))
    for axes, key, name in zip(panels, ("hit_rate", "load_imbalance", "route_us_per_request"),
                               ("prefix hit rate", "load imbalance (max / mean)", "router µs per decision")):
        axes.bar(positions, [r[key] or 0.0 for r in runs], color="tab:blue")
        axes.set_xticks(list(positions), labels, rotation=30, fontsize=7, ha="right")
        axes.set_title(name, fontsize=9)
        axes.grid(True, axis="y", alpha=0.3)
    panels[2].set_yscale("log")
    figure.suptitle(f"{title}: {runs[0]['replicas']} replicas", fontsize=10)
    return _save(figure, directory, "routers.png")


def _save(figure: Any, directory: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(directory, name)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
