"""The plots: a run's loss.png and a sweep's summary.png. matplotlib is imported on first use and draws with
its Agg renderer into a standalone Figure (no pyplot, no global backend switch)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from accutrain.runs import MISSING_VALUE, RunRow, common_overrides

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger("accutrain")


def _figure(width: float, height: float) -> "Figure":
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=90, layout="constrained")


def plot_run(row: RunRow, out: Path) -> None:
    """Training loss per optimizer step and validation loss per evaluation, against samples seen."""
    fig = _figure(7, 4.2)
    ax = fig.add_subplot()
    if row.curve:
        ax.plot(*zip(*row.curve), lw=1, label="training loss (per optimizer step)")
    if row.val_curve:
        ax.plot(*zip(*row.val_curve), "o-", ms=4, label="validation loss")
    effective = f", effective batch {row.effective}" if row.effective else ""
    ax.set(title=f"{row.job}: {row.status}{effective}", xlabel="samples seen", ylabel="loss")
    if row.curve or row.val_curve:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.savefig(out)


def _label(row: RunRow, common: set[str]) -> str:
    own = " ".join(o for o in row.overrides if o not in common) or row.job
    return own if row.status == "completed" else f"{own} ({row.status})"


def _against_micro_batch(ax: "Axes", rows: list[RunRow], value: str, ylabel: str, empty: str) -> None:
    points = sorted((r.micro_batch, getattr(r, value)) for r in rows
                    if r.micro_batch is not None and getattr(r, value) is not None)
    ax.set(xlabel="micro_batch", ylabel=ylabel, title=f"{ylabel} vs micro_batch")
    ax.grid(alpha=0.3)
    if not points:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set(xticks=[], yticks=[])
        return
    xs, ys = zip(*points)
    ax.plot(xs, ys, "o-" if len(set(xs)) == len(xs) else "o")
    if min(xs) > 0 and max(xs) > 2 * min(xs):
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(xs)), [str(x) for x in sorted(set(xs))])


def plot_summary(rows: list[RunRow], out: Path) -> None:
    """Training loss against samples seen for every run on one chart; peak memory and samples/s against
    micro_batch."""
    common = set(common_overrides(rows))
    fig = _figure(16, 4.6)
    loss, memory, speed = fig.subplots(1, 3, width_ratios=[1.6, 1, 1])
    for row in rows:
        if row.curve:
            loss.plot(*zip(*row.curve), lw=1, label=_label(row, common))
    loss.set(title="training loss per optimizer step", xlabel="samples seen", ylabel="loss")
    loss.grid(alpha=0.3)
    if any(row.curve for row in rows):
        loss.legend(fontsize="small")
    _against_micro_batch(memory, rows, "peak_mem_mb", "peak memory (MiB)",
                         f"no peak_mem_mb in metrics.jsonl ({MISSING_VALUE})")
    _against_micro_batch(speed, rows, "samples_per_s", "samples/s", f"no samples/s recorded ({MISSING_VALUE})")
    fig.savefig(out)
