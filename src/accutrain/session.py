"""One rank's run: join the process group, agree on the run directory, build, check, resume, train with rotating
checkpoints, and say how it ended. Rank 0 alone writes config.yaml, metrics.jsonl, checkpoints and the summary."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from accutrain import check, checkpoint, dist
from accutrain.build import Components, build
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.loop import Outcome, fit
from accutrain.metrics import MetricsLog, summary_line
from accutrain.progress import Progress
from accutrain.resume import checkpoint_state, find_resume, keep_metrics_until, restore
from accutrain.run_status import add_to_status
from accutrain.signals import StopRequest, signal_numbers
from accutrain.state_dicts import write_sharded
from accutrain.trackers import Trackers

log = logging.getLogger("accutrain")


def train_rank(world: World, cfg: DictConfig, run_dir: Path, device: torch.device) -> Outcome:
    """One rank's training on `device` (this rank's GPU is picked from it); config.yaml, metrics.jsonl and
    checkpoints/ go into run_dir."""
    device = dist.worker_device(device, world)
    dist.init_process_group(world, device, cfg.trainer.dist_timeout_s)
    run_dir = agree_on_run_dir(run_dir, world)
    trackers = Trackers.build(cfg, run_dir) if world.main else Trackers()  # a missing library: one line, early
    c = build(cfg, world, device, cache_dir=run_dir.parent)
    if cfg.trainer.check and world.main:
        result = check.run_check(c)
        for line in result.lines():
            (log.info if result.faithful else log.warning)(f"check: {line}")
    if cfg.trainer.check:
        dist.wait_for_main(world)  # the other ranks wait for rank 0's check, however long it takes
    resume_from = dist.broadcast_from_main(find_resume(cfg, run_dir) if world.main else None, world)
    progress = restore(c, resume_from) if resume_from else Progress()
    rotation = checkpoint.Rotation(run_dir / "checkpoints", cfg.trainer.keep_checkpoints)

    def save(p: Progress, best: bool = False) -> Optional[Path]:
        trackers.flush()  # a resume from this checkpoint finds in the trackers every step up to it
        return save_checkpoint(c, p, rotation, best)

    if world.main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if resume_from:
            keep_metrics_until(run_dir / "metrics.jsonl", progress.step)
        add_to_status(run_dir, plan=c.plan.record())
        trackers.start(cfg, c.plan, progress.step, resumed=cfg.resume is not None)
    metrics = MetricsLog(run_dir / "metrics.jsonl" if world.main else None, trackers)
    metrics.write(dict(plan=c.plan.record()))  # the plan as data, for reports (a resumed session adds its own)
    try:
        with StopRequest(announce=world.main, signals=signal_numbers(cfg.trainer.preempt_signals)) as stop:
            out = fit(c, metrics, progress, save, stop)
    except BaseException as e:
        trackers.finish("interrupted" if isinstance(e, KeyboardInterrupt) else "failed", progress)
        raise
    finally:
        metrics.close()
    if world.main and cfg.trainer.export == "hf" and not out.stopped_by:
        from accutrain.hf import export

        log.info(f"exported with save_pretrained to {export(c.model, c.tokenizer, run_dir / 'hf')}")
    if world.main:
        trackers.finish("interrupted" if out.stopped_by else "completed", out.progress, out.seconds, out.samples,
                        out.peak_mb)
        say_how_it_ended(c, out, run_dir)
    c.strategy.close()
    return out


def agree_on_run_dir(run_dir: Path, world: World) -> Path:
    """Rank 0's run directory. Under torchrun each rank's Hydra made its own, possibly timed a second later: a stray
    one is removed."""
    main_dir = Path(dist.broadcast_from_main(str(run_dir), world))
    if main_dir != run_dir:
        dist.remove_stray_run_dir(run_dir)
    return main_dir


def save_checkpoint(c: Components, p: Progress, rotation: checkpoint.Rotation, best: bool = False) -> Optional[Path]:
    """Every rank's state into rank 0's checkpoint (refused when the weights are not finite): the next step-*.pt of
    the rotation, or best.pt; with strategy.checkpoint=sharded a directory (step-*/, best/) each rank writes its
    shards into. Every rank waits for it to be on disk."""
    state, shards = checkpoint_state(c, p)
    if not finite_weights(c, state, shards):
        raise UserError(f"the weights are not finite at optimizer step {p.step}: no checkpoint written "
                        f"(the last good one is {rotation.steps()[0] if rotation.steps() else 'none'})")
    path = None
    if shards is not None:
        path = write_sharded(rotation.directory / ("best" if best else f"step-{p.step:08d}"), shards, state, c.world)
        if c.world.main and not best:
            rotation.commit(path)
    elif c.world.main:
        path = rotation.save_best(state) if best else rotation.save(state, p.step)
    dist.wait_for_main(c.world)  # no rank leaves before the checkpoint is on disk
    return path


def finite_weights(c: Components, state: dict, shards: Optional[dict]) -> bool:
    """Whether the weights about to be saved are finite: rank 0's whole ones (True elsewhere), or every rank's shards
    (then every rank gets the answer)."""
    if shards is None:
        return not c.world.main or all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    local = all(torch.isfinite(t.to_local() if dist.is_sharded(t) else t).all()
                for t in shards["model"].values() if t.is_floating_point())
    return bool(dist.all_reduce_min(torch.tensor(float(local)), c.world).item())


def say_how_it_ended(c: Components, out: Outcome, run_dir: Path) -> None:
    p, monitor = out.progress, c.monitor
    best = monitor.describe(p.best, p.best_step) if p.best is not None else None
    log.info(summary_line(p.step, p.samples, out.samples, out.seconds, p.last_loss, best, out.peak_mb)
             + (f", {p.skipped} non-finite windows skipped" if p.skipped else ""))
    if p.best is not None:
        add_to_status(run_dir, best=dict(metric=monitor.metric, mode=monitor.mode, value=p.best, step=p.best_step,
                                         checkpoint=str(run_dir / "checkpoints" / (
                                             "best" if c.strategy.sharded_checkpoints else "best.pt"))))
    if out.early_stop:
        log.info(f"early stopping after optimizer step {p.step} of {c.plan.total_steps}: {monitor.metric} has not "
                 f"improved by more than {monitor.min_delta:g} for {monitor.patience} evaluations ({best}); "
                 f"checkpoint {out.checkpoint}")
    if out.stopped_by:
        log.warning(f"stopped by {out.stopped_by} after optimizer step {p.step} of {c.plan.total_steps}; "
                    f"checkpoint {out.checkpoint}. Resume with the same command plus: resume=auto "
                    f"hydra.run.dir={run_dir}")
    else:
        log.info(f"outputs in {run_dir}")
