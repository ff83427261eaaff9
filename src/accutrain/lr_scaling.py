"""`optim.lr_scaling`: the learning rate follows the effective batch, relative to `optim.base_batch`.

linear: lr × effective / base_batch (the linear scaling rule, for SGD); sqrt: lr × √(effective / base_batch)
(for adaptive optimisers such as AdamW); none: lr as given.
"""
from __future__ import annotations

import math
from typing import Optional

from accutrain.config import LRScaling

# The optim keys that configure the scaling; they are not arguments of the optimizer factories.
KEYS = ("lr_scaling", "base_batch")


def scaled_lr(lr: float, effective: int, rule: LRScaling, base_batch: Optional[int]) -> float:
    """The learning rate the optimizer starts from (before the scheduler's factor)."""
    if rule is LRScaling.none:
        return lr
    if base_batch is None:
        raise ValueError(f"lr_scaling={rule.name} needs base_batch")
    ratio = effective / base_batch
    return lr * (ratio if rule is LRScaling.linear else math.sqrt(ratio))


def describe(lr: float, effective: int, rule: LRScaling, base_batch: Optional[int]) -> Optional[str]:
    """The start-up line, e.g. `lr 0.1 = 0.05 × 64/32 (optim.lr_scaling=linear, base_batch 32)`; None if unscaled."""
    if rule is LRScaling.none:
        return None
    factor = f"{effective}/{base_batch}" if rule is LRScaling.linear else f"√({effective}/{base_batch})"
    return (f"lr {scaled_lr(lr, effective, rule, base_batch):.4g} = {lr:.4g} × {factor} "
            f"(optim.lr_scaling={rule.name}, base_batch {base_batch})")
