"""Cross-entropy summed over a micro-batch's terms, and counting terms: the reductions a window's real count |W|,
not the micro-batch, divides (accutrain.core.step)."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from accutrain.core.batches import Batch, as_batch
from accutrain.core.chunked_ce import Projection, linear_cross_entropy_sums, summed_linear_cross_entropy
from accutrain.core.full_ce import summed_rows_cross_entropy


def summed_cross_entropy(logits: torch.Tensor | Projection, target: torch.Tensor, ignore_index: int = -100,
                         label_smoothing: float = 0.0, per_sequence: bool = False) -> torch.Tensor:
    """Σ_i loss_i over the micro-batch: the reduction is a sum so that the window, not the micro-batch, divides.
    Targets are class indices per sample (logits N×C) or per element (logits N×C×d…, targets N×d…), whose
    ignore_index adds nothing, or class probabilities per sample (N×C floats: MixUp/CutMix's soft targets).
    label_smoothing ε makes each target (1 - ε) × itself + ε/C on every class, per term: the sum stays a sum of
    per-term losses. Half-precision logits are promoted: the loss is float32 at least. `per_sequence`: Σ_s of
    sample s's mean over its elements whose target is not ignore_index (0 for a sample without one) — each
    sample's count is its own, so the sum is the same however the samples are grouped. A Projection (hidden states
    and a linear head) gives the same sum without its full logits (core/chunked_ce.py)."""
    if isinstance(logits, Projection):
        weights = sequence_weights(target, ignore_index, logits.hidden.dtype) if per_sequence else None
        return summed_linear_cross_entropy(logits, target, ignore_index, label_smoothing, weights)
    rows = class_rows(logits, target)
    if rows is not None:  # a language model's full logits: chunk by chunk, not kept for the backward
        weights = sequence_weights(target, ignore_index, logits.dtype).reshape(-1) if per_sequence else None
        return summed_rows_cross_entropy(rows, target.reshape(-1), ignore_index, label_smoothing, weights)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if not per_sequence:
        return F.cross_entropy(logits, target, reduction="sum", ignore_index=ignore_index,
                               label_smoothing=label_smoothing)
    per_element = F.cross_entropy(logits, target, reduction="none", ignore_index=ignore_index,
                                  label_smoothing=label_smoothing)
    dims = tuple(range(1, per_element.dim()))
    counted = (target != ignore_index).sum(dims).clamp(min=1)  # padding and masked prompts carry ignore_index
    return (per_element.sum(dims) / counted).sum()


def class_rows(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """Per-element logits (N, C, d…) whose classes are the innermost dimension in memory (a language model's
    (batch, length, classes) seen as (batch, classes, length)) with class-index targets, as a view of rows
    (N·d…, C); else None."""
    if logits.dim() < 3 or target.is_floating_point():
        return None
    last = logits.movedim(1, -1)
    return last.reshape(-1, logits.shape[1]) if last.is_contiguous() else None


def sequence_weights(target: torch.Tensor, ignore_index: int, dtype: torch.dtype) -> torch.Tensor:
    """1 / (sample's counted elements) for each element of the targets (loss.normalize=sequences), float32 at least."""
    counted = (target != ignore_index).flatten(1).sum(1).clamp(min=1)
    weights = 1.0 / counted.to(torch.promote_types(dtype, torch.float32))
    return weights.reshape(-1, *[1] * (target.dim() - 1)).expand(target.shape)


def cross_entropy_sums(logits: torch.Tensor | Projection, target: torch.Tensor, ignore_index: int = -100
                       ) -> torch.Tensor:
    """float64 [plain summed loss (no smoothing), correct predictions, terms] of one evaluation batch of targets as
    the loss compares them (after any shift)."""
    if isinstance(logits, Projection):
        return linear_cross_entropy_sums(logits, target, ignore_index)
    counted = target != ignore_index
    return torch.stack([summed_cross_entropy(logits, target, ignore_index).double(),
                        ((logits.argmax(1) == target) & counted).sum().double(), counted.sum().double()])


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
