"""The loss as accumulation needs it: summed over a micro-batch's terms (samples, or elements whose target is not
ignore_index), so that the window's real count |W|, not the micro-batch, divides (accutrain.core.step).

Every loss of `loss=` (this module's cross-entropy, accutrain.core.losses' others) is a `Loss`: it sums a micro-batch's
terms, counts the terms of any micro-batches from their targets alone (|W| is known before the first backward), and
reduces an evaluation to sums (exact over ranks: all-reduced, then divided once)."""
from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Iterable, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from accutrain.core.batches import Batch, as_batch
from accutrain.core.options import Normalize


def summed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         label_smoothing: float = 0.0, per_sequence: bool = False) -> torch.Tensor:
    """Σ_i loss_i over the micro-batch: the reduction is a sum so that the window, not the micro-batch, divides.
    Targets are class indices per sample (logits N×C) or per element (logits N×C×d…, targets N×d…), whose
    ignore_index adds nothing, or class probabilities per sample (N×C floats: MixUp/CutMix's soft targets).
    label_smoothing ε makes each target (1 - ε) × itself + ε/C on every class, per term: the sum stays a sum of
    per-term losses. Half-precision logits are promoted: the loss is float32 at least. `per_sequence`: Σ_s of
    sample s's mean over its elements whose target is not ignore_index (0 for a sample without one) — each
    sample's count is its own, so the sum is the same however the samples are grouped."""
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


class Loss(Protocol):
    """What the loop, the step and the check need of the run's loss."""

    elements: bool  # the terms are counted from the targets (accutrain.core.terms), not the window's samples
    tokens: bool  # the terms are tokens: the records add their count, their rate and the perplexity
    task: str  # classification | regression | multilabel | custom: the metrics measured, the monitor's default
    ignore_index: int

    def target(self, labels: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...

    def terms(self, micro_batches: Iterable[Batch | Sequence[torch.Tensor]]) -> int: ...

    def eval_sums(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...

    def eval_metrics(self, sums: list[float]) -> dict[str, float]: ...

    @property
    def monitor(self) -> str: ...


@dataclass(frozen=True)
class SummedLoss:
    """The run's loss (`loss.*`): a micro-batch's loss summed over its terms, and how to count the terms."""

    elements: bool = False  # terms are elements (tokens), not samples
    ignore_index: int = -100
    shift_labels: bool = False  # targets are the labels shifted left by one position (labels = input_ids)
    label_smoothing: float = 0.0  # loss.label_smoothing: training only (evaluation reports the plain loss)
    per_sequence: bool = False  # loss.normalize=sequences: a term is a sample's mean over its elements

    def target(self, labels: torch.Tensor) -> torch.Tensor:
        """The targets the loss compares the logits with."""
        return shift_left(labels, self.ignore_index) if self.shift_labels else labels

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(logits, self.target(labels), self.ignore_index, self.label_smoothing,
                                    self.per_sequence)

    def terms(self, micro_batches: Iterable[Batch | Sequence[torch.Tensor]]) -> int:
        """|W| of these micro-batches: samples, or elements counted after the shift."""
        batches = [as_batch(b) for b in micro_batches]
        if self.shift_labels:
            batches = [Batch(b.inputs, self.target(b.target), b.stand_in) for b in batches]
        return count_terms(batches, self.elements, self.ignore_index)

    task = "classification"

    @property
    def tokens(self) -> bool:
        return self.elements

    @property
    def monitor(self) -> str:
        """trainer.monitor=auto: a classifier follows its accuracy, a language model its loss (per token, or with
        loss.normalize=sequences per sequence)."""
        return "val_loss" if self.elements or self.per_sequence else "val_acc"

    def eval_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """float64 [plain summed loss (no smoothing), correct predictions, terms] of one evaluation batch."""
        y = self.target(labels)
        counted = y != self.ignore_index
        return torch.stack([summed_cross_entropy(logits, y, self.ignore_index).double(),
                            ((logits.argmax(1) == y) & counted).sum().double(), counted.sum().double()])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        """val_loss, val_acc (and val_ppl per token) from the held-out split's summed eval_sums."""
        loss_sum, correct, n = sums
        measured = {"val_loss": loss_sum / n, "val_acc": correct / n}
        if self.elements:
            measured["val_ppl"] = math.exp(min(loss_sum / n, 700))
        return measured


def make_loss(normalize: Normalize, ignore_index: int, shift_labels: Optional[bool] = None,
              model: Optional[nn.Module] = None, label_smoothing: float = 0.0) -> SummedLoss:
    """The run's loss; `loss.normalize=auto` and `loss.shift_labels=null` take the model's `loss_defaults` (model=
    hf_causal_lm: tokens, shifted), else samples, unshifted."""
    defaults = getattr(model, "loss_defaults", {})
    if normalize is Normalize.auto:
        normalize = Normalize(defaults.get("normalize", "samples"))
    shift = defaults.get("shift_labels", False) if shift_labels is None else shift_labels
    return SummedLoss(normalize in (Normalize.elements, Normalize.tokens), ignore_index, shift, label_smoothing,
                      normalize is Normalize.sequences)
