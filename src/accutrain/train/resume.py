"""Resuming: the state a checkpoint holds (weights, optimizer, scheduler, scaler, progress, every RNG), finding the
checkpoint to resume from, and loading it into a run, refusing one of another model or another effective batch."""
from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from accutrain.core.progress import Progress
from accutrain.errors import UserError
from accutrain.seeding import derived_seed
from accutrain.store import checkpoint
from accutrain.store.files import read_jsonl, write_atomic
from accutrain.train.components import Components

log = logging.getLogger("accutrain")


def checkpoint_state(c: Components, p: Progress) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """The whole training state, gathered on every rank (the RNG states come from all of them): (what rank 0
    writes, each rank's shards of the model, optimizer and EMA — None unless strategy.checkpoint=sharded)."""
    rng = checkpoint.rng_state()
    rngs = [rng]
    if c.world.size > 1:
        rngs = [None] * c.world.size
        torch.distributed.all_gather_object(rngs, rng)
    tensors, shards = c.strategy.state(c.model, c.optimizer, c.ema)  # model, optimizer, ema (or their shards)
    return dict(
        format=checkpoint.FORMAT, **tensors, scheduler=c.scheduler.state_dict(),
        scaler=c.precision.scaler.state_dict() if c.precision.scaler else None, progress=asdict(p), rng=rngs,
        plan=c.plan.record(), config=OmegaConf.to_container(c.cfg, resolve=True, enum_to_str=True),
        step=p.step, epoch=p.epoch, monitor=c.monitor.metric,
    ), shards


def find_resume(cfg: DictConfig, run_dir: Path) -> Optional[Path]:
    """The checkpoint `resume` names: a file, a run directory, or auto (this run directory's newest good one)."""
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        where = run_dir / "checkpoints"
    else:
        where = Path(cfg.resume).expanduser()
        if (where / ".metadata").is_file():  # a sharded checkpoint's directory
            return where
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


def restore(c: Components, path: Path) -> Progress:
    """Load a checkpoint into the run; refuse one from another model or another effective batch."""
    state = checkpoint.load(path, mmap=True)  # every rank maps the file; FSDP takes each rank's shard from it
    if "optimizer" not in state and not state.get("sharded"):
        raise UserError(f"{path} holds the weights for evaluation only (best.pt keeps no optimizer state): resume "
                        "from last.pt or a step-*.pt of the same run")
    saved = state["plan"]
    schedule = c.plan.schedule.record() if c.plan.schedule else None
    if saved.get("schedule") != schedule:
        raise UserError(f"{path} was trained with batch schedule {saved.get('schedule') or 'none'}; this run's is "
                        f"{schedule or 'none'}: resuming needs the same schedule (it decides every window)")
    if saved["effective"] != c.plan.effective:
        raise UserError(
            f"{path} was trained with effective batch {saved['effective']} (micro_batch {saved['micro_batch']} × "
            f"accum {saved['accum']} × devices {saved['devices']}); this run's is {c.plan.effective}: resuming "
            "needs the same effective batch")
    if saved["train_size"] != c.plan.train_size:
        raise UserError(f"{path} was trained on {saved['train_size']} samples; this data has {c.plan.train_size}: "
                        "resuming needs the same training set")
    refuse_another_seed_or_optimizer(path, state.get("config") or {}, c.cfg)
    try:  # the model, optimizer and EMA (from a sharded checkpoint's shards too)
        c.strategy.load(c.model, c.optimizer, c.ema, state, path)
    except RuntimeError as e:
        raise UserError(f"{path} was written for another model: {str(e).strip().splitlines()[-1].strip()[:200]}"
                        ) from None
    except (KeyError, ValueError, TypeError) as e:
        raise UserError(f"{path}: its optimizer state does not fit this run's optimizer ({c.cfg.optim._target_}): "
                        f"{type(e).__name__}: {e}") from None
    try:
        c.scheduler.load_state_dict(state["scheduler"])
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise UserError(f"{path}: its scheduler state does not fit this run's scheduler ({c.cfg.sched._target_}): "
                        f"{type(e).__name__}: {e}") from None
    if c.precision.scaler and state.get("scaler"):
        c.precision.scaler.load_state_dict(state["scaler"])
    p = Progress.from_record(state["progress"])
    if c.ema is not None and state.get("ema") is None:
        log.info(f"{path} holds no average of the weights (trainer.ema was off): it starts at the resumed weights")
    if state.get("monitor", "val_acc") != c.monitor.metric:  # the best so far was of another metric
        log.info(f"the checkpoint's run monitored {state.get('monitor', 'val_acc')}, this one {c.monitor.metric}: "
                 "its best value and early-stopping patience start anew")
        p.best, p.best_step, p.evals_since_best = None, None, 0
    split = (saved["micro_batch"], saved["accum"], saved["devices"])
    if split != (c.plan.micro_batch, c.plan.accum, c.plan.devices):
        log.info(f"resuming with micro_batch {c.plan.micro_batch} × accum {c.plan.accum} × devices {c.plan.devices} "
                 f"(the checkpoint's run used {' × '.join(map(str, split))}): the same effective batch "
                 f"{c.plan.effective}, so the same windows")
    if saved["total_steps"] != c.plan.total_steps:
        log.info(f"the checkpoint's run planned {saved['total_steps']} optimizer steps, this one "
                 f"{c.plan.total_steps}: the schedule follows this run's plan")
    if len(state["rng"]) == c.world.size:
        checkpoint.set_rng_state(state["rng"][c.world.rank])
    else:
        log.info(f"the checkpoint holds RNG states for {len(state['rng'])} rank(s), this run has {c.world.size}: "
                 "dropout and augmentation draw new random numbers (the data order is unchanged)")
        torch.manual_seed(derived_seed(c.cfg.seed, p.step * 101 + c.world.rank))
    log.info(f"resumed from {path} at optimizer step {p.step} (epoch {p.epoch + 1}, window {p.window})")
    return p


def refuse_another_seed_or_optimizer(path: Path, saved: dict[str, Any], cfg: DictConfig) -> None:
    """The seed decides every epoch's order of samples, so resuming with another one would change the data order
    mid-epoch; another optimizer cannot take the checkpoint's optimizer state. Both are refused in one line."""
    if "seed" in saved and saved["seed"] != cfg.seed:
        raise UserError(f"{path} was trained with seed={saved['seed']}; this run has seed={cfg.seed}: the seed decides "
                        f"the order of the samples, so resuming needs the same seed (seed={saved['seed']})")
    target = (saved.get("optim") or {}).get("_target_")
    if target is not None and target != cfg.optim._target_:
        raise UserError(f"{path} was trained with the optimizer {target}; this run uses {cfg.optim._target_}: resuming "
                        "needs the same optimizer (" + (f"optim={target.rsplit('.', 1)[-1]}" if target.startswith(
                            "accutrain.models.optim.") else f"optim._target_={target}") + ")")


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop what a killed run logged after its checkpoint (and a half-written last line) before resuming there; the
    file is replaced whole (write_atomic), so a kill during the trim leaves the history as it was."""
    if path.is_file():
        kept = [line for line, record in read_jsonl(path) if record.get("step", 0) <= step]
        write_atomic(path, "".join(line + "\n" for line in kept), durable=True)

