"""The Hydra callback (`hydra.callbacks.sweep_summary` in configs/train.yaml) that summarises a multirun in its sweep
directory: summary.md, summary.csv and summary.png, and the table printed. How many jobs failed is the command's to
say (accutrain.cli.main), from the jobs' records."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from accutrain.report.sweep import summarise


class SweepSummary(Callback):
    """on_multirun_end: print the table and write summary.md, summary.csv, summary.png into hydra.sweep.dir."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        summarise(Path(str(config.hydra.sweep.dir)))
