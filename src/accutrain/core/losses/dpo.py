"""loss=dpo (kinds sigmoid, ipo, hinge, simpo; dpo_maths.py) and loss=orpo on preference pairs, exact under any split.

A window W of pairs: each pair's loss summed and divided by |W|, the window's real pairs (every micro-batch, every
rank); loss.nll_coef > 0 adds the chosen completions' NLL (RPO; ORPO's NLL term) normalised by the WINDOW's chosen
tokens N_c — counted from the labels before the first backward (the window read once without the model, summed over
ranks), so that term too is the big batch's:

    L(W) = (1/|W|) Σ_{pairs p in W} ℓ_p + α · (1/N_c) Σ_{chosen tokens t in W} −log π(y_t)

A micro-batch's backward is that of Σ_b c_b s_b (logps.py): c_b the derivative of its share of L(W) × world with
respect to its sequences' summed log-probabilities s_b. The reference π_ref (logps.Reference): the base with the LoRA
adapter disabled, or a frozen copy; reference-free kinds (simpo, orpo) take none."""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch
import torch.distributed as tdist
from torch import nn

from accutrain.core.batches import Batch, stand_in_guard
from accutrain.core.compiled import eager
from accutrain.core.gradcache import on
from accutrain.core.losses.dpo_maths import REFERENCE_FREE, Pairs, odds_ratio_losses, pair_losses, rewards
from accutrain.core.losses.dpo_spec import reference_values
from accutrain.core.losses.logps import completion_tokens, role_inputs, sequence_logps, targets, weighted_logps
from accutrain.core.losses.preference import PreferenceLoss, reduced
from accutrain.core.precision import Precision
from accutrain.core.step import FP32, micro_steps, rereadable
from accutrain.errors import UserError

ROLES = ("chosen", "rejected")


@dataclass
class PairLoss(PreferenceLoss):
    """The loss of loss=dpo (and of loss=orpo: kind `orpo`, its λ in `beta`, the NLL's weight 1)."""

    kind: str = "sigmoid"
    beta: float = 0.1
    gamma: float = 0.5  # simpo's target margin γ
    nll_coef: float = 0.0
    measured: dict = field(default_factory=dict, repr=False)
    name = "dpo"
    task = "preference"
    monitor = "val_rewards_accuracy"
    item_keys = ("chosen.input_ids", "rejected.input_ids")
    wanted = "preference pairs (records with prompt, chosen and rejected)"

    @property
    def reference_free(self) -> bool:
        return self.kind in REFERENCE_FREE or self.kind == "orpo"

    # --- one micro-batch -----------------------------------------------------------------------------------------
    def pairs(self, model: nn.Module, batch: Batch, precision: Precision, grad: bool) -> tuple[Pairs, list]:
        """The micro-batch's pairs (policy log-probabilities detached) and the policy's outputs (kept for the
        surrogate's backward when `grad`)."""
        logps, counts, outputs, refs = [], [], [], []
        for role in ROLES:
            inputs, labels = role_inputs(batch.inputs, role), batch.inputs[f"{role}.labels"]
            if not self.reference_free:
                refs.append(self.reference_logps(model, batch, role, inputs, labels, precision))
            with precision.autocast(), (nullcontext() if grad else torch.no_grad()):
                output = model(**{k: precision.inputs(v) for k, v in inputs.items()})
            logps.append(sequence_logps(output, targets(labels, self.ignore_index), self.ignore_index))
            counts.append(completion_tokens(labels, self.ignore_index))
            outputs.append((output, labels) if grad else None)
        return Pairs(logps[0], logps[1], *(refs or [None, None]), counts[0], counts[1]), outputs

    def objective(self, p: Pairs, scale: float, nll_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(this micro-batch's share of L(W) × world — `scale` = world/|W|, `nll_scale` = world/N_c — and its pairs'
        summed loss Σ ℓ_p, for the record)."""
        if self.kind == "orpo":
            losses, _ = odds_ratio_losses(self.beta, p)
        else:
            losses = pair_losses(self.kind, self.beta, self.gamma, p)
        nll = -p.chosen.sum()
        return losses.sum() * scale + self.nll_coef * nll * nll_scale, losses.sum()

    def tally(self, p: Pairs) -> torch.Tensor:
        """What the micro-batch adds to the window's figures: [Σ chosen reward, Σ rejected reward, pairs the chosen
        wins, Σ chosen NLL, chosen tokens, Σ log odds ratio (orpo)]."""
        kind = "simpo" if self.kind == "orpo" else self.kind
        chosen, rejected = rewards(kind, self.beta if self.kind != "orpo" else 1.0, p)
        odds = odds_ratio_losses(1.0, p)[1].sum() if self.kind == "orpo" else torch.zeros((), dtype=torch.float64,
                                                                                             device=chosen.device)
        return torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).double().sum(), -p.chosen.sum(),
                            p.chosen_tokens.sum(), odds])

    # --- one window -----------------------------------------------------------------------------------------------
    def accumulate(self, model: nn.Module, micro_batches: Iterable, terms: int, device: torch.device, *,
                   world: int = 1, no_sync: Callable[[], ContextManager] = nullcontext,
                   precision: Optional[Precision] = None, observe: Optional[Callable[[int], None]] = None
                   ) -> torch.Tensor:
        """.grad = ∇L(W) (the module's docstring), one reduction; returns this rank's Σ ℓ_p + α (|W|/N_c) Σ NLL."""
        precision = precision or FP32
        window = rereadable(micro_batches) if self.nll_coef else micro_batches
        chosen_tokens = self.window_chosen_tokens(window, device, world) if self.nll_coef else 1.0
        scale, nll_scale = world / terms, world / chosen_tokens
        total = torch.zeros((), dtype=torch.float64, device=device)
        tally = torch.zeros(6, dtype=torch.float64, device=device)
        for batch, synchronises in micro_steps(window.again() if self.nll_coef else window):
            with nullcontext() if synchronises else no_sync(), (
                    stand_in_guard(model, device) if batch.stand_in else nullcontext()), eager(model, len(batch)):
                batch = on(batch, device)
                p, outputs = self.pairs(model, batch, precision, grad=True)
                leaves = [p.chosen.clone().requires_grad_(), p.rejected.clone().requires_grad_()]
                q = dataclasses.replace(p, chosen=leaves[0], rejected=leaves[1])
                objective, summed = self.objective(q, scale, nll_scale)
                coefs = torch.autograd.grad(objective, leaves)
                surrogate = sum(weighted_logps(out, targets(labels, self.ignore_index), c, self.ignore_index)
                                for (out, labels), c in zip(outputs, coefs))
                precision.backward(surrogate, 0.0 if batch.stand_in else 1.0)
                if observe is not None:
                    observe(len(batch))
            if not batch.stand_in:
                total += summed.detach() + self.nll_coef * (-p.chosen.sum()) * terms / chosen_tokens
                tally += self.tally(p)
        self.measured = self.figures_of(reduced(tally, world), terms)
        return total

    def window_chosen_tokens(self, window: Any, device: torch.device, world: int) -> float:
        """N_c: the window's chosen completion tokens on every rank, from the labels alone (no forward)."""
        count = torch.zeros((), dtype=torch.float64, device=device)
        for batch, _ in micro_steps(window):
            if not batch.stand_in:
                count += completion_tokens(batch.inputs["chosen.labels"], self.ignore_index).sum().to(device)
        if world > 1:
            tdist.all_reduce(count)
        return max(float(count.item()), 1.0)

    def figures_of(self, tally: torch.Tensor, pairs: float) -> dict[str, torch.Tensor]:
        """The window's mean rewards (chosen, rejected), their margin, the fraction of pairs whose chosen wins, and
        (nll_coef, orpo) the chosen tokens' mean NLL, (orpo) the mean log odds ratio."""
        chosen, rejected, wins, nll, tokens, odds = tally.unbind()
        figures = {"rewards_chosen": chosen / pairs, "rewards_rejected": rejected / pairs,
                   "rewards_margin": (chosen - rejected) / pairs, "rewards_accuracy": wins / pairs}
        if self.nll_coef:
            figures["nll"] = nll / tokens.clamp(min=1)
        if self.kind == "orpo":
            figures["log_odds_ratio"] = odds / pairs
        return figures

    # --- evaluation ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_batch(self, model: nn.Module, batch: Batch, precision: Precision) -> torch.Tensor:
        """float64 [Σ ℓ_p, pairs, Σ chosen reward, Σ rejected reward, wins, Σ chosen NLL, chosen tokens, Σ log odds]."""
        p, _ = self.pairs(model, batch, precision, grad=False)
        _, summed = self.objective(p, 1.0, 0.0)
        n = torch.tensor(float(len(p.chosen)), dtype=torch.float64, device=summed.device)
        return torch.cat([torch.stack([summed, n]), self.tally(p)])

    def eval_width(self) -> int:
        return 8

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        """val_loss (the pairs' mean loss + α × the chosen tokens' mean NLL) and the held-out rewards."""
        loss, n, chosen, rejected, wins, nll, tokens, odds = sums
        n, tokens = max(n, 1.0), max(tokens, 1.0)
        metrics = {"val_loss": loss / n + self.nll_coef * nll / tokens, "val_rewards_chosen": chosen / n,
                   "val_rewards_rejected": rejected / n, "val_rewards_margin": (chosen - rejected) / n,
                   "val_rewards_accuracy": wins / n}
        return metrics

    def summary(self, figures: dict[str, float]) -> str:
        if "rewards_accuracy" not in figures:
            return ""
        return (f"rewards: chosen {figures['rewards_chosen']:.4f}, rejected {figures['rewards_rejected']:.4f}, "
                f"margin {figures['rewards_margin']:.4f}, accuracy {figures['rewards_accuracy']:.3f}")

    def notes(self, batch: Batch) -> list[str]:
        return []


def dpo(kind: str = "sigmoid", beta: float = 0.1, simpo_gamma: float = 0.5, nll_coef: float = 0.0,
        reference: str = "model", ignore_index: int = -100, model_defaults: Optional[dict] = None) -> PairLoss:
    """loss=dpo's factory (`loss._target_`)."""
    if kind not in ("sigmoid", "ipo", "hinge", "simpo"):
        raise UserError(f"loss.kind={kind} is not valid: expected sigmoid (DPO), ipo, hinge or simpo")
    check_positive("loss.beta", beta)
    if nll_coef < 0:
        raise UserError(f"loss.nll_coef={nll_coef} is not valid: expected 0 (off) or a positive weight")
    reference_values({"reference": reference})
    if reference == "precompute" and kind in REFERENCE_FREE:
        raise UserError(f"loss.reference=precompute: loss.kind={kind} is reference-free (nothing to precompute)")
    return PairLoss(ignore_index=ignore_index, kind=kind, beta=float(beta), gamma=float(simpo_gamma),
                    nll_coef=float(nll_coef), precompute=reference == "precompute")


def orpo(beta: float = 0.1, reference: str = "model", ignore_index: int = -100,
         model_defaults: Optional[dict] = None) -> PairLoss:
    """loss=orpo's factory: the chosen tokens' NLL (over the window's chosen tokens) + λ (loss.beta) × the mean odds
    ratio loss; reference-free."""
    check_positive("loss.beta", beta)
    if reference != "model":
        raise UserError(f"loss.reference={reference} is not valid for loss=orpo: it is reference-free")
    loss = PairLoss(ignore_index=ignore_index, kind="orpo", beta=float(beta), nll_coef=1.0)
    loss.name = "orpo"
    return loss


def check_positive(key: str, value: float) -> None:
    if not value > 0:
        raise UserError(f"{key}={value} is not valid: expected a positive number (e.g. 0.1)")
