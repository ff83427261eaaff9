"""The Hydra callback (`hydra.callbacks.sweep_summary` in configs/train.yaml) that summarises a multirun in its
sweep directory, and remembers how many jobs failed so that the command can exit non-zero."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ClassVar

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepSummary(Callback):
    """on_multirun_end: print the table and write summary.md, summary.csv, summary.png into hydra.sweep.dir."""

    failed_jobs: ClassVar[int] = 0  # jobs of the last multirun recorded as failed; read by accutrain.cli.main

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        SweepSummary.failed_jobs = 0

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from accutrain.report import write_report
        from accutrain.runs import collect

        # Printed rather than logged: after in-process jobs the root logger still writes into the last job's log.
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            rows = collect(sweep_dir)
            SweepSummary.failed_jobs = sum(r.status == "failed" for r in rows)
            report = write_report(sweep_dir, rows)
        except Exception as e:  # the jobs ran and recorded their outcome; a summary failing must not hide that
            print(f"accutrain: could not summarise {sweep_dir}: {type(e).__name__}: {e}", file=sys.stderr)
            return
        print(f"\n{report.text}\n\nwritten: {', '.join(str(p) for p in report.files)}", flush=True)
        if SweepSummary.failed_jobs:
            print(f"accutrain: {SweepSummary.failed_jobs} of {len(report.rows)} jobs failed (exit code 1)",
                  file=sys.stderr)
