"""Experiment trackers (`logger=`): rank 0 tells each configured tracker about the run, every optimizer step's and
every evaluation's metrics.jsonl record, each checkpoint and the end. One that raises is switched off with one
warning line and training goes on. The trackers' run ids are kept in the run directory's trackers.json, so that a
resumed run continues the same tracker runs."""
from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import yaml

from accutrain.config.targets import instantiate, load_target, plain
from accutrain.config.train import TrainConfig
from accutrain.config.typed import Supplied, with_supplied
from accutrain.errors import UserError
from accutrain.report.runs import read_overrides
from accutrain.store.files import write_atomic
from accutrain.store.owned import TRACKERS_FILE, check_tracker_paths
from accutrain.trackers.base import RunEnd, RunInfo, Tracker, flatten, scalars

if TYPE_CHECKING:
    from accutrain.core.plan import BatchPlan
    from accutrain.store.progress import Progress

__all__ = ["RunEnd", "RunInfo", "Tracker", "Trackers", "scalars"]

log = logging.getLogger("accutrain")

SAVED_FILE = TRACKERS_FILE


class Trackers:
    """The run's trackers, called in turn (none on ranks other than 0, or with logger=none)."""

    def __init__(self, trackers: Optional[dict[str, Any]] = None, run_dir: Optional[Path] = None) -> None:
        self.active = dict(trackers or {})
        self.monitor = "val_acc"  # trainer.monitor, set by start
        self.run_dir = run_dir

    @classmethod
    def build(cls, cfg: TrainConfig, run_dir: Path) -> "Trackers":
        """Build every `logger.<name>` from its `_target_` and other keys; a tracker whose library is missing, or an
        option it does not take, or a file or directory it would write that is accutrain's own or an existing file
        outside the run directory (store.owned), is one line."""
        check_tracker_paths(run_dir, {name: node.arguments for name, node in cfg.logger.items()}, cfg.resume)
        built = {}
        for name, node in cfg.logger.items():
            make = load_target(f"logger.{name}._target_", node.target)
            kwargs = {k: v for k, v in plain(node).items() if k != "_target_"}
            try:
                inspect.signature(make).bind(**kwargs)
            except TypeError as e:
                raise UserError(f"logger.{name} ({node.target}): {e}") from None
            except ValueError:  # no signature to check (a builtin)
                pass
            built[name] = instantiate(f"logger.{name}", node)
        return cls(built, run_dir)

    def start(self, cfg: TrainConfig, supplied: Supplied, plan: "BatchPlan", step: int, resumed: bool,
              monitor: Optional[str] = None) -> None:
        """Start every tracker on this run (continue their runs when resuming), then keep their run ids."""
        if not self.active:
            return
        assert self.run_dir is not None
        self.monitor = monitor or cfg.trainer.monitor  # trainer.monitor=auto: the loss's metric
        config = {**with_supplied(cfg, supplied), "plan": plan.record()}
        group, job = sweep_of(self.run_dir)
        saved = read_saved(self.run_dir) if resumed else {}  # kept for a tracker that does not start this time
        name = " ".join([self.run_dir.name, *read_overrides(self.run_dir)])[:128]
        params = flatten(config)
        for key in list(self.active):
            run = RunInfo(self.run_dir, name, group, job, config, params, step, resumed, saved.get(key, {}))
            state = self._call(key, "start", run)
            if key in self.active:
                saved[key] = state or {}
        try:
            write_atomic(self.run_dir / SAVED_FILE, json.dumps(saved, indent=1, default=str) + "\n")
        except OSError as e:
            log.warning(f"could not write {self.run_dir / SAVED_FILE} ({e}): a resume will start new tracker runs")

    def log_step(self, record: dict[str, Any]) -> None:
        for key in list(self.active):
            self._call(key, "log_step", record)

    def log_eval(self, record: dict[str, Any]) -> None:
        for key in list(self.active):
            self._call(key, "log_eval", record)

    def flush(self) -> None:
        for key in list(self.active):
            self._call(key, "flush")

    def finish(self, status: str, p: "Progress", seconds: Optional[float] = None, samples: int = 0,
               peak_mb: float = 0.0, extra: Optional[dict[str, float]] = None) -> None:
        """The end of this session: `completed`, `interrupted` or `failed`, where the run is, and when training got
        to its end, this session's time, samples and peak memory (and `extra` figures: the noise scale's)."""
        if not self.active:
            return
        from accutrain.report.summary import write_loss_plot

        end = RunEnd(status, {**summary(p, self.monitor, seconds, samples, peak_mb), **(extra or {})},
                     write_loss_plot(self.run_dir, status))
        for key in list(self.active):
            self._call(key, "finish", end)
        self.active.clear()

    def _call(self, key: str, method: str, *args: Any) -> Any:
        tracker = self.active[key]
        call = getattr(tracker, method, None)
        if call is None:
            return None
        try:
            return call(*args)
        except Exception as e:
            del self.active[key]
            log.warning(f"tracker {key} stopped logging ({method}: {describe(e)}); training goes on")
            return None


def describe(error: BaseException) -> str:
    """`Type: first line`, and the root cause's when it is another (MLflow wraps sqlite's errors)."""
    def line(e: BaseException) -> str:
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__

    root, seen = error, {id(error)}
    while (root.__cause__ or root.__context__) is not None and id(root.__cause__ or root.__context__) not in seen:
        root = root.__cause__ or root.__context__
        seen.add(id(root))
    return line(error) + (f"; caused by {line(root)}" if root is not error else "")


def summary(p: "Progress", monitor: str, seconds: Optional[float], samples: int, peak_mb: float) -> dict[str, float]:
    """The final summary as numbers: the run's steps, samples, last loss, the best evaluation of the monitored metric
    (`best_<monitor>`, `best_step`), skipped windows, and this session's time, speed and peak memory when it trained
    to its end."""
    values: dict[str, Any] = dict(steps=p.step, samples_seen=p.samples, last_loss=p.last_loss,
                                  best_step=p.best_step, skipped=p.skipped, **{f"best_{monitor}": p.best})
    if seconds is not None:
        values.update(seconds=seconds, samples_per_s=samples / seconds if seconds > 0 else None,
                      peak_mem_mb=peak_mb or None)
    return {k: float(v) for k, v in values.items() if v is not None}


def read_saved(run_dir: Path) -> dict[str, Any]:
    """The trackers' saved states of the run directory's earlier session ({} when none can be read)."""
    try:
        saved = json.loads((run_dir / SAVED_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def sweep_of(run_dir: Path) -> tuple[Optional[str], Optional[int]]:
    """(the sweep directory, the job's number) when Hydra ran this run as a job of a multirun, else (None, None):
    from the job's .hydra/hydra.yaml and the sweep's multirun.yaml above it (files, so that spawned workers know)."""
    try:
        hydra = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None, None
    if str(hydra.get("mode")) != "MULTIRUN":
        return None, None
    num = (hydra.get("job") or {}).get("num")
    job = num if isinstance(num, int) else None
    for folder in run_dir.resolve().parents:
        if (folder / "multirun.yaml").is_file():
            cwd = Path.cwd().resolve()
            return (folder.relative_to(cwd) if folder.is_relative_to(cwd) else folder).as_posix(), job
    return None, job
