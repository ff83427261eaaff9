"""accutrain from Python — scripts and notebooks: `accutrain.compose(*overrides)`, the typed run a command would train,
and `accutrain.run(*overrides, run_dir=…)`, the run itself, returning its record. The overrides are what a user types
after `accutrain`; the same checks refuse the same mistakes (a UserError, before the run directory is made), the run
directory is held, marked and recorded as the command records it (status.json, config.yaml, metrics.jsonl,
checkpoints/), and `accutrain-report` reads it."""
from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path
from typing import Optional

from accutrain.config.targets import check_plugins
from accutrain.config.train import TrainConfig
from accutrain.config.train import compose as compose_config
from accutrain.config.validate import typed_run
from accutrain.report.runs import RunRow, read_run
from accutrain.report.summary import write_loss_plot
from accutrain.runtime.launch import place, train
from accutrain.store import claim, owned, rundir
from accutrain.store.record import Changes
from accutrain.store.status import recorded

log = logging.getLogger("accutrain")


def compose(*overrides: str) -> TrainConfig:
    """The typed, frozen run `accutrain <overrides>` would train: composed, checked, its plug-ins imported."""
    run = typed_run(compose_config(*overrides))
    check_plugins(run)
    return run


def run(*overrides: str, run_dir: Optional[str | Path] = None) -> RunRow:
    """Train as `accutrain <overrides> hydra.run.dir=<run_dir>` would, in this process (with devices=N, in N worker
    processes), and return the run's record: its status, steps, final loss, best monitored value, curves
    (accutrain.report.runs.RunRow). `run_dir` defaults to outputs/<date>/<time> in the working directory. A signal
    of trainer.preempt_signals ends it with accutrain.errors.Preempted, after its checkpoint."""
    cfg = compose(*overrides)
    path = Path(run_dir) if run_dir is not None else Path("outputs") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    ranks = place(cfg)  # the device and the ranks: refused here, before the directory
    owned.refuse_foreign(path, "run_dir")
    changes = Changes()
    with claim.claimed(path, "run", "run_dir", lambda: rundir.check_reuse(path, cfg.resume, cfg.trainer.overwrite,
                                                                          "run_dir"),
                       changes):
        rundir.prepare(path, cfg.resume, cfg.trainer.overwrite)
        with recorded(path, changes):
            train(cfg, path, None, ranks)
        write_loss_plot(path)
    return read_run(path, path.name)
