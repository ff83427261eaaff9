"""Reading run directories: one row per run, from status.json, .hydra/overrides.yaml and metrics.jsonl (the batch
plan is recorded in both as data). Interrupted and still-running runs are read from what they have written so far."""
from __future__ import annotations

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

from accutrain.store.files import read_jsonl
from accutrain.store.status import STATUS_FILE, current_state, read_status

log = logging.getLogger("accutrain")

METRICS_FILE = "metrics.jsonl"
OVERRIDES_FILE = ".hydra/overrides.yaml"
RUN_MARKERS = (STATUS_FILE, METRICS_FILE, OVERRIDES_FILE)
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
    best_val_loss_ema: Optional[float] = None  # the same of the averaged weights (trainer.ema)
    best_val_acc_ema: Optional[float] = None
    monitor: Optional[str] = None  # the monitored metric (trainer.monitor), its best value and that evaluation's step
    monitor_mode: Optional[str] = None  # min | max
    best: Optional[float] = None
    best_step: Optional[int] = None
    samples_per_s: Optional[float] = None
    peak_mem_mb: Optional[float] = None
    wall_s: Optional[float] = None
    curve: list[tuple[int, float]] = field(default_factory=list)  # (samples seen, training loss) per step
    val_curve: list[tuple[int, float]] = field(default_factory=list)  # (samples seen, val loss) per evaluation
    metric: Optional[str] = None  # the validation metric drawn beside the loss (the monitored one, unless a loss)
    metric_curve: list[tuple[int, float]] = field(default_factory=list)  # (samples seen, its value) per evaluation
    test: Optional[dict[str, Any]] = None  # the test stage's record (data.test)
    noise_curve: list[tuple[int, float, int]] = field(default_factory=list)  # (samples seen, B_simple, effective)


# --- reading ------------------------------------------------------------------------------------------
def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, evaluation records), each by step, the latest record of a step winning (a resumed run
    appends). Lines that do not parse, such as the half-written last line of a running or killed run, are skipped."""
    steps: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for _, record in read_jsonl(path):
        if not isinstance(record.get("step"), int):
            continue
        if "loss" in record:
            steps[record["step"]] = record
        elif "val_loss" in record or "val_acc" in record:
            evals[record["step"]] = record
    return [steps[k] for k in sorted(steps)], [evals[k] for k in sorted(evals)]


KINDS = ("plan", "step", "eval", "test")  # metrics.jsonl's records: the batch plan, optimizer steps, evaluations, test


def record_kind(record: dict[str, Any]) -> Optional[str]:
    """A metrics.jsonl record's kind: the one it says, or (a file written before records said one) what its keys
    are: plan, step (a loss), eval (val_*); None for anything else."""
    if isinstance(record.get("kind"), str):
        return record["kind"]
    return ("plan" if "plan" in record else "step" if "loss" in record else
            "eval" if any(key.startswith("val_") for key in record) else None)


def metrics_records(run_dir: str | Path, kind: Optional[str] = None) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl (`run_dir` is the run directory or the file) of `kind` — plan, step,
    eval or test; every record with None — in the file's order, each with its `kind` first."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(KINDS)} (or None: every record)")
    path = Path(run_dir)
    path = path / METRICS_FILE if path.is_dir() else path
    found = ((record_kind(record), record) for _, record in read_jsonl(path))
    return [{"kind": own, **{k: v for k, v in record.items() if k != "kind"}} for own, record in found
            if kind is None or own == kind]


def metrics_frame(run_dir: str | Path, kind: Optional[str] = "step") -> Any:
    """metrics_records(run_dir, kind) as a pandas DataFrame, a column per key (a plan record's keys as plan.effective,
    plan.accum, …). Needs pandas (pip install pandas): metrics_records gives the same rows as dicts without it."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("accutrain.report.runs.metrics_frame needs pandas (pip install pandas); "
                          "metrics_records gives the same records as dicts") from None
    return pd.json_normalize(metrics_records(run_dir, kind))


def read_overrides(run_dir: Path) -> list[str]:
    """The command-line overrides Hydra recorded for the run (empty when there are none or they cannot be read)."""
    try:
        overrides = yaml.safe_load((run_dir / OVERRIDES_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in overrides] if isinstance(overrides, list) else []


def read_plan(run_dir: Path) -> Optional[dict[str, Any]]:
    """The batch plan the run recorded (status.json; else the last plan record of metrics.jsonl), None before it had
    one."""
    plan = (read_status(run_dir) or {}).get("plan")
    if plan is None:
        plans = [record["plan"] for _, record in read_jsonl(run_dir / METRICS_FILE) if "plan" in record]
        plan = plans[-1] if plans else None
    return plan if isinstance(plan, dict) else None


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
    plan = read_plan(run_dir) or {}
    row.effective, row.micro_batch, row.accum, row.devices = (plan.get(key) for key in
                                                                ("effective", "micro_batch", "accum", "devices"))
    steps, evals = read_metrics(run_dir / METRICS_FILE)
    if steps:
        row.steps = steps[-1]["step"]
        row.final_loss = steps[-1]["loss"]
        rates = [r["samples_per_s"] for r in steps if isinstance(r.get("samples_per_s"), (int, float))]
        row.samples_per_s = statistics.median(rates) if rates else None
        peaks = [r["peak_mem_mb"] for r in steps if isinstance(r.get("peak_mem_mb"), (int, float))]
        process = (record or {}).get("peak_mem_mb")  # the process's (evaluations, checkpoints, test included)
        peaks += [process] if isinstance(process, (int, float)) else []
        row.peak_mem_mb = max(peaks) if peaks else None
        row.curve = [(r.get("samples_seen", r["step"]), r["loss"]) for r in steps]
        row.noise_curve = [(r.get("samples_seen", r["step"]), r["b_simple"], r["effective"]) for r in steps
                           if isinstance(r.get("b_simple"), (int, float)) and isinstance(r.get("effective"), int)]
    seen_at = {r["step"]: r.get("samples_seen", r["step"]) for r in steps}
    for suffix in ("", "_ema"):
        losses = [r[f"val_loss{suffix}"] for r in evals if isinstance(r.get(f"val_loss{suffix}"), (int, float))]
        accs = [r[f"val_acc{suffix}"] for r in evals if isinstance(r.get(f"val_acc{suffix}"), (int, float))]
        setattr(row, f"best_val_loss{suffix}", min(losses) if losses else None)
        setattr(row, f"best_val_acc{suffix}", max(accs) if accs else None)
    best = (record or {}).get("best")
    if isinstance(best, dict):
        row.monitor, row.monitor_mode = best.get("metric"), best.get("mode")
        row.best, row.best_step = best.get("value"), best.get("step")
    row.val_curve = [(seen_at[r["step"]], r["val_loss"]) for r in evals  # null: a value that was not finite
                     if r["step"] in seen_at and isinstance(r.get("val_loss"), (int, float))]
    row.metric = beside_the_loss(row.monitor, evals)
    row.metric_curve = [(seen_at[r["step"]], r[row.metric]) for r in evals
                        if r["step"] in seen_at and isinstance(r.get(row.metric), (int, float))] if row.metric else []
    row.test = next((r for r in reversed(metrics_records(run_dir, "test"))), None)
    return row


def beside_the_loss(monitor: Optional[str], evals: list[dict[str, Any]]) -> Optional[str]:
    """The validation metric loss.png draws beside the loss: the monitored one, unless it is a loss; else the first
    the evaluations hold of accuracy, F1, MAE, recall@1."""
    held = {key for r in evals for key in r}
    if monitor and monitor in held and not monitor.startswith("val_loss"):
        return monitor
    return next((name for name in ("val_acc", "val_f1", "val_mae", "val_recall1") if name in held), None)


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




def common_overrides(rows: list[RunRow]) -> list[str]:
    """The overrides every run shares (none for a single run, whose overrides are its own)."""
    if len(rows) < 2:
        return []
    shared = set.intersection(*(set(r.overrides) for r in rows))
    return [o for o in rows[0].overrides if o in shared]
