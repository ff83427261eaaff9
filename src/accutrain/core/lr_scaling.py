"""`scaling.*`: hyperparameters that follow the effective batch, relative to `scaling.base_batch`.

scaling.lr — linear: lr × effective / base_batch (the linear scaling rule, for SGD); sqrt: lr × √(effective /
base_batch) (for adaptive optimisers such as AdamW); none: lr as given.
scaling.beta2=half_life — Adam's β2 ** (effective / base_batch): a moving average with factor β2 per step forgets
half of itself after ln ½ / ln β2 steps, i.e. base_batch × ln ½ / ln β2 samples; the power keeps that number of
samples fixed whatever the batch (Marek et al. 2025). scaling.ema — trainer.ema's decay likewise (Busbridge et al.
2023, "How to Scale Your EMA"). Each applies per window, to that window's effective batch (batch_schedule too).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from accutrain.core.options import Beta2Scaling, LRScaling


def scaled_lr(lr: float, effective: int, rule: LRScaling, base_batch: Optional[int]) -> float:
    """`lr` scaled for a window of `effective` samples (the scheduler's factor applies on top)."""
    if rule is LRScaling.none:
        return lr
    if base_batch is None:
        raise ValueError(f"lr_scaling={rule.name} needs base_batch")
    ratio = effective / base_batch
    return lr * (ratio if rule is LRScaling.linear else math.sqrt(ratio))


@dataclass(frozen=True)
class WindowScaling:
    """What one window's effective batch does to the hyperparameters: the learning rate's factor, and the powers
    Adam's β2 and the EMA's decay are raised to (1.0: as given)."""

    lr: float = 1.0
    beta2: float = 1.0
    ema: float = 1.0


@dataclass(frozen=True)
class BatchScaling:
    """scaling.lr, scaling.beta2 and scaling.ema with scaling.base_batch: what a window's effective batch does to
    the learning rate, β2 and the EMA's decay."""

    rule: LRScaling = LRScaling.none
    base_batch: Optional[int] = None
    beta2: Beta2Scaling = Beta2Scaling.none
    ema: bool = False

    def factor(self, effective: int) -> float:
        return scaled_lr(1.0, effective, self.rule, self.base_batch)

    def window(self, effective: int) -> WindowScaling:
        """The scaling of a window of `effective` samples."""
        if self.base_batch is None:
            return WindowScaling(self.factor(effective))
        ratio = effective / self.base_batch
        return WindowScaling(self.factor(effective), ratio if self.beta2 is Beta2Scaling.half_life else 1.0,
                             ratio if self.ema else 1.0)


def half_life_samples(decay: float, batch: int) -> float:
    """The samples after which a moving average with factor `decay` per step of `batch` samples weighs ½."""
    return batch * math.log(0.5) / math.log(decay)


def describe(lr: float, effective: int, rule: LRScaling, base_batch: Optional[int]) -> Optional[str]:
    """The start-up line, e.g. `lr 0.1 = 0.05 × 64/32 (scaling.lr=linear, base_batch 32)`; None if unscaled."""
    if rule is LRScaling.none:
        return None
    factor = f"{effective}/{base_batch}" if rule is LRScaling.linear else f"√({effective}/{base_batch})"
    return (f"lr {scaled_lr(lr, effective, rule, base_batch):.4g} = {lr:.4g} × {factor} "
            f"(scaling.lr={rule.name}, base_batch {base_batch})")


@contextmanager
def window_hparams(optimizer: torch.optim.Optimizer, scaled: WindowScaling) -> Iterator[None]:
    """Inside the block the optimizer steps with its learning rates × scaled.lr and its β2 ** scaled.beta2; after
    it, its own values are back (so that the optimizer's state_dict, hence a checkpoint, holds the unscaled ones)."""
    with window_lr(optimizer, scaled.lr), window_beta2(optimizer, scaled.beta2):
        yield


@contextmanager
def window_beta2(optimizer: torch.optim.Optimizer, power: float) -> Iterator[None]:
    """Inside the block every parameter group's betas are (β1, β2 ** power); after it, the given ones."""
    if power == 1.0:
        yield
        return
    own = [group["betas"] for group in optimizer.param_groups]
    for group, (beta1, beta2) in zip(optimizer.param_groups, own):
        group["betas"] = (beta1, beta2 ** power)
    try:
        yield
    finally:
        for group, betas in zip(optimizer.param_groups, own):
            group["betas"] = betas


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
