"""Accumulate one window, and evaluate.

For a window W (every micro-batch on every rank before one optimizer step) with |W| loss terms:

    grad = Σ_{micro-batch b in W} ∇ [ Σ_{i in b} loss_i ] / |W|

|W| is the real count, so the step is the big batch's step also when the last micro-batch of an epoch is short
or the last window incomplete (dividing by `accum` would over-weight a short tail). With DDP averaging over
`world` ranks, each rank scales its sum by world / |W|. The loss terms are the window's samples, or (for
element-level losses, loss.normalize=elements) its elements (tokens, pixels) whose target is not ignore_index —
counted after the shift when the labels are shifted (loss.shift_labels). A batch is an accutrain.core.batches.Batch (or
an (inputs, target) pair); a stand-in batch (a rank with an empty share) backpropagates exact zeros.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, Iterable, Optional, Sequence

import torch
from torch import nn

from accutrain.core.batches import Batch, as_batch, stand_in_guard
from accutrain.core.compiled import eager
from accutrain.core.loss import Loss, SummedLoss, summed_cross_entropy
from accutrain.core.precision import Precision, make_precision
from accutrain.dist import is_sharded

FP32 = make_precision("32", torch.device("cpu"))


def accumulate(
    model: nn.Module,
    micro_batches: Iterable[Batch | Sequence[torch.Tensor]],
    terms: int,
    device: torch.device,
    *,
    world: int = 1,
    no_sync: Callable[[], ContextManager] = nullcontext,
    precision: Optional[Precision] = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = summed_cross_entropy,
    observe: Optional[Callable[[int], None]] = None,
) -> torch.Tensor:
    """Forward and backward each of this rank's micro-batches of one window; .grad then holds ∇(mean loss over W).

    `terms` is |W|, the window's loss terms on all ranks (samples, or elements), known before the first backward.
    Micro-batches are taken one at a time and backward runs on each, so only one micro-batch's activations are
    alive at a time. Gradients are synchronised across ranks on the last micro-batch only. A stand-in batch (this
    rank's share of a short window is empty) is skipped under no_sync; on the synchronising micro-batch it is
    forwarded and backpropagates exact zeros, so the all-reduce happens. Returns this rank's summed loss over the
    window (stand-ins left out), a float64 scalar still on the device: the loop reads it with its one
    synchronisation. (Not a tensor per micro-batch: each loss kept would keep, on the CPU, the memory its
    reduction was computed in — about 0.8 MB per micro-batch of 8 × 1,024 tokens — so host memory would grow with
    the window.) `observe(n)`, if given, is called after each backward with its micro-batch's samples (0 for a
    stand-in): the noise scale's end of one micro-batch's gradient.
    """
    precision = precision or FP32
    scale = world / terms  # DDP averages the ranks' gradients: × world undoes that mean
    total = torch.zeros((), dtype=torch.float64, device=device)  # Σ loss over this rank's micro-batches
    batches = iter(micro_batches)
    batch = next(batches, None)
    while batch is not None:
        following = next(batches, None)  # looked up first: the last micro-batch is the one that synchronises
        batch = as_batch(batch)
        if batch.stand_in and following is not None:
            batch = following  # nothing to synchronise here: no forward needed
            continue
        with no_sync() if following is not None else nullcontext(), (  # one gradient all-reduce per window
                stand_in_guard(model, device) if batch.stand_in else nullcontext()), eager(model, len(batch)):
            if device.type != "cpu":  # the loader's batches are in CPU memory already
                batch = batch.to(device)
            with precision.autocast():
                logits = batch.forward(model, precision.inputs)
            loss_sum = loss(logits, batch.target)  # Σ_{i in b} loss_i
            precision.backward(loss_sum, 0.0 if batch.stand_in else scale)  # ∇ scale × Σ_{i in b} loss_i into .grad
            if observe is not None:
                observe(0 if batch.stand_in else len(batch))
        if not batch.stand_in:
            total += loss_sum.detach()
        batch = following
    return total


def pieces(n: int, parts: int) -> int:
    """How many micro-batches one of `n` samples becomes when cut into `parts` (after an out-of-memory)."""
    return 1 if n <= 1 or parts == 1 else -(-n // -(-n // parts))


def cut_micro_batches(micro_batches: Iterable[Batch | Sequence[torch.Tensor]], parts: int) -> Iterable[Batch]:
    """Cut every micro-batch into `parts` smaller ones (after an out-of-memory): the same samples, same window."""
    for batch in micro_batches:
        yield from as_batch(batch).split(parts)


def grad_norm(parameters: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of the window's gradients, measured before clipping them to max_norm (if set). Gradients
    of one device and dtype (the usual case) take the fused kernels directly — the same arithmetic as
    clip_grad_norm_/get_total_norm, without their grouping, which costs more than the norm on a small model. Others
    go through torch's own functions; sharded ones (strategy=fsdp) too: the norm is then a collective, which every
    rank calls."""
    grads = [p.grad for p in parameters if p.grad is not None]
    kinds = {(type(g), g.device, g.dtype, g.layout) for g in grads}
    if len(kinds) == 1 and next(iter(kinds))[0] is torch.Tensor and grads[0].layout == torch.strided:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if max_norm is not None:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    return norm.full_tensor() if is_sharded(norm) else norm  # FSDP's: replicated, the same on every rank


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, device: torch.device, precision: Optional[Precision] = None,
             loss: Loss = SummedLoss()) -> torch.Tensor:
    """Sums over this rank's share of the held-out split, as the loss reduces an evaluation batch (its eval_sums:
    for cross-entropy [summed loss, correct predictions, terms], the terms being samples or elements whose target,
    after any shift, is not ignore_index); all-reduced and then divided once, they are exact over ranks."""
    precision = precision or FP32
    was_training = model.training
    model.eval()
    sums: Optional[torch.Tensor] = None
    with eager(model):  # a compiled model too: its evaluation would be one more graph
        for batch in loader:
            batch = as_batch(batch).to(device)
            with precision.autocast():
                logits = batch.forward(model, precision.inputs)
            these = loss.eval_sums(logits, batch.target).to(device)
            sums = these if sums is None else sums + these
    model.train(was_training)
    return sums if sums is not None else loss.eval_sums(*empty_batch(loss)).to(device)


def empty_batch(loss: Loss) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, target) of no sample, for a rank whose share of the held-out split is empty: sums of zeros."""
    if loss.task == "classification":
        return torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64)
    return torch.zeros(0, 1), torch.zeros(0, 1)
