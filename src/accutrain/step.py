"""Accumulate one window, and evaluate.

For a window W (every micro-batch on every rank before one optimizer step) with |W| samples:

    grad = Σ_{micro-batch b in W} ∇ [ Σ_{i in b} loss_i ] / |W|

|W| is the real count, so the step is the big batch's step also when the last micro-batch of an epoch is short
or the last window incomplete (dividing by `accum` would over-weight a short tail). With DDP averaging over
`world` ranks, each rank scales its sum by world / |W|.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, Iterable

import torch
import torch.nn.functional as F
from torch import nn


def summed_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Σ_i loss_i over the micro-batch: the reduction is a sum so that the window, not the micro-batch, divides."""
    return F.cross_entropy(logits, target, reduction="sum")


def accumulate(
    model: nn.Module,
    micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    n_micro: int,
    window_size: int,
    device: torch.device,
    *,
    world: int = 1,
    no_sync: Callable[[], ContextManager] = nullcontext,
) -> torch.Tensor:
    """Forward and backward each of the window's `n_micro` micro-batches; .grad then holds ∇(mean loss over W).

    Backward runs per micro-batch, so only one micro-batch's activations are alive at a time. Gradients are
    synchronised across ranks on the last micro-batch only. Returns this rank's summed loss, detached.
    """
    scale = world / window_size
    loss_total = torch.zeros((), device=device, dtype=torch.float64)
    for k, (x, y) in enumerate(micro_batches):
        with no_sync() if k < n_micro - 1 else nullcontext():  # one gradient all-reduce per window
            loss_sum = summed_cross_entropy(model(x.to(device, non_blocking=True)),
                                            y.to(device, non_blocking=True))
            (loss_sum * scale).backward()
        loss_total += loss_sum.detach()
    return loss_total


def grad_norm(parameters: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of the window's gradients, measured before clipping them to max_norm (if set)."""
    if max_norm is not None:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], foreach=True)


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, device: torch.device) -> torch.Tensor:
    """Sums over this rank's share of the held-out split: tensor([summed loss, correct predictions, samples])."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        sums[0] += summed_cross_entropy(logits.float(), y).double()
        sums[1] += (logits.argmax(1) == y).sum()
        sums[2] += len(y)
    model.train(was_training)
    return sums
