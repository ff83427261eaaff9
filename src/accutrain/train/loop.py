"""The loop: windows → accumulate → one optimizer step → record, evaluate, checkpoint.

Per window: |W| is known before the first backward (the sampler counts samples; element-normalised losses count
their samples' elements, kept per sample, summed over ranks); each micro-batch backpropagates its summed loss ×
world / |W| (core/step.py); memory holds one micro-batch at a time, on the host too;
then, once per window: gradients back from their buffers, AMP unscale, the global norm (clipped if asked), one
small all-reduce of the loss and the stop votes, one optimizer and scheduler step, zero_grad, the record. The host
waits for the device once per window (`settle`), never per micro-batch.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from accutrain.config.train import OnNonFinite
from accutrain.core import lr_scaling
from accutrain.core.loader import windows_of
from accutrain.core.step import pieces
from accutrain.core.terms import TermCounts
from accutrain.errors import NonFinite
from accutrain.signals import StopRequest
from accutrain.store.progress import Progress
from accutrain.train import memory
from accutrain.train.checkpoint_clock import CheckpointClock
from accutrain.train.components import Components
from accutrain.train.evaluation import run_validation
from accutrain.train.metrics import MetricsLog
from accutrain.train.steplog import Settled, StepLog
from accutrain.train.stopping import Abandoned, WindowWatch
from accutrain.train.window_step import accumulate_window, settle, window_terms

log = logging.getLogger("accutrain")


@dataclass
class Outcome:
    progress: Progress
    seconds: float  # this session's wall time in the loop
    samples: int  # samples this session trained on
    peak_mb: float  # the process's peak memory (MiB): every window's, and what ran before, between and after them
    stopped_by: Optional[str] = None  # the signal that stopped the run early
    checkpoint: Optional[Path] = None
    early_stop: bool = False  # trainer.early_stopping ended the run before its plan
    tokens: Optional[int] = None  # the loss terms this session trained on, when they are elements (tokens)
    test: Optional[dict[str, Any]] = None  # the test stage's record (train/testing.py), when the run has a test split
    figures: dict[str, float] = field(default_factory=dict)  # the loss's own figures of the last step (loss.figures)


def fit(parts: Components, metrics: MetricsLog, progress: Progress, save: Callable[..., Optional[Path]],
        stop: StopRequest) -> Outcome:
    """Run the plan's remaining optimizer steps, one window of micro-batches each; evaluate and checkpoint
    (`save(progress)`, and `save(progress, best=True)` when an evaluation is the best so far)."""
    plan, trainer = parts.plan, parts.trainer
    params = [param for param in parts.model.parameters() if param.requires_grad]
    record = StepLog(parts, metrics, progress)
    counts = TermCounts(parts.loader.dataset, parts.sampler, parts.loss) if parts.loss.elements else None
    watch = WindowWatch(parts, stop)  # a stop signal mid-window: finish the window, or abandon it (train/stopping.py)
    clock = CheckpointClock(trainer)  # trainer.checkpoint_minutes: by the clock the ranks agree on, and epoch ends
    if parts.world.main:
        log.info(clock.promise())
    memory.fold_peak(parts.device)  # the build's, the check's and the resume's peak, before the first window resets it
    parts.model.zero_grad(set_to_none=True)  # the first window starts from nothing, whatever ran before (a check)
    if parts.buffers:
        parts.buffers.clear()
    for epoch in range(progress.epoch, plan.total_epochs):
        parts.sampler.set_epoch(epoch, start_window=progress.window)
        for window, batches in windows_of(parts.loader):
            record.start()
            watch.begin(len(window.sizes))
            terms = window_terms(parts, window, counts)  # |W|: the window's samples (or elements), all ranks
            try:  # forward+backward per micro-batch
                loss_sum = accumulate_window(parts, progress, window, batches, terms, watch)
            except Abandoned as abandoned:  # the weights are those of the last completed step: checkpoint them
                watch.drop(abandoned, progress.step)
                metrics.flush()
                return outcome(record, progress, stop.name, save(progress))
            if parts.buffers:
                parts.buffers.release()  # the window's summed gradients back into .grad
            settled = settle(parts, params, trainer.grad_clip, loss_sum, stop, watch.last_s,  # unscale, norm, …
                             clock.seconds())
            watch.ended(settled.window_s, len(window.sizes))  # the pace every rank agrees on, for the next window
            if settled.stop:
                watch.finished(progress.step + 1)
            scaled = parts.lr_scaling.window(window.batch)  # the window's lr factor, β2 and EMA powers (scaling.*)
            loss, lr = settled.loss_sum / terms, parts.optimizer.param_groups[0]["lr"] * scaled.lr
            skipped = optimizer_step(parts, loss, settled, scaled, progress)
            if parts.ema is not None and skipped is None:
                parts.ema.update(parts.model, scaled.ema)  # moves with the optimizer step, only when one was taken
            if parts.noise is not None:  # B_simple from the window's micro-batches and its whole gradient
                parts.noise.settle(settled.norm, window.size, taken=skipped is None, effective=window.batch)
            parts.optimizer.zero_grad(set_to_none=True)
            progress.advance(window, loss, skipped)
            record(window, terms, loss, lr, settled, skipped,
                   sum(pieces(n, progress.oom_parts) for n in window.sizes))

            step, patience_out = progress.step, False
            done = step == plan.total_steps or (window.last and progress.epoch == plan.total_epochs)
            if done and step < plan.total_steps:  # a stream whose passes (trainer.epochs) ended first
                log.info(f"the stream's {plan.total_epochs} passes (trainer.epochs) ended at optimizer step {step}, "
                         f"before trainer.max_steps={plan.total_steps}: the run ends here")
            if done or (step % trainer.eval_every == 0 if trainer.eval_every else progress.window == 0):
                if run_validation(parts, metrics, progress):
                    save(progress, best=True)
                memory.fold_peak(parts.device)  # an evaluation's peak: the process's, before the next window resets it
                patience_out = not done and parts.monitor.out_of_patience(progress.evals_since_best)
            if done or settled.stop or patience_out or clock.due(settled.clock_s, progress.window == 0) or (
                    trainer.checkpoint_every and step % trainer.checkpoint_every == 0):
                metrics.flush()  # every record up to this checkpoint is on disk before it
                path = save(progress)
                clock.written()
                memory.fold_peak(parts.device)
                if done or settled.stop or patience_out:
                    return outcome(record, progress, stop.name if settled.stop else None, path, patience_out)
    return outcome(record, progress, None, None)


def outcome(record: StepLog, progress: Progress, stopped_by: Optional[str], checkpoint: Optional[Path],
            early_stop: bool = False) -> Outcome:
    record.close()
    return Outcome(progress, record.seconds, record.samples, record.peak, stopped_by, checkpoint, early_stop,
                   record.tokens if record.elements else None, figures=record.measured)


def optimizer_step(parts: Components, loss: float, settled: Settled, scaled: lr_scaling.WindowScaling,
                   progress: Progress) -> Optional[str]:
    """Step the optimizer (its learning rates and β2 as the window's batch scales them) and the scheduler once for the
    window, or say why not: `nonfinite` (trainer.on_nonfinite=skip; `stop` raises) or `amp_overflow` (16-mixed: the
    GradScaler, already updated by settle, lowered its scale)."""
    scaler = parts.precision.scaler
    if not math.isfinite(loss) or (not math.isfinite(settled.norm) and not scaler):
        if parts.trainer.on_nonfinite is OnNonFinite.stop:
            raise NonFinite(f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'} at optimizer step "
                            f"{progress.step + 1} (epoch {progress.epoch + 1}): stopping (trainer.on_nonfinite=skip "
                            "skips such windows)")
        return "nonfinite"
    if settled.overflow:
        return "amp_overflow"  # inf/NaN in the scaled gradients: no step, as GradScaler.step would decide
    with lr_scaling.window_hparams(parts.optimizer, scaled):
        parts.optimizer.step()
    parts.scheduler.step()
    return None


