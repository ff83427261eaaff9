"""Run and sweep summaries: one row per run directory, read from status.json, the log's batch line,
.hydra/overrides.yaml and metrics.jsonl, written as summary.md, summary.csv and a plot. Interrupted and
still-running runs are summarised from what they have written so far."""
from __future__ import annotations

import csv
import json
import logging
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import yaml

from accutrain.errors import UserError
from accutrain.run_status import STATUS_FILE, current_state, read_status

log = logging.getLogger("accutrain")

METRICS_FILE = "metrics.jsonl"
OVERRIDES_FILE = ".hydra/overrides.yaml"
RUN_MARKERS = (STATUS_FILE, METRICS_FILE, OVERRIDES_FILE)
PLAN_LINE = re.compile(r"effective batch (\d+) = micro_batch (\d+) × accum (\d+) × devices (\d+)")
MISSING_VALUE = "–"


@dataclass
class RunRow:
    """What one run directory shows: its setup, outcome and curves (None where it has not recorded it)."""

    path: Path
    job: str
    overrides: list[str]
    status: str
    error: Optional[str] = None
    effective: Optional[int] = None
    micro_batch: Optional[int] = None
    accum: Optional[int] = None
    devices: Optional[int] = None
    steps: int = 0
    final_loss: Optional[float] = None
    best_val_loss: Optional[float] = None
    best_val_acc: Optional[float] = None
    samples_per_s: Optional[float] = None
    peak_mem_mb: Optional[float] = None
    wall_s: Optional[float] = None
    curve: list[tuple[int, float]] = field(default_factory=list)  # (samples seen, training loss) per step
    val_curve: list[tuple[int, float]] = field(default_factory=list)  # (samples seen, val loss) per evaluation


# --- reading ------------------------------------------------------------------------------------------
def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, evaluation records), each by step, the latest record of a step winning (a resumed run
    appends). Lines that do not parse, such as the half-written last line of a running or killed run, are skipped."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return [], []
    steps: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        if "loss" in record:
            steps[record["step"]] = record
        elif "val_loss" in record or "val_acc" in record:
            evals[record["step"]] = record
    return [steps[k] for k in sorted(steps)], [evals[k] for k in sorted(evals)]


def read_overrides(run_dir: Path) -> list[str]:
    """The command-line overrides Hydra recorded for the run (empty when there are none or they cannot be read)."""
    try:
        overrides = yaml.safe_load((run_dir / OVERRIDES_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in overrides] if isinstance(overrides, list) else []


def read_plan(run_dir: Path) -> Optional[tuple[int, int, int, int]]:
    """(effective, micro_batch, accum, devices) from the last batch line the run logged, None before it had one."""
    logs = sorted(run_dir.glob("*.log"), key=lambda p: (p.name != "train.log", p.name))
    for path in logs:
        try:
            found = PLAN_LINE.findall(path.read_text(errors="replace"))
        except OSError:
            continue
        if found:
            effective, micro_batch, accum, devices = (int(v) for v in found[-1])
            return effective, micro_batch, accum, devices
    return None


def _timestamp(value: Any) -> Optional[float]:
    try:
        return datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        return None


def wall_seconds(run_dir: Path, record: Optional[dict[str, Any]], state: str) -> Optional[float]:
    """From the recorded start to the recorded end; for a running run, to now; for a killed one, to its last write."""
    if record is None or (started := _timestamp(record.get("started"))) is None:
        return None
    if (ended := _timestamp(record.get("ended"))) is None:
        if state == "running":
            ended = time.time()
        else:
            written = [p.stat().st_mtime for p in (run_dir / METRICS_FILE, run_dir / STATUS_FILE) if p.exists()]
            ended = max(written, default=started)
    return max(0.0, ended - started)


def read_run(run_dir: Path, job: str) -> RunRow:
    """Summarise one run directory, whatever state it is in."""
    record = read_status(run_dir)
    state = current_state(record)
    row = RunRow(path=run_dir, job=job, overrides=read_overrides(run_dir), status=state,
                 error=(record or {}).get("error"), wall_s=wall_seconds(run_dir, record, state))
    plan = read_plan(run_dir)
    if plan is not None:
        row.effective, row.micro_batch, row.accum, row.devices = plan
    steps, evals = read_metrics(run_dir / METRICS_FILE)
    if steps:
        row.steps = steps[-1]["step"]
        row.final_loss = steps[-1]["loss"]
        rates = [r["samples_per_s"] for r in steps if isinstance(r.get("samples_per_s"), (int, float))]
        row.samples_per_s = statistics.median(rates) if rates else None
        peaks = [r["peak_mem_mb"] for r in steps if isinstance(r.get("peak_mem_mb"), (int, float))]
        row.peak_mem_mb = max(peaks) if peaks else None
        row.curve = [(r.get("samples_seen", r["step"]), r["loss"]) for r in steps]
    seen_at = {r["step"]: r.get("samples_seen", r["step"]) for r in steps}
    val_losses = [r["val_loss"] for r in evals if isinstance(r.get("val_loss"), (int, float))]
    val_accs = [r["val_acc"] for r in evals if isinstance(r.get("val_acc"), (int, float))]
    row.best_val_loss = min(val_losses) if val_losses else None
    row.best_val_acc = max(val_accs) if val_accs else None
    row.val_curve = [(seen_at[r["step"]], r["val_loss"]) for r in evals if r["step"] in seen_at and "val_loss" in r]
    return row


def is_run_dir(path: Path) -> bool:
    """A folder an accutrain run wrote into: it holds status.json, metrics.jsonl or .hydra/overrides.yaml."""
    return any((path / marker).is_file() for marker in RUN_MARKERS)


def _natural_key(path: Path) -> list[tuple[int, Any]]:
    """Job 2 before job 10."""
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", path.as_posix()) if t]


def find_runs(root: Path) -> list[Path]:
    """root itself when it is a run directory, else every run directory below it (jobs of a sweep, sweeps of a
    multirun/ folder), in natural order. Hidden folders (.hydra, .submitit) are not searched."""
    if is_run_dir(root):
        return [root]
    runs = []
    for folder, subfolders, _ in os.walk(root):
        here = Path(folder)
        if here != root and is_run_dir(here):
            runs.append(here)
            subfolders.clear()
        else:
            subfolders[:] = [s for s in subfolders if not s.startswith(".")]
    return sorted(runs, key=lambda p: _natural_key(p.relative_to(root)))


def collect(root: Path) -> list[RunRow]:
    """One row per run directory in or below root (empty when there is none)."""
    return [read_run(p, root.name if p == root else p.relative_to(root).as_posix()) for p in find_runs(root)]


# --- writing ------------------------------------------------------------------------------------------
def common_overrides(rows: list[RunRow]) -> list[str]:
    """The overrides every run shares (none for a single run, whose overrides are its own)."""
    if len(rows) < 2:
        return []
    shared = set.intersection(*(set(r.overrides) for r in rows))
    return [o for o in rows[0].overrides if o in shared]


def _fmt(value: Optional[float], digits: int) -> str:
    return MISSING_VALUE if value is None else f"{value:.{digits}f}"


HEADER = ["job", "overrides", "effective batch", "micro_batch × accum × devices", "steps", "final loss",
          "best val loss", "best val acc", "samples/s", "peak mem (MiB)", "wall (s)", "status"]


def table_cells(rows: list[RunRow]) -> list[list[str]]:
    """One list of formatted cells per run, in HEADER's order; the overrides column leaves out the shared ones."""
    common = set(common_overrides(rows))
    cells = []
    for r in rows:
        split = (MISSING_VALUE if r.micro_batch is None else f"{r.micro_batch} × {r.accum} × {r.devices}")
        cells.append([
            r.job, " ".join(o for o in r.overrides if o not in common) or MISSING_VALUE,
            MISSING_VALUE if r.effective is None else str(r.effective), split, str(r.steps),
            _fmt(r.final_loss, 4), _fmt(r.best_val_loss, 4), _fmt(r.best_val_acc, 4), _fmt(r.samples_per_s, 0),
            _fmt(r.peak_mem_mb, 0), _fmt(r.wall_s, 1), r.status,
        ])
    return cells


def markdown_table(rows: list[RunRow]) -> str:
    """A Markdown table whose columns are padded, so that it reads as well in a terminal."""
    body = [[c.replace("|", "\\|") for c in line] for line in table_cells(rows)]
    widths = [max(len(line[i]) for line in [HEADER, *body]) for i in range(len(HEADER))]
    numeric = set(range(2, 11))

    def line(cells: list[str]) -> str:
        padded = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if i in numeric else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(HEADER), rule, *(line(cells) for cells in body)])


def overview(rows: list[RunRow], root: Path) -> str:
    """The text above and below the table: the counts, the shared overrides, the failures."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    runs = "1 run" if len(rows) == 1 else f"{len(rows)} runs"
    lines = [f"{root}: {runs}, " + ", ".join(f"{n} {state}" for state, n in counts.items())]
    if common := common_overrides(rows):
        lines.append(f"overrides shared by every run: {' '.join(common)}")
    return "\n".join(lines)


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
                 "best val loss/acc: over the evaluations; samples/s: median over optimizer steps; "
                 "peak mem: the largest `peak_mem_mb` in metrics.jsonl; wall: from start to end (or to now).")
    if image:
        parts.append(f"![training loss, peak memory and samples/s]({image})")
    return "\n\n".join(parts) + "\n"


CSV_FIELDS = ["job", "path", "overrides", "effective_batch", "micro_batch", "accum", "devices", "steps", "final_loss",
              "best_val_loss", "best_val_acc", "samples_per_s", "peak_mem_mb", "wall_s", "status", "error"]


def write_csv(rows: list[RunRow], path: Path) -> None:
    """Every override of every run (not only those that differ), unrounded numbers, empty where unknown."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            values = dict(job=r.job, path=str(r.path), overrides=" ".join(r.overrides), effective_batch=r.effective,
                          micro_batch=r.micro_batch, accum=r.accum, devices=r.devices, steps=r.steps,
                          final_loss=r.final_loss, best_val_loss=r.best_val_loss, best_val_acc=r.best_val_acc,
                          samples_per_s=r.samples_per_s, peak_mem_mb=r.peak_mem_mb, wall_s=r.wall_s,
                          status=r.status, error=r.error)
            writer.writerow({k: "" if v is None else v for k, v in values.items()})


@dataclass
class Report:
    rows: list[RunRow]
    text: str  # what the terminal shows: the overview, the table, the failures
    files: list[Path]


def write_report(root: Path, rows: Optional[list[RunRow]] = None) -> Report:
    """Write summary.md and summary.csv into root, and summary.png (a sweep) or loss.png (a single run), from
    `rows` (default: collect(root)). A plot that cannot be drawn is a warning; UserError when root holds no run."""
    from accutrain import plots  # matplotlib is imported only when a plot is drawn

    if not root.is_dir():
        raise UserError(f"{root} is not a directory: expected a run or sweep directory")
    rows = collect(root) if rows is None else rows
    if not rows:
        raise UserError(f"no accutrain run in {root}: expected a folder with status.json, metrics.jsonl or "
                        f".hydra/overrides.yaml, in it or below it")
    single = rows[0].path == root
    image = root / ("loss.png" if single else "summary.png")
    files = [root / "summary.md", root / "summary.csv"]
    try:
        plots.plot_run(rows[0], image) if single else plots.plot_summary(rows, image)
        files.append(image)
    except Exception as e:  # a plot is a convenience; the table must still be written
        log.warning(f"could not draw {image}: {type(e).__name__}: {e}")
    (root / "summary.md").write_text(markdown(rows, root, image.name if image in files else None))
    write_csv(rows, root / "summary.csv")
    parts = [overview(rows, root), markdown_table(rows), failures(rows)]
    return Report(rows, "\n\n".join(p for p in parts if p), files)
