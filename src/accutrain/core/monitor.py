"""The monitored evaluation metric (`trainer.monitor`): is an evaluation the best so far (checkpoints/best.pt), and
has the run stopped improving (`trainer.early_stopping`, patience counted in evaluations)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from accutrain.errors import UserError

# What each task's evaluation measures (accutrain.core.loss / losses: a loss's `task`); trainer.monitor=auto takes
# the loss's own choice (val_acc for a classifier, val_loss for the others and for a language model).
TASK_METRICS = {
    "classification": ("val_loss", "val_acc"),
    "regression": ("val_loss", "val_mae", "val_rmse"),
    "multilabel": ("val_loss", "val_f1"),
    "custom": ("val_loss",),
    "contrastive": ("val_loss", "val_recall1"),
}
METRICS = ("auto", *dict.fromkeys(m + ema for ms in TASK_METRICS.values() for m in ms for ema in ("", "_ema")))
HIGHER_IS_BETTER = ("val_acc", "val_f1", "val_recall1")


def mode_of(metric: str, mode: Optional[str]) -> str:
    """`min` or `max`: as given, else max for accuracies and F1, min for losses and errors."""
    return mode or ("max" if metric.removesuffix("_ema") in HIGHER_IS_BETTER else "min")


@dataclass(frozen=True)
class Monitor:
    metric: str
    mode: str  # min | max
    min_delta: float = 0.0
    patience: Optional[int] = None  # evaluations without improvement before stopping; None: never stop early

    @classmethod
    def from_config(cls, trainer: Any, task: str = "classification", auto: str = "val_acc") -> "Monitor":
        """trainer.monitor (`auto`: the loss's choice), checked against what the loss's `task` measures."""
        metric = auto if trainer.monitor == "auto" else trainer.monitor
        if metric.removesuffix("_ema") not in TASK_METRICS[task]:
            raise UserError(f"trainer.monitor={metric} is not measured for this loss ({task}): expected one of "
                             f"{', '.join(TASK_METRICS[task])} (or auto)")
        return cls(metric, mode_of(metric, trainer.monitor_mode), trainer.min_delta, trainer.early_stopping)

    def improves(self, value: float, best: Optional[float]) -> bool:
        """Whether `value` beats `best` by more than min_delta (the first evaluation always does)."""
        if best is None:
            return True
        return value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta

    def out_of_patience(self, evaluations_without_improvement: int) -> bool:
        return self.patience is not None and evaluations_without_improvement >= self.patience

    def describe(self, value: Optional[float], step: Optional[int]) -> str:
        return f"best {self.metric} {value:.4f} (step {step})" if value is not None else f"no {self.metric} yet"
