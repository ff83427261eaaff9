"""The pair losses of loss=dpo, per pair, from the sequences' summed log-probabilities (float64):

    h = (log π(y_c|x) − log π_ref(y_c|x)) − (log π(y_r|x) − log π_ref(y_r|x))
    sigmoid (DPO, Rafailov et al. 2023)   −log σ(β h)
    ipo     (Azar et al. 2023)             (h − 1/(2β))²
    hinge   (SLiC, Zhao et al. 2023)       max(0, 1 − β h)
    simpo   (Meng et al. 2024)             −log σ(β (log π(y_c|x)/|y_c| − log π(y_r|x)/|y_r|) − γ), reference-free

with the implicit rewards β (log π − log π_ref) (SimPO: β log π / |y|). loss=orpo (Hong et al. 2024) is λ · −log σ of
the log odds ratio of the length-normalised log-probabilities, beside the chosen completions' NLL."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("sigmoid", "ipo", "hinge", "simpo")
REFERENCE_FREE = ("simpo",)


@dataclass(frozen=True)
class Pairs:
    """A set of pairs' per-sequence figures: the policy's summed log-probabilities (chosen, rejected), the
    reference's (None: reference-free) and the completions' token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def rewards(kind: str, beta: float, p: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's implicit rewards (chosen, rejected)."""
    if kind in REFERENCE_FREE:
        return beta * p.chosen / p.chosen_tokens, beta * p.rejected / p.rejected_tokens
    return beta * (p.chosen - p.ref_chosen), beta * (p.rejected - p.ref_rejected)


def pair_losses(kind: str, beta: float, gamma: float, p: Pairs) -> torch.Tensor:
    """Each pair's loss (see the module's docstring)."""
    chosen, rejected = rewards(kind, beta, p)
    if kind == "sigmoid":
        return -F.logsigmoid(chosen - rejected)
    if kind == "ipo":
        h = (chosen - rejected) / beta
        return (h - 1 / (2 * beta)) ** 2
    if kind == "hinge":
        return torch.relu(1 - (chosen - rejected))
    if kind == "simpo":
        return -F.logsigmoid(chosen - rejected - gamma)
    raise ValueError(f"loss.kind={kind}")


def odds_ratio_losses(lam: float, p: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO's per-pair −λ log σ(log odds(y_c) − log odds(y_r)), odds(y) = P̄/(1 − P̄), P̄ the length-normalised
    likelihood; and the log odds ratio itself (for the figures)."""
    mean_c, mean_r = p.chosen / p.chosen_tokens, p.rejected / p.rejected_tokens
    log_odds = (mean_c - mean_r) - (torch.log1p(-torch.exp(mean_c)) - torch.log1p(-torch.exp(mean_r)))
    return -lam * F.logsigmoid(log_odds), log_odds
