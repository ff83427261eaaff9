"""Where a run is: optimizer steps taken, the next window, samples seen, the best evaluation — what a checkpoint
records besides the model, optimizer and RNG states."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from accutrain.core.windows import Window


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken (windows consumed, skipped ones included)
    epoch: int = 0  # the epoch of the next window
    window: int = 0  # the next window's index in that epoch
    samples: int = 0
    skipped: int = 0  # windows whose step was skipped for a non-finite loss or gradient
    oom_parts: int = 1  # each micro-batch is cut into this many, after out-of-memory errors
    last_loss: Optional[float] = None
    best: Optional[float] = None  # the best value of the monitored metric (trainer.monitor) so far
    best_step: Optional[int] = None
    evals_since_best: int = 0  # evaluations without improvement since (early stopping's patience)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Progress":
        """A checkpoint's `progress` (written by dataclasses.asdict; former names: split, best_acc)."""
        renamed = {"split": "oom_parts", "best_acc": "best"}
        return cls(**{renamed.get(key, key): value for key, value in record.items()})

    @property
    def last_epoch(self) -> int:
        """The epoch (from 0) of the optimizer step just taken: the next window may already be the next epoch's."""
        return self.epoch if self.window else self.epoch - 1

    def advance(self, window: Window, loss: float, skipped: Optional[str]) -> None:
        """Count the window's optimizer step (taken or skipped) and move to the next window."""
        self.step, self.samples = self.step + 1, self.samples + window.size
        self.skipped += skipped == "nonfinite"
        if window.last:
            self.epoch, self.window = self.epoch + 1, 0
        else:
            self.window = window.index + 1
        if math.isfinite(loss):
            self.last_loss = loss
