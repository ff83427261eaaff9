"""One rank's run: join the process group, agree on the run directory, build, check, resume, train with rotating
checkpoints, and say how it ended. Rank 0 alone writes config.yaml, metrics.jsonl, checkpoints and the summary."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Optional

import torch

from accutrain import dist
from accutrain.config.train import TrainConfig
from accutrain.config.typed import to_yaml
from accutrain.store.progress import Progress
from accutrain.dist import World
from accutrain.errors import NonFinite, UserError
from accutrain.parallel.state_dicts import write_sharded
from accutrain.report.noise import late
from accutrain.report.runs import RunRow, read_run
from accutrain.runtime.cpu import prepare as prepare_cpu
from accutrain.runtime.export import export
from accutrain.signals import StopRequest, signal_numbers
from accutrain.store import owned
from accutrain.store.classes import record
from accutrain.store.rotation import Rotation
from accutrain.store.files import write_atomic
from accutrain.store.status import add_to_status
from accutrain.trackers import Trackers
from accutrain.train import check
from accutrain.train.build import build
from accutrain.train.components import Components
from accutrain.train.loop import Outcome, fit
from accutrain.train.prepare import prepare_loss
from accutrain.train.metrics import MetricsLog, summary_lines
from accutrain.train.resume import checkpoint_state, resume_point, start_branch
from accutrain.train.testing import headline, run_test

log = logging.getLogger("accutrain")
RESUME_ONLY = ("optimizer", "scheduler", "scaler", "rng")  # what best.pt leaves out


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


class Checkpoints:
    """What the loop calls to checkpoint: every rank's state into rank 0's rotating checkpoints/, every rank waiting
    for it to be on disk. A write that fails (disk full, I/O error) is one error line: the previous checkpoint stays
    whole, no temporary file is left, training goes on and the next checkpoint tries again; if the run's last one
    (at the end, or on a signal) fails, raise_if_the_last_failed ends the run with one line. best.pt holds what
    evaluation needs, without the optimizer's state (for_evaluation)."""

    def __init__(self, parts: Components, directory: Path, trackers: Trackers) -> None:
        self.parts, self.trackers = parts, trackers
        self.rotation = Rotation(directory, parts.trainer.keep_checkpoints)
        self.failure: Optional[str] = None  # why the latest checkpoint could not be written
        self.failed: list[int] = []  # the optimizer steps whose checkpoint could not be written, this session

    def last_good(self) -> str:
        steps = self.rotation.steps()
        if steps:
            return f"the last checkpoint, {steps[0]}, holds finite weights (resume=auto continues from it)"
        return "no checkpoint was written before it (trainer.checkpoint_every=N writes one every N optimizer steps)"

    def __call__(self, p: Progress, best: bool = False) -> Optional[Path]:
        """The next step-*.pt of the rotation, or (best) best.pt, the state at the best evaluation so far; with
        strategy.checkpoint=sharded a directory (step-*/, best/) each rank writes its shards into. Refused when the
        weights are not finite."""
        parts = self.parts
        self.trackers.flush()  # a resume from this checkpoint finds in the trackers every step up to it
        state, shards = checkpoint_state(parts, p)
        if not finite_weights(parts, state, shards):
            newest = self.rotation.steps()
            raise UserError(f"the weights are not finite at optimizer step {p.step}: no checkpoint written "
                            f"(the last good one is {newest[0] if newest else 'none'})")
        path = None
        try:
            if shards is not None:  # every rank writes; a failure is raised alike on every rank (write_sharded)
                path = write_sharded(self.rotation.directory / ("best" if best else f"step-{p.step:08d}"), shards,
                                     state, parts.world)
                if parts.world.main and not best:
                    self.rotation.commit(path)
            elif parts.world.main:
                epoch = p.last_epoch + 1  # the step's epoch, as the log and metrics.jsonl count it
                path = (self.rotation.save_best(for_evaluation(state), f"epoch{epoch}-step{p.step}-"
                                                f"{parts.monitor.metric}{p.best:.4g}") if best
                        else self.rotation.save(state, p.step, epoch))
            if not best:
                self.failure = None
        except OSError as e:
            path = None
            if parts.world.main:
                self.not_written(e, p, best)
        dist.wait_for_main(parts.world)  # no rank leaves before the checkpoint is on disk
        return path

    def not_written(self, e: OSError, p: Progress, best: bool) -> None:
        """The checkpoint of step p.step (or best.pt) could not be written: one error line, recorded."""
        newest = self.rotation.steps()
        failure = (f"could not write {'best.pt' if best else 'the checkpoint'} of optimizer step {p.step} into "
                   f"{self.rotation.directory} ({e.strerror or e}); the newest on disk is "
                   f"{newest[0].name if newest else 'none'}")
        if best or p.step < self.parts.plan.total_steps:  # the run's last one: raise_if_the_last_failed says it
            log.error(f"{failure}: training goes on, the next {'best evaluation' if best else 'checkpoint'} tries "
                      "again")
        if not best:  # a best.pt that could not be written leaves the run's last steps saved
            self.failure = failure
            self.failed.append(p.step)
            add_to_status(self.rotation.directory.parent, checkpoints_failed=dict(
                count=len(self.failed), steps=self.failed[:10], last_step=p.step, error=e.strerror or str(e)))

    def best_path(self) -> Path:
        """Where the best evaluation's checkpoint is (best.pt; best/ when sharded)."""
        return self.rotation.directory / ("best" if self.parts.strategy.sharded_checkpoints else "best.pt")

    def raise_if_the_last_failed(self) -> None:
        """At the end: the checkpoints that could not be written, said; if the last one failed, UserError."""
        if self.failed and not self.failure:
            newest = self.rotation.steps()
            log.error(f"{len(self.failed)} checkpoint{'s' if len(self.failed) > 1 else ''} could not be written "
                      f"(optimizer step{'s' if len(self.failed) > 1 else ''} "
                      f"{', '.join(map(str, self.failed[:10]))}{', …' if len(self.failed) > 10 else ''}); the newest "
                      f"on disk is {newest[0].name if newest else 'none'} (status.json: checkpoints_failed)")
        if self.failure:
            raise UserError(f"{self.failure}: the run's last steps are not saved (make room, then resume=auto "
                            "continues from that checkpoint)")


def for_evaluation(state: dict) -> dict:
    """best.pt's content: the checkpoint without what only a resume needs (optimizer, scheduler, scaler, RNG
    states) — the weights (and their average), the progress, plan and config; about half a full checkpoint with
    SGD's momentum, a third with Adam's moments. A resume continues from step-*.pt or last.pt, never from it."""
    return {key: value for key, value in state.items() if key not in RESUME_ONLY}


def warn_if_disk_is_short(parts: Components, rotation: Rotation) -> None:
    """A warning when the disk holding checkpoints/ has less room than the checkpoints kept at once will take (the
    weights and up to twice as much optimizer state each, keep_checkpoints + the one being written)."""
    weights = sum(t.numel() * t.element_size() for t in parts.model.state_dict().values())
    needed = 3 * weights * (rotation.keep + 1)
    try:
        free = shutil.disk_usage(rotation.directory.parent).free
    except OSError:
        return
    if free < needed:
        log.warning(f"the disk holding {rotation.directory} has {free / 2**20:.3g} MiB free; the "
                    f"{rotation.keep + 1} checkpoints on it at once may take up to {needed / 2**20:.3g} MiB "
                    "(weights and optimizer state): a checkpoint that cannot be written is reported and retried")


def finite_weights(parts: Components, state: dict, shards: Optional[dict]) -> bool:
    """Whether the weights about to be saved are finite: rank 0's whole ones (True elsewhere), or every rank's shards
    (then every rank gets the answer)."""
    if shards is None:
        return not parts.world.main or all(torch.isfinite(t).all() for t in state["model"].values()
                                       if t.is_floating_point())
    local = all(torch.isfinite(t.to_local() if dist.is_sharded(t) else t).all()
                for t in shards["model"].values() if t.is_floating_point())
    return bool(dist.all_reduce_min(torch.tensor(float(local)), parts.world).item())


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
