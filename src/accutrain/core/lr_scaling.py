"""`scaling.lr`: the learning rate follows the effective batch, relative to `scaling.base_batch`.

linear: lr × effective / base_batch (the linear scaling rule, for SGD); sqrt: lr × √(effective / base_batch)
(for adaptive optimisers such as AdamW); none: lr as given.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from accutrain.core.options import LRScaling


def scaled_lr(lr: float, effective: int, rule: LRScaling, base_batch: Optional[int]) -> float:
    """`lr` scaled for a window of `effective` samples (the scheduler's factor applies on top)."""
    if rule is LRScaling.none:
        return lr
    if base_batch is None:
        raise ValueError(f"lr_scaling={rule.name} needs base_batch")
    ratio = effective / base_batch
    return lr * (ratio if rule is LRScaling.linear else math.sqrt(ratio))


@dataclass(frozen=True)
class BatchScaling:
    """scaling.lr with scaling.base_batch: what a window's effective batch multiplies the learning rate by."""

    rule: LRScaling = LRScaling.none
    base_batch: Optional[int] = None

    def factor(self, effective: int) -> float:
        return scaled_lr(1.0, effective, self.rule, self.base_batch)


def describe(lr: float, effective: int, rule: LRScaling, base_batch: Optional[int]) -> Optional[str]:
    """The start-up line, e.g. `lr 0.1 = 0.05 × 64/32 (scaling.lr=linear, base_batch 32)`; None if unscaled."""
    if rule is LRScaling.none:
        return None
    factor = f"{effective}/{base_batch}" if rule is LRScaling.linear else f"√({effective}/{base_batch})"
    return (f"lr {scaled_lr(lr, effective, rule, base_batch):.4g} = {lr:.4g} × {factor} "
            f"(scaling.lr={rule.name}, base_batch {base_batch})")


@contextmanager
def window_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Inside the block the optimizer steps with its learning rates × `factor` (the window's batch scaling); after
    it, the scheduler's own values are back, so that a scheduler computing from the current lr never compounds it."""
    if factor == 1.0:
        yield
        return
    own = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, own):
        group["lr"] = lr * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, own):
            group["lr"] = lr
