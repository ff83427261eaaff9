"""Resuming: the state a checkpoint holds (weights, optimizer, scheduler, scaler, progress, every RNG), finding the
checkpoint to resume from, and loading it into a run, refusing one of another model or another effective batch."""
from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

from accutrain import dist
from accutrain.config.train import TrainConfig
from accutrain.config.typed import with_supplied
from accutrain.errors import CorruptCheckpoint, UserError
from accutrain.models import adapters
from accutrain.seeding import derived_seed
from accutrain.store import checkpoint, rng
from accutrain.store.classes import record, refuse_other_classes
from accutrain.store.files import read_jsonl, write_atomic
from accutrain.store.progress import Progress
from accutrain.store.rotation import Rotation
from accutrain.train.components import Components

log = logging.getLogger("accutrain")


def checkpoint_state(parts: Components, p: Progress) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """The whole training state, gathered on every rank (the RNG states come from all of them): (what rank 0
    writes, each rank's shards of the model, optimizer and EMA — None unless strategy.checkpoint=sharded)."""
    mine = rng.rng_state()
    rngs = [mine]
    if parts.world.size > 1:
        rngs = [None] * parts.world.size
        torch.distributed.all_gather_object(rngs, mine)
    tensors, shards = parts.strategy.state(parts.model, parts.optimizer, parts.ema)  # model, optimizer, ema (or their shards)
    return dict(
        format=checkpoint.FORMAT, **tensors, scheduler=parts.scheduler.state_dict(),
        scaler=parts.precision.scaler.state_dict() if parts.precision.scaler else None, progress=asdict(p), rng=rngs,
        plan=parts.plan.record(), config=with_supplied(parts.run, parts.supplied),
        step=p.step, epoch=p.epoch, monitor=parts.monitor.metric, base=parts.base, classes=record(parts.class_names),
        noise_scale=parts.noise.state_dict() if parts.noise is not None else None,
        stream=parts.sampler.state_dict(p.epoch, p.window),  # a stream's position (None for a map-style set)
    ), shards


def resume_point(parts: Components, run_dir: Path) -> tuple[Optional[Path], Progress]:
    """The checkpoint this run resumes from (rank 0's find_resume, for every rank) loaded into the run, and where the
    run is; with resume=auto one found corrupt only as it loads (a sharded checkpoint's garbled shard: every rank
    raises it) is passed over for the previous one. Collective."""
    passed: set[Path] = set()  # (rank 0's: those find_resume found unreadable, and those that failed to load)
    last_failed: Optional[Path] = None
    while True:
        found = find_resume(parts.run, run_dir, passed) if parts.world.main else None
        path = dist.broadcast_from_main(found, parts.world)
        if path is None:
            if last_failed is not None:  # the weights may hold part of what failed to load: not a start from scratch
                raise UserError(f"resume=auto: no checkpoint in {run_dir / 'checkpoints'} loads (the last tried: "
                                f"{last_failed.name}): resume=<a checkpoint> goes on from another, "
                                "trainer.overwrite=true starts afresh")
            return None, Progress()
        try:
            return path, restore(parts, path)
        except CorruptCheckpoint as e:
            if parts.run.resume != "auto":
                raise
            log.warning(f"resume=auto: {e}; falling back to the previous checkpoint")
            passed.add(path)
            last_failed = path


def find_resume(cfg: TrainConfig, run_dir: Path, passed: Optional[set[Path]] = None) -> Optional[Path]:
    """The checkpoint `resume` names: a file, a run directory, or auto (this run directory's newest good one, but
    those `passed`; those found unreadable are added to it)."""
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
    found = Rotation(where, cfg.trainer.keep_checkpoints).latest_good(passed)
    if found is None:
        if cfg.resume != "auto":
            raise UserError(f"resume={cfg.resume}: no readable checkpoint in {where}")
        log.info(f"resume=auto: no checkpoint to resume from in {where}: starting from scratch")
        return None
    return found[0]


def restore(parts: Components, path: Path) -> Progress:
    """Load a checkpoint into the run; refuse one from another model or another effective batch."""
    state = checkpoint.load(path, mmap=True)  # every rank maps the file; FSDP takes each rank's shard from it
    saved = state["plan"]
    schedule = parts.plan.schedule.record() if parts.plan.schedule else None
    if saved.get("schedule") != schedule:
        raise UserError(f"{path} was trained with batch schedule {saved.get('schedule') or 'none'}; this run's is "
                        f"{schedule or 'none'}: resuming needs the same schedule (it decides every window)")
    if saved["effective"] != parts.plan.effective:
        raise UserError(
            f"{path} was trained with effective batch {saved['effective']} (micro_batch {saved['micro_batch']} × "
            f"accum {saved['accum']} × devices {saved['devices']}); this run's is {parts.plan.effective}: resuming "
            "needs the same effective batch")
    if saved["train_size"] != parts.plan.train_size:
        raise UserError(f"{path} was trained on {saved['train_size']} samples; this data has {parts.plan.train_size}: "
                        "resuming needs the same training set")
    now = with_supplied(parts.run, parts.supplied)  # as config.yaml and the checkpoint record it
    refuse_another_seed_or_optimizer(path, state.get("config") or {}, now)
    adapters.refuse_another_base(path, state.get("base"), parts.base)
    refuse_other_classes(path, state.get("classes"), record(parts.class_names))
    say_another_precision(path, state.get("config") or {}, now)
    fresh = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in parts.optimizer.param_groups]
    fresh_base = list(getattr(parts.scheduler, "base_lrs", []))  # this run's learning rates, before the schedule's factor
    try:  # the model, optimizer and EMA (from a sharded checkpoint's shards too)
        parts.strategy.load(parts.model, parts.optimizer, parts.ema, state, path)
    except RuntimeError as e:
        raise UserError(f"{path} was written for another model: {str(e).strip().splitlines()[-1].strip()[:200]}"
                        ) from None
    except (KeyError, ValueError, TypeError) as e:
        raise UserError(f"{path}: its optimizer state does not fit this run's optimizer ({parts.run.optim.target}): "
                        f"{type(e).__name__}: {e}") from None
    try:
        parts.scheduler.load_state_dict(state["scheduler"])
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise UserError(f"{path}: its scheduler state does not fit this run's scheduler ({parts.run.sched.target}): "
                        f"{type(e).__name__}: {e}") from None
    follow_this_runs_optimizer(parts, path, fresh, fresh_base)
    if parts.precision.scaler and state.get("scaler"):
        parts.precision.scaler.load_state_dict(state["scaler"])
    p = Progress.from_record(state["progress"])
    parts.sampler.load_state_dict(state.get("stream"))  # a stream continues where it stood
    if parts.noise is not None and state.get("noise_scale"):  # the noise scale's moving averages go on where they were
        parts.noise.load_state_dict(state["noise_scale"])
    if parts.ema is not None and state.get("ema") is None:
        log.info(f"{path} holds no average of the weights (trainer.ema was off): it starts at the resumed weights")
    if state.get("monitor", "val_acc") != parts.monitor.metric:  # the best so far was of another metric
        log.info(f"the checkpoint's run monitored {state.get('monitor', 'val_acc')}, this one {parts.monitor.metric}: "
                 "its best value and early-stopping patience start anew")
        p.best, p.best_step, p.evals_since_best = None, None, 0
    split = (saved["micro_batch"], saved["accum"], saved["devices"])
    if split != (parts.plan.micro_batch, parts.plan.accum, parts.plan.devices):
        log.info(f"resuming with micro_batch {parts.plan.micro_batch} × accum {parts.plan.accum} × devices {parts.plan.devices} "
                 f"(the checkpoint's run used {' × '.join(map(str, split))}): the same effective batch "
                 f"{parts.plan.effective}, so the same windows")
    if saved["total_steps"] != parts.plan.total_steps:
        log.info(f"the checkpoint's run planned {saved['total_steps']} optimizer steps, this one "
                 f"{parts.plan.total_steps}: the schedule follows this run's plan")
    rngs = state.get("rng")
    if isinstance(rngs, list) and len(rngs) == parts.world.size:
        rng.set_rng_state(rngs[parts.world.rank])
    else:
        if isinstance(rngs, list):
            log.info(f"the checkpoint holds RNG states for {len(rngs)} rank(s), this run has {parts.world.size}: "
                     "dropout and augmentation draw new random numbers (the data order is unchanged)")
        else:
            log.warning(f"{path} holds no RNG states: dropout and augmentation draw new random numbers (the data "
                        "order is unchanged)")
        torch.manual_seed(derived_seed(parts.run.seed, p.step * 101 + parts.world.rank))
    log.info(f"resumed from {path} at optimizer step {p.step} (epoch {p.epoch + 1}, window {p.window})")
    return p


def refuse_another_seed_or_optimizer(path: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """The seed decides every epoch's order of samples, so resuming with another one would change the data order
    mid-epoch; data.seed decides the data itself (generated samples, the held-out split), so another one continues on
    other data; another optimizer cannot take the checkpoint's optimizer state. Each is refused in one line."""
    if "seed" in saved and saved["seed"] != now["seed"]:
        raise UserError(f"{path} was trained with seed={saved['seed']}; this run has seed={now['seed']}: the seed "
                        f"decides the order of the samples, so resuming needs the same seed (seed={saved['seed']})")
    data_seed, seed_now = (saved.get("data") or {}).get("seed"), now["data"].get("seed")
    if data_seed is not None and seed_now is not None and data_seed != seed_now:
        raise UserError(f"{path} was trained with data.seed={data_seed}; this run has data.seed={seed_now}: it "
                        "decides which samples the data holds (or which are held out), so resuming needs the same "
                        f"data.seed (data.seed={data_seed})")
    target, target_now = (saved.get("optim") or {}).get("_target_"), now["optim"]["_target_"]
    if target is not None and target != target_now:
        raise UserError(f"{path} was trained with the optimizer {target}; this run uses {target_now}: resuming "
                        "needs the same optimizer (" + (f"optim={target.rsplit('.', 1)[-1]}" if target.startswith(
                            "accutrain.models.optim.") else f"optim._target_={target}") + ")")


def follow_this_runs_optimizer(parts: Components, path: Path, fresh: list[dict[str, Any]], fresh_base: list[float]
                               ) -> None:
    """Loading the optimizer and scheduler states brings back the checkpoint's settings (learning rate, weight
    decay, momentum, …) with the moments; this run's config (what config.yaml records) wins, and a change is said in
    one line. The learning rate keeps its place in the schedule: lr = this run's base lr × the schedule's factor."""
    changed = []
    for group, own in zip(parts.optimizer.param_groups, fresh):
        for key, value in own.items():
            if key in group and differs(group[key], value):
                changed.append(f"{key} {group[key]} → {value}")
                group[key] = value
    base = getattr(parts.scheduler, "base_lrs", None)
    if base is not None and len(base) == len(fresh_base) and list(base) != fresh_base:
        changed.append(f"lr {base[0]:g} → {fresh_base[0]:g}")
        for group, old, new in zip(parts.optimizer.param_groups, base, fresh_base):
            group["lr"] = group["lr"] * new / old if old else new
            group["initial_lr"] = new
        parts.scheduler.base_lrs = list(fresh_base)
        parts.scheduler._last_lr = [group["lr"] for group in parts.optimizer.param_groups]  # what get_last_lr() reports
    if changed:
        log.warning(f"resuming with optimizer settings other than those {path} was trained with "
                    f"({', '.join(dict.fromkeys(changed))}): this run's config applies from here")


def differs(a: Any, b: Any) -> bool:
    """Whether two optimizer settings differ (a tuple and the list a state dict made of it do not)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(differs(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not torch.equal(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))
    return a != b


def say_another_precision(path: Path, saved: dict[str, Any], run: dict[str, Any]) -> None:
    """Resuming in another trainer.precision is allowed (the weights and optimizer state load in any), and said."""
    before = (saved.get("trainer") or {}).get("precision")
    now = str(run["trainer"]["precision"])
    if before is not None and str(before) != now:
        log.warning(f"resuming with trainer.precision={now}; {path} was trained with trainer.precision={before}: "
                    "the steps from here are computed in another precision (the run is no longer one precision's)")


def keep_metrics_until(path: Path, step: int, aside: Optional[Path] = None) -> None:
    """Drop what a killed run logged after its checkpoint (and a half-written last line) before resuming there; the
    file is replaced whole (write_atomic), so a kill during the trim leaves the history as it was. aside: the folder
    an abandoned branch's checkpoints went to; the records dropped go there too (aside/metrics.jsonl)."""
    if not path.is_file():
        return
    kept, dropped = [], []
    for line, entry in read_jsonl(path):
        (kept if entry.get("step", 0) <= step else dropped).append(line + "\n")
    if aside is not None and dropped:
        write_atomic(aside / path.name, "".join(dropped), durable=True)
    write_atomic(path, "".join(kept), durable=True)


def start_branch(run_dir: Path, step: int, resumed: bool) -> None:
    """This run goes on from optimizer step `step` (0: from scratch) in run_dir: the checkpoints of later steps are
    set aside (Rotation.set_aside) with the records metrics.jsonl holds of those steps; without them, what
    a killed run logged after its checkpoint is dropped, or (from scratch) what a run before it logged."""
    aside = Rotation(run_dir / "checkpoints", 0).set_aside(step)
    if aside is not None and step == 0 and not resumed:
        log.warning(f"this run starts at optimizer step 0: what an earlier run left in {run_dir / 'checkpoints'} "
                    f"({', '.join(sorted(p.name for p in aside.iterdir()))}) is no state to resume from (best.pt holds "
                    f"the weights alone): moved to {aside} (kept)")
    elif aside is not None:
        log.warning(f"this run goes on from optimizer step {step}, and {run_dir / 'checkpoints'} held checkpoints of "
                    f"later steps (another branch, or unreadable): moved to {aside} (kept; they no longer count "
                    "for rotation or resume=auto)")
    metrics = run_dir / "metrics.jsonl"
    if resumed:
        keep_metrics_until(metrics, step, aside)
    elif aside is not None and metrics.is_file():
        os.replace(metrics, aside / metrics.name)
    else:
        metrics.unlink(missing_ok=True)

