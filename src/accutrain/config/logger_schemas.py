"""The schemas of the `logger/` group: each tracker's keys (accutrain.trackers), a built-in option's `_target_` its
factory; accutrain.config.train registers them with the others."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from accutrain.config.schemas import MISSING


# `logger` maps a name to a tracker (accutrain.trackers); every key but `_target_` is a keyword argument of it.
@dataclass
class TrackerConfig:
    _target_: str = MISSING


@dataclass
class CSVTracker(TrackerConfig):
    _target_: str = "accutrain.trackers.csv.CSV"
    filename: str = "metrics.csv"  # in the run directory


@dataclass
class TensorBoardTracker(TrackerConfig):
    _target_: str = "accutrain.trackers.tensorboard.TensorBoard"
    log_dir: Optional[str] = None  # null: the run directory itself; a relative path is taken inside it
    flush_secs: int = 30  # the event file is written at least this often (and before every checkpoint)


@dataclass
class MLflowTracker(TrackerConfig):
    _target_: str = "accutrain.trackers.mlflow.MLflow"
    tracking_uri: Optional[str] = None  # null: sqlite:///<the run directory's parent>/mlflow.db
    experiment: Optional[str] = None  # null: the sweep's directory for a sweep's job, else "accutrain"
    run_name: Optional[str] = None  # null: the run directory's name and the overrides
    tags: Dict[str, str] = field(default_factory=dict)
    flush_secs: float = 10.0  # metrics are sent at least this often (and before every checkpoint, and at the end)


@dataclass
class WandBTracker(TrackerConfig):
    _target_: str = "accutrain.trackers.wandb.WandB"
    project: Optional[str] = None  # null: WANDB_PROJECT, else accutrain
    entity: Optional[str] = None  # null: WANDB_ENTITY, else your default entity (online)
    mode: Optional[str] = None  # offline | online | disabled; null: WANDB_MODE, else offline
    group: Optional[str] = None  # null: the sweep's directory for a sweep's job
    name: Optional[str] = None  # null: the run directory's name and the overrides
    tags: List[str] = field(default_factory=list)
