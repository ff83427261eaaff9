"""Per optimizer step: the metrics.jsonl record, the progress bar, the periodic log line and the warnings of a
skipped step; and this session's time, samples and peak memory for the summary."""
from __future__ import annotations

import logging
import math
import time
from typing import Optional

from accutrain import memory
from accutrain.build import Components
from accutrain.metrics import MetricsLog, progress_bar
from accutrain.progress import Progress
from accutrain.windows import Window

log = logging.getLogger("accutrain")


class StepLog:
    def __init__(self, c: Components, metrics: MetricsLog, p: Progress) -> None:
        self.c, self.metrics, self.p = c, metrics, p
        self.bar = progress_bar(c.plan.total_steps, p.step, c.cfg.trainer.progress and c.world.main)
        self.began, self.start_samples, self.peak, self.t0 = time.perf_counter(), p.samples, 0.0, 0.0

    def start(self) -> None:
        """A window begins: its time and its peak memory count from here."""
        self.t0 = time.perf_counter()
        memory.reset_peak(self.c.device)

    def __call__(self, window: Window, terms: int, loss: float, lr: float, norm: float, skipped: Optional[str],
                 micro_batches: int) -> None:
        """Record the optimizer step just taken (or skipped) on `window`: |W| = `terms`, `micro_batches` per rank."""
        c, p = self.c, self.p
        seconds = time.perf_counter() - self.t0
        rate = window.size / seconds
        epoch = p.last_epoch
        record = dict(step=p.step, epoch=epoch + 1, loss=loss if math.isfinite(loss) else None,
                      samples=window.size, effective=window.batch, micro_batches=micro_batches, lr=lr,
                      grad_norm=norm if math.isfinite(norm) else None, samples_per_s=rate, samples_seen=p.samples,
                      time=time.perf_counter() - self.began, peak_mem_mb=round(memory.peak_mb(c.device), 1))
        self.peak = max(self.peak, record["peak_mem_mb"])
        if c.loss.elements:  # tokens: their count, rate and the perplexity of the window
            record.update(elements=terms, tokens_per_s=terms / seconds,
                          ppl=math.exp(min(loss, 700)) if math.isfinite(loss) else None)
        if c.precision.scaler:
            record["amp_scale"] = c.precision.scaler.get_scale()
        if c.strategy.comm is not None:
            record["grad_syncs"], record["comm_bytes"] = c.strategy.comm.take()
        if skipped:
            record["skipped"] = skipped
            log.warning(f"step {p.step}: " + (
                "AMP overflow: the GradScaler skipped the optimizer and scheduler step and lowered its scale to "
                f"{c.precision.scaler.get_scale():g}" if skipped == "amp_overflow" else
                f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'}; the window's gradients are "
                f"dropped, no optimizer step ({p.skipped} skipped so far)"))
        self.metrics.step(record)
        unit, per_s = ("tokens", record["tokens_per_s"]) if c.loss.elements else ("samples", rate)
        speed = f"{per_s:.0f} {unit}/s"
        self.bar.set_postfix({"loss": f"{loss:.4f}", "lr": f"{lr:.3g}", f"{unit}_s": f"{per_s:.0f}"}, refresh=False)
        self.bar.update()
        if p.step % c.cfg.trainer.log_every == 0:
            ppl = f"  ppl {record['ppl']:.4g}" if record.get("ppl") is not None else ""
            log.info(f"step {p.step}/{c.plan.total_steps} (epoch {epoch + 1}): loss {loss:.4f}{ppl}  lr {lr:.4g}  "
                     f"grad_norm {norm:.3g}  {speed}")

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
