"""logger=wandb: a Weights & Biases run, offline by default (files in the run directory's wandb/, no account;
`wandb sync` uploads them), online with logger.wandb.mode=online or WANDB_MODE=online. A sweep's jobs share the
sweep as their group. A resumed run continues the same W&B run id."""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from accutrain.errors import UserError
from accutrain.trackers.base import RunEnd, RunInfo, Tracker, needs, scalars

log = logging.getLogger("accutrain")

MODES = ("offline", "online", "disabled")


class WandB(Tracker):
    def __init__(self, project: Optional[str] = None, entity: Optional[str] = None, mode: Optional[str] = None,
                 group: Optional[str] = None, name: Optional[str] = None, tags: Optional[list[str]] = None) -> None:
        try:
            import wandb
        except ImportError:
            raise needs("wandb", "wandb") from None
        if mode not in (None, *MODES):
            raise UserError(f"logger.wandb.mode={mode} is not valid: expected offline, online, disabled, or null "
                            "(WANDB_MODE, else offline)")
        self.wandb, self.project, self.entity, self.mode = wandb, project, entity, mode
        self.group, self.name, self.tags = group, name, list(tags or [])
        self.run: Any = None
        self.first, self.step = 0, 0

    def start(self, run: RunInfo) -> dict[str, Any]:
        mode = self.mode or os.environ.get("WANDB_MODE") or "offline"
        mode = "offline" if mode == "dryrun" else mode
        project = self.project or os.environ.get("WANDB_PROJECT") or "accutrain"
        run_id = run.saved.get("id") if run.saved.get("project") == project else None
        self.run = self.wandb.init(
            project=project, entity=self.entity, dir=str(run.run_dir), id=run_id,
            resume="allow", group=self.group or run.group, job_type="train", name=self.name or run.name,
            tags=self.tags or None, mode=mode, settings=self.wandb.Settings(silent=True, console="off"))
        self.run.config.update(run.config, allow_val_change=True)
        # Online, a resumed run starts at the server's next step; offline at 0: a new offline segment of the same
        # run gets the steps up to the checkpoint again (the killed session may not have written its last ones),
        # and `wandb sync` keeps each step once.
        self.first, self.step = self.run.starting_step, run.step
        if run.resumed:
            for record in run.history():
                self._log(record)
        where = (f"offline run {self.run.id} in {run.run_dir / 'wandb'} (upload: wandb sync "
                 f"{run.run_dir / 'wandb'}/offline-run-*)" if mode == "offline" else f"{mode} run {self.run.id}")
        log.info(f"wandb: {where}" + (f" {self.run.url}" if mode == "online" and self.run.url else ""))
        return {"id": self.run.id, "project": project}

    def log_step(self, record: dict[str, Any]) -> None:
        self._log(record)

    def log_eval(self, record: dict[str, Any]) -> None:
        self._log(record)

    def _log(self, record: dict[str, Any]) -> None:
        self.step = record["step"]
        if self.step >= self.first:  # W&B refuses a step below its current one
            self.run.log(scalars(record), step=self.step)

    def finish(self, end: RunEnd) -> None:
        if end.loss_plot is not None and self.step >= self.first:
            self.run.log({"loss_plot": self.wandb.Image(str(end.loss_plot))}, step=self.step)
        self.run.summary.update({f"summary/{k}": v for k, v in end.summary.items()})
        if end.status == "interrupted":
            self.run.mark_preempting()  # stopped by a signal: to be resumed
        self.run.finish(exit_code=1 if end.status == "failed" else 0)
