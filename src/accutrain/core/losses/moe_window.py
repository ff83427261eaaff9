"""loss=moe's window (accutrain.core.losses.moe): pass 1 — the window's routing counts and real tokens, without
gradients, every rank's — and the figures each step records of the window it accumulated."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as tdist
from torch import nn

from accutrain.core.batches import Batch
from accutrain.core.compiled import eager
from accutrain.core.gradcache import on, rng_of
from accutrain.core.options import RouterAux
from accutrain.core.precision import Precision
from accutrain.core.routing import balancing, load_figures, route, token_rows
from accutrain.core.step import micro_steps

RouterBalancedLoss = Any  # accutrain.core.losses.moe's (not imported: it imports this module)


@dataclass
class Counted:
    """Pass 1's result: the window's routing counts (L, E) and real tokens, every rank's, and the RNG state before
    each of this rank's real micro-batches (replayed in pass 2) and after the last."""

    counts: torch.Tensor
    tokens: torch.Tensor
    states: list
    after: Any


def outputs(model: nn.Module, batch: Batch, cast: Callable[[torch.Tensor], torch.Tensor], wanted: tuple[str, ...]
            ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The model's logits and its auxiliary outputs `wanted` for one micro-batch."""
    return batch.forward(functools.partial(model, aux=wanted), cast)


def count_window(loss: RouterBalancedLoss, model: nn.Module, window: Iterable[Batch], device: torch.device,
                 precision: Precision, world: int) -> Counted:
    """Pass 1: the window's routing counts and real tokens, without gradients, on every rank (one all-reduce),
    and the RNG states pass 2 replays."""
    bare = getattr(model, "module", model)  # no gradient, no collective: DDP's wrapper is not needed
    counts = torch.zeros((loss.layers, loss.routing.experts), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    states = []
    with torch.no_grad(), eager(bare):
        for batch, _ in micro_steps(window):
            if batch.stand_in:
                continue
            states.append(rng_of(device))
            batch = on(batch, device)
            with precision.autocast():
                _, aux = outputs(bare, batch, precision.inputs, ("router_logits",))
            routed = route(loss.router_logits(aux), loss.routing.top_k, token_rows(batch.inputs))
            counts += routed.counts
            tokens += routed.tokens
    after = rng_of(device)
    if world > 1:
        flat = torch.cat([counts.reshape(-1), tokens.reshape(1)])
        tdist.all_reduce(flat)
        counts, tokens = flat[:-1].reshape(counts.shape), flat[-1]
    return Counted(counts, tokens, states, after)



def empty_tally(loss: RouterBalancedLoss, device: torch.device) -> list[torch.Tensor]:
    shape = (loss.layers, loss.routing.experts)
    zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
    return [zeros(shape), zeros(shape), zeros(()), zeros(()), zeros(())]



def figures_of(loss: RouterBalancedLoss, tally: list[torch.Tensor], terms: int, world: int) -> dict[str, torch.Tensor]:
    """The window's figures, every rank's: its balancing loss (router_aux_window), the term a per-micro-batch
    option optimised instead (router_aux), the z-loss per token, each router layer's load and entropy."""
    if world > 1:
        flat = torch.cat([t.reshape(-1) for t in tally])
        tdist.all_reduce(flat)
        sizes = [t.numel() for t in tally]
        tally = [part.reshape(t.shape) for part, t in zip(flat.split(sizes), tally)]
    counts, probs, tokens, optimised, z = tally
    figures = {"router_aux_window": balancing(counts, probs, tokens.clamp(min=1))}
    if loss.router_aux in (RouterAux.micro_batch, RouterAux.model):
        figures["router_aux"] = optimised / terms
    figures["router_z"] = z / terms
    figures.update(load_figures(counts))
    return figures

