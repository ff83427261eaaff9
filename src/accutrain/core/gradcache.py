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

    def pieces(self, model: nn.Module, batch: Batch, cast: Callable[[torch.Tensor], torch.Tensor]
               ) -> list[tuple[slice, Callable[[], torch.Tensor]]]:
        """embed() in pieces for pass 2: (the columns of the rows a piece embeds, its forward), run in embed's order
        (the same random draws) and each backpropagated before the next runs."""

    def keys(self, batch: Batch) -> torch.Tensor:
        """What the loss knows of each sample's candidates beside their embeddings (N, …; int64): gathered with
        them."""

    def per_sample(self, embeddings: torch.Tensor, rows: Optional[slice] = None, keys: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
        """Each sample's loss (of `rows`, default all) with every row of `embeddings` a candidate."""

    def eval_rows(self, embeddings: torch.Tensor, rows: slice, keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The evaluation sums (float64) of the samples `rows`, every row of `embeddings` a candidate."""

    def empty_rows(self, device: torch.device) -> torch.Tensor:
        """Embeddings of no sample, shaped as this loss's rows."""


def wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 at least (half-precision embeddings are promoted, float64 kept)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def gather_rows(local: torch.Tensor, world: int) -> tuple[torch.Tensor, slice]:
    """Every rank's rows of `local` (ranks' counts may differ, some may be 0 — their row shape is then taken from the
    others'), in rank order, and this rank's slice of them. Without gradient: each rank backpropagates only its own
    rows (pass 2)."""
    if world == 1:
        return local, slice(0, len(local))
    shape = torch.tensor([len(local), *local.shape[1:]], device=local.device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    tdist.all_gather(shapes, shape)
    sizes = [int(s[0]) for s in shapes]
    row = next((tuple(int(d) for d in s[1:]) for s in shapes if int(s[0])), tuple(local.shape[1:]))
    padded = torch.zeros((max(sizes), *row), dtype=local.dtype, device=local.device)
    padded[: len(local)] = local.reshape(len(local), *row)
    parts = [torch.empty_like(padded) for _ in range(world)]
    tdist.all_gather(parts, padded)
    start = sum(sizes[: tdist.get_rank()])
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]), slice(start, start + len(local))


class Rows:
    """What pass 1 keeps of a window — embeddings, keys (`add` a tensor of rows) or RNG states (`add` a tuple, kept in
    `items`) — written into one buffer of at most `capacity` (|W|) rows, allocated at the first micro-batch: a small
    tensor kept per micro-batch would fragment the heap as the window's inputs come and go (measured: +840 MiB of
    resident memory over a window of 4,096 image pairs)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.buffer, self.filled, self.items = capacity, None, 0, []

    def add(self, value: torch.Tensor | tuple) -> None:
        if isinstance(value, tuple):  # an RNG state: the CPU generator's bytes go into the buffer, a view kept
            cpu, cuda = value
            self.add(cpu[None])
            self.items.append((self.buffer[self.filled - 1], cuda))
            return
        if self.buffer is None:
            self.buffer = value.new_empty((self.capacity, *value.shape[1:]))
        self.buffer[self.filled: self.filled + len(value)] = value
        self.filled += len(value)

    def rows(self, empty: torch.Tensor) -> torch.Tensor:
        return self.buffer[: self.filled] if self.buffer is not None else empty


def rng_of(device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng(state: tuple[torch.Tensor, Optional[torch.Tensor]], device: torch.device) -> None:
    torch.set_rng_state(state[0].clone())  # (a row of Rows' buffer: torch reads a state from its storage's start)
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
    states, cached, keys = Rows(terms), Rows(terms), Rows(terms)  # one buffer each: no tensor per micro-batch kept
    with torch.no_grad():
        for batch, _ in micro_steps(window):  # pass 1
            if batch.stand_in:
                continue
            states.add(rng_of(device))
            batch = on(batch, device)
            with precision.autocast():
                cached.add(wide(loss.embed(bare, batch, precision.inputs)))
            keys.add(loss.keys(batch))
    after = rng_of(device)
    everyone, mine = gather_rows(cached.rows(loss.empty_rows(device)), world)
    all_keys = gather_rows(keys.rows(torch.zeros((0, everyone.shape[1] - 1), dtype=torch.int64, device=device)),
                           world)[0]
    everyone = everyone.detach().requires_grad_()
    wrt = [everyone] + ([loss.head.logit_scale] if loss.head is not None else [])
    per_sample, grads = loss_and_grad(loss, everyone, all_keys, wrt)
    cache = (grads[0] * scale)[mine]  # ∂(L × world / |W|)/∂ this rank's embeddings
    if loss.head is not None:  # the same on every rank (the same L): DDP's mean over ranks keeps it
        (loss.head.logit_scale * (grads[1] / terms)).backward()  # outside a DDP forward: accumulated, not reduced
    touch = loss.head.logit_scale * 0.0 if loss.head is not None else 0.0  # DDP reduces it with the last backward

    replay, offset = iter(states.items), 0
    for batch, synchronises in micro_steps(window.again()):  # pass 2: the same walk, read anew
        batch, n = on(batch, device), len(batch)
        if not batch.stand_in:
            set_rng(next(replay), device)  # the k-th real micro-batch of pass 2 is pass 1's k-th
        pieces = loss.pieces(model, batch, precision.inputs)  # (a text triple's roles: one at a time)
        for k, (columns, forward) in enumerate(pieces):
            last = synchronises and k == len(pieces) - 1  # the window's one gradient reduction
            with nullcontext() if last else no_sync(), (
                    stand_in_guard(model, device) if batch.stand_in else nullcontext()):
                with precision.autocast():
                    out = wide(forward())
                rows = cache[offset: offset + n, columns] if n else torch.zeros_like(out)
                precision.backward((out * rows).sum() + (touch if last else 0.0), 0.0 if batch.stand_in else 1.0)
        offset += n
    set_rng(after, device)
    return per_sample.detach()[mine].double().sum()


def blocks(rows: slice, candidates: int) -> list[slice]:
    """`rows` in blocks whose similarities hold at most 2**20 floats (4 MiB in float32) each, so that the window's
    similarity matrix is never held whole: its memory stays flat in the window (the embeddings are what grows)."""
    size = max(1, 2**20 // max(1, candidates))
    return [slice(start, min(rows.stop, start + size)) for start in range(rows.start, rows.stop, size)]


def loss_and_grad(loss: WindowObjective, everyone: torch.Tensor, keys: torch.Tensor, wrt: list[torch.Tensor]
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every sample's loss over the whole window, and ∂(their sum)/∂`wrt`, one block of anchors at a time: the sum
    is a sum over samples, so its gradient is the sum of the blocks' (each block's similarities freed before the
    next). The blocks depend on the window's size alone, never on its split."""
    per_sample = torch.zeros(len(everyone), dtype=everyone.dtype, device=everyone.device)
    grads = [torch.zeros_like(w) for w in wrt]
    for rows in blocks(slice(0, len(everyone)), len(everyone) * max(1, everyone.shape[1] - 1)):
        part = loss.per_sample(everyone, rows, keys)
        per_sample[rows] = part.detach()
        for total, g in zip(grads, torch.autograd.grad(part.sum(), wrt)):
            total += g
    return per_sample, grads


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
            summed = loss.per_sample(out, keys=loss.keys(batch)).sum()
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
    cached, keys = [], []
    for batch in loader:
        batch = as_batch(batch).to(device)
        if len(batch):
            with precision.autocast():
                cached.append(wide(loss.embed(bare, batch, precision.inputs)))
            keys.append(loss.keys(batch))
    model.train(was_training)
    local = torch.cat(cached) if cached else loss.empty_rows(device)
    everyone, mine = gather_rows(local, world)
    all_keys = gather_rows(torch.cat(keys) if keys else torch.zeros((0, everyone.shape[1] - 1), dtype=torch.int64,
                                                                     device=device), world)[0]
    candidates = len(everyone) * max(1, everyone.shape[1] - 1)
    return sum((loss.eval_rows(everyone, rows, all_keys) for rows in blocks(mine, candidates)),
               loss.eval_rows(everyone, slice(mine.start, mine.start), all_keys))


def one_pass(model: nn.Module, batch: Batch, terms: int, loss: WindowObjective, device: torch.device,
             precision: Optional[Precision] = None) -> torch.Tensor:
    """The reference: the window as ONE differentiable forward and backward of L / |W| (what gradient caching must
    equal; accutrain-check and the tests compare with it). Returns the summed loss."""
    precision = precision or make_precision("32", torch.device("cpu"))
    batch = as_batch(batch).to(device)
    with precision.autocast():
        out = wide(loss.embed(model, batch, precision.inputs))
    summed = loss.per_sample(out, keys=loss.keys(batch)).sum()
    (summed / terms).backward()
    return summed.detach().double()
