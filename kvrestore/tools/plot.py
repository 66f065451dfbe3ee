"""Plot a restore's trace in the style of Cake's Figure 5 (needs matplotlib: `pip install kvrestore[plot]`).

Bottom panel: which chunk each lane worked on over time, computes rising from the front, loads coming
down from the back, dropped loads hatched; the two meet where the restore ends. Top panel (optional):
the link's bandwidth and the compute lane's share over the same time axis.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from kvrestore.core.bandwidth import BandwidthTrace
from kvrestore.core.errors import KVRestoreError
from kvrestore.core.trace import Trace

COLORS = {
    "compute": "#d95f02",
    "load": "#1b9e77",
    "load-dropped": "#bbbbbb",
    "load-failed": "#e7298a",
    "compute-dropped": "#f4b183",
}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise KVRestoreError("plotting needs matplotlib: pip install 'kvrestore[plot]'") from exc
    return plt


def plot_trace(
    trace: Trace,
    path: str | os.PathLike,
    *,
    title: str = "restore trace",
    bandwidth: BandwidthTrace | None = None,
    compute_share: Callable[[float], float] | None = None,
) -> Path:
    """Write the trace (and, if given, the bandwidth / compute-share over time) to a PNG at `path`."""
    plt = _pyplot()
    end = max((e.end_s for e in trace.events), default=1.0) or 1.0
    top = bandwidth is not None or compute_share is not None
    fig, axes = plt.subplots(
        2 if top else 1,
        1,
        figsize=(8, 5.5 if top else 3.8),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [1, 2] if top else [1]},
    )
    ax = axes[-1][0]
    for e in trace.events:
        ax.barh(
            (e.first_chunk + e.last_chunk) / 2,
            e.seconds,
            left=e.start_s,
            height=e.last_chunk - e.first_chunk + 0.8,
            color=COLORS.get(e.kind, "black"),
            hatch="//" if e.kind == "load-dropped" else None,
            edgecolor="white",
            linewidth=0.5,
        )
    n = max((e.last_chunk for e in trace.events), default=0) + 1
    ax.set_ylim(-0.5, n - 0.5)
    ax.set_xlim(0, end * 1.02)
    ax.set_xlabel("seconds since the restore began")
    ax.set_ylabel("chunk index")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in COLORS.items()]
    ax.legend(handles, list(COLORS), loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, ncol=4)
    if top:
        tax = axes[0][0]
        steps = [i * end / 400 for i in range(401)]
        if bandwidth is not None:
            tax.plot(
                steps, [bandwidth.rate_at(t) / 1e6 for t in steps], color=COLORS["load"], label="bandwidth"
            )
            tax.set_ylabel("MB/s")
        if compute_share is not None:
            sax = tax.twinx()
            sax.plot(steps, [compute_share(t) for t in steps], color=COLORS["compute"], label="compute share")
            sax.set_ylabel("compute share")
            sax.set_ylim(0, 1.05)
        tax.set_title(title)
    else:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
