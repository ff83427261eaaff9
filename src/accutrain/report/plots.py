"""The plots: a run's loss.png and a sweep's summary.png. matplotlib is imported on first use and draws with
its Agg renderer into a standalone Figure (no pyplot, no global backend switch).

Per-step losses are spiky: each curve is drawn faint as recorded, with an exponential moving average over it. A
diverged run (its loss grows a hundredfold and more) would flatten every other curve of a sweep: the loss axis is
then cut above the other runs' losses, and the plot says so."""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from accutrain.report.runs import MISSING_VALUE, RunRow, common_overrides
from accutrain.store.files import write_atomic

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger("accutrain")

DIVERGED = 100.0  # a curve whose loss rises this many times above its first value has diverged


def _figure(width: float, height: float, margins: Optional[dict[str, float]] = None) -> "Figure":
    """A figure laid out by matplotlib (constrained), or with fixed `margins` (subplots_adjust's): a run's loss.png,
    drawn at the end of every run, takes 0.3 s of CPU that way instead of 0.5."""
    from matplotlib.figure import Figure

    if margins is None:
        return Figure(figsize=(width, height), dpi=90, layout="constrained")
    figure = Figure(figsize=(width, height), dpi=90)
    figure.subplots_adjust(**margins)
    return figure


def smoothing_span(n: int) -> int:
    """Steps the moving average spans: a tenth of the curve, at least 3 (none under 10 points)."""
    return max(3, n // 10) if n >= 10 else 1


def smoothed(values: Sequence[Optional[float]], span: int) -> list[float]:
    """Exponential moving average with weight 2/(span+1), debiased at the start (as TensorBoard's); a missing or
    non-finite value (a skipped step) keeps the average where it was."""
    beta, average, weight, out = 1 - 2 / (span + 1), 0.0, 0.0, []
    for v in values:
        if v is not None and math.isfinite(v):
            average, weight = beta * average + (1 - beta) * v, beta * weight + (1 - beta)
        out.append(average / weight if weight else math.nan)
    return out


def _finite(curve: list[tuple[int, float]]) -> list[float]:
    return [y for _, y in curve if y is not None and math.isfinite(y)]


def diverged(curve: list[tuple[int, float]]) -> bool:
    ys = _finite(curve)
    return bool(ys) and max(ys) > DIVERGED * max(abs(ys[0]), 1e-12)


def draw_loss(ax: "Axes", curve: list[tuple[int, float]], label: str, color: Optional[str] = None) -> None:
    """The recorded per-step loss, faint, and its moving average over it (one colour)."""
    xs, ys = zip(*curve)
    span = smoothing_span(len(curve))
    if span == 1:
        ax.plot(xs, ys, lw=1.2, color=color, label=label)
        return
    raw = ax.plot(xs, ys, lw=0.8, alpha=0.3, color=color)[0]
    ax.plot(xs, smoothed(ys, span), lw=1.6, color=raw.get_color(), label=label)


def cut_loss_axis(ax: "Axes", curves: list[tuple[str, list[tuple[int, float]]]]) -> None:
    """With a diverged curve among others, limit the loss axis to the others' range and say so on the plot; with one
    diverged curve alone, a log scale."""
    gone = [(name, max(_finite(c))) for name, c in curves if diverged(c)]
    kept = [y for name, c in curves if not diverged(c) for y in _finite(c)]
    if not gone:
        return
    if not kept:
        ax.set_yscale("log")
        ax.text(0.99, 0.98, "log scale: the loss diverged", ha="right", va="top", transform=ax.transAxes,
                fontsize="small", color="firebrick")
        return
    low, high = min(kept), max(kept)
    ax.set_ylim(min(0.0, low), high + 0.1 * (high - min(0.0, low)))
    names = "; ".join(f"{name} (up to {peak:.3g})" for name, peak in gone)
    ax.text(0.99, 0.98, f"axis cut at {high * 1.1:.3g}: diverged: {names}", ha="right", va="top",
            transform=ax.transAxes, fontsize="small", color="firebrick", wrap=True)


DECADES = 30.0  # a loss axis whose values span this factor or more is drawn on a log scale


def spans_decades(values: list[float]) -> bool:
    """Whether positive `values` span DECADES or more (the first steps' loss dwarfing the rest on a linear axis)."""
    return bool(values) and min(values) > 0 and max(values) >= DECADES * min(values)


def run_figure(row: RunRow) -> "Figure":
    """Training loss per optimizer step (raw, and its moving average) and validation loss per evaluation, against
    samples seen — on a log scale when they span decades — and beside it, the validation metric (row.metric) with
    the test stage's values."""
    margins = dict(left=0.07, right=0.985, bottom=0.12, top=0.91, wspace=0.2)
    fig = _figure(11, 4.2, margins) if row.metric_curve else _figure(7, 4.2, {**margins, "left": 0.1})
    ax = fig.add_subplot(1, 2, 1) if row.metric_curve else fig.add_subplot()
    if row.curve:
        span = smoothing_span(len(row.curve))
        label = "training loss per optimizer step" + (f" (faint), and its moving average over ~{span} steps"
                                                       if span > 1 else "")
        draw_loss(ax, row.curve, label)
    if row.val_curve:
        ax.plot(*zip(*row.val_curve), "o-", ms=4, label="validation loss")
    if spans_decades(_finite(row.curve) + _finite(row.val_curve)):
        ax.set_yscale("log")
    else:
        cut_loss_axis(ax, [("training loss", row.curve)] if row.curve else [])
    effective = f", effective batch {row.effective}" if row.effective else ""
    ax.set(title=f"{row.job}: {row.status}{effective}", xlabel="samples seen",
           ylabel="loss (log scale)" if ax.get_yscale() == "log" else "loss")
    if row.curve or row.val_curve:
        ax.legend(fontsize="small", loc="upper right" if ax.get_yscale() == "log" else "upper left")
    ax.grid(alpha=0.3)
    if row.metric_curve:
        draw_metric(fig.add_subplot(1, 2, 2), row)
    return fig


def draw_metric(ax: "Axes", row: RunRow) -> None:
    """The validation metric per evaluation against samples seen, and the test stage's of the last and the best
    weights, at the end."""
    name = str(row.metric)
    ax.plot(*zip(*row.metric_curve), "o-", ms=4, color="tab:green", label=name.replace("_", " ", 1))
    test = row.test or {}
    end = row.metric_curve[-1][0]
    for suffix, marker, what in (("", "s", "last"), ("_best", "*", "best")):
        value = test.get("test" + name.removeprefix("val") + suffix)
        if isinstance(value, (int, float)):
            ax.plot([end], [value], marker, ms=9, ls="none", label=f"test, {what} weights: {value:.4g}")
    ax.set(title=name, xlabel="samples seen", ylabel=name)
    ax.legend(fontsize="small", loc="best")
    ax.grid(alpha=0.3)


def plot_run(row: RunRow, out: Path) -> None:
    figure = run_figure(row)
    write_atomic(out, lambda f: figure.savefig(f, format="png"))  # a full disk leaves the old plot, not half a new one


def _label(row: RunRow, common: set[str]) -> str:
    own = " ".join(o for o in row.overrides if o not in common) or row.job
    return own if row.status == "completed" else f"{own} ({row.status})"


def varied(rows: list[RunRow]) -> tuple[list[str], list[dict[str, str]]]:
    """The override keys the runs do not share (in the order they appear) and each run's values of them."""
    common = set(common_overrides(rows))
    values = [dict(o.split("=", 1) for o in r.overrides if o not in common and "=" in o) for r in rows]
    keys = list(dict.fromkeys(k for v in values for k in v))
    return keys, values


def _number(text: Optional[str]) -> Optional[float]:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def against_varied(ax: "Axes", rows: list[RunRow], value: str, ylabel: str, empty: str) -> None:
    """`value` of each run against what the sweep varied: on a numeric axis when one numeric override varies,
    else one tick per run, labelled with its overrides."""
    keys, values = varied(rows)
    have = [(r, v) for r, v in zip(rows, values) if getattr(r, value) is not None]
    numeric = len(keys) == 1 and all(_number(v.get(keys[0])) is not None for _, v in have)
    xlabel = keys[0] if numeric else (f"job ({', '.join(keys)})" if keys else "job")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=f"{ylabel} vs {keys[0] if numeric else 'job'}")
    ax.grid(alpha=0.3)
    if not have:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set(xticks=[], yticks=[])
        return
    if numeric:
        points = sorted((_number(v[keys[0]]), getattr(r, value)) for r, v in have)
        xs, ys = zip(*points)
        ax.plot(xs, ys, "o-" if len(set(xs)) == len(xs) else "o")
        if min(xs) > 0 and max(xs) > 2 * min(xs):
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(xs)), [f"{x:g}" for x in sorted(set(xs))])
        return
    ax.plot(range(len(have)), [getattr(r, value) for r, _ in have], "o")
    names = [" ".join(f"{k}={v[k]}" for k in keys if k in v) or r.job for r, v in have]
    ax.set_xticks(range(len(have)), names, rotation=30, ha="right", fontsize="small")


def summary_figure(rows: list[RunRow]) -> "Figure":
    """Training loss against samples seen for every run on one chart (a diverged run does not flatten the others);
    peak memory and samples/s against what the sweep varied."""
    common = set(common_overrides(rows))
    fig = _figure(16, 4.8)
    loss, memory, speed = fig.subplots(1, 3, width_ratios=[1.6, 1, 1])
    curves = [(_label(row, common), row.curve) for row in rows if row.curve]
    for name, curve in curves:
        draw_loss(loss, curve, f"{name} (diverged)" if diverged(curve) else name)
    cut_loss_axis(loss, curves)
    loss.set(title="training loss per optimizer step (faint) and its moving average", xlabel="samples seen",
             ylabel="loss")
    loss.grid(alpha=0.3)
    if curves:
        loss.legend(fontsize="small", loc="upper left")
    against_varied(memory, rows, "peak_mem_mb", "peak memory (MiB)",
                   f"no peak_mem_mb in metrics.jsonl ({MISSING_VALUE})")
    against_varied(speed, rows, "samples_per_s", "samples/s", f"no samples/s recorded ({MISSING_VALUE})")
    return fig


def plot_summary(rows: list[RunRow], out: Path) -> None:
    figure = summary_figure(rows)
    write_atomic(out, lambda f: figure.savefig(f, format="png"))
