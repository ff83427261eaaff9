"""A multirun's summary in its sweep directory (written at its end by accutrain.cli.sweep_summary, Hydra's callback),
how many of its jobs failed, and what a sweep stopped by a signal writes and says (the summary of what ran, and the
command that resumes the sweep)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional


def summarise(sweep_dir: Path) -> Optional[tuple[int, int]]:
    """Print the table and write summary.md, summary.csv, summary.png into sweep_dir; (failed jobs, jobs), or None
    when the summary could not be made (the jobs recorded their outcome, so a failing summary must not hide it).
    Printed rather than logged: after in-process jobs the root logger still writes into the last job's log."""
    from accutrain.report.runs import collect
    from accutrain.report.summary import write_report

    try:
        rows = collect(sweep_dir)
        report = write_report(sweep_dir, rows)
    except Exception as e:
        print(f"accutrain: could not summarise {sweep_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    print(file=sys.stderr, flush=True)  # a blank line after the consoles' (stderr): `> table.md` starts with the table
    print(f"{report.text}\n\nwritten: {', '.join(str(p) for p in report.files)}", flush=True)
    return sum(r.status == "failed" for r in rows), len(rows)


def failed_jobs(sweep_dir: Path) -> tuple[int, int]:
    """(failed, jobs) of the sweep's jobs as their records (status.json) say."""
    from accutrain.report.runs import collect

    try:
        rows = collect(sweep_dir)
    except Exception:
        return 0, 0
    return sum(r.status == "failed" for r in rows), len(rows)


def resume_command(argv: list[str], sweep_dir: Path) -> str:
    """`accutrain -m <the same overrides> hydra.sweep.dir=<sweep_dir> resume=auto`: every job continues from its
    newest checkpoint, a finished one has nothing left to do, one that never started starts."""
    kept = [a for a in argv if a not in ("-m", "--multirun") and not a.startswith(("hydra.sweep.dir=", "resume="))]
    args = ["accutrain", "-m", *kept, f"hydra.sweep.dir={sweep_dir.resolve()}", "resume=auto"]
    return " ".join(shlex.quote(a) for a in args)


def stopped(sweep_dir: Path, job: str, signal_name: str, argv: list[str]) -> None:
    """A signal stopped the sweep during `job` (after that job's checkpoint): summarise what ran and say how to
    resume the whole sweep."""
    summarise(sweep_dir)
    print(f"accutrain: the sweep was stopped by {signal_name} during job {job} (checkpointed); the jobs after it did "
          f"not run. Resume the sweep with:\n  {resume_command(argv, sweep_dir)}", file=sys.stderr, flush=True)
