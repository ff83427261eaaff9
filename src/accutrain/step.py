"""Accumulate one window, and evaluate.

For a window W (every micro-batch on every rank before one optimizer step) with |W| loss terms:

    grad = Σ_{micro-batch b in W} ∇ [ Σ_{i in b} loss_i ] / |W|

|W| is the real count, so the step is the big batch's step also when the last micro-batch of an epoch is short
or the last window incomplete (dividing by `accum` would over-weight a short tail). With DDP averaging over
`world` ranks, each rank scales its sum by world / |W|. The loss terms are the window's samples, or (for
element-level losses, loss.normalize=elements) its elements (tokens, pixels) whose target is not ignore_index.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from accutrain.config import Normalize
from accutrain.dist import is_sharded
from accutrain.precision import Precision, make_precision

FP32 = make_precision("32", torch.device("cpu"))


def summed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Σ_i loss_i over the micro-batch: the reduction is a sum so that the window, not the micro-batch, divides.
    Targets are per sample (logits N×C) or per element (logits N×C×d…, targets N×d…); targets equal to
    ignore_index add nothing. Half-precision logits are promoted: the loss is float32 at least."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, target, reduction="sum", ignore_index=ignore_index)


def count_terms(micro_batches: Iterable[Sequence[torch.Tensor]], elements: bool, ignore_index: int = -100) -> int:
    """The loss terms in these micro-batches: samples, or elements whose target is not ignore_index."""
    if not elements:
        return sum(len(b[1]) for b in micro_batches)
    return int(sum(int((b[1] != ignore_index).sum()) for b in micro_batches))


@dataclass(frozen=True)
class SummedLoss:
    """The run's loss (`loss.*`): a micro-batch's loss summed over its terms, and how to count the terms."""

    elements: bool = False  # terms are elements (tokens), not samples
    ignore_index: int = -100

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(logits, target, self.ignore_index)

    def terms(self, micro_batches: Iterable[Sequence[torch.Tensor]]) -> int:
        return count_terms(micro_batches, self.elements, self.ignore_index)


def make_loss(normalize: Normalize, ignore_index: int) -> SummedLoss:
    return SummedLoss(normalize in (Normalize.elements, Normalize.tokens), ignore_index)


def accumulate(
    model: nn.Module,
    micro_batches: Iterable[Sequence[torch.Tensor]],
    terms: int,
    device: torch.device,
    *,
    world: int = 1,
    no_sync: Callable[[], ContextManager] = nullcontext,
    precision: Optional[Precision] = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = summed_cross_entropy,
) -> torch.Tensor:
    """Forward and backward each of this rank's micro-batches of one window; .grad then holds ∇(mean loss over W).

    `terms` is |W|, the window's loss terms on all ranks (samples, or elements), known before the first backward.
    Micro-batches are taken one at a time and backward runs on each, so only one micro-batch's activations are
    alive at a time. Gradients are synchronised across ranks on the last micro-batch only. Returns this rank's
    summed loss.
    """
    precision = precision or FP32
    scale = world / terms
    loss_total = torch.zeros((), device=device, dtype=torch.float64)
    batches = iter(micro_batches)
    batch = next(batches, None)
    while batch is not None:
        following = next(batches, None)  # looked up first: the last micro-batch is the one that synchronises
        x, y = batch
        with no_sync() if following is not None else nullcontext():  # one gradient all-reduce per window
            with precision.autocast():
                logits = model(precision.inputs(x.to(device, non_blocking=True)))
            loss_sum = loss(logits, y.to(device, non_blocking=True))
            precision.backward(loss_sum * scale)
        loss_total += loss_sum.detach()
        batch = following
    return loss_total


def pieces(n: int, parts: int) -> int:
    """How many micro-batches one of `n` samples becomes when cut into `parts` (after an out-of-memory)."""
    return 1 if n <= 1 or parts == 1 else -(-n // -(-n // parts))


def cut_micro_batches(micro_batches: Iterable[Sequence[torch.Tensor]], parts: int
                      ) -> Iterable[tuple[torch.Tensor, ...]]:
    """Cut every micro-batch into `parts` smaller ones (after an out-of-memory): the same samples, same window."""
    for batch in micro_batches:
        n = len(batch[0])
        if n <= 1 or parts == 1:
            yield tuple(batch)
            continue
        size = -(-n // parts)
        yield from zip(*(t.split(size) for t in batch))


def grad_norm(parameters: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of the window's gradients, measured before clipping them to max_norm (if set). Of sharded
    gradients (strategy=fsdp) too: it is then a collective, which every rank calls."""
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], foreach=True)
    return norm.full_tensor() if is_sharded(norm) else norm  # FSDP's: replicated, the same on every rank


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, device: torch.device, precision: Optional[Precision] = None,
             ignore_index: int = -100) -> torch.Tensor:
    """Sums over this rank's share of the held-out split: tensor([summed loss, correct predictions, terms]), where
    the terms are samples, or (for element targets) elements whose target is not ignore_index."""
    precision = precision or FP32
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with precision.autocast():
            logits = model(precision.inputs(x))
        counted = y != ignore_index
        sums[0] += summed_cross_entropy(logits, y, ignore_index).double()
        sums[1] += ((logits.argmax(1) == y) & counted).sum()
        sums[2] += counted.sum()
    model.train(was_training)
    return sums
