"""The maths of a mixture-of-experts router's balancing over a set of tokens (loss=moe, accutrain.core.losses.moe).

Switch/Mixtral-style balancing, as Hugging Face's `load_balancing_loss_func` computes it (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, …): over the tokens T (padding excluded) and the router layers l = 1…L, pooled,

    f_i = C_i / (L·|T|)      C_i = Σ_l Σ_t [i ∈ top-k of p_l(t)]      (a count: no gradient)
    P_i = S_i / (L·|T|)      S_i = Σ_l Σ_t p_l(t)_i                    (p = softmax of the router's logits)
    L_bal = N_E · Σ_i f_i · P_i

Its gradient flows through S alone, a sum over tokens: for a window cut into micro-batches b, with C and |T| of the
whole window known first, L_bal = Σ_b N_E · Σ_i f_i^W · S_i^b / (L·|T^W|) — each micro-batch's share is exact.
The router z-loss (ST-MoE) per token t: the mean over layers of logsumexp(logits_l(t))².
Everything here is float32 at least (the router's own softmax is float32), counts float64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch


@dataclass(frozen=True)
class Routing:
    """What a mixture-of-experts model says of its router (a model's `routing` attribute: models/moe.py)."""

    experts: int  # N_E: experts per router layer
    top_k: int  # experts each token is routed to
    coef: float  # the model's own weight of its balancing loss (router_aux_loss_coef)
    name: str  # the architecture, for messages (e.g. MixtralForCausalLM)
    returns_logits: bool = True  # each router layer's logits can be taken from its forward (aux=("router_logits",))
    own_loss: bool = True  # it computes a balancing loss of its own (aux=("aux_loss",)): its formula can be checked


@dataclass
class Routed:
    """One forward's routing over its tokens: per layer and expert the top-k counts C (float64, no gradient) and the
    summed probabilities S (with gradient), the tokens |T| counted, and Σ_t of the z-loss over the tokens `z_rows`
    names."""

    counts: torch.Tensor  # (L, E)
    probs: torch.Tensor  # (L, E)
    tokens: torch.Tensor  # () float64
    z: torch.Tensor  # () Σ_t mean_l logsumexp², over the z-loss's tokens


def token_rows(inputs: Mapping[str, torch.Tensor] | torch.Tensor) -> Optional[torch.Tensor]:
    """Which rows of the router's (batch × length, experts) logits are real tokens: the attention mask's ones, or
    (blocks packed by documents) the tokens of a document — padding is excluded, as the model's own loss excludes it.
    None: every row (no mask)."""
    if not isinstance(inputs, Mapping):
        return None
    if "document_ids" in inputs:  # a packed block: its 4-D mask is the model's, its padding has document 0
        return inputs["document_ids"].reshape(-1) != 0
    mask = inputs.get("attention_mask")
    return mask.reshape(-1) != 0 if mask is not None and mask.dim() == 2 else None


def route(logits: Sequence[torch.Tensor], top_k: int, rows: Optional[torch.Tensor],
          z_rows: Optional[torch.Tensor] = None) -> Routed:
    """The routing of one forward from its router logits (one (rows, E) tensor per layer); `rows` the real tokens
    (token_rows), `z_rows` the tokens the z-loss counts (None: no z-loss)."""
    counts, probs, z = [], [], None
    for layer in logits:
        layer = layer.float() if layer.dtype in (torch.float16, torch.bfloat16) else layer
        p = torch.softmax(layer, dim=-1)
        chosen = p.detach().topk(top_k, dim=-1).indices
        weight = torch.ones_like(chosen, dtype=torch.float64) if rows is None else \
            rows[:, None].expand_as(chosen).to(torch.float64)
        counts.append(torch.zeros(p.shape[-1], dtype=torch.float64, device=p.device)
                      .index_add_(0, chosen.reshape(-1), weight.reshape(-1)))
        probs.append((p if rows is None else p * rows[:, None].to(p.dtype)).sum(0))
        if z_rows is not None:
            squared = torch.logsumexp(layer, dim=-1).square() * z_rows.to(layer.dtype)
            z = squared.sum() if z is None else z + squared.sum()
    device = logits[0].device
    tokens = torch.tensor(float(logits[0].shape[0]), dtype=torch.float64, device=device) if rows is None else \
        rows.sum().to(torch.float64)
    z = z / len(logits) if z is not None else torch.zeros((), device=device)
    return Routed(torch.stack(counts), torch.stack(probs), tokens, z)


def balancing(counts: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor | float) -> torch.Tensor:
    """N_E · Σ_i f_i · P_i of counts C and summed probabilities S (L, E) over `tokens` tokens: the model's own
    formula when C, S and |T| are one micro-batch's; the big batch's when they are the window's; and with the
    window's C and |T| but one micro-batch's S, that micro-batch's exact share of the window's (summed over the
    window's micro-batches it is the window's loss, and so is its gradient)."""
    layers, experts = counts.shape
    rows = tokens * layers
    f = (counts.sum(0) / rows).to(probs.dtype)
    return experts * (f * probs.sum(0)).sum() / rows


def load(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer: the busiest expert's share of the routed tokens over the mean share (1: balanced; N_E: one expert
    takes all), and the entropy of the shares in nats (ln N_E: balanced; 0: one expert)."""
    totals = counts.sum(-1, keepdim=True).clamp(min=1e-12)
    q = counts / totals
    busiest = q.max(-1).values * counts.shape[-1]
    entropy = -(q * q.clamp(min=1e-300).log()).sum(-1)
    return busiest, entropy


def load_figures(counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a user watches per optimizer step: each router layer's load (busiest / mean) and entropy, named by
    layer (router_load_max_l0, router_entropy_l0, …)."""
    busiest, entropy = load(counts)
    figures = {}
    for layer in range(len(counts)):
        figures[f"router_load_max_l{layer}"] = busiest[layer]
        figures[f"router_entropy_l{layer}"] = entropy[layer]
    return figures


def describe_load(figures: Mapping[str, float], experts: int) -> str:
    """The summary line's words for the last step's load: the worst layer's busiest/mean and lowest entropy."""
    busiest = {k: v for k, v in figures.items() if k.startswith("router_load_max_l")}
    entropy = [v for k, v in figures.items() if k.startswith("router_entropy_l")]
    if not busiest:
        return ""
    worst = max(busiest, key=lambda k: busiest[k])
    return (f"expert load {busiest[worst]:.2f}× the mean at most (layer {worst.rsplit('_l', 1)[1]} of "
            f"{len(busiest)}), entropy ≥ {min(entropy):.3f} of {math.log(experts):.3f} nats")
