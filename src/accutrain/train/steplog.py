"""Per optimizer step: the metrics.jsonl record, the progress bar, the periodic log line and the warnings of a
skipped step; and this session's time, samples and peak memory for the summary. A few µs per step: every figure is
already on the host (the loop's one synchronisation), the config is read once, the bar's text is set only when the
bar is about to redraw, metrics.jsonl is written in batches."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from accutrain.core import compiled
from accutrain.core.options import Beta2Scaling
from accutrain.core.windows import Window
from accutrain.store.progress import Progress
from accutrain.train import memory, threads
from accutrain.train.components import Components
from accutrain.train.console import StepBar
from accutrain.train.metrics import MetricsLog

log = logging.getLogger("accutrain")


@dataclass(frozen=True)
class Settled:
    """A window's figures, read from the device once: its loss summed over every rank, the global gradient norm
    (before clipping), 16-mixed's overflow and next scale, and whether any rank was asked to stop."""

    loss_sum: float
    norm: float
    stop: bool
    overflow: bool = False  # inf/NaN in the unscaled gradients: the GradScaler skips the step
    scale: Optional[float] = None  # the GradScaler's scale for the next window
    window_s: float = 0.0  # the previous window's time, averaged over the ranks (for stopping.WindowWatch)
    clock_s: float = 0.0  # the time since the last checkpoint, averaged over the ranks (train/checkpoint_clock.py)
    measured: dict[str, float] = field(default_factory=dict)  # the loss's own figures of the window (loss.figures)


class StepLog:
    def __init__(self, parts: Components, metrics: MetricsLog, p: Progress) -> None:
        self.parts, self.metrics, self.p = parts, metrics, p
        self.log_every, self.elements, self.scaler = parts.trainer.log_every, parts.loss.tokens, parts.precision.scaler
        self.bar = StepBar(parts.plan.total_steps, p.step, parts.trainer.progress and parts.world.main)
        self.began, self.start_samples, self.peak, self.t0 = time.perf_counter(), p.samples, 0.0, 0.0
        self.compiling = compiled.WATCH if compiled.is_compiled(parts.model) else None
        self.graphs_said, self.first_step = 0, p.step + 1
        self.tokens = 0  # this session's loss terms, when they are elements
        self.measured: dict[str, float] = {}  # the loss's own figures of the last step (for the summary)
        self.cpus = threads.available_cpus() if parts.device.type == "cpu" else None  # the log line's load, per core
        self.watch = threads.ThreadWatch(torch.get_num_threads(), self.cpus) if self.cpus and parts.world.main else None

    def start(self) -> None:
        """A window begins: its time and its peak memory count from here."""
        self.t0 = time.perf_counter()
        memory.reset_peak(self.parts.device)

    def __call__(self, window: Window, terms: int, loss: float, lr: float, w: Settled, skipped: Optional[str],
                 micro_batches: int) -> None:
        """Record the optimizer step just taken (or skipped) on `window`: |W| = `terms`, `micro_batches` per rank."""
        parts, p, norm = self.parts, self.p, w.norm
        now = time.perf_counter()
        seconds = now - self.t0
        rate = window.size / seconds
        epoch = p.last_epoch
        record = dict(step=p.step, epoch=epoch + 1, loss=loss if math.isfinite(loss) else None,
                      samples=window.size, effective=window.batch, micro_batches=micro_batches, lr=lr,
                      grad_norm=norm if math.isfinite(norm) else None, samples_per_s=rate, samples_seen=p.samples,
                      time=now - self.began, peak_mem_mb=round(memory.peak_mb(parts.device), 1))
        self.peak = max(self.peak, record["peak_mem_mb"])
        if self.elements:  # tokens: their count, rate and the perplexity of the window
            self.tokens += terms
            record.update(elements=terms, tokens_per_s=terms / seconds,
                          ppl=math.exp(min(loss, 700)) if math.isfinite(loss) else None)
        padding = parts.sampler.padding(window)
        if padding is not None:  # token data: the tokens the model read, and the share of padding its rows added
            record.update(input_tokens=padding[0], input_tokens_per_s=padding[0] / seconds,
                          pad_fraction=1 - padding[0] / padding[1] if padding[1] else 0.0)
        if self.scaler:
            record["amp_scale"] = w.scale
        record.update(scaled_hparams(parts, window.batch, skipped))
        if parts.noise is not None:
            record.update(parts.noise.record)
        if w.measured:  # the loss's own figures (loss=moe: the router's load per layer)
            record.update(w.measured)
            self.measured = w.measured
        if parts.strategy.comm is not None:
            record["grad_syncs"], record["comm_bytes"] = parts.strategy.comm.take()
        if skipped:
            record["skipped"] = skipped
            log.warning(f"step {p.step}: " + (
                "AMP overflow: the GradScaler skipped the optimizer and scheduler step and lowered its scale to "
                f"{w.scale:g}" if skipped == "amp_overflow" else
                f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'}; the window's gradients are "
                f"dropped, no optimizer step ({p.skipped} skipped so far)"))
        self.metrics.step(record)
        unit, per_s = ("tokens", record["tokens_per_s"]) if self.elements else ("samples", rate)
        if not self.bar.disable:
            self.bar.step(loss, lr, unit, per_s)
        if self.watch is not None and (starved := self.watch.step(per_s, unit)):
            log.warning(starved)
        if self.compiling is not None and not self.compiling.runs_graphs and p.step == self.first_step and \
                parts.plan.micro_batch > 1:  # sizes 0 and 1 run eager by design
            log.warning("trainer.compile=true, yet torch.compile compiled nothing in the first optimizer step: the "
                        "model runs eagerly (dynamo skipped it; TORCH_LOGS=graph_breaks,recompiles says why)")
        if self.compiling is not None and self.compiling.graphs != self.graphs_said:
            self.graphs_said = self.compiling.graphs
            log.info(f"torch.compile: {self.graphs_said} graph(s) compiled so far, {self.compiling.seconds:.1f} s "
                     f"compiling (optimizer step {p.step})")
        if p.step % self.log_every == 0:
            ppl = f"  ppl {record['ppl']:.4g}" if record.get("ppl") is not None else ""
            busy = threads.load() if self.cpus else None
            log.info(f"step {p.step}/{parts.plan.total_steps} (epoch {epoch + 1}): loss {loss:.4f}{ppl}  lr {lr:.4g}  "
                     f"grad_norm {norm:.3g}  {per_s:.0f} {unit}/s"
                     + (f"  load {busy:.1f} on {self.cpus} cores" if busy is not None else ""))

    @property
    def seconds(self) -> float:
        """This session's wall time in the loop so far."""
        return time.perf_counter() - self.began

    @property
    def samples(self) -> int:
        """Samples this session has trained on."""
        return self.p.samples - self.start_samples

    def close(self) -> None:
        self.bar.close()


def scaled_hparams(parts: Components, effective: int, skipped: Optional[str]) -> dict[str, Optional[float]]:
    """What scaling.beta2 and scaling.ema made of β2 (the first parameter group's) and the EMA's decay for this
    window's batch (the decay None when no update was taken); nothing when neither scales."""
    scaled, out = parts.lr_scaling.window(effective), {}
    if parts.lr_scaling.beta2 is Beta2Scaling.half_life:
        out["beta2"] = parts.optimizer.param_groups[0]["betas"][1] ** scaled.beta2
    if parts.lr_scaling.ema and parts.ema is not None:
        out["ema_decay"] = parts.ema.last_decay if skipped is None else None
    return out
