"""loss=kto (Ethayarajh et al. 2024) on feedback records (prompt, completion, desirable or not), exact under any split.

Each sample's loss, r = log π(y|x) − log π_ref(y|x) its log-ratio and z0 the reference point (kto_point.py):

    desirable     λ_D (1 − σ(β (r − z0)))        undesirable     λ_U (1 − σ(β (z0 − r)))

summed over the window and divided by |W|, its real samples. loss.reference_point=window (the default) takes z0 over
the WHOLE window — every micro-batch, every rank — in a first pass without gradients (the model in eval mode, so no
dropout is drawn and the random stream is untouched) before the first backward, as loss=moe takes the window's routing
counts: the step is the big batch's whatever the split, micro_batch=1 included. loss.reference_point=micro_batch
takes it per micro-batch from its own samples (TRL's per-device batch estimate) — NOT the big batch's objective, kept
for comparison. z0 carries no gradient (the paper's)."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from accutrain.core.batches import Batch, stand_in_guard
from accutrain.core.compiled import eager
from accutrain.core.gradcache import on
from accutrain.core.losses.kto_point import Point, mismatched_batch, reference_point, samples_of
from accutrain.core.losses.kto_spec import PRECOMPUTE
from accutrain.core.losses.logps import evaluating, role_inputs, sequence_logps, targets, weighted_logps
from accutrain.core.losses.preference import PreferenceLoss, reduced
from accutrain.core.precision import Precision
from accutrain.core.step import FP32, micro_steps, rereadable
from accutrain.errors import UserError

PER_MICRO_BATCH = ("loss.reference_point=micro_batch takes KTO's reference point z0 from each micro-batch's own "
                   "samples, so the accumulated step is NOT the big batch's (for comparison only; "
                   "loss.reference_point=window takes it over the whole window, exactly)")


@dataclass
class FeedbackLoss(PreferenceLoss):
    """The loss of loss=kto."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    reference_point: str = "window"
    seed: int = 0
    measured: dict = field(default_factory=dict, repr=False)
    name = "kto"
    task = "feedback"
    monitor = "val_loss"
    item_keys = ("input_ids", "completion.labels", "desirable", "prompt.length")
    wanted = "feedback records (prompt, completion and a true/false label)"

    @property
    def whole_window(self) -> bool:
        return self.reference_point == "window"

    # --- the maths ----------------------------------------------------------------------------------------------
    def losses(self, ratio: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor) -> torch.Tensor:
        good = desirable.bool()
        return torch.where(good, self.desirable_weight * (1 - F.sigmoid(self.beta * (ratio - z0))),
                           self.undesirable_weight * (1 - F.sigmoid(self.beta * (z0 - ratio))))

    def log_ratio(self, model: nn.Module, batch: Batch, precision: Precision) -> torch.Tensor:
        """log π − log π_ref of each row of `batch` (input_ids, attention_mask; its target the labels), without
        gradient, the policy in eval mode."""
        bare = getattr(model, "module", model)
        inputs = {k: batch.inputs[k] for k in ("input_ids", "attention_mask")}
        ref = self.ref.logps(model, inputs, batch.target, self.ignore_index, precision.inputs, precision.autocast)
        with torch.no_grad(), evaluating(bare), precision.autocast():
            output = bare(**{k: precision.inputs(v) for k, v in inputs.items()})
        return sequence_logps(output, targets(batch.target, self.ignore_index), self.ignore_index) - ref

    def point(self, model: nn.Module, samples: list, chunk: int, precision: Precision, world: int,
              device: torch.device) -> Point:
        return reference_point(samples, chunk, self.seed, world, lambda b: self.log_ratio(model, b, precision), 0,
                               self.ignore_index, device)

    def matched(self, model: nn.Module, batch: Batch, precision: Precision, grad: bool):
        """(policy log-probabilities detached, the reference's, the policy's output and targets)."""
        inputs, labels = role_inputs(batch.inputs, ""), batch.inputs["completion.labels"]
        ref = self.reference_logps(model, batch, "", inputs, labels, precision)
        target = targets(labels, self.ignore_index)
        with precision.autocast(), (nullcontext() if grad else torch.no_grad()):
            output = model(**{k: precision.inputs(v) for k, v in inputs.items()})
        return sequence_logps(output, target, self.ignore_index), ref, output, target

    # --- one window ---------------------------------------------------------------------------------------------
    def accumulate(self, model: nn.Module, micro_batches: Iterable, terms: int, device: torch.device, *,
                   world: int = 1, no_sync: Callable[[], ContextManager] = nullcontext,
                   precision: Optional[Precision] = None, observe: Optional[Callable[[int], None]] = None
                   ) -> torch.Tensor:
        """Pass 1 (reference_point=window): z0 over the window; pass 2: each micro-batch's Σ loss × world/|W|
        backpropagated. Returns this rank's summed loss."""
        precision = precision or FP32
        window = rereadable(micro_batches) if self.whole_window else micro_batches
        point = None
        if self.whole_window:
            local, chunk = [], 1
            for batch, _ in micro_steps(window):
                if not batch.stand_in:
                    local += samples_of(batch)
                    chunk = max(chunk, len(batch))
            point = self.point(model, local, chunk, precision, world, device)
        scale = world / terms
        total = torch.zeros((), dtype=torch.float64, device=device)
        tally = torch.zeros(6, dtype=torch.float64, device=device)
        for batch, synchronises in micro_steps(window.again() if self.whole_window else window):
            with nullcontext() if synchronises else no_sync(), (
                    stand_in_guard(model, device) if batch.stand_in else nullcontext()), eager(model, len(batch)):
                batch = on(batch, device)
                here = point if point is not None else self.micro_point(model, batch, precision, device)
                logp, ref, output, target = self.matched(model, batch, precision, grad=True)
                leaf = logp.clone().requires_grad_()
                losses = self.losses(leaf - ref, batch.inputs["desirable"], here.z0)
                (coef,) = torch.autograd.grad(losses.sum() * scale, [leaf])
                precision.backward(weighted_logps(output, target, coef, self.ignore_index),
                                   0.0 if batch.stand_in else 1.0)
                if observe is not None:
                    observe(len(batch))
            if not batch.stand_in:
                total += losses.detach().sum()
                tally += self.tally(logp - ref, batch.inputs["desirable"], here)
        self.measured = self.figures_of(reduced(tally, world), point)
        return total

    def micro_point(self, model: nn.Module, batch: Batch, precision: Precision, device: torch.device) -> Point:
        """z0 of one micro-batch alone (TRL's per-device estimate): each prompt with the next sample's completion —
        its own when it is alone."""
        local = samples_of(batch)
        completions = {local[b][0]: local[(b + 1) % len(local)][2] for b in range(len(local))}
        ratio = self.log_ratio(model, mismatched_batch(local, completions, 0, self.ignore_index, device), precision)
        return Point(ratio.sum(), torch.tensor(float(len(local)), dtype=torch.float64, device=device))

    def tally(self, ratio: torch.Tensor, desirable: torch.Tensor, point: Point) -> torch.Tensor:
        """[Σ desirable rewards, desirable samples, Σ undesirable rewards, undesirable samples, Σ z0 × samples,
        samples]."""
        good = desirable.bool()
        reward = self.beta * ratio
        n = torch.tensor(float(len(ratio)), dtype=torch.float64, device=ratio.device)
        return torch.stack([reward[good].sum(), good.double().sum(), reward[~good].sum(), (~good).double().sum(),
                            point.z0 * n, n])

    def figures_of(self, tally: torch.Tensor, point: Optional[Point]) -> dict[str, torch.Tensor]:
        """The window's z0 (per micro-batch: their mean, per sample), mean rewards of its desirable and undesirable
        samples."""
        good, n_good, bad, n_bad, z, n = tally.unbind()
        return {"kl": point.z0 if point is not None else z / n.clamp(min=1),
                "rewards_desirable": good / n_good.clamp(min=1), "rewards_undesirable": bad / n_bad.clamp(min=1)}

    # --- evaluation: z0 over the whole held-out split, then the losses ------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Iterable, device: torch.device, precision: Precision,
                 world: int) -> torch.Tensor:
        """[Σ loss, samples, Σ desirable rewards, desirable, Σ undesirable rewards, undesirable, z0 × samples]."""
        bare = getattr(model, "module", model)
        local, ratios, desirable, chunk = [], [], [], 1
        with evaluating(bare):
            for raw in loader:
                batch = on(raw if isinstance(raw, Batch) else Batch(*raw), device)
                local += samples_of(batch)
                chunk = max(chunk, len(batch))
                logp, ref, _, _ = self.matched(bare, batch, precision, grad=False)
                ratios.append(logp - ref)
                desirable.append(batch.inputs["desirable"])
        point = self.point(bare, local, chunk, precision, world, device)
        sums = torch.zeros(7, dtype=torch.float64, device=device)
        if ratios:
            ratio, good = torch.cat(ratios), torch.cat(desirable)
            tally = self.tally(ratio, good, point)
            sums = torch.cat([self.losses(ratio, good, point.z0).sum()[None], tally[5:6], tally[:4], tally[4:5]])
        return sums

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, n, good, n_good, bad, n_bad, z = sums
        return {"val_loss": loss / max(n, 1.0), "val_kl": z / max(n, 1.0),
                "val_rewards_desirable": good / max(n_good, 1.0), "val_rewards_undesirable": bad / max(n_bad, 1.0)}

    def summary(self, figures: dict[str, float]) -> str:
        if "kl" not in figures:
            return ""
        return (f"reference point z0 {figures['kl']:.4f}, rewards: desirable {figures['rewards_desirable']:.4f}, "
                f"undesirable {figures['rewards_undesirable']:.4f}")

    def notes(self, batch: Batch) -> list[str]:
        return [PER_MICRO_BATCH] if not self.whole_window else []

    def attach(self, model: nn.Module) -> list[str]:
        return super().attach(model) + ([PER_MICRO_BATCH] if not self.whole_window else [])


def kto(beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
        reference_point: str = "window", seed: int = 0, reference: str = "model", ignore_index: int = -100,
        model_defaults: Optional[dict] = None) -> FeedbackLoss:
    """loss=kto's factory (`loss._target_`)."""
    if not beta > 0:
        raise UserError(f"loss.beta={beta} is not valid: expected a positive number (e.g. 0.1)")
    for key, value in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if not value > 0:
            raise UserError(f"loss.{key}={value} is not valid: expected a positive weight")
    if reference != "model":
        raise UserError(f"loss.reference={reference} is not valid for loss=kto: {PRECOMPUTE.remedy}")
    if reference_point not in ("window", "micro_batch"):
        raise UserError(f"loss.reference_point={reference_point} is not valid: expected window (over the whole "
                        "window, exact) or micro_batch (per micro-batch, not the big batch's)")
    return FeedbackLoss(ignore_index=ignore_index, beta=float(beta), desirable_weight=float(desirable_weight),
                        undesirable_weight=float(undesirable_weight), reference_point=reference_point, seed=int(seed))
