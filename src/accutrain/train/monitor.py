"""The monitored evaluation metric (`trainer.monitor`): is an evaluation the best so far (checkpoints/best.pt), and
has the run stopped improving (`trainer.early_stopping`, patience counted in evaluations)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from accutrain.config import families
from accutrain.errors import UserError


def mode_of(metric: str, mode: Optional[str]) -> str:
    """`min` or `max`: as given, else max for accuracies and F1, min for losses and errors."""
    return mode or ("max" if metric.removesuffix("_ema") in families.higher_is_better() else "min")


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
        measured = families.task_metrics().get(task, ("val_loss",))
        if metric.removesuffix("_ema") not in measured:
            raise UserError(f"trainer.monitor={metric} is not measured for this loss ({task}): expected one of "
                            f"{', '.join(measured)} (or auto)")
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
