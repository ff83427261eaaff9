"""The loop: windows → accumulate → one optimizer step → record, evaluate, checkpoint.

Per window: |W| is known before the first backward (the sampler counts samples; element-normalised losses count
their elements across ranks first); each micro-batch backpropagates its summed loss × world / |W| (step.py);
then, once per window: gradients back from their buffers, AMP unscale, the global norm (clipped if asked), one
small all-reduce of the loss and the stop votes, one optimizer and scheduler step, zero_grad, the record. The host
waits for the device once per window (`settle`), never per micro-batch.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from accutrain import dist, lr_scaling, memory, norms, pitfalls
from accutrain.build import Components
from accutrain.config import OnNonFinite
from accutrain.errors import NonFinite, UserError
from accutrain.metrics import MetricsLog
from accutrain.progress import Progress
from accutrain.schemas import LRScaling
from accutrain.signals import StopRequest
from accutrain.step import accumulate, cut_micro_batches, evaluate, grad_norm, pieces
from accutrain.steplog import Settled, StepLog
from accutrain.windows import Window, windows_of

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


@dataclass(frozen=True)
class Settings:
    """The config keys the loop reads every step, read once (an OmegaConf lookup costs tens of µs)."""

    grad_clip: Optional[float]
    eval_every: Optional[int]
    checkpoint_every: Optional[int]
    on_nonfinite: OnNonFinite
    lr_scaling: LRScaling
    base_batch: Optional[int]

    @classmethod
    def of(cls, c: Components) -> "Settings":
        t = c.cfg.trainer
        return cls(t.grad_clip, t.eval_every, t.checkpoint_every, t.on_nonfinite, c.cfg.optim.lr_scaling,
                   c.cfg.optim.base_batch)


def fit(c: Components, metrics: MetricsLog, p: Progress, save: Callable[..., Optional[Path]],
        stop: StopRequest) -> Outcome:
    """Run the plan's remaining optimizer steps, one window of micro-batches each; evaluate and checkpoint
    (`save(p)`, and `save(p, best=True)` when an evaluation is the best so far)."""
    s, plan = Settings.of(c), c.plan
    params = [param for param in c.model.parameters() if param.requires_grad]
    record = StepLog(c, metrics, p)
    c.model.zero_grad(set_to_none=True)  # the first window starts from nothing, whatever ran before (a check, say)
    if c.buffers:
        c.buffers.clear()
    for epoch in range(p.epoch, plan.total_epochs):
        c.sampler.set_epoch(epoch, start_window=p.window)
        for window, batches in windows_of(c.loader):
            record.start()
            terms, batches = window_terms(c, window, batches)  # |W|: the window's samples (or elements), all ranks
            losses = accumulate_window(c, p, window, batches, terms)  # forward+backward per micro-batch
            if c.buffers:
                c.buffers.release()  # the window's summed gradients back into .grad
            w = settle(c, params, s.grad_clip, losses, stop)  # unscale, norm, clip, all-reduce: the one sync
            lr_factor = lr_scaling.scaled_lr(1.0, window.batch, s.lr_scaling, s.base_batch)
            loss, lr = w.loss_sum / terms, c.optimizer.param_groups[0]["lr"] * lr_factor
            skipped = optimizer_step(c, s, loss, w, lr_factor, p)
            if c.ema is not None and skipped is None:
                c.ema.update(c.model)  # the average moves with the optimizer step, only when one was taken
            c.optimizer.zero_grad(set_to_none=True)
            p.advance(window, plan, loss, skipped)
            record(window, terms, loss, lr, w, skipped, sum(pieces(n, p.oom_parts) for n in window.sizes))

            done, patience_out = p.step == plan.total_steps, False
            if done or (p.step % s.eval_every == 0 if s.eval_every else p.window == 0):
                if run_validation(c, metrics, p):
                    save(p, best=True)
                patience_out = not done and c.monitor.out_of_patience(p.evals_since_best)
            if done or w.stop or patience_out or (s.checkpoint_every and p.step % s.checkpoint_every == 0):
                metrics.flush()  # every record up to this checkpoint is on disk before it
                path = save(p)
                if done or w.stop or patience_out:
                    return outcome(record, p, stop.name if w.stop else None, path, patience_out)
    return outcome(record, p, None, None)


def settle(c: Components, params: list[torch.nn.Parameter], grad_clip: Optional[float], losses: torch.Tensor,
           stop: StopRequest) -> Settled:
    """Once per window, on the device: AMP's unscale, overflow check and scale update (what GradScaler.step and
    update do, without step's own wait for the device), the global norm (clipped if asked), and with several ranks
    one all-reduce of the loss and the stop votes; then the host reads it all as one small tensor (`losses`, this
    rank's micro-batch loss sums, included) — the step's only synchronisation."""
    scaler = c.precision.scaler
    if scaler:
        scaler.unscale_(c.optimizer)  # before the norm and clipping
    figures = [grad_norm(params, grad_clip).to(c.device)]  # global already: DDP averaged the gradients
    if scaler:
        found = list(scaler._found_inf_per_device(c.optimizer).values())  # what scaler.step() would .item()
        figures.append(torch.stack(found).sum().to(c.device) if found else torch.zeros_like(figures[0]))
        scaler.update()  # the next window's scale, from the same found-inf flags: a device op, no wait
        figures.append(scaler._scale.to(c.device))
    stopping = stop.signum is not None
    if c.world.size > 1:  # every rank's loss and stop vote, summed: (loss, votes)
        losses = dist.all_reduce_sum(torch.stack([losses.sum(dtype=torch.float64), torch.tensor(
            float(stopping), dtype=torch.float64, device=c.device)]), c.world)
    values = torch.cat([losses, torch.stack(figures)]).tolist()  # the one wait; floats exact in float64
    n = len(losses)
    if c.world.size > 1:
        loss_sum, stopping = values[0], values[1] > 0
    else:
        loss_sum = sum(values[:n])  # the micro-batches' sums, added in float64
    return Settled(loss_sum, values[n], stopping, *((values[n + 1] > 0, values[n + 2]) if scaler else ()))


def outcome(record: StepLog, p: Progress, stopped_by: Optional[str], checkpoint: Optional[Path],
            early_stop: bool = False) -> Outcome:
    record.close()
    return Outcome(p, record.seconds, record.samples, record.peak, stopped_by, checkpoint, early_stop,
                   record.tokens if record.elements else None)


def window_terms(c: Components, window: Window, batches: Iterator[Any]) -> tuple[int, Iterable[Any]]:
    """(|W|, the window's batches): the loss terms on every rank, known before the first backward — its samples
    (from the sampler; the batches are then still to be loaded), or (loss.normalize=elements) its elements whose
    target is not ignore_index, counted in the loaded batches and summed over ranks."""
    if not c.loss.elements:
        return window.size, batches
    loaded = list(batches)  # counted on the host, where the loader left them: no wait for the device
    terms = c.loss.terms(loaded)
    if c.world.size > 1:
        terms = int(dist.all_reduce_sum(torch.tensor(terms, device=c.device), c.world).item())
    if terms == 0:
        raise UserError(f"window {window.index} has no element to learn from: every target equals "
                        f"loss.ignore_index={c.loss.ignore_index}")
    return terms, loaded


def accumulate_window(c: Components, p: Progress, window: Window, batches: Iterable[Any], terms: int
                      ) -> torch.Tensor:
    """accumulate() the window's micro-batches, each cut into p.oom_parts; after an out-of-memory, the window again
    from its first micro-batch (those already loaded are kept for that), cut into twice as many."""
    batches, loaded = iter(batches), []

    def micro_batches() -> Iterator[Any]:
        parts = p.oom_parts
        yield from cut_micro_batches(loaded, parts)
        for batch in batches:
            loaded.append(batch)
            if parts == 1:
                yield batch
            else:
                yield from cut_micro_batches([batch], parts)

    while True:
        try:
            return accumulate(c.wrapped, micro_batches(), terms, c.device, world=c.world.size,
                              no_sync=c.strategy.no_sync, precision=c.precision, loss=c.loss)
        except Exception as e:
            c.strategy.explain(e)  # a known limitation of the strategy, as one line
            cut_after_oom(c, p, window, e)


def cut_after_oom(c: Components, p: Progress, window: Window, error: Exception) -> None:
    """After an out-of-memory mid-window: drop the partial gradients and cut every micro-batch in twice as many.
    The window, hence the effective batch and the exact gradient, stay the same; accum doubles from now on."""
    if not memory.is_oom(error):
        raise error
    largest = max(-(-n // p.oom_parts) for n in window.sizes)
    if largest <= 1 or c.world.size > 1 or c.strategy.lockstep:
        raise UserError(f"out of memory with micro-batches of {largest}" + (
            " on one of several devices: set micro_batch lower (or micro_batch=auto)" if c.world.size > 1 else
            " under strategy=fsdp: set micro_batch lower" if c.strategy.lockstep else
            ": even one sample does not fit (try trainer.activation_checkpointing=true or bf16-mixed precision)"))
    c.optimizer.zero_grad(set_to_none=True)
    if c.buffers:
        c.buffers.clear()
    memory.free_memory(c.device)
    p.oom_parts *= 2
    count = sum(pieces(n, p.oom_parts) for n in window.sizes)
    log.warning(f"out of memory with micro-batches of {largest} at optimizer step {p.step + 1}: the window is "
                f"re-split into {count} micro-batches of at most {max(-(-n // p.oom_parts) for n in window.sizes)}; "
                f"the effective batch stays {c.plan.effective}" + twice_note(c.model))


def twice_note(model: torch.nn.Module) -> str:
    """What running a window again from its first micro-batch after an out-of-memory does twice, for the log."""
    twice = (["BatchNorm's running statistics take those samples in twice"] if norms.batchnorm_layers(model, True)
             else []) + (["dropout draws new masks (the random stream moves on)"] if pitfalls.dropout_layers(model)
                         else [])
    return (f". For what ran before the out-of-memory, {', and '.join(twice)}" if twice else "")


def optimizer_step(c: Components, s: Settings, loss: float, w: Settled, lr_factor: float, p: Progress
                   ) -> Optional[str]:
    """Step the optimizer (its learning rates × lr_factor, the window's batch scaling) and the scheduler once for the
    window, or say why not: `nonfinite` (trainer.on_nonfinite=skip; `stop` raises) or `amp_overflow` (16-mixed: the
    GradScaler, already updated by settle, lowered its scale)."""
    scaler = c.precision.scaler
    if not math.isfinite(loss) or (not math.isfinite(w.norm) and not scaler):
        if s.on_nonfinite is OnNonFinite.stop:
            raise NonFinite(f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'} at optimizer step "
                            f"{p.step + 1} (epoch {p.epoch + 1}): stopping (trainer.on_nonfinite=skip skips such "
                            "windows)")
        return "nonfinite"
    if w.overflow:
        return "amp_overflow"  # inf/NaN in the scaled gradients: no step, as GradScaler.step would decide
    with lr_scaling.window_lr(c.optimizer, lr_factor):
        c.optimizer.step()
    c.scheduler.step()
    return None


def run_validation(c: Components, metrics: MetricsLog, p: Progress) -> bool:
    """Evaluate on the held-out split (every rank its share), with the averaged weights too when trainer.ema is on;
    log it; follow the monitored metric. True when this evaluation is the best so far."""
    record = dict(step=p.step, epoch=p.last_epoch + 1, **measure(c, ""))
    if c.ema is not None:
        with c.ema.swapped_in(c.model):
            record.update(measure(c, "_ema"))
    metrics.evaluation(record)
    log.info(f"step {p.step} (epoch {record['epoch']}): val_loss {record['val_loss']:.4f}  val_acc "
             f"{record['val_acc']:.4f}" + (f"  val_ppl {record['val_ppl']:.4g}" if "val_ppl" in record else "")
             + (f"  (ema: val_loss {record['val_loss_ema']:.4f}  val_acc {record['val_acc_ema']:.4f})"
                if c.ema is not None else ""))
    value = record[c.monitor.metric]
    if c.monitor.improves(value, p.best):
        p.best, p.best_step, p.evals_since_best = value, p.step, 0
        return True
    p.evals_since_best += 1
    return False


def measure(c: Components, suffix: str) -> dict[str, float]:
    """val_loss and val_acc (named with `suffix`) of the model's current weights over the whole held-out split."""
    sums = evaluate(c.wrapped, c.val_loader, c.device, c.precision, c.loss)
    loss_sum, correct, n = dist.all_reduce_sum(sums, c.world).tolist()
    measured = {f"val_loss{suffix}": loss_sum / n, f"val_acc{suffix}": correct / n}
    if c.loss.elements:  # perplexity, per token
        measured[f"val_ppl{suffix}"] = math.exp(min(loss_sum / n, 700))
    return measured
