"""The loss curve of a run as a PNG a person can look at (matplotlib, Agg: no display needed).

One point per optimizer step; segment boundaries are drawn as thin vertical
lines, so a resumed segment is visible. The held-out loss, where the run
evaluates, is a second line at the steps it was measured after. Non-finite losses are marked on the
x-axis instead of being dropped silently.
"""

from __future__ import annotations

import math
from pathlib import Path

LOSS_CURVE_FILE = "loss_curve.png"


def write_loss_curve(
    path: Path,
    steps: list[int],
    losses: list[float],
    segment_starts: list[int],
    title: str,
    learning_rates: list[float] | None = None,
    eval_points: list[tuple[int, float]] | None = None,
) -> Path:
    """Plot `losses` against `steps` into `path` (PNG), and the learning rate per step on a right-hand axis where
    given; returns the path."""
    # The object API with an Agg canvas: no pyplot global state, no backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 3.6), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    finite = [(s, v) for s, v in zip(steps, losses) if math.isfinite(v)]
    if finite:
        axes.plot([s for s, _ in finite], [v for _, v in finite], marker="o", markersize=3, linewidth=1.5, label="loss")
    evaluated = [(s, v) for s, v in eval_points or () if math.isfinite(v)]
    if evaluated:
        axes.plot(
            [s for s, _ in evaluated],
            [v for _, v in evaluated],
            marker="s",
            markersize=4,
            linewidth=1.5,
            color="tab:green",
            label="eval loss",
        )
    bad = [s for s, v in zip(steps, losses) if not math.isfinite(v)]
    if bad:
        axes.plot(bad, [axes.get_ylim()[0]] * len(bad), "rx", label="non-finite loss")
    for start in segment_starts[1:]:
        axes.axvline(start - 0.5, color="0.8", linewidth=0.8)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if learning_rates:
        rate_axes = axes.twinx()
        rate_axes.plot(steps, learning_rates, color="tab:orange", linewidth=1.0, linestyle="--", label="learning rate")
        rate_axes.set_ylabel("learning rate")
        rate_axes.set_ylim(bottom=0)
        more_handles, more_labels = rate_axes.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    axes.legend(handles, labels, loc="upper right", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path
