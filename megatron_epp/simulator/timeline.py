"""Per-stage Gantt chart of a simulated step (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from megatron_epp.simulator.step import SimResult  # noqa: E402

KIND_COLORS = {"batched": "#4C72B0", "split": "#DD8452", "hybrid": "#55A868"}
RECOMPUTE_COLOR = "#C44E52"


def draw_timeline(sim: SimResult, num_stages: int, path: str | Path, title: str = "") -> None:
    """Forward (light), backward (dark) colored by chunk kind, recompute in red, idle blank."""
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * num_stages))
    for e in sim.events:
        y = num_stages - 1 - e.stage
        color = KIND_COLORS[e.chunk_kind]
        if e.recompute_ms > 0:
            ax.barh(y, e.recompute_ms, left=e.start, height=0.8, color=RECOMPUTE_COLOR, linewidth=0)
        start = e.start + e.recompute_ms
        ax.barh(y, e.end - start, left=start, height=0.8, color=color, alpha=0.55 if e.op == "F" else 1.0, linewidth=0.2, edgecolor="white")
    ax.set_yticks(range(num_stages), [f"stage {p}" for p in reversed(range(num_stages))])
    ax.set_xlim(0, sim.step_ms)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"step {sim.step_ms:.1f} ms, bubble {sim.bubble_ratio:.1%}, recompute {sim.recompute_ms:.1f} ms")
    handles = [Patch(color=c, label=f"{k} (F light, B dark)") for k, c in KIND_COLORS.items()]
    handles.append(Patch(color=RECOMPUTE_COLOR, label="recompute"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
