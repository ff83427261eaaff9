"""Accumulate one window, and evaluate.

For a window W (every micro-batch on every rank before one optimizer step) with |W| loss terms:

    grad = Σ_{micro-batch b in W} ∇ [ Σ_{i in b} loss_i ] / |W|

|W| is the real count, so the step is the big batch's step also when the last micro-batch of an epoch is short
or the last window incomplete (dividing by `accum` would over-weight a short tail). With DDP averaging over
`world` ranks, each rank scales its sum by world / |W|. The loss terms are the window's samples, or (for
element-level losses, loss.normalize=elements) its elements (tokens, pixels) whose target is not ignore_index —
counted after the shift when the labels are shifted (loss.shift_labels). A batch is an accutrain.batches.Batch (or
an (inputs, target) pair); a stand-in batch (a rank with an empty share) backpropagates exact zeros.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from accutrain.batches import Batch, as_batch, stand_in_guard
from accutrain.compiled import eager
from accutrain.dist import is_sharded
from accutrain.precision import Precision, make_precision
from accutrain.schemas import Normalize

FP32 = make_precision("32", torch.device("cpu"))


def summed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         label_smoothing: float = 0.0) -> torch.Tensor:
    """Σ_i loss_i over the micro-batch: the reduction is a sum so that the window, not the micro-batch, divides.
    Targets are class indices per sample (logits N×C) or per element (logits N×C×d…, targets N×d…), whose
    ignore_index adds nothing, or class probabilities per sample (N×C floats: MixUp/CutMix's soft targets).
    label_smoothing ε makes each target (1 - ε) × itself + ε/C on every class, per term: the sum stays a sum of
    per-term losses. Half-precision logits are promoted: the loss is float32 at least."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, target, reduction="sum", ignore_index=ignore_index,
                           label_smoothing=label_smoothing)


def shift_left(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Position t's target becomes labels[t + 1] (the last position gets ignore_index): the targets of a causal LM
    whose labels are its inputs (Hugging Face's convention labels = input_ids)."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def count_terms(micro_batches: Iterable[Batch | Sequence[torch.Tensor]], elements: bool, ignore_index: int = -100
                ) -> int:
    """The loss terms in these micro-batches (targets as the loss sees them): samples, or elements whose target is
    not ignore_index. A stand-in has none."""
    batches = [as_batch(b) for b in micro_batches]
    if not elements:
        return sum(len(b) for b in batches)
    return int(sum(int((b.target != ignore_index).sum()) for b in batches if not b.stand_in))


@dataclass(frozen=True)
class SummedLoss:
    """The run's loss (`loss.*`): a micro-batch's loss summed over its terms, and how to count the terms."""

    elements: bool = False  # terms are elements (tokens), not samples
    ignore_index: int = -100
    shift_labels: bool = False  # targets are the labels shifted left by one position (labels = input_ids)
    label_smoothing: float = 0.0  # loss.label_smoothing: training only (evaluation reports the plain loss)

    def target(self, labels: torch.Tensor) -> torch.Tensor:
        """The targets the loss compares the logits with."""
        return shift_left(labels, self.ignore_index) if self.shift_labels else labels

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(logits, self.target(labels), self.ignore_index, self.label_smoothing)

    def terms(self, micro_batches: Iterable[Batch | Sequence[torch.Tensor]]) -> int:
        """|W| of these micro-batches: samples, or elements counted after the shift."""
        batches = [as_batch(b) for b in micro_batches]
        if self.shift_labels:
            batches = [Batch(b.inputs, self.target(b.target), b.stand_in) for b in batches]
        return count_terms(batches, self.elements, self.ignore_index)


def make_loss(normalize: Normalize, ignore_index: int, shift_labels: Optional[bool] = None,
              model: Optional[nn.Module] = None, label_smoothing: float = 0.0) -> SummedLoss:
    """The run's loss; `loss.normalize=auto` and `loss.shift_labels=null` take the model's `loss_defaults` (model=
    hf_causal_lm: tokens, shifted), else samples, unshifted."""
    defaults = getattr(model, "loss_defaults", {})
    if normalize is Normalize.auto:
        normalize = Normalize(defaults.get("normalize", "samples"))
    shift = defaults.get("shift_labels", False) if shift_labels is None else shift_labels
    return SummedLoss(normalize in (Normalize.elements, Normalize.tokens), ignore_index, shift, label_smoothing)


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
) -> torch.Tensor:
    """Forward and backward each of this rank's micro-batches of one window; .grad then holds ∇(mean loss over W).

    `terms` is |W|, the window's loss terms on all ranks (samples, or elements), known before the first backward.
    Micro-batches are taken one at a time and backward runs on each, so only one micro-batch's activations are
    alive at a time. Gradients are synchronised across ranks on the last micro-batch only. A stand-in batch (this
    rank's share of a short window is empty) is skipped under no_sync; on the synchronising micro-batch it is
    forwarded and backpropagates exact zeros, so the all-reduce happens. Returns this rank's summed losses, one per
    micro-batch (stand-ins left out), still on the device: the loop reads them with its one synchronisation.
    """
    precision = precision or FP32
    scale = world / terms
    parts: list[torch.Tensor] = []  # the micro-batches' summed losses
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
            loss_sum = loss(logits, batch.target)
            precision.backward(loss_sum, 0.0 if batch.stand_in else scale)
        if not batch.stand_in:
            parts.append(loss_sum.detach())
        batch = following
    return torch.stack(parts) if parts else torch.zeros(0, device=device)


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
             loss: SummedLoss = SummedLoss()) -> torch.Tensor:
    """Sums over this rank's share of the held-out split: tensor([summed loss, correct predictions, terms]), where
    the terms are samples, or (for element targets) elements whose target (after any shift) is not ignore_index."""
    precision = precision or FP32
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)
    with eager(model):  # a compiled model too: its evaluation would be one more graph
        for batch in loader:
            batch = as_batch(batch).to(device)
            with precision.autocast():
                logits = batch.forward(model, precision.inputs)
            y = loss.target(batch.target)
            counted = y != loss.ignore_index
            sums[0] += summed_cross_entropy(logits, y, loss.ignore_index).double()
            sums[1] += ((logits.argmax(1) == y) & counted).sum()
            sums[2] += counted.sum()
    model.train(was_training)
    return sums
