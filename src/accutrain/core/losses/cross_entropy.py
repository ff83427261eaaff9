"""loss=cross_entropy, the default family: classes per sample or per element (tokens), soft targets (MixUp/CutMix),
label smoothing — a micro-batch's loss summed over its terms, divided by the window's real count |W| in
accutrain.core.step (one pass: accutrain.core.loss.OnePass)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from accutrain.core.batches import Batch, as_batch
from accutrain.core.loss import Batches, OnePass
from accutrain.core.options import Normalize
from accutrain.core.summing import count_terms, cross_entropy_sums, shift_left, summed_cross_entropy
from accutrain.errors import UserError


@dataclass(frozen=True)
class SummedLoss(OnePass):
    """loss=cross_entropy: a micro-batch's loss summed over its terms, and how to count the terms."""

    elements: bool = False  # terms are elements (tokens), not samples
    ignore_index: int = -100
    shift_labels: bool = False  # targets are the labels shifted left by one position (labels = input_ids)
    label_smoothing: float = 0.0  # loss.label_smoothing: training only (evaluation reports the plain loss)
    per_sequence: bool = False  # loss.normalize=sequences: a term is a sample's mean over its elements

    name = "cross_entropy"
    task = "classification"
    reads_logits_once = True  # the step may give the logits up to their gradient (core/full_ce.py)

    def target(self, labels: torch.Tensor) -> torch.Tensor:
        """The targets the loss compares the logits with."""
        return shift_left(labels, self.ignore_index) if self.shift_labels else labels

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(logits, self.target(labels), self.ignore_index, self.label_smoothing,
                                    self.per_sequence)

    def terms(self, micro_batches: Batches) -> int:
        """|W| of these micro-batches: samples, or elements counted after the shift."""
        batches = [as_batch(b) for b in micro_batches]
        if self.shift_labels:
            batches = [Batch(b.inputs, self.target(b.target), b.stand_in) for b in batches]
        return count_terms(batches, self.elements, self.ignore_index)

    @property
    def tokens(self) -> bool:
        return self.elements

    @property
    def monitor(self) -> str:
        """trainer.monitor=auto: a classifier follows its accuracy, a language model its loss (per token, or with
        loss.normalize=sequences per sequence)."""
        return "val_loss" if self.elements or self.per_sequence else "val_acc"

    def per_element(self, batch: Batch) -> bool:
        """Targets per element (tokens), not soft targets per sample (MixUp)."""
        return batch.target.dim() > 1 and not batch.target.is_floating_point()

    def reference_terms(self, batch: Batch) -> int:
        """The big batch's mean: over its elements when the targets are per element (a check of loss.normalize
        too), per sequence with loss.normalize=sequences."""
        per_element = self.per_element(batch) and not self.per_sequence
        return dataclasses.replace(self, elements=per_element).terms([batch])

    def notes(self, batch: Batch) -> list[str]:
        if self.per_element(batch) and not self.elements and not self.per_sequence:
            return ["per-element targets with loss.normalize=samples: the window's loss is its token losses summed "
                    "per sample, not their mean over the window's tokens, so windows with more tokens take larger "
                    "steps; use loss.normalize=elements"]
        return []

    def eval_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """float64 [plain summed loss (no smoothing), correct predictions, terms] of one evaluation batch."""
        return cross_entropy_sums(logits, self.target(labels), self.ignore_index)

    def empty_eval(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64)

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        """val_loss, val_acc (and val_ppl per token) from the held-out split's summed eval_sums."""
        loss_sum, correct, n = sums
        measured = {"val_loss": loss_sum / n, "val_acc": correct / n}
        if self.elements:
            measured["val_ppl"] = math.exp(min(loss_sum / n, 700))
        return measured

    def check_targets(self, target: torch.Tensor, data: str) -> None:
        if self.shift_labels and target.dim() < 2:
            raise UserError("loss.shift_labels=true needs a target per token (labels = input_ids); this data has one "
                            "target per sample")

    def attach(self, model: nn.Module) -> list[str]:
        routing = getattr(model, "routing", None)  # a mixture of experts (models/moe.py)
        if routing is not None and self.elements:
            return [f"the model ({routing.name}) routes each token to {routing.top_k} of {routing.experts} experts, "
                    "and loss=cross_entropy does not balance its router (experts may collapse): loss=moe adds its "
                    "balancing loss, over the whole window"]
        return []

    def check(self, model: nn.Module, batch: Batch, data: str) -> None:
        if self.per_sequence and isinstance(batch.inputs, dict) and "document_ids" in batch.inputs:
            raise UserError("loss.normalize=sequences averages each sample's tokens, and data.packing=true makes a "
                            "sample a block of several documents: use data.packing=false with "
                            "loss.normalize=sequences")
        super().check(model, batch, data)


def make_loss(normalize: Normalize, ignore_index: int, shift_labels: Optional[bool] = None,
              model_defaults: Optional[dict] = None, label_smoothing: float = 0.0) -> SummedLoss:
    """The run's loss; `loss.normalize=auto` and `loss.shift_labels=null` take the model's defaults (its factory's
    `loss_defaults`: model=hf_causal_lm's tokens, shifted), else samples, unshifted."""
    defaults = dict(model_defaults or {})
    if normalize is Normalize.auto:
        normalize = Normalize(defaults.get("normalize", "samples"))
    shift = defaults.get("shift_labels", False) if shift_labels is None else shift_labels
    return SummedLoss(normalize in (Normalize.elements, Normalize.tokens), ignore_index, shift, label_smoothing,
                      normalize is Normalize.sequences)


# --- the factories `loss._target_` names: every key of a loss's node is a keyword argument -------------------
def cross_entropy(normalize: Normalize | str = "auto", ignore_index: int = -100, shift_labels: Optional[bool] = None,
                  label_smoothing: float = 0.0, model_defaults: Optional[dict] = None) -> SummedLoss:
    """loss=cross_entropy: classes per sample or per element (tokens), soft targets (MixUp/CutMix), smoothing;
    `model_defaults` (supplied by the run: the model factory's `loss_defaults`) decide normalize=auto and
    shift_labels=null."""
    return make_loss(Normalize(normalize), ignore_index, shift_labels, model_defaults, label_smoothing)
