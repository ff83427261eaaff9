"""Resuming: what a checkpoint holds besides weights (where the run is, every RNG), finding the checkpoint to
resume from, and loading it into a run, refusing one of another model or another effective batch."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from accutrain import checkpoint
from accutrain.errors import UserError
from accutrain.plan import BatchPlan
from accutrain.windows import Window

if TYPE_CHECKING:
    from accutrain.train import Run

log = logging.getLogger("accutrain")


@dataclass
class Progress:
    """Where the run is: what a checkpoint records besides the model, optimizer and RNG states."""

    step: int = 0  # optimizer steps taken (windows consumed, skipped ones included)
    epoch: int = 0  # the epoch of the next window
    window: int = 0  # the next window's index in that epoch
    samples: int = 0
    skipped: int = 0  # windows whose step was skipped for a non-finite loss or gradient
    split: int = 1  # each loaded micro-batch is cut in this many after out-of-memory errors
    last_loss: Optional[float] = None
    best_acc: Optional[float] = None
    best_step: Optional[int] = None

    @property
    def last_epoch(self) -> int:
        """The epoch (from 0) of the optimizer step just taken: the next window may already be the next epoch's."""
        return self.epoch if self.window else self.epoch - 1

    def advance(self, window: Window, plan: BatchPlan, loss: float, skipped: Optional[str]) -> None:
        """Count the window's optimizer step (taken or skipped) and move to the next window."""
        self.step, self.samples = self.step + 1, self.samples + window.size
        self.skipped += skipped == "nonfinite"
        if window.index == plan.steps_per_epoch - 1:
            self.epoch, self.window = self.epoch + 1, 0
        else:
            self.window = window.index + 1
        if math.isfinite(loss):
            self.last_loss = loss



def checkpoint_state(r: Run, p: Progress, cfg: DictConfig) -> dict[str, Any]:
    """The whole training state, gathered on every rank (the RNG states come from all of them)."""
    rng = checkpoint.rng_state()
    rngs = [rng]
    if r.world.size > 1:
        rngs = [None] * r.world.size
        torch.distributed.all_gather_object(rngs, rng)
    return dict(
        format=checkpoint.FORMAT,
        model=r.model.state_dict(), optimizer=r.optimizer.state_dict(), scheduler=r.scheduler.state_dict(),
        scaler=r.precision.scaler.state_dict() if r.precision.scaler else None, progress=asdict(p), rng=rngs,
        plan=dict(micro_batch=r.plan.micro_batch, accum=r.plan.accum, devices=r.plan.devices,
                  effective=r.plan.effective, train_size=r.plan.train_size, total_steps=r.plan.total_steps),
        config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        step=p.step, epoch=p.epoch,
    )


def find_resume(cfg: DictConfig, run_dir: Path) -> Optional[Path]:
    """The checkpoint `resume` names: a file, a run directory, or auto (this run directory's newest good one)."""
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        where = run_dir / "checkpoints"
    else:
        where = Path(cfg.resume).expanduser()
        if where.is_dir():
            where = where / "checkpoints" if (where / "checkpoints").is_dir() else where
        elif not where.exists():
            raise UserError(f"resume={cfg.resume}: no such checkpoint file or run directory")
        else:
            return where
    found = checkpoint.Rotation(where, cfg.trainer.keep_checkpoints).latest_good()
    if found is None:
        if cfg.resume != "auto":
            raise UserError(f"resume={cfg.resume}: no readable checkpoint in {where}")
        log.info(f"resume=auto: no checkpoint in {where} yet: starting from scratch")
        return None
    return found[0]


def restore(r: Run, path: Path) -> Progress:
    """Load a checkpoint into the run; refuse one from another model or another effective batch."""
    state = checkpoint.load(path)
    saved = state["plan"]
    if saved["effective"] != r.plan.effective:
        raise UserError(
            f"{path} was trained with effective batch {saved['effective']} (micro_batch {saved['micro_batch']} × "
            f"accum {saved['accum']} × devices {saved['devices']}); this run's is {r.plan.effective}: resuming "
            "needs the same effective batch")
    if saved["train_size"] != r.plan.train_size:
        raise UserError(f"{path} was trained on {saved['train_size']} samples; this data has {r.plan.train_size}: "
                        "resuming needs the same training set")
    try:
        r.model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise UserError(f"{path} was written for another model: {str(e).strip().splitlines()[-1].strip()[:200]}"
                        ) from None
    r.optimizer.load_state_dict(state["optimizer"])
    r.scheduler.load_state_dict(state["scheduler"])
    if r.precision.scaler and state.get("scaler"):
        r.precision.scaler.load_state_dict(state["scaler"])
    p = Progress(**state["progress"])
    split = (saved["micro_batch"], saved["accum"], saved["devices"])
    if split != (r.plan.micro_batch, r.plan.accum, r.plan.devices):
        log.info(f"resuming with micro_batch {r.plan.micro_batch} × accum {r.plan.accum} × devices {r.plan.devices} "
                 f"(the checkpoint's run used {' × '.join(map(str, split))}): the same effective batch "
                 f"{r.plan.effective}, so the same windows")
    if saved["total_steps"] != r.plan.total_steps:
        log.info(f"the checkpoint's run planned {saved['total_steps']} optimizer steps, this one "
                 f"{r.plan.total_steps}: the schedule follows this run's plan")
    if len(state["rng"]) == r.world.size:
        checkpoint.set_rng_state(state["rng"][r.world.rank])
    else:
        log.info(f"the checkpoint holds RNG states for {len(state['rng'])} rank(s), this run has {r.world.size}: "
                 "dropout and augmentation draw new random numbers (the data order is unchanged)")
        torch.manual_seed(r.cfg.seed * 1_000_003 + p.step * 101 + r.world.rank)
    log.info(f"resumed from {path} at optimizer step {p.step} (epoch {p.epoch + 1}, window {p.window})")
    return p


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop what a killed run logged after its checkpoint (and a half-written last line) before resuming there."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))
