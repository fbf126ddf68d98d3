"""Plots a soak's series (soak.py's JSON): server RSS and used blocks over time, PNG beside it.

    python tools/verify_abuse/plot.py .abuse-results/soak-pagedkv.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(path).read_text())
    fig, (ax_rss, ax_used) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    rss = data["rss_samples"]
    ax_rss.plot([t for t, _ in rss], [kib / 1024 for _, kib in rss], lw=1)
    ax_rss.set_ylabel("server RSS (MiB)")
    used = data["used_samples"]
    ax_used.plot([t for t, _ in used], [u for _, u in used], lw=0.6, label="used blocks (probe)")
    idle = [(r["t"] + r["seconds"], r["leaked_blocks"] or 0) for r in data["rounds"]]
    ax_used.scatter([t for t, _ in idle], [u for _, u in idle], color="red", s=14, zorder=3,
                    label="used blocks at each round's drain")
    ax_used.axhline(data["num_blocks"] - 1, color="grey", ls="--", lw=0.8, label="pool (minus the null block)")
    ax_used.set_ylabel("blocks")
    ax_used.set_xlabel("seconds")
    ax_used.legend(loc="upper right", fontsize=7)
    for ax in (ax_rss, ax_used):
        ax.axvline(data["warm_up_s"], color="orange", ls=":", lw=1)
    fig.suptitle(f"soak on {data['variant']}: {data['requests']} requests, {len(data['rounds'])} rounds "
                 f"(dotted: end of warm-up)")
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(plot(Path(arg)))
