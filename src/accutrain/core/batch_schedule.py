"""`batch_schedule`: the effective batch as a function of the samples seen before a window.

Points `(at, batch)`, `at` in samples, epochs (× the training set) or a fraction of the run's training samples
(`unit`); `ramp=step` holds each batch from its point to the next, `ramp=linear` interpolates between them,
rounded down to a multiple of the scheduled batches' greatest common divisor — a property of the schedule, not of
the split, which must divide every scheduled batch. After the last point the last batch holds. The windows are
cut from the seed's permutation with these sizes, so every split of the same
schedule visits the same windows (plan.py, windows.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from accutrain.errors import UserError


@dataclass(frozen=True)
class BatchSchedule:
    at: tuple[int, ...]  # samples seen where each point begins (ascending, the first 0)
    batch: tuple[int, ...]  # the effective batch at each point
    linear: bool  # interpolate between the points (else hold each value to the next point)

    @property
    def granule(self) -> int:
        """Every batch the schedule gives is a multiple of this: the scheduled batches' greatest common divisor."""
        return math.gcd(*self.batch)

    def batch_at(self, seen: int) -> int:
        """The effective batch of a window that begins after `seen` samples."""
        k = max(i for i, start in enumerate(self.at) if start <= seen)
        if not self.linear or k == len(self.at) - 1:
            return self.batch[k]
        fraction = (seen - self.at[k]) / (self.at[k + 1] - self.at[k])
        value = self.batch[k] + fraction * (self.batch[k + 1] - self.batch[k])
        return max(self.granule, int(value // self.granule) * self.granule)

    def record(self) -> dict[str, Any]:
        return dict(at=list(self.at), batch=list(self.batch), ramp="linear" if self.linear else "step")

    def describe(self) -> str:
        points = ", ".join(f"{b} from sample {a:,}" for a, b in zip(self.at, self.batch))
        return (f"batch schedule ({'linear ramp' if self.linear else 'steps'}): {points}" +
                (f"; the ramp moves in multiples of {self.granule}" if self.linear else ""))


def resolve(cfg: Any, per_pass: int, train_size: int, epochs: Optional[int]) -> BatchSchedule:
    """The `batch_schedule` config as points in samples; one line for a value the split (micro_batch × devices =
    per_pass) cannot make."""
    at, batch = [float(a) for a in cfg.at], [int(b) for b in cfg.batch]
    unit = cfg.unit.value if hasattr(cfg.unit, "value") else str(cfg.unit)
    if not at or len(at) != len(batch):
        raise UserError(f"batch_schedule.at={list(cfg.at)} and batch_schedule.batch={list(cfg.batch)} must be "
                        "lists of the same length, at least one point")
    if at[0] != 0 or any(b <= a for a, b in zip(at, at[1:])):
        raise UserError(f"batch_schedule.at={list(cfg.at)} is not valid: expected ascending points starting at 0")
    if unit == "fraction":
        if epochs is None:
            raise UserError("batch_schedule.unit=fraction needs trainer.epochs (the run's training samples); with "
                            "trainer.max_steps alone use batch_schedule.unit=samples or epochs")
        if at[-1] > 1:
            raise UserError(f"batch_schedule.at={list(cfg.at)} is not valid with unit=fraction: expected values "
                            "from 0 to 1")
        scale = epochs * train_size
    else:
        scale = train_size if unit == "epochs" else 1
    for value in batch:
        if value < 1 or value % per_pass:
            raise UserError(f"batch_schedule.batch has {value}, which micro_batch × devices = {per_pass} does not "
                            f"divide: every scheduled batch must be a multiple of {per_pass}")
    ramp = cfg.ramp.value if hasattr(cfg.ramp, "value") else str(cfg.ramp)
    return BatchSchedule(tuple(math.ceil(a * scale) for a in at), tuple(batch), ramp == "linear")
