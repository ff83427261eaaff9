"""Run and sweep summaries: one row per run directory (accutrain.report.runs), written as summary.md, summary.csv and a
plot; and a run's own loss.png."""
from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from accutrain.errors import UserError
from accutrain.report import noise
from accutrain.report.runs import MISSING_VALUE, RunRow, collect, common_overrides, read_run
from accutrain.store import mark

log = logging.getLogger("accutrain")


def _fmt(value: Optional[float], digits: int) -> str:
    return MISSING_VALUE if value is None else f"{value:.{digits}f}"


HEADER = ["job", "overrides", "effective batch", "micro_batch × accum × devices", "steps", "final loss",
          "best val loss", "best val acc", "samples/s", "peak mem (MiB)", "wall (s)", "best (monitored)", "status"]


def _with_ema(value: Optional[float], ema: Optional[float]) -> str:
    return _fmt(value, 4) + (f" (ema {_fmt(ema, 4)})" if ema is not None else "")


def _monitored(r: RunRow) -> str:
    return MISSING_VALUE if r.best is None else f"{r.monitor} {r.best:.4f} (step {r.best_step})"


def tested(r: RunRow) -> tuple[Optional[str], Optional[float], Optional[float]]:
    """The test stage's monitored metric (val_acc → test_acc; else test_loss) and its values with the last and the
    best weights; (None, None, None) for a run without a test split."""
    if not r.test:
        return None, None, None
    name = "test" + (r.monitor or "val_loss").removeprefix("val")
    name = name if name in r.test else "test_loss"
    return name, r.test.get(name), r.test.get(f"{name}_best")


def header(rows: list[RunRow]) -> list[str]:
    """HEADER, and a last column for the test stage when a run had one."""
    return HEADER + (["test: last / best weights"] if any(r.test for r in rows) else [])


def table_cells(rows: list[RunRow]) -> list[list[str]]:
    """One list of formatted cells per run, in header(rows)'s order; the overrides column leaves out the shared
    ones."""
    common = set(common_overrides(rows))
    cells = []
    for r in rows:
        split = (MISSING_VALUE if r.micro_batch is None else f"{r.micro_batch} × {r.accum} × {r.devices}")
        cells.append([
            r.job, " ".join(o for o in r.overrides if o not in common) or MISSING_VALUE,
            MISSING_VALUE if r.effective is None else str(r.effective), split, str(r.steps),
            _fmt(r.final_loss, 4), _with_ema(r.best_val_loss, r.best_val_loss_ema),
            _with_ema(r.best_val_acc, r.best_val_acc_ema), _fmt(r.samples_per_s, 0), _fmt(r.peak_mem_mb, 0),
            _fmt(r.wall_s, 1), _monitored(r), r.status,
        ])
        if len(header(rows)) > len(HEADER):
            name, last, best = tested(r)
            cells[-1].append(MISSING_VALUE if name is None else f"{name} {_fmt(last, 4)} / {_fmt(best, 4)}")
    return cells


def markdown_table(rows: list[RunRow]) -> str:
    """A Markdown table whose columns are padded, so that it reads as well in a terminal."""
    body = [[c.replace("|", "\\|") for c in line] for line in table_cells(rows)]
    head = header(rows)
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    numeric = set(range(2, 11))

    def line(cells: list[str]) -> str:
        padded = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if i in numeric else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), rule, *(line(cells) for cells in body)])


def overview(rows: list[RunRow], root: Path) -> str:
    """The text above and below the table: the counts, the shared overrides, the failures."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    runs = "1 run" if len(rows) == 1 else f"{len(rows)} runs"
    lines = [f"{root}: {runs}, " + ", ".join(f"{n} {state}" for state, n in counts.items())]
    if common := common_overrides(rows):
        lines.append(f"overrides shared by every run: {' '.join(common)}")
    if (best := best_run(rows)) is not None:
        own = " ".join(o for o in best.overrides if o not in common) or best.job
        lines.append(f"best run: {best.job} ({own}): {best.monitor} {best.best:.4f} at step {best.best_step}")
    return "\n".join(lines)


def best_run(rows: list[RunRow]) -> Optional[RunRow]:
    """The run with the best value of the monitored metric, when every run that has one monitors the same."""
    scored = [r for r in rows if r.best is not None]
    if len(rows) < 2 or not scored or len({(r.monitor, r.monitor_mode) for r in scored}) > 1:
        return None
    pick = max if scored[0].monitor_mode == "max" else min
    return pick(scored, key=lambda r: r.best)


def failures(rows: list[RunRow]) -> str:
    """One line per failed run with its recorded error; empty when none failed."""
    failed = [r for r in rows if r.status == "failed"]
    return "\n".join(f"- {r.job} failed: {r.error or 'no message recorded'}" for r in failed)


def markdown(rows: list[RunRow], root: Path, image: Optional[str]) -> str:
    """summary.md: the overview, the table, the failures, what the columns mean, and the plot when there is one."""
    parts = ["# accutrain summary", overview(rows, root), markdown_table(rows)]
    if text := failures(rows):
        parts.append(text)
    parts.append("final loss: training loss of the last optimizer step (the window's sample-weighted mean); "
                 "best val loss/acc: over the evaluations (ema: of the averaged weights, with trainer.ema); "
                 "best (monitored): trainer.monitor's best evaluation, the one checkpoints/best.pt holds; "
                 "samples/s: median over optimizer steps; test (with data.test): the monitored metric on the "
                 "test split, of the last weights and of best.pt's; "
                 "peak mem: the process's (status.json), else the largest in metrics.jsonl; "
                 "wall: from start to end (or to now).")
    if image:
        parts.append(f"![training loss, peak memory and samples/s]({image})")
    return "\n\n".join(parts) + "\n"


CSV_FIELDS = ["job", "path", "overrides", "effective_batch", "micro_batch", "accum", "devices", "steps", "final_loss",
              "best_val_loss", "best_val_acc", "best_val_loss_ema", "best_val_acc_ema", "monitor", "best", "best_step",
              "samples_per_s", "peak_mem_mb", "wall_s", "status", "error"]


def write_csv(rows: list[RunRow], path: Path) -> None:
    """Every override of every run (not only those that differ), unrounded numbers, empty where unknown."""
    fields = CSV_FIELDS + (["test_metric", "test_last", "test_best"] if any(r.test for r in rows) else [])
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            values = dict(job=r.job, path=str(r.path), overrides=" ".join(r.overrides), effective_batch=r.effective,
                          micro_batch=r.micro_batch, accum=r.accum, devices=r.devices, steps=r.steps,
                          final_loss=r.final_loss, best_val_loss=r.best_val_loss, best_val_acc=r.best_val_acc,
                          best_val_loss_ema=r.best_val_loss_ema, best_val_acc_ema=r.best_val_acc_ema,
                          monitor=r.monitor, best=r.best, best_step=r.best_step, samples_per_s=r.samples_per_s,
                          peak_mem_mb=r.peak_mem_mb, wall_s=r.wall_s,
                          status=r.status, error=r.error)
            if len(fields) > len(CSV_FIELDS):
                values.update(zip(("test_metric", "test_last", "test_best"), tested(r)))
            writer.writerow({k: "" if v is None else v for k, v in values.items()})


@dataclass
class Report:
    rows: list[RunRow]
    text: str  # what the terminal shows: the overview, the table, the failures
    files: list[Path]


def write_report(root: Path, rows: Optional[list[RunRow]] = None) -> Report:
    """Write summary.md and summary.csv into root, and summary.png (a sweep) or loss.png (a single run), from
    `rows` (default: collect(root)). A plot that cannot be drawn is a warning; UserError when root holds no run."""
    from accutrain.report import plots  # matplotlib is imported only when a plot is drawn

    if not root.is_dir():
        raise UserError(f"{root} is not a directory: expected a run or sweep directory")
    rows = collect(root) if rows is None else rows
    if not rows:
        raise UserError(f"no accutrain run in {root}: expected a folder with status.json, metrics.jsonl or "
                        f".hydra/overrides.yaml, in it or below it")
    single = rows[0].path == root
    image = root / ("loss.png" if single else "summary.png")
    files = [root / "summary.md", root / "summary.csv"]
    ours(root, [*files, image, root / "noise.png"])
    try:
        plots.plot_run(rows[0], image) if single else plots.plot_summary(rows, image)
        files.append(image)
    except Exception as e:  # a plot is a convenience; the table must still be written
        log.warning(f"could not draw {image}: {type(e).__name__}: {e}")
    said = "\n".join(line for line in map(noise.verdict, rows) if line)
    try:
        if noise.plot_noise(rows, root / "noise.png"):
            files.append(root / "noise.png")
    except Exception as e:
        log.warning(f"could not draw {root / 'noise.png'}: {type(e).__name__}: {e}")
    text = markdown(rows, root, image.name if image in files else None)
    if said:
        text += "\n## The noise scale\n\n" + said + ("\n\n![B_simple against the effective batch](noise.png)\n"
                                                      if root / "noise.png" in files else "\n")
    (root / "summary.md").write_text(text)
    write_csv(rows, root / "summary.csv")
    parts = [overview(rows, root), markdown_table(rows), failures(rows), said]
    return Report(rows, "\n\n".join(p for p in parts if p), files)


def ours(root: Path, files: list[Path]) -> None:
    """The summary's files are written only into a directory accutrain marked (a run's, a sweep's, or one a report
    was written into before: store.mark) or one made before the mark existed; into any other folder only where none
    of them is there yet (the folder is then marked as a report's). UserError otherwise: a user's own summary.md
    is never replaced."""
    if mark.owner(root) is not None:
        return
    theirs = [p.name for p in files if p.exists() or p.is_symlink()]
    if theirs:
        raise UserError(f"{root} is not a directory accutrain made (no {mark.MARK_FILE} mark) and holds "
                        f"{', '.join(theirs)} of its own, which the summary would replace: summarise a run or sweep "
                        "directory, or move those files away")
    mark.write_new(root, "report")


def write_loss_plot(run_dir: Path, status: Optional[str] = None) -> Optional[Path]:
    """Draw run_dir/loss.png from its metrics.jsonl when it has any step, in a run directory accutrain marked
    (store.mark); never raises (a warning instead). `status` titles it when status.json does not have the outcome
    yet."""
    from accutrain.report import plots  # matplotlib is imported only when a plot is drawn

    out = run_dir / "loss.png"
    if mark.owner(run_dir) != "run":
        return None
    try:
        row = read_run(run_dir, run_dir.name)
        row.status = status or row.status
        if not row.curve:
            return None
        plots.plot_run(row, out)
        return out
    except Exception as e:  # a plot must never break a run
        log.warning(f"could not draw {out}: {type(e).__name__}: {e}")
        return None
