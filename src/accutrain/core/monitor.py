"""The monitored evaluation metric (`trainer.monitor`): is an evaluation the best so far (checkpoints/best.pt), and
has the run stopped improving (`trainer.early_stopping`, patience counted in evaluations)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

METRICS = ("val_loss", "val_acc", "val_loss_ema", "val_acc_ema")


def mode_of(metric: str, mode: Optional[str]) -> str:
    """`min` or `max`: as given, else max for accuracies and min for losses."""
    return mode or ("max" if "acc" in metric else "min")


@dataclass(frozen=True)
class Monitor:
    metric: str
    mode: str  # min | max
    min_delta: float = 0.0
    patience: Optional[int] = None  # evaluations without improvement before stopping; None: never stop early

    @classmethod
    def from_config(cls, trainer: Any) -> "Monitor":
        return cls(trainer.monitor, mode_of(trainer.monitor, trainer.monitor_mode), trainer.min_delta,
                   trainer.early_stopping)

    def improves(self, value: float, best: Optional[float]) -> bool:
        """Whether `value` beats `best` by more than min_delta (the first evaluation always does)."""
        if best is None:
            return True
        return value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta

    def out_of_patience(self, evaluations_without_improvement: int) -> bool:
        return self.patience is not None and evaluations_without_improvement >= self.patience

    def describe(self, value: Optional[float], step: Optional[int]) -> str:
        return f"best {self.metric} {value:.4f} (step {step})" if value is not None else f"no {self.metric} yet"
