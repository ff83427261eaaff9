"""The batch arithmetic: effective batch = micro_batch × accum × devices, and how many optimizer steps follow."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from accutrain.config import LastWindow
from accutrain.errors import UserError


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    accum: int
    devices: int
    train_size: int
    last_window: LastWindow
    epochs: Optional[int]
    max_steps: Optional[int]

    @property
    def effective(self) -> int:
        """Samples per optimizer step (the last window of an epoch may hold fewer)."""
        return self.micro_batch * self.accum * self.devices

    @property
    def tail(self) -> int:
        """Samples in the incomplete last window of an epoch (0 when the windows tile the epoch)."""
        return self.train_size % self.effective

    @property
    def steps_per_epoch(self) -> int:
        full = self.train_size // self.effective
        return full + (1 if self.tail and self.last_window is LastWindow.step else 0)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: epochs and max_steps, whichever ends first."""
        by_epochs = self.epochs * self.steps_per_epoch if self.epochs is not None else None
        return min(s for s in (by_epochs, self.max_steps) if s is not None)

    @property
    def total_epochs(self) -> int:
        """Epochs begun, the last possibly cut short by max_steps."""
        return math.ceil(self.total_steps / self.steps_per_epoch)

    def record(self) -> dict[str, Any]:
        """The plan as data: what status.json, metrics.jsonl and checkpoints record, and reports read back."""
        return dict(effective=self.effective, micro_batch=self.micro_batch, accum=self.accum, devices=self.devices,
                    train_size=self.train_size, steps_per_epoch=self.steps_per_epoch, total_steps=self.total_steps,
                    last_window=self.last_window.value)

    def describe(self) -> list[str]:
        """The start-up lines: the arithmetic, then the optimizer steps per epoch and in total."""
        windows = f"{self.train_size // self.effective} windows of {self.effective}"
        if self.tail and self.last_window is LastWindow.step:
            windows += f" + 1 of {self.tail} samples"
        elif self.tail:
            windows += f"; the last {self.tail} samples of each epoch dropped (trainer.last_window=drop)"
        epochs = "epoch" if self.total_epochs == 1 else "epochs"
        return [
            f"effective batch {self.effective} = micro_batch {self.micro_batch} × accum {self.accum} "
            f"× devices {self.devices}",
            f"{self.train_size} training samples: {self.steps_per_epoch} optimizer steps per epoch ({windows}), "
            f"{self.total_steps} in total over {self.total_epochs} {epochs}",
        ]


def derive_accum(micro_batch: int, devices: int, accum: Optional[int], global_batch: Optional[int]) -> int:
    """accum as given, or global_batch / (micro_batch × devices); one clear line when they cannot agree."""
    if global_batch is None:
        return accum if accum is not None else 1
    per_pass = micro_batch * devices
    if global_batch % per_pass:
        raise UserError(
            f"global_batch={global_batch} is not a multiple of micro_batch {micro_batch} × devices {devices} "
            f"= {per_pass}: choose a global_batch divisible by {per_pass}, or another micro_batch"
        )
    derived = global_batch // per_pass
    if accum is not None and accum != derived:
        raise UserError(
            f"accum={accum} contradicts global_batch={global_batch} = micro_batch {micro_batch} × devices "
            f"{devices} × accum {derived}: drop accum (it is derived from global_batch) or make them agree"
        )
    return derived


def make_plan(
    *,
    micro_batch: int,
    accum: Optional[int],
    devices: int,
    global_batch: Optional[int],
    train_size: int,
    last_window: LastWindow,
    epochs: Optional[int],
    max_steps: Optional[int],
) -> BatchPlan:
    plan = BatchPlan(
        micro_batch=micro_batch,
        accum=derive_accum(micro_batch, devices, accum, global_batch),
        devices=devices,
        train_size=train_size,
        last_window=last_window,
        epochs=epochs,
        max_steps=max_steps,
    )
    if plan.steps_per_epoch == 0:
        raise UserError(
            f"effective batch {plan.effective} is larger than the {train_size} training samples and "
            f"trainer.last_window=drop drops them all: lower micro_batch/accum or set trainer.last_window=step"
        )
    return plan
