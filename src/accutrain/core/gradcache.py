"""One window of a window-level loss (loss=contrastive), exactly, by gradient caching (Gao et al. 2021):

    pass 1  forward every micro-batch of the window without gradients; keep its embeddings and its RNG state
    loss    gather every rank's embeddings (negatives span the window on every device); L = Σ_i loss_i over the
            window's samples, and G = ∂(L × world / |W|)/∂embeddings, once
    pass 2  forward each micro-batch again with its RNG state replayed (dropout draws the same masks) and
            backpropagate its slice of G — gradients synchronised on the last micro-batch only, as accumulate does

Every rank computes the same L from the same gathered embeddings and backpropagates only its own samples' rows of
G through its own encoder; DDP's mean over ranks then gives ∇(L / |W|), the big batch's gradient. A learnt
temperature's gradient comes from the loss alone, the same on every rank; DDP reduces it with the window's last
backward like any weight's.
Memory: the window's embeddings and its micro-batches' inputs (kept for pass 2), one micro-batch's activations.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, Iterable, Optional, Sequence

import torch
import torch.distributed as tdist
from torch import nn

from accutrain.core.batches import Batch, as_batch, stand_in_guard
from accutrain.core.contrastive import ContrastiveLoss, embed, wide
from accutrain.core.precision import Precision, make_precision


def gather_rows(local: torch.Tensor, world: int) -> tuple[torch.Tensor, slice]:
    """Every rank's rows of `local` (ranks' counts may differ, some may be 0), in rank order, and this rank's slice
    of them. Without gradient: each rank backpropagates only its own rows (pass 2)."""
    if world == 1:
        return local, slice(0, len(local))
    count = torch.tensor([len(local)], device=local.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    tdist.all_gather(counts, count)
    sizes = [int(c) for c in counts]
    padded = torch.zeros((max(sizes), *local.shape[1:]), dtype=local.dtype, device=local.device)
    padded[: len(local)] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    tdist.all_gather(parts, padded)
    start = sum(sizes[: tdist.get_rank()])
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]), slice(start, start + len(local))


def rng_of(device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng(state: tuple[torch.Tensor, Optional[torch.Tensor]], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def accumulate_window_loss(
    model: nn.Module,
    micro_batches: Iterable[Batch | Sequence[torch.Tensor]],
    terms: int,
    device: torch.device,
    loss: ContrastiveLoss,
    *,
    world: int = 1,
    no_sync: Callable[[], ContextManager] = nullcontext,
    precision: Optional[Precision] = None,
) -> torch.Tensor:
    """accumulate() for a window-level loss: .grad then holds ∇(L / |W|) of the whole window; returns this rank's
    samples' summed loss (float64, on the device). loss.window=false: each micro-batch's own loss instead."""
    precision = precision or make_precision("32", torch.device("cpu"))
    bare = getattr(model, "module", model)  # pass 1 needs no DDP: no gradient, no collective
    batches = [as_batch(b) for b in micro_batches]
    real = [b.to(device) if device.type != "cpu" else b for b in batches if not b.stand_in]
    scale = world / terms
    if not loss.window:
        return naive(model, batches, real, scale, device, loss, world, no_sync, precision)

    states, cached = [], []
    with torch.no_grad():
        for batch in real:  # pass 1
            states.append(rng_of(device))
            with precision.autocast():
                cached.append(wide(embed(bare, batch, precision.inputs)))
    after = rng_of(device)
    local = torch.cat(cached) if cached else torch.zeros((0, 2, 1), device=device)
    everyone, mine = gather_rows(local, world)
    everyone = everyone.detach().requires_grad_()
    per_sample = loss.per_sample(everyone)
    wrt = [everyone] + ([loss.head.logit_scale] if loss.head is not None else [])
    grads = torch.autograd.grad(per_sample.sum(), wrt) if len(everyone) else [torch.zeros_like(w) for w in wrt]
    cache = (grads[0] * scale)[mine]  # ∂(L × world / |W|)/∂ this rank's embeddings
    if loss.head is not None:  # the same on every rank (the same L): DDP's mean over ranks keeps it
        (loss.head.logit_scale * (grads[1] / terms)).backward()  # outside a DDP forward: accumulated, not reduced
    touch = loss.head.logit_scale * 0.0 if loss.head is not None else 0.0  # DDP reduces it with the last backward

    todo = [b for b in batches if not b.stand_in] or batches[-1:]
    if batches and batches[-1].stand_in and len(todo) and not todo[-1].stand_in:
        todo.append(batches[-1])  # the synchronising micro-batch is a stand-in: forward it for the all-reduce
    offset = 0
    for k, batch in enumerate(todo):  # pass 2
        last = k == len(todo) - 1
        with no_sync() if not last else nullcontext(), (
                stand_in_guard(model, device) if batch.stand_in else nullcontext()):
            if batch.stand_in:
                batch = batch.to(device) if device.type != "cpu" else batch
                with precision.autocast():
                    out = embed(model, batch, precision.inputs)
                precision.backward(wide(out).sum() + touch, 0.0)
                continue
            set_rng(states[k], device)
            batch = real[k]
            with precision.autocast():
                out = embed(model, batch, precision.inputs)
            n = len(batch)
            precision.backward((wide(out) * cache[offset: offset + n]).sum() + (touch if last else 0.0))
            offset += n
    set_rng(after, device)
    return per_sample.detach()[mine].double().sum()


def naive(model: nn.Module, batches: list[Batch], real: list[Batch], scale: float, device: torch.device,
          loss: ContrastiveLoss, world: int, no_sync: Callable[[], ContextManager], precision: Precision
          ) -> torch.Tensor:
    """loss.window=false: each micro-batch's loss with its own samples as the only negatives (not the big batch's
    objective), summed and divided by |W| as accumulate does."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    todo = [b for b in batches if not b.stand_in]
    if not todo or batches[-1].stand_in:
        todo.append(batches[-1])
    for k, batch in enumerate(todo):
        last = k == len(todo) - 1
        with no_sync() if not last else nullcontext(), (
                stand_in_guard(model, device) if batch.stand_in else nullcontext()):
            batch = batch.to(device) if device.type != "cpu" else batch
            with precision.autocast():
                out = embed(model, batch, precision.inputs)
            summed = loss(wide(out), batch.target)
            precision.backward(summed, 0.0 if batch.stand_in else scale)
        if not batch.stand_in:
            total += summed.detach()
    return total


@torch.no_grad()
def evaluate_window(model: nn.Module, loader: Iterable, device: torch.device, precision: Precision,
                    loss: ContrastiveLoss, world: int) -> torch.Tensor:
    """Sums over this rank's share of the held-out split, every sample of the whole split (all ranks') a candidate:
    all-reduced, they are the loss and recall@1 of the split as one set, whatever the ranks or eval batches."""
    was_training = model.training
    model.eval()
    bare = getattr(model, "module", model)
    cached = []
    for batch in loader:
        batch = as_batch(batch).to(device)
        if len(batch):
            with precision.autocast():
                cached.append(wide(embed(bare, batch, precision.inputs)))
    model.train(was_training)
    local = torch.cat(cached) if cached else torch.zeros((0, 2, 1), device=device)
    everyone, mine = gather_rows(local, world)
    return loss.eval_rows(everyone, mine)


def one_pass(model: nn.Module, batch: Batch, terms: int, loss: ContrastiveLoss, device: torch.device) -> torch.Tensor:
    """The reference: the window as ONE differentiable forward and backward of L / |W| (what gradient caching must
    equal; accutrain-check and the tests compare with it). Returns the summed loss."""
    batch = as_batch(batch).to(device)
    summed = loss.per_sample(embed(model, batch)).sum()
    (summed / terms).backward()
    return summed.detach().double()
