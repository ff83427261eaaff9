"""Learning-rate schedules selected by `sched=`; both step once per optimizer step, never per micro-batch."""
from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def _warmup(step: int, warmup_steps: int) -> float:
    """Linear warm-up: the first optimizer step uses lr/warmup_steps, step warmup_steps the full lr."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


def constant(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: _warmup(step, warmup_steps))


def cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
           min_lr_ratio: float = 0.0) -> LambdaLR:
    """Warm-up, then half a cosine from the peak lr towards min_lr_ratio × peak, reached after the last step."""
    decay_steps = max(1, total_steps - warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return _warmup(step, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
