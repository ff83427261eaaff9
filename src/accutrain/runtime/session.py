"""One rank's run: join the process group, agree on the run directory, build, check, resume, train with rotating
checkpoints, and say how it ended. Rank 0 alone writes config.yaml, metrics.jsonl, checkpoints and the summary."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from accutrain import dist
from accutrain.config.train import TrainConfig
from accutrain.config.typed import to_yaml
from accutrain.dist import World
from accutrain.errors import NonFinite
from accutrain.report.noise import late
from accutrain.report.runs import RunRow, read_run
from accutrain.runtime.checkpoints import Checkpoints, warn_if_disk_is_short
from accutrain.runtime.cpu import prepare as prepare_cpu
from accutrain.runtime.export import export, export_if_missing
from accutrain.runtime.malloc import release_heap
from accutrain.signals import StopRequest, signal_numbers
from accutrain.store import owned
from accutrain.store.classes import record
from accutrain.store.files import write_atomic
from accutrain.store.status import add_to_status
from accutrain.trackers import Trackers
from accutrain.train import check
from accutrain.train.build import build
from accutrain.train.components import Components
from accutrain.train.loop import Outcome, fit
from accutrain.train.memory import fold_peak
from accutrain.train.metrics import MetricsLog, summary_lines
from accutrain.train.prepare import prepare_loss
from accutrain.train.resume import resume_point, start_branch
from accutrain.train.testing import headline, run_test

log = logging.getLogger("accutrain")


def train_rank(world: World, cfg: TrainConfig, run_dir: Path, device: torch.device) -> Outcome:
    """One rank's training on `device` (this rank's GPU is picked from it); config.yaml, metrics.jsonl and
    checkpoints/ go into run_dir."""
    device = dist.worker_device(device, world)
    for line in prepare_cpu(cfg.trainer, device, world.size):  # every rank's process, before the data and model
        if world.main:
            log.info(line)
    dist.init_process_group(world, device, cfg.trainer.dist_timeout_s)
    run_dir = agree_on_run_dir(run_dir, world)
    if world.main:
        owned.adopt(run_dir)  # before anything is written there: accutrain's own, or refused
        log.info(f"run directory {run_dir} (train.log, metrics.jsonl, checkpoints/)")
    trackers = Trackers.build(cfg, run_dir) if world.main else Trackers()  # a missing library: one line, early
    parts = build(cfg, world, device, cache_dir=run_dir.parent)
    prepare_loss(parts, run_dir)  # loss.reference=precompute: its pass, or its file read back (before any resume)
    if cfg.trainer.check and world.main:
        result = check.run_check(parts)
        for line in result.lines():
            (log.info if result.faithful else log.warning)(f"check: {line}")
    if cfg.trainer.check:
        dist.wait_for_main(world)  # the other ranks wait for rank 0's check, however long it takes
    resume_from, progress = resume_point(parts, run_dir)
    save = Checkpoints(parts, run_dir / "checkpoints", trackers)
    if progress.step >= parts.plan.total_steps:  # before anything is written: the run's record stays as it was
        log.info(f"the checkpoint is at optimizer step {progress.step}, the end of this run's plan "
                 f"({parts.plan.total_steps} steps): nothing left to train")
        if world.main:
            export_if_missing(parts, run_dir, progress.step)  # an export a full disk stopped: retried
        return Outcome(progress, 0.0, 0, 0.0, checkpoint=resume_from)
    if world.main:  # the run takes its directory over (store.status.taken_over), then writes into it
        add_to_status(run_dir, plan=parts.plan.record(), classes=record(parts.class_names))
        start_branch(run_dir, progress.step, resumed=resume_from is not None)
        write_atomic(run_dir / "config.yaml", to_yaml(cfg, parts.supplied))
        warn_if_disk_is_short(parts, save.rotation)
        trackers.start(cfg, parts.supplied, parts.plan, progress.step, resumed=cfg.resume is not None,
                       monitor=parts.monitor.metric)
    metrics = MetricsLog(run_dir / "metrics.jsonl" if world.main else None, trackers)
    metrics.write(dict(plan=parts.plan.record()), "plan")  # the plan as data, for reports (a resumed session: its own)
    try:
        with StopRequest(announce=world.main, signals=signal_numbers(cfg.trainer.preempt_signals)) as stop:
            out = fit(parts, metrics, progress, save, stop)
        release_heap()  # what the loop kept for its next micro-batch: the process's peak is not its plus what follows
        if not out.stopped_by:  # the run's end: export the last weights, then test with them and the best ones
            if world.main and cfg.trainer.export:
                export(parts, run_dir, out.progress.step)
            out.test = run_test(parts, metrics, out.progress, save.best_path())
    except NonFinite as e:
        trackers.finish("failed", progress)
        raise NonFinite(f"{e}; {save.last_good()}") from None
    except BaseException as e:
        trackers.finish("interrupted" if isinstance(e, KeyboardInterrupt) else "failed", progress)
        raise
    finally:
        metrics.close()
    out.peak_mb = max(out.peak_mb, fold_peak(parts.device))  # the process's: the final evaluation, test, export too
    if world.size > 1:  # the summary, status.json and the trackers name the most any rank held
        out.peak_mb = float(dist.all_reduce_max(torch.tensor(out.peak_mb, device=parts.device), world).item())
    if world.main:
        row = read_run(run_dir, run_dir.name)  # the run as its summary table (accutrain-report) gives it
        trackers.finish("interrupted" if out.stopped_by else "completed", out.progress, out.seconds, out.samples,
                        out.peak_mb, {**noise_summary(parts, row), **out.figures})
        say_how_it_ended(parts, out, run_dir, row)
    parts.strategy.close()
    if world.main:
        save.raise_if_the_last_failed()
    return out


def agree_on_run_dir(run_dir: Path, world: World) -> Path:
    """Rank 0's run directory. Under torchrun each rank's Hydra made its own, possibly timed a second later: a stray
    one is removed."""
    main_dir = Path(dist.broadcast_from_main(str(run_dir), world))
    if main_dir != run_dir:
        dist.remove_stray_run_dir(run_dir)
    return main_dir


def say_how_it_ended(parts: Components, out: Outcome, run_dir: Path, row: RunRow) -> None:
    p, monitor = out.progress, parts.monitor
    best = monitor.describe(p.best, p.best_step) if p.best is not None else None
    done, *results = summary_lines(p.step, p.samples, out.samples, out.seconds, p.last_loss, best, out.peak_mb,
                                   out.tokens, parts.world.size, row.samples_per_s)
    results += [f"{p.skipped} non-finite window{'s' if p.skipped > 1 else ''} skipped"] if p.skipped else []
    results += [headline(out.test, monitor.metric)] if out.test is not None else []
    results += [words] if out.figures and (words := parts.loss.summary(out.figures)) else []
    for line in [done, ", ".join(results)] if results else [done]:
        log.info(line)
    noise = noise_summary(parts, row)
    if noise:  # the figure accutrain-report's verdict reads
        log.info(f"noise scale B_simple ≈ {noise['b_simple']:.3g} late in training, at effective batch "
                 f"{noise['effective']:.0f}")
    if out.test is not None:
        add_to_status(run_dir, test={k: v for k, v in out.test.items() if k != "kind"})
    if out.peak_mb:
        add_to_status(run_dir, peak_mem_mb=round(out.peak_mb, 1), peak_mem_of=(
            f"the most of {parts.world.size} ranks" if parts.world.size > 1 else "the one rank"))
    if p.best is not None:
        add_to_status(run_dir, best=dict(metric=monitor.metric, mode=monitor.mode, value=p.best, step=p.best_step,
                                         checkpoint=str(run_dir / "checkpoints" / (
                                             "best" if parts.strategy.sharded_checkpoints else "best.pt"))))
    if out.early_stop:
        log.info(f"early stopping after optimizer step {p.step} of {parts.plan.total_steps}: {monitor.metric} has not "
                 f"improved by more than {monitor.min_delta:g} for {monitor.patience} evaluations ({best}); "
                 f"checkpoint {out.checkpoint}")
    if out.stopped_by:
        log.info(f"stopped by {out.stopped_by} after optimizer step {p.step} of {parts.plan.total_steps}; "
                 f"checkpoint {out.checkpoint}")
    else:
        log.info(f"outputs in {run_dir}")


def noise_summary(parts: Components, row: RunRow) -> dict[str, float]:
    """trainer.noise_scale's figure as accutrain-report reads it from metrics.jsonl — the median B_simple over the
    last fifth of the steps, beside the median effective batch there — ({} when it is off or has no estimate)."""
    found = late(row) if parts.noise is not None else None
    return dict(b_simple=found[0], effective=float(found[1])) if found else {}
