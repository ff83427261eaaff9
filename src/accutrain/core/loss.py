"""The loss protocol: what every loss family (`loss=`) implements, so that the loop, accutrain-check and the build
use the run's loss without knowing which it is — and cross-entropy, the default family.

A family decides how a window is accumulated (one pass per micro-batch, or two passes with cached gradients for a
loss over the whole window), how the held-out split is evaluated (per sample, or as one candidate set), what
accutrain-check compares, and what its targets must look like. Its refusals of other options are rows of
accutrain.config.refusals, checked before PyTorch loads. Adding a family: a module in core/ (its maths and these
methods), a config node (configs/loss/), its row in the refusal table, tests — nothing in train/ (docs/layout.md).

Auxiliary outputs: a family that needs more of the model than its output (loss=moe: the router's logits) calls the
model with `aux=(name, …)`; a model that provides them then returns (output, {name: value}) — model=hf_causal_lm
does for a mixture of experts (models/moe.py) — and a plain call still returns the output alone. What a family
measures beside its loss per window (`figures`) goes into each step's record, the trackers and the summary line.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterable, Optional, Protocol, Sequence

import torch
from torch import nn

from accutrain.core.batches import Batch
from accutrain.core.precision import Precision
from accutrain.core.step import accumulate, evaluate
from accutrain.errors import UserError

__all__ = ["Loss", "OnePass", "Batches"]
Batches = Iterable[Batch | Sequence[torch.Tensor]]


class Loss(Protocol):
    """What the loop, the check and the build need of the run's loss."""

    name: str  # loss=<option>, or a plug-in's `_target_`: for messages
    elements: bool  # |W| counts the targets' elements (accutrain.core.terms), not the window's samples
    tokens: bool  # the terms are tokens: the records add their count, their rate and the perplexity
    task: str  # classification | regression | multilabel | custom | contrastive: the metrics, the monitor's default
    ignore_index: int
    min_window: int  # the fewest samples a window must hold for the loss to mean anything
    whole_window: bool  # a sample's loss depends on the window's other samples: the window is seen whole
    output: str  # what the model returns for it: logits (per class or target element; checked) or embeddings

    @property
    def monitor(self) -> str:
        """trainer.monitor=auto: the metric best.pt and early stopping follow."""

    def terms(self, micro_batches: Batches) -> int:
        """|W| of these micro-batches: samples, or counted elements — from the targets alone."""

    def accumulate(self, model: nn.Module, micro_batches: Batches, terms: int, device: torch.device, *,
                   world: int = 1, no_sync: Callable[[], ContextManager] = nullcontext,
                   precision: Optional[Precision] = None, observe: Optional[Callable[[int], None]] = None
                   ) -> torch.Tensor:
        """Forward and backward this rank's micro-batches of one window (a step.Rereadable when the family reads
        the window twice); .grad then holds ∇(the window's loss / |W|), reduced across ranks once. Returns this
        rank's summed loss (float64, on the device)."""

    def evaluate(self, model: nn.Module, loader: Iterable, device: torch.device, precision: Precision,
                 world: int) -> torch.Tensor:
        """This rank's sums over its share of the held-out split (float64): all-reduced, eval_metrics divides."""

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        """val_loss and the family's metrics from the summed evaluation sums of every rank."""

    def reference(self, model: nn.Module, batch: Batch, device: torch.device, precision: Precision) -> torch.Tensor:
        """accutrain-check's reference: the whole window as one batch, its gradient (the big batch's: its loss over
        its own count) into .grad. Returns the summed loss."""

    def probe(self, batch: Batch) -> Batch:
        """The batch as the model's forward takes it, one input per row (for the check's batch-dependence probe)."""

    def notes(self, batch: Batch) -> list[str]:
        """What in the loss's own settings makes the accumulated step differ from the big batch's (check's causes)."""

    def target(self, labels: torch.Tensor) -> torch.Tensor:
        """The targets the output is compared with (labels shifted for a causal LM)."""

    def check(self, model: nn.Module, batch: Batch, data: str) -> None:
        """The first samples through the model and the loss, once before training: the targets are what the loss
        takes and the loss has a gradient, or one UserError naming the key (`data` is data._target_)."""

    def attach(self, model: nn.Module) -> list[str]:
        """What the loss needs of the model (a learnt temperature becomes its parameter); the warnings to log."""

    def prepare(self, model: nn.Module, splits: Any, device: torch.device, precision: Precision) -> list[str]:
        """What the loss takes of the data once before training, before the check and any resume (loss.reference=
        precompute: core/losses/precomputed.py, `splits` a Splits); the lines to log ([] for none)."""

    def figures(self) -> dict[str, torch.Tensor]:
        """What the loss measured over the window it accumulated last, beside its loss (loss=moe: the router's load
        per layer): named 0-d tensors on the device, the same on every rank. The loop reads them with the step's
        one synchronisation into the step's record (metrics.jsonl, the trackers); {} for none."""

    def summary(self, figures: dict[str, float]) -> str:
        """The final summary line's words for the last step's figures ('' for none)."""

    def components(self) -> dict[str, Loss]:
        """Parts of the objective whose gradient accutrain-check also compares alone, where the whole's would hide
        them (loss=moe: the router's balancing loss beside the cross-entropy); {} for none."""


class Defaults:
    """The Loss members a family without them takes: no notes, nothing attached or prepared, no figures, summary or
    components of its own (OnePass and WindowLoss start from it)."""

    # True where the loss reads a micro-batch's logits once and hands nothing of them on: the step may then let the
    # full logits' memory take their gradient (core/full_ce.py). A loss that reads them again after a cross-entropy
    # of them (a user's subclass adding a term of the logits) keeps False.
    reads_logits_once = False

    def notes(self, batch: Batch) -> list[str]:
        return []

    def attach(self, model: nn.Module) -> list[str]:
        return []

    def prepare(self, model: nn.Module, splits: Any, device: torch.device, precision: Precision) -> list[str]:
        return []

    def figures(self) -> dict[str, torch.Tensor]:
        return {}

    def summary(self, figures: dict[str, float]) -> str:
        return ""

    def components(self) -> dict[str, Loss]:
        return {}


class OnePass(Defaults):
    """The window methods of a loss summed per micro-batch (cross-entropy, the per-term losses): a window is
    step.accumulate's one pass, an evaluation the sum of its batches' eval_sums. A subclass gives the maths:
    __call__ (Σ over a micro-batch's terms), terms, eval_sums, empty_eval, eval_metrics, target."""

    min_window = 1
    whole_window = False
    output = "logits"
    name: str
    terms: Callable[[Batches], int]
    __call__: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def accumulate(self, model: nn.Module, micro_batches: Batches, terms: int, device: torch.device, *,
                   world: int = 1, no_sync: Callable[[], ContextManager] = nullcontext,
                   precision: Optional[Precision] = None, observe: Optional[Callable[[int], None]] = None
                   ) -> torch.Tensor:
        return accumulate(model, micro_batches, terms, device, world=world, no_sync=no_sync, precision=precision,
                          loss=self, observe=observe)

    def evaluate(self, model: nn.Module, loader: Iterable, device: torch.device, precision: Precision,
                 world: int) -> torch.Tensor:
        return evaluate(model, loader, device, precision, self)

    def reference_terms(self, batch: Batch) -> int:
        """The big batch's count, for the check's reference."""
        return self.terms([batch])

    def reference(self, model: nn.Module, batch: Batch, device: torch.device, precision: Precision) -> torch.Tensor:
        return accumulate(model, [batch], self.reference_terms(batch), device, precision=precision, loss=self)

    def probe(self, batch: Batch) -> Batch:
        return batch

    def check_targets(self, target: torch.Tensor, data: str) -> None:
        """One line when the data's targets are not what the loss compares the output with."""

    def check(self, model: nn.Module, batch: Batch, data: str) -> None:
        self.check_targets(batch.target, data)
        training = model.training
        model.eval()  # no dropout draw, no BatchNorm statistics moved: the run starts as it would without the check
        try:
            output = batch.forward(model)
            value = self(output, batch.target)
        except SystemExit as e:
            raise UserError(f"loss={self.name} called sys.exit({e.code}) on the first samples: a loss returns "
                            "per-term losses and never ends the program") from None
        finally:
            model.train(training)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            return  # the per-term check (losses()) has said what is wrong already
        trained = any(p.requires_grad for p in model.parameters())
        if trained and not value.requires_grad:
            raise UserError(f"loss={self.name} returned a loss without gradient on the first samples (computed "
                            "under torch.no_grad, detached, or through .item()/numpy): training could not move the "
                            "weights; compute it from the model's output with torch operations")
