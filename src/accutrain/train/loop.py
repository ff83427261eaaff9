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
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from accutrain import dist
from accutrain.config.train import OnNonFinite
from accutrain.core import lr_scaling
from accutrain.train import memory
from accutrain.core.precision import found_inf_and_update
from accutrain.store.progress import Progress
from accutrain.core.step import cut_micro_batches, grad_norm, pieces
from accutrain.core.terms import TermCounts
from accutrain.core.windows import Window, windows_of
from accutrain.errors import NonFinite, UserError
from accutrain.models import norms, pitfalls
from accutrain.signals import StopRequest
from accutrain.train.components import Components
from accutrain.train.console import wait_bar
from accutrain.train.metrics import MetricsLog
from accutrain.train.steplog import Settled, StepLog
from accutrain.train.stopping import Abandoned, WindowWatch

log = logging.getLogger("accutrain")


@dataclass
class Outcome:
    progress: Progress
    seconds: float  # this session's wall time in the loop
    samples: int  # samples this session trained on
    peak_mb: float  # the highest per-step peak memory of this session (MiB)
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
            settled = settle(parts, params, trainer.grad_clip, loss_sum, stop, watch.last_s)  # unscale, norm, …
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
                patience_out = not done and parts.monitor.out_of_patience(progress.evals_since_best)
            if done or settled.stop or patience_out or (trainer.checkpoint_every and
                                                         step % trainer.checkpoint_every == 0):
                metrics.flush()  # every record up to this checkpoint is on disk before it
                path = save(progress)
                if done or settled.stop or patience_out:
                    return outcome(record, progress, stop.name if settled.stop else None, path, patience_out)
    return outcome(record, progress, None, None)


def settle(parts: Components, params: list[torch.nn.Parameter], grad_clip: Optional[float], loss_sum: torch.Tensor,
           stop: StopRequest, window_s: float = 0.0) -> Settled:
    """Once per window, on the device: AMP's unscale, overflow check and scale update (what GradScaler.step and
    update do, without step's wait: precision.found_inf_and_update), the global norm (clipped if asked), and with
    several ranks one all-reduce of the loss, the stop votes and the previous window's time (`window_s`, averaged,
    for stopping.WindowWatch); then the
    host reads it all as one small tensor (`loss_sum`, this rank's summed loss, and the loss's own figures of the
    window included) — the step's only synchronisation."""
    device, scaler = parts.device, parts.precision.scaler
    if scaler:
        scaler.unscale_(parts.optimizer)  # before the norm and clipping
    figures = {"norm": grad_norm(params, grad_clip).to(device)}  # global already: DDP averaged the gradients
    if scaler:
        found_inf, next_scale = found_inf_and_update(scaler, parts.optimizer)
        figures.update(found_inf=found_inf.to(device), scale=next_scale.to(device))
    measured = parts.loss.figures()  # the loss's own figures of the window (every rank's already)
    host = [float(stop.signum is not None), window_s]  # this rank's stop vote and window time
    head = loss_sum.reshape(1).double()
    if parts.world.size > 1:  # every rank's loss, stop vote and window time, summed
        votes = torch.tensor(host, dtype=torch.float64)
        if device.type == "cuda":  # a pageable host-to-device copy would wait for the GPU: a second sync per step
            votes = votes.pin_memory()
        head = dist.all_reduce_sum(torch.cat([head, votes.to(device, non_blocking=True)]), parts.world)
    values = torch.cat([head, torch.stack([*figures.values(), *measured.values()]).double()]).tolist()  # the one wait
    if parts.world.size == 1:
        values[1:1] = host
    read = dict(zip(figures, values[3:]))
    return Settled(loss_sum=values[0], norm=read["norm"], stop=values[1] > 0, overflow=read.get("found_inf", 0.0) > 0,
                   scale=read.get("scale"), window_s=values[2] / parts.world.size,
                   measured=dict(zip(measured, values[3 + len(figures):])))


def outcome(record: StepLog, progress: Progress, stopped_by: Optional[str], checkpoint: Optional[Path],
            early_stop: bool = False) -> Outcome:
    record.close()
    return Outcome(progress, record.seconds, record.samples, record.peak, stopped_by, checkpoint, early_stop,
                   record.tokens if record.elements else None, figures=record.measured)


def window_terms(parts: Components, window: Window, counts: Optional[TermCounts]) -> int:
    """|W|, the loss terms on every rank, known before the first backward and before any of the window is loaded:
    its samples (from the sampler), or (loss.normalize=elements) its elements whose target is not ignore_index,
    from each sample's kept count (core/terms.py), summed over ranks."""
    if counts is None:
        return window.size
    terms = counts(window)
    if parts.world.size > 1:
        terms = int(dist.all_reduce_sum(torch.tensor(terms, device=parts.device), parts.world).item())
    if terms == 0:
        raise UserError(f"window {window.index} has no element to learn from: every target equals "
                        f"loss.ignore_index={parts.loss.ignore_index}")
    return terms


def accumulate_window(parts: Components, progress: Progress, window: Window, batches: Iterable[Any], terms: int,
                      watch: Optional[WindowWatch] = None) -> torch.Tensor:
    """The loss accumulates the window's micro-batches (loss.accumulate: one pass, or two for a loss over the whole
    window); after an out-of-memory, the window again from its first micro-batch, cut into twice as many."""
    reader = WindowReader(parts, progress, window, batches, watch)
    while True:
        if parts.noise is not None:  # (again after an out-of-memory) the window's micro-batch gradients from nothing
            parts.noise.begin(terms, parts.world.size)
        try:
            return parts.loss.accumulate(parts.wrapped, reader, terms, parts.device, world=parts.world.size,
                                         no_sync=parts.strategy.no_sync, precision=parts.precision,
                                         observe=parts.noise.micro_batch_done if parts.noise is not None else None)
        except Exception as e:
            parts.strategy.explain(e)  # a known limitation of the strategy, as one line
            cut_after_oom(parts, progress, window, e)


class WindowReader:
    """This rank's micro-batches of one window as the loss reads them (a step.Rereadable): the loader's, each cut
    into progress.oom_parts. Read again — a retry after an out-of-memory, or a two-pass loss's second pass — they
    come anew from the sampler (the same samples, views and mixes: a window is a function of the seed, its epoch and
    its index), so no micro-batch is kept. Between the loader's micro-batches `watch` may abandon the window for a
    stop signal."""

    def __init__(self, parts: Components, progress: Progress, window: Window, batches: Iterable[Any],
                 watch: Optional[WindowWatch]) -> None:
        self.parts, self.progress, self.window, self.watch = parts, progress, window, watch
        self.batches, self.taken, self.total = iter(batches), 0, len(window.sizes)

    def read(self, count: Optional[int] = None) -> Iterator[Any]:
        """This rank's first `count` micro-batches of the window (all: None), read from the sampler."""
        again = self.parts.sampler.micro_batches_of(self.window)[:count]
        return (self.parts.loader.dataset.__getitems__(m)[1] for m in again)

    def __iter__(self) -> Iterator[Any]:
        cuts = self.progress.oom_parts
        if self.taken:  # a retry: the micro-batches the loader gave before the out-of-memory, one at a time
            yield from cut_micro_batches(self.read(self.taken), cuts)
        for batch in self.batches:
            if self.taken and self.watch is not None:
                self.watch.between(self.taken, self.total)  # every rank here at the same micro-batch: may raise
            self.taken += 1
            yield from cut_micro_batches([batch], cuts) if cuts > 1 else (batch,)

    def again(self) -> Iterator[Any]:
        return cut_micro_batches(self.read(), self.progress.oom_parts)


def cut_after_oom(parts: Components, progress: Progress, window: Window, error: Exception) -> None:
    """After an out-of-memory mid-window: drop the partial gradients and cut every micro-batch in twice as many.
    The window, hence the effective batch and the exact gradient, stay the same; accum doubles from now on."""
    if not memory.is_oom(error):
        raise error
    largest = max(-(-n // progress.oom_parts) for n in window.sizes)
    if largest <= 1 or parts.world.size > 1 or parts.strategy.lockstep:
        raise UserError(f"out of memory with micro-batches of {largest}" + (
            " on one of several devices: set micro_batch lower (or micro_batch=auto)" if parts.world.size > 1 else
            " under strategy=fsdp: set micro_batch lower" if parts.strategy.lockstep else
            ": even one sample does not fit (try trainer.activation_checkpointing=true or bf16-mixed precision)"))
    parts.optimizer.zero_grad(set_to_none=True)
    if parts.buffers:
        parts.buffers.clear()
    memory.free_memory(parts.device)
    progress.oom_parts *= 2
    count = sum(pieces(n, progress.oom_parts) for n in window.sizes)
    most = max(-(-n // progress.oom_parts) for n in window.sizes)
    log.warning(f"out of memory with micro-batches of {largest} at optimizer step {progress.step + 1}: the window is "
                f"re-split into {count} micro-batches of at most {most}; "
                f"the effective batch stays {parts.plan.effective}" + twice_note(parts.model))


def twice_note(model: torch.nn.Module) -> str:
    """What running a window again from its first micro-batch after an out-of-memory does twice, for the log."""
    twice = (["BatchNorm's running statistics take those samples in twice"] if norms.batchnorm_layers(model, True)
             else []) + (["dropout draws new masks (the random stream moves on)"] if pitfalls.dropout_layers(model)
                         else [])
    return (f". For what ran before the out-of-memory, {', and '.join(twice)}" if twice else "")


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


def run_validation(parts: Components, metrics: MetricsLog, progress: Progress) -> bool:
    """Evaluate on the held-out split (every rank its share), with the averaged weights too when trainer.ema is on;
    log it; follow the monitored metric. True when this evaluation is the best so far."""
    record = dict(step=progress.step, epoch=progress.last_epoch + 1, **measure(parts, ""))
    if parts.ema is not None:
        with parts.ema.swapped_in(parts.model):
            record.update(measure(parts, "_ema"))
    metrics.evaluation(record)
    log.info(f"step {progress.step} (epoch {record['epoch']}): " + "  ".join(
        f"{name} {value:.4g}" if name == "val_ppl" else f"{name} {value:.4f}" for name, value in record.items()
        if name.startswith("val_") and not name.endswith("_ema")) + (
        "  (ema: " + "  ".join(f"{name.removesuffix('_ema')} {value:.4f}" for name, value in record.items()
                               if name.endswith("_ema")) + ")" if parts.ema is not None else ""))
    value = record[parts.monitor.metric]
    if parts.monitor.improves(value, progress.best):
        progress.best, progress.best_step, progress.evals_since_best = value, progress.step, 0
        return True
    progress.evals_since_best += 1
    return False


def measure(parts: Components, suffix: str, loader: Optional[Iterable[Any]] = None, split: str = "val"
            ) -> dict[str, float]:
    """The loss's metrics (val_loss, and val_acc, val_mae/val_rmse or val_f1; named with `suffix`, and `split` in
    place of val for another split's `loader`) of the model's current weights over the whole held-out split (or
    `loader`'s): every rank's sums added, then divided once."""
    loader = wait_bar(parts.val_loader if loader is None else loader, desc=f"evaluating ({split})", unit="batch",
                      enabled=parts.trainer.progress and parts.world.main)
    sums = parts.loss.evaluate(parts.wrapped, loader, parts.device, parts.precision, parts.world.size)
    measured = parts.loss.eval_metrics(dist.all_reduce_sum(sums, parts.world).tolist())
    return {f"{split}{name.removeprefix('val')}{suffix}": value for name, value in measured.items()}
