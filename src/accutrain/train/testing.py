"""The test stage: once training has ended, the test split (data.test) evaluated with the last weights and with the
best evaluation's (best.pt), every rank its share, the sums added over ranks and divided once (evaluation.measure, as
validation is). One record (kind "test") in metrics.jsonl and the trackers, a line in the log, `test` in
status.json."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from accutrain.errors import UserError
from accutrain.store import checkpoint
from accutrain.store.progress import Progress
from accutrain.train.components import Components
from accutrain.train.evaluation import measure
from accutrain.train.metrics import MetricsLog

log = logging.getLogger("accutrain")


def run_test(parts: Components, metrics: MetricsLog, p: Progress, best: Optional[Path]) -> Optional[dict[str, Any]]:
    """Evaluate the test split with the model's weights as training left them (`test_*`, `test_*_ema` with
    trainer.ema) and with those of `best` (the best checkpoint: `test_*_best`, `test_*_ema_best`), when it holds the
    best evaluation's step; record and log it. None without a test split. The model holds the best weights after."""
    if parts.test_loader is None:
        return None
    record: dict[str, Any] = dict(kind="test", step=p.step, epoch=p.last_epoch + 1, **weights_metrics(parts))
    if p.best_step is not None:
        record["best_step"] = p.best_step
        if p.best_step == p.step:  # the best weights are the last ones: measured once
            record.update({f"{name}_best": value for name, value in weights_metrics(parts).items()})
        elif (why := load_best(parts, best, p.best_step)) is None:
            record.update({f"{name}_best": value for name, value in weights_metrics(parts).items()})
        else:
            log.warning(f"test: the best weights (optimizer step {p.best_step}) are not evaluated: {why}")
    metrics.evaluation(record)
    log.info(f"test (optimizer step {p.step}): {describe(record)}")
    return record


def weights_metrics(parts: Components) -> dict[str, float]:
    """The test split's metrics of the model's current weights, and of their average with trainer.ema."""
    measured = measure(parts, "", parts.test_loader, "test")
    if parts.ema is not None:
        with parts.ema.swapped_in(parts.model):
            measured.update(measure(parts, "_ema", parts.test_loader, "test"))
    return measured


def load_best(parts: Components, path: Optional[Path], step: int) -> Optional[str]:
    """Load the best checkpoint's weights into the model (every rank); None, or why they could not be."""
    if path is None or not (path.exists()):
        return f"no best checkpoint at {path}"
    try:
        state = checkpoint.load(path, mmap=True, evaluation=True)
    except UserError as e:
        return str(e)
    if state.get("step") != step:
        return f"{path} holds optimizer step {state.get('step')} (it could not be written since)"
    parts.strategy.load_weights(parts.model, parts.ema, state, path)
    return None


def describe(record: dict[str, Any]) -> str:
    """`test_loss 0.1234  test_acc 0.9500` of the last weights, then `(best, step N: …)`, for the log and summary."""
    def figures(suffix: str) -> str:
        return "  ".join(f"{name.removesuffix(suffix)} {value:.4g}" if "ppl" in name else
                         f"{name.removesuffix(suffix)} {value:.4f}" for name, value in record.items()
                         if name.startswith("test_") and name.endswith(suffix) and (suffix or not name.endswith(
                             "_best")) and isinstance(value, float))
    text = figures("")
    if "best_step" in record and any(name.endswith("_best") for name in record):
        text += f"  (best weights, optimizer step {record['best_step']}: {figures('_best')})"
    return text


def headline(record: dict[str, Any], monitor: str) -> str:
    """The monitored metric on the test split (val_acc → test_acc; test_loss for one it has not), of the last weights
    and of the best ones, for the summary line: `test_acc 0.9444 (best weights 0.9500)`."""
    name = "test" + monitor.removeprefix("val")
    name = name if name in record else "test_loss"
    best = record.get(f"{name}_best")
    return f"{name} {record[name]:.4f}" + (f" (best weights {best:.4f})" if best is not None else "")
