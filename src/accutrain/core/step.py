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
from typing import Callable, ContextManager, Iterable, Iterator, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from accutrain.core.batches import Batch, as_batch, stand_in_guard
from accutrain.core.compiled import eager
from accutrain.core.full_ce import logits_given_up
from accutrain.core.plan import ceil_div
from accutrain.core.precision import Precision, make_precision
from accutrain.core.summing import cross_entropy_sums, summed_cross_entropy
from accutrain.dist import is_sharded

FP32 = make_precision("32", torch.device("cpu"))


@runtime_checkable
class Rereadable(Protocol):
    """This rank's micro-batches of one window, iterated once as they arrive and read again from the start by
    `again()` (the same samples, views and mixes: a window is a function of the seed, its epoch and its index), so
    that a two-pass loss never keeps a window's inputs."""

    def __iter__(self) -> Iterator[Batch | Sequence[torch.Tensor]]: ...

    def again(self) -> Iterable[Batch | Sequence[torch.Tensor]]: ...


class Held(list):
    """Micro-batches held in memory (a test's, accutrain-check's): read again, they are the same objects."""

    def again(self) -> Held:
        return self


def rereadable(micro_batches: Iterable[Batch | Sequence[torch.Tensor]]) -> Rereadable:
    """`micro_batches` if it can read its window again, else held in memory."""
    return micro_batches if isinstance(micro_batches, Rereadable) else Held(micro_batches)


def micro_steps(micro_batches: Iterable[Batch | Sequence[torch.Tensor]]) -> Iterator[tuple[Batch, bool]]:
    """This rank's micro-batches of a window as they run, with whether each is the one that synchronises (the last:
    its backward all-reduces the window's gradients). A stand-in (this rank's share of a short window is empty) is
    skipped unless it is the last, which must run — forwarded, it backpropagates exact zeros — so that the
    all-reduce happens on every rank. Every accumulation, one pass or two, walks a window through this."""
    batches = iter(micro_batches)
    batch = next(batches, None)
    while batch is not None:
        following = next(batches, None)  # looked up first: the last micro-batch is the one that synchronises
        batch = as_batch(batch)
        if not (batch.stand_in and following is not None):
            yield batch, following is None
        batch = following


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
    `loss(output, target)` sums a micro-batch's terms. Micro-batches are taken one at a time and backward runs on
    each, so only one micro-batch's activations are alive at a time. Gradients are synchronised across ranks on the
    last micro-batch only (micro_steps). Returns this rank's summed loss over the window (stand-ins left out), a
    float64 scalar still on the device: the loop reads it with its one synchronisation. (Not a tensor per
    micro-batch: each loss kept would keep, on the CPU, the memory its reduction was computed in — about 0.8 MB per
    micro-batch of 8 × 1,024 tokens — so host memory would grow with the window.) `observe(n)`, if given, is called
    after each backward with its micro-batch's samples (0 for a stand-in): the noise scale's end of one micro-batch's
    gradient.
    """
    precision = precision or FP32
    given_up = logits_given_up if getattr(loss, "reads_logits_once", False) else nullcontext
    scale = world / terms  # DDP averages the ranks' gradients: × world undoes that mean
    total = torch.zeros((), dtype=torch.float64, device=device)  # Σ loss over this rank's micro-batches
    for batch, synchronises in micro_steps(micro_batches):
        with nullcontext() if synchronises else no_sync(), (  # one gradient all-reduce per window
                stand_in_guard(model, device) if batch.stand_in else nullcontext()), eager(model, len(batch)):
            if device.type != "cpu":  # the loader's batches are in CPU memory already
                batch = batch.to(device)
            with precision.autocast():
                logits = batch.forward(model, precision.inputs)
            with given_up():  # read no more: full logits' memory may take their gradient (core/full_ce.py)
                loss_sum = loss(logits, batch.target)  # Σ_{i in b} loss_i
            del logits  # what the backward needs, the graph holds
            precision.backward(loss_sum, 0.0 if batch.stand_in else scale)  # ∇ scale × Σ_{i in b} loss_i into .grad
            if observe is not None:
                observe(len(batch))
        if not batch.stand_in:
            total += loss_sum.detach()
    return total


def pieces(n: int, parts: int) -> int:
    """How many micro-batches one of `n` samples becomes when cut into `parts` (after an out-of-memory)."""
    return 1 if n <= 1 or parts == 1 else ceil_div(n, ceil_div(n, parts))


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


class Evaluated(Protocol):
    """What evaluate() needs of a loss summed per batch: its sums of one batch, and an output of no sample."""

    def eval_sums(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...

    def empty_eval(self) -> tuple[torch.Tensor, torch.Tensor]: ...


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, device: torch.device, precision: Optional[Precision] = None,
             loss: Optional[Evaluated] = None) -> torch.Tensor:
    """Sums over this rank's share of the held-out split, as the loss reduces an evaluation batch (its eval_sums;
    without a loss, cross-entropy's [summed loss, correct predictions, samples]); all-reduced and then divided once,
    they are exact over ranks."""
    precision = precision or FP32
    eval_sums = loss.eval_sums if loss is not None else cross_entropy_sums
    was_training = model.training
    model.eval()
    sums: Optional[torch.Tensor] = None
    with eager(model):  # a compiled model too: its evaluation would be one more graph
        for batch in loader:
            batch = as_batch(batch).to(device)
            with precision.autocast():
                logits = batch.forward(model, precision.inputs)
            these = eval_sums(logits, batch.target).to(device)
            sums = these if sums is None else sums + these
    model.train(was_training)
    if sums is None:  # this rank's share is empty: sums of zeros
        empty = loss.empty_eval() if loss is not None else (torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64))
        sums = eval_sums(*empty).to(device)
    return sums
