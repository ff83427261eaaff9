"""The per-term families of `loss=` — mse, l1, huber, bce and a user's own per-term loss (`loss=custom`) — and their
factories (`loss._target_`): each loss is the sum of per-term losses (reduction none) over a micro-batch's counted terms, divided by the window's real count |W| in
accutrain.core.step — never a mean of micro-batch means.

A term is a sample (`loss.normalize=samples`: a sample's loss is the sum of its elements' losses) or an element of
the target (`elements`: the mean over the window's elements). Target elements equal to `loss.ignore_index` are
neither summed nor counted, so a target may mark what it does not know. The count comes from the targets alone:
|W| is known before the window's first backward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from accutrain.core.batches import Batch, as_batch
from accutrain.core.chunked_ce import logits_of
from accutrain.core.loss import OnePass
from accutrain.core.losses import elements_spec as spec
from accutrain.core.options import Normalize
from accutrain.errors import UserError

PerTerm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PerTermLoss(OnePass):
    """A loss from per-term losses: `per_term(output, target)` returns one loss per term, in the target's shape
    (or, for samples, one per sample: shape (N, …)). `name` is the config's (`loss=mse`, `loss._target_=…`)."""

    per_term: PerTerm
    task: str  # regression | multilabel | custom
    name: str
    elements: bool = True
    ignore_index: int = -100
    tokens = False

    @property
    def monitor(self) -> str:
        return "val_loss"

    def target(self, labels: torch.Tensor) -> torch.Tensor:
        return labels

    def check_targets(self, target: torch.Tensor, data: str) -> None:
        """Float values for regression and multi-label losses (class indices would be read as numbers); multi-hot
        (or soft) targets in [0, 1] for bce."""
        if self.task not in ("regression", "multilabel"):
            return
        if not target.is_floating_point():
            wanted = "float targets (values to regress)" if self.task == "regression" else "multi-hot float targets"
            raise UserError(f"loss={self.name} needs {wanted}, but data._target_={data} gives {target.dtype} class "
                            f"indices: use loss=cross_entropy, or data whose targets are "
                            f"{'values' if self.task == 'regression' else 'multi-hot'} (data=synthetic data.target="
                            f"{self.task})")
        counted = target[self.counted(target)]
        if self.task == "multilabel" and len(counted) and not bool(((counted >= 0) & (counted <= 1)).all()):
            bad = counted[(counted < 0) | (counted > 1)][0].item()
            raise UserError(f"loss={self.name} takes targets in [0, 1] (multi-hot labels, or soft ones), and "
                            f"data._target_={data} gives {bad:g} in the first samples: rescale the targets, or use "
                            "loss=mse for values (loss.ignore_index marks an element to skip)")

    def counted(self, target: torch.Tensor) -> torch.Tensor:
        """The target's elements that count: those not equal to ignore_index."""
        return target != self.ignore_index

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The per-term losses, float32 at least, those of ignored elements zero; one clear line when the loss is
        not per term (a scalar, or not one row per sample). A Projection's logits are computed whole for it."""
        output = logits_of(output)
        if self.task != "custom" and output.shape != target.shape:
            if output.numel() != target.numel():
                raise UserError(f"loss={self.name} compares the model's output of shape {tuple(output.shape)} "
                                f"with targets of shape {tuple(target.shape)}: the model must output one value per "
                                "target element")
            output = output.reshape(target.shape)
        if output.dtype in (torch.float16, torch.bfloat16):
            output = output.float()
        values = self.per_term(output, target)
        if not isinstance(values, torch.Tensor) or values.dim() == 0 or values.shape[0] != target.shape[0]:
            got = ("a scalar (a mean or a sum over the batch)" if isinstance(values, torch.Tensor) and
                   values.dim() == 0 else f"shape {tuple(values.shape)}" if isinstance(values, torch.Tensor)
                   else type(values).__name__)
            raise UserError(f"loss._target_={self.name} returned {got} for {target.shape[0]} samples: it must return "
                            "per-term losses (reduction='none'), one row per sample, so that accutrain sums and "
                            "counts them over the whole window")
        if values.shape == target.shape:
            values = values.masked_fill(~self.counted(target), 0.0)
        elif self.elements:
            raise UserError(f"loss._target_={self.name} returned shape {tuple(values.shape)} for targets of shape "
                            f"{tuple(target.shape)}: loss.normalize=elements counts the target's elements, so the "
                            "per-term losses must have the target's shape (or use loss.normalize=samples)")
        return values

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Σ over the micro-batch's counted terms."""
        return self.losses(output, labels).sum()

    def terms(self, micro_batches: Iterable[Batch | Sequence[torch.Tensor]]) -> int:
        """|W| of these micro-batches: their samples, or their target elements not equal to ignore_index."""
        batches = [as_batch(b) for b in micro_batches]
        if not self.elements:
            return sum(len(b) for b in batches)
        return int(sum(int(self.counted(b.target).sum()) for b in batches if not b.stand_in))

    def eval_sums(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """float64 sums of one evaluation batch: [summed loss, terms, …the task's own]."""
        losses = self.losses(output, labels)
        terms = self.counted(labels).sum() if self.elements else torch.tensor(labels.shape[0])
        head = [losses.sum().double(), terms.double()]
        if self.task == "custom":
            return torch.stack(head)
        counted = self.counted(labels)
        output = logits_of(output).reshape(labels.shape).double()
        if self.task == "regression":  # Σ|error|, Σ error², elements
            error = (output - labels.double()).masked_fill(~counted, 0.0)
            return torch.stack([*head, error.abs().sum(), error.square().sum(), counted.sum().double()])
        predicted, actual = output > 0, labels > 0.5  # multi-label: a logit above 0 predicts the label
        tp, fp, fn = ((predicted & actual & counted).sum(), (predicted & ~actual & counted).sum(),
                      (~predicted & actual & counted).sum())
        return torch.stack([*head, tp.double(), fp.double(), fn.double()])

    def empty_eval(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(0, 1), torch.zeros(0, 1)

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        """val_loss, and val_mae / val_rmse (regression) or val_f1, micro-averaged (multi-label), from the held-out
        split's summed eval_sums."""
        measured = {"val_loss": sums[0] / sums[1]}
        if self.task == "regression":
            measured.update(val_mae=sums[2] / sums[4], val_rmse=math.sqrt(sums[3] / sums[4]))
        elif self.task == "multilabel":
            tp, fp, fn = sums[2:]
            measured["val_f1"] = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0
        return measured


def elements_of(normalize: Normalize | str, default: Normalize) -> bool:
    """Whether `loss.normalize` counts elements (auto: the loss's default)."""
    normalize = Normalize(normalize)
    return (default if normalize is Normalize.auto else normalize) in (Normalize.elements, Normalize.tokens)


def mse(normalize: Normalize | str = "auto", ignore_index: int = -100) -> PerTermLoss:
    """loss=mse: squared error; auto normalizes over elements (torch's MSELoss mean)."""
    return PerTermLoss(lambda x, y: F.mse_loss(x, y, reduction="none"), "regression", "mse",
                       elements_of(normalize, Normalize.elements), ignore_index)


def l1(normalize: Normalize | str = "auto", ignore_index: int = -100) -> PerTermLoss:
    """loss=l1: absolute error; auto normalizes over elements."""
    return PerTermLoss(lambda x, y: F.l1_loss(x, y, reduction="none"), "regression", "l1",
                       elements_of(normalize, Normalize.elements), ignore_index)


def huber(normalize: Normalize | str = "auto", ignore_index: int = -100, delta: float = 1.0) -> PerTermLoss:
    """loss=huber: squared error below `delta`, linear above; auto normalizes over elements."""
    spec.threshold(dict(delta=delta))
    return PerTermLoss(lambda x, y: F.huber_loss(x, y, reduction="none", delta=delta), "regression", "huber",
                       elements_of(normalize, Normalize.elements), ignore_index)


def bce(normalize: Normalize | str = "auto", ignore_index: int = -100, pos_weight: Optional[float] = None
        ) -> PerTermLoss:
    """loss=bce: multi-label, one logit per class against multi-hot (or soft) float targets; auto normalizes over
    samples × classes (torch's BCEWithLogitsLoss mean), samples sums each sample's classes."""
    weight = None if pos_weight is None else torch.tensor(float(pos_weight))

    def per_term(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y = y.to(x.dtype).clamp(0, 1)  # ignored elements (ignore_index) are masked after; clamped, they stay finite
        return F.binary_cross_entropy_with_logits(x, y, reduction="none",
                                                  pos_weight=None if weight is None else weight.to(x.device))

    return PerTermLoss(per_term, "multilabel", "bce", elements_of(normalize, Normalize.elements), ignore_index)


def custom(fn: Any, name: str, normalize: Normalize | str = "samples", ignore_index: int = -100) -> PerTermLoss:
    """loss=custom: a user's callable `fn(output, target)` returning per-term losses (reduction none): one per
    sample (normalize=samples: rows summed per sample) or one per target element (elements)."""
    return PerTermLoss(fn, "custom", name, elements_of(normalize, Normalize.samples), ignore_index)
