"""What the gradient noise scale says about a run's batch (trainer.noise_scale): B_simple over training against the
effective batch, as one line and as a plot (noise.png).

McCandlish et al. 2018: below the noise scale, a larger batch takes proportionally fewer steps for about the same
samples (accumulating more pays in steps); above it, more samples per step stop paying — the steps barely drop while
the samples seen grow, so smaller windows reach the same loss on fewer samples. Near it is the balance they
recommend (about twice the fewest steps and twice the fewest samples). The verdict reads the late part of training
(its last fifth of steps), where the noise scale has grown and settled.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

from accutrain.report.runs import RunRow

LATE = 0.2  # the last fifth of a run's steps: "late in training"


def late(row: RunRow) -> Optional[tuple[float, float]]:
    """(the median B_simple, the median effective batch) over the last fifth of the steps that have an estimate;
    None without any."""
    curve = row.noise_curve
    if not curve:
        return None
    tail = curve[int(len(curve) * (1 - LATE)):] or curve[-1:]
    return statistics.median(b for _, b, _ in tail), statistics.median(e for _, _, e in tail)


def verdict(row: RunRow) -> Optional[str]:
    """One line on the run's effective batch against its measured noise scale, late in training; None when the run
    did not measure it (or the estimate never came out positive)."""
    found = late(row)
    if found is None:
        return None
    b_simple, effective = found
    if b_simple <= 0:
        return f"{row.job}: the noise scale never came out positive: its |G|² estimate is swamped by the noise"
    ratio = effective / b_simple
    head = f"{row.job}: the effective batch {effective:.0f} is "
    if ratio >= 2:
        return (head + f"{ratio:.1f}× the measured noise scale B_simple ≈ {b_simple:.3g} late in training: beyond it "
                "more samples per step stop paying; smaller windows would reach the same loss on fewer samples "
                "(more, cheaper steps)")
    if ratio <= 0.5:
        return (head + f"{1 / ratio:.1f}× below the measured noise scale B_simple ≈ {b_simple:.3g} late in training: "
                "a larger effective batch (more accumulation) would take proportionally fewer steps for about the "
                "same samples")
    return (head + f"near the measured noise scale B_simple ≈ {b_simple:.3g} late in training ({ratio:.2g}×): the "
            "balance of steps and samples McCandlish et al. recommend")


def plot_noise(rows: list[RunRow], out: Path) -> bool:
    """noise.png: each run's B_simple (per optimizer step, smoothed as logged) and its effective batch (dashed)
    against samples seen, on a log scale. False (nothing drawn) when no run measured it."""
    measured = [r for r in rows if r.noise_curve]
    if not measured:
        return False
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=90, layout="constrained")
    ax = fig.add_subplot()
    for i, row in enumerate(measured):
        color = f"C{i % 10}"
        xs = [x for x, _, _ in row.noise_curve]
        ax.plot(xs, [b if b > 0 else float("nan") for _, b, _ in row.noise_curve], color=color,
                label=f"{row.job}: B_simple")
        ax.plot(xs, [e for _, _, e in row.noise_curve], "--", color=color, label=f"{row.job}: effective batch")
    ax.set_yscale("log")
    ax.set(title="gradient noise scale against the effective batch", xlabel="samples seen", ylabel="samples")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    fig.savefig(out)
    return True
