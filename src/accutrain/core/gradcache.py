"""One window of a window-level loss (loss=contrastive), exactly, by gradient caching (Gao et al. 2021):

    pass 1  forward every micro-batch of the window without gradients; keep its embeddings and its RNG state
    loss    gather every rank's embeddings (negatives span the window on every device); L = Σ_i loss_i over the
            window's samples, and G = ∂(L × world / |W|)/∂embeddings, once
    pass 2  read the window again (step.Rereadable: the same samples and views, never kept), forward each
            micro-batch with its RNG state replayed (dropout draws the same masks) and backpropagate its slice of
            G — gradients synchronised on the last micro-batch only, as accumulate does (step.micro_steps)

Every rank computes the same L from the same gathered embeddings and backpropagates only its own samples' rows of
G through its own encoder; DDP's mean over ranks then gives ∇(L / |W|), the big batch's gradient. A learnt
temperature's gradient comes from the loss alone, the same on every rank; DDP reduces it with the window's last
backward like any weight's.
Memory: the window's embeddings and one micro-batch's inputs and activations.

The loss is any `WindowObjective`: how a micro-batch becomes rows of embeddings, each sample's loss over the rows of
the whole window, the evaluation sums over a whole split, its learnt scale (if any).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, Iterable, Optional, Protocol, Sequence

import torch
import torch.distributed as tdist
from torch import nn

from accutrain.core.batches import Batch, as_batch, stand_in_guard
from accutrain.core.precision import Precision, make_precision
from accutrain.core.step import micro_steps, rereadable


class WindowObjective(Protocol):
    """The maths a two-pass accumulation needs of a window-level loss."""

    window: bool  # false: each micro-batch's own loss (the naive accumulation, for comparison)
    head: Optional[nn.Module]  # a learnt scale with a `logit_scale` parameter, or None

    def embed(self, model: nn.Module, batch: Batch, cast: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The micro-batch's embeddings, one row per sample (N, …)."""

    def per_sample(self, embeddings: torch.Tensor, rows: Optional[slice] = None) -> torch.Tensor:
        """Each sample's loss (of `rows`, default all) with every row of `embeddings` a candidate."""

    def eval_rows(self, embeddings: torch.Tensor, rows: slice) -> torch.Tensor:
        """The evaluation sums (float64) of the samples `rows`, every row of `embeddings` a candidate."""

    def empty_rows(self, device: torch.device) -> torch.Tensor:
        """Embeddings of no sample, shaped as this loss's rows."""


def wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 at least (half-precision embeddings are promoted, float64 kept)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


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


def on(batch: Batch, device: torch.device) -> Batch:
    return batch.to(device) if device.type != "cpu" else batch


def accumulate_window_loss(
    model: nn.Module,
    micro_batches: Iterable[Batch | Sequence[torch.Tensor]],
    terms: int,
    device: torch.device,
    loss: WindowObjective,
    *,
    world: int = 1,
    no_sync: Callable[[], ContextManager] = nullcontext,
    precision: Optional[Precision] = None,
) -> torch.Tensor:
    """accumulate() for a window-level loss: .grad then holds ∇(L / |W|) of the whole window; returns this rank's
    samples' summed loss (float64, on the device). loss.window=false: each micro-batch's own loss instead."""
    precision = precision or make_precision("32", torch.device("cpu"))
    scale = world / terms
    if not loss.window:
        return naive(model, micro_batches, scale, device, loss, no_sync, precision)
    window = rereadable(micro_batches)
    bare = getattr(model, "module", model)  # pass 1 needs no DDP: no gradient, no collective
    states, cached = [], []
    with torch.no_grad():
        for batch, _ in micro_steps(window):  # pass 1
            if batch.stand_in:
                continue
            states.append(rng_of(device))
            with precision.autocast():
                cached.append(wide(loss.embed(bare, on(batch, device), precision.inputs)))
    after = rng_of(device)
    local = torch.cat(cached) if cached else loss.empty_rows(device)
    del cached
    everyone, mine = gather_rows(local, world)
    everyone = everyone.detach().requires_grad_()
    per_sample = loss.per_sample(everyone)
    wrt = [everyone] + ([loss.head.logit_scale] if loss.head is not None else [])
    grads = torch.autograd.grad(per_sample.sum(), wrt) if len(everyone) else [torch.zeros_like(w) for w in wrt]
    cache = (grads[0] * scale)[mine]  # ∂(L × world / |W|)/∂ this rank's embeddings
    if loss.head is not None:  # the same on every rank (the same L): DDP's mean over ranks keeps it
        (loss.head.logit_scale * (grads[1] / terms)).backward()  # outside a DDP forward: accumulated, not reduced
    touch = loss.head.logit_scale * 0.0 if loss.head is not None else 0.0  # DDP reduces it with the last backward

    replay, offset = iter(states), 0
    for batch, synchronises in micro_steps(window.again()):  # pass 2: the same walk, read anew
        with nullcontext() if synchronises else no_sync(), (
                stand_in_guard(model, device) if batch.stand_in else nullcontext()):
            batch = on(batch, device)
            if not batch.stand_in:
                set_rng(next(replay), device)  # the k-th real micro-batch of pass 2 is pass 1's k-th
            with precision.autocast():
                out = wide(loss.embed(model, batch, precision.inputs))
            n = len(batch)
            rows = cache[offset: offset + n] if n else torch.zeros_like(out)
            precision.backward((out * rows).sum() + (touch if synchronises else 0.0),
                               0.0 if batch.stand_in else 1.0)
            offset += n
    set_rng(after, device)
    return per_sample.detach()[mine].double().sum()


def naive(model: nn.Module, micro_batches: Iterable[Batch | Sequence[torch.Tensor]], scale: float,
          device: torch.device, loss: WindowObjective, no_sync: Callable[[], ContextManager], precision: Precision
          ) -> torch.Tensor:
    """loss.window=false: each micro-batch's loss with its own samples as the only candidates (not the big batch's
    objective), summed and divided by |W| as accumulate does."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for batch, synchronises in micro_steps(micro_batches):
        with nullcontext() if synchronises else no_sync(), (
                stand_in_guard(model, device) if batch.stand_in else nullcontext()):
            batch = on(batch, device)
            with precision.autocast():
                out = wide(loss.embed(model, batch, precision.inputs))
            summed = loss.per_sample(out).sum()
            precision.backward(summed, 0.0 if batch.stand_in else scale)
        if not batch.stand_in:
            total += summed.detach()
    return total


@torch.no_grad()
def evaluate_window(model: nn.Module, loader: Iterable, device: torch.device, precision: Precision,
                    loss: WindowObjective, world: int) -> torch.Tensor:
    """Sums over this rank's share of the held-out split, every sample of the whole split (all ranks') a candidate:
    all-reduced, they are the split's as one set, whatever the ranks or eval batches."""
    was_training = model.training
    model.eval()
    bare = getattr(model, "module", model)
    cached = []
    for batch in loader:
        batch = as_batch(batch).to(device)
        if len(batch):
            with precision.autocast():
                cached.append(wide(loss.embed(bare, batch, precision.inputs)))
    model.train(was_training)
    local = torch.cat(cached) if cached else loss.empty_rows(device)
    everyone, mine = gather_rows(local, world)
    return loss.eval_rows(everyone, mine)


def one_pass(model: nn.Module, batch: Batch, terms: int, loss: WindowObjective, device: torch.device,
             precision: Optional[Precision] = None) -> torch.Tensor:
    """The reference: the window as ONE differentiable forward and backward of L / |W| (what gradient caching must
    equal; accutrain-check and the tests compare with it). Returns the summed loss."""
    precision = precision or make_precision("32", torch.device("cpu"))
    batch = as_batch(batch).to(device)
    with precision.autocast():
        out = wide(loss.embed(model, batch, precision.inputs))
    summed = loss.per_sample(out).sum()
    (summed / terms).backward()
    return summed.detach().double()
