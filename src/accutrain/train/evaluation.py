"""Evaluation during training: the held-out split's metrics of the current weights (and of the EMA's), every rank's
sums added and divided once, and the monitored metric followed (best.pt, early stopping)."""
from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

from accutrain import dist
from accutrain.store.progress import Progress
from accutrain.train.components import Components
from accutrain.train.console import wait_bar
from accutrain.train.metrics import MetricsLog

log = logging.getLogger("accutrain")


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
