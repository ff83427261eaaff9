"""One window of the loop: |W| before the first backward, the loss's accumulation of this rank's micro-batches (read
again from the sampler for a retry after an out-of-memory, or a second pass), and `settle` — the window's one
synchronisation: AMP's unscale, the global norm, the all-reduced loss and stop votes, read as named figures."""
from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Optional

import torch

from accutrain import dist
from accutrain.core.plan import ceil_div
from accutrain.core.precision import found_inf_and_update
from accutrain.core.step import cut_micro_batches, grad_norm, pieces
from accutrain.core.terms import TermCounts
from accutrain.core.windows import Window
from accutrain.errors import UserError
from accutrain.models import norms, pitfalls
from accutrain.signals import StopRequest
from accutrain.store.progress import Progress
from accutrain.train import memory
from accutrain.train.components import Components
from accutrain.train.steplog import Settled
from accutrain.train.stopping import WindowWatch

log = logging.getLogger("accutrain")


def settle(parts: Components, params: list[torch.nn.Parameter], grad_clip: Optional[float], loss_sum: torch.Tensor,
           stop: StopRequest, window_s: float = 0.0, clock_s: float = 0.0) -> Settled:
    """Once per window, on the device: AMP's unscale, overflow check and scale update (what GradScaler.step and
    update do, without step's wait: precision.found_inf_and_update), the global norm (clipped if asked), and with
    several ranks one all-reduce of the loss, the stop votes and the previous window's time (`window_s`, averaged,
    for stopping.WindowWatch) and the time since the last checkpoint (`clock_s`, averaged: checkpoint_clock); then the
    host reads it all as one small tensor (`loss_sum`, this rank's summed loss, and the loss's own figures of the
    window included) — the step's only synchronisation."""
    device, scaler = parts.device, parts.precision.scaler
    if scaler:
        scaler.unscale_(parts.optimizer)  # before the norm and clipping
    local = {"norm": grad_norm(params, grad_clip).to(device)}  # global already: DDP averaged the gradients
    if scaler:
        found_inf, next_scale = found_inf_and_update(scaler, parts.optimizer)
        local.update(found_inf=found_inf.to(device), scale=next_scale.to(device))
    measured = parts.loss.figures()  # the loss's own figures of the window (every rank's already)
    host = {"stop": float(stop.signum is not None), "window_s": window_s,  # this rank's stop vote and window time,
            "clock_s": clock_s}  # and its time since the last checkpoint
    summed = {"loss_sum": loss_sum.reshape(()).double()}
    if parts.world.size > 1:  # every rank's loss, stop vote and window time, summed
        votes = torch.tensor(list(host.values()), dtype=torch.float64)
        if device.type == "cuda":  # a pageable host-to-device copy would wait for the GPU: a second sync per step
            votes = votes.pin_memory()
        reduced = dist.all_reduce_sum(torch.cat([summed["loss_sum"].reshape(1), votes.to(device, non_blocking=True)]),
                                      parts.world)
        summed, host = dict(zip(["loss_sum", *host], reduced.unbind())), {}
    on_device = {**summed, **local, **{f"measured.{k}": v for k, v in measured.items()}}
    values = dict(zip(on_device, torch.stack([v.double() for v in on_device.values()]).tolist()))  # the one wait
    values.update(host)
    return Settled(loss_sum=values["loss_sum"], norm=values["norm"], stop=values["stop"] > 0,
                   overflow=values.get("found_inf", 0.0) > 0, scale=values.get("scale"),
                   window_s=values["window_s"] / parts.world.size, clock_s=values["clock_s"] / parts.world.size,
                   measured={k: values[f"measured.{k}"] for k in measured})


def window_terms(parts: Components, window: Window, counts: Optional[TermCounts]) -> int:
    """|W|, the loss terms on every rank, known before the first backward and before any of the window is loaded:
    its samples (from the sampler), or (loss.normalize=elements) its elements whose target is not ignore_index,
    from each sample's kept count (core/terms.py), summed over ranks."""
    if counts is None:
        return window.size
    terms = counts(window)
    if parts.world.size > 1:
        terms = int(dist.all_reduce_sum(torch.tensor(terms, device=parts.device), parts.world).item())
    if terms == 0:
        raise UserError(f"window {window.index} has no element to learn from: every target equals "
                        f"loss.ignore_index={parts.loss.ignore_index}")
    return terms


def accumulate_window(parts: Components, progress: Progress, window: Window, batches: Iterable[Any], terms: int,
                      watch: Optional[WindowWatch] = None) -> torch.Tensor:
    """The loss accumulates the window's micro-batches (loss.accumulate: one pass, or two for a loss over the whole
    window); after an out-of-memory, the window again from its first micro-batch, cut into twice as many."""
    reader = WindowReader(parts, progress, window, batches, watch)
    while True:
        if parts.noise is not None:  # (again after an out-of-memory) the window's micro-batch gradients from nothing
            parts.noise.begin(terms, parts.world.size)
        try:
            return parts.loss.accumulate(parts.wrapped, reader, terms, parts.device, world=parts.world.size,
                                         no_sync=parts.strategy.no_sync, precision=parts.precision,
                                         observe=parts.noise.micro_batch_done if parts.noise is not None else None)
        except Exception as e:
            parts.strategy.explain(e)  # a known limitation of the strategy, as one line
            cut_after_oom(parts, progress, window, e)


class WindowReader:
    """This rank's micro-batches of one window as the loss reads them (a step.Rereadable): the loader's, each cut
    into progress.oom_parts. Read again — a retry after an out-of-memory, or a two-pass loss's second pass — they
    come anew from the sampler (the same samples, views and mixes: a window is a function of the seed, its epoch and
    its index), so no micro-batch is kept. Between the loader's micro-batches `watch` may abandon the window for a
    stop signal."""

    def __init__(self, parts: Components, progress: Progress, window: Window, batches: Iterable[Any],
                 watch: Optional[WindowWatch]) -> None:
        self.parts, self.progress, self.window, self.watch = parts, progress, window, watch
        self.batches, self.taken, self.total = iter(batches), 0, len(window.sizes)

    def read(self, count: Optional[int] = None) -> Iterator[Any]:
        """This rank's first `count` micro-batches of the window (all: None), read from the sampler."""
        again = self.parts.sampler.micro_batches_of(self.window)[:count]
        return (self.parts.loader.dataset.__getitems__(m)[1] for m in again)

    def __iter__(self) -> Iterator[Any]:
        cuts = self.progress.oom_parts
        if self.taken:  # a retry: the micro-batches the loader gave before the out-of-memory, one at a time
            yield from cut_micro_batches(self.read(self.taken), cuts)
        for batch in self.batches:
            if self.taken and self.watch is not None:
                self.watch.between(self.taken, self.total)  # every rank here at the same micro-batch: may raise
            self.taken += 1
            yield from cut_micro_batches([batch], cuts) if cuts > 1 else (batch,)

    def again(self) -> Iterator[Any]:
        return cut_micro_batches(self.read(), self.progress.oom_parts)


def cut_after_oom(parts: Components, progress: Progress, window: Window, error: Exception) -> None:
    """After an out-of-memory mid-window: drop the partial gradients and cut every micro-batch in twice as many.
    The window, hence the effective batch and the exact gradient, stay the same; accum doubles from now on."""
    if not memory.is_oom(error):
        raise error
    largest = max(ceil_div(n, progress.oom_parts) for n in window.sizes)
    if largest <= 1 or parts.world.size > 1 or parts.strategy.lockstep:
        raise UserError(f"out of memory with micro-batches of {largest}" + (
            " on one of several devices: set micro_batch lower (or micro_batch=auto)" if parts.world.size > 1 else
            " under strategy=fsdp: set micro_batch lower" if parts.strategy.lockstep else
            ": even one sample does not fit (try trainer.activation_checkpointing=true or bf16-mixed precision)"))
    parts.optimizer.zero_grad(set_to_none=True)
    if parts.buffers:
        parts.buffers.clear()
    memory.free_memory(parts.device)
    progress.oom_parts *= 2
    count = sum(pieces(n, progress.oom_parts) for n in window.sizes)
    most = max(ceil_div(n, progress.oom_parts) for n in window.sizes)
    log.warning(f"out of memory with micro-batches of {largest} at optimizer step {progress.step + 1}: the window is "
                f"re-split into {count} micro-batches of at most {most}; "
                f"the effective batch stays {parts.plan.effective}" + twice_note(parts.model))


def twice_note(model: torch.nn.Module) -> str:
    """What running a window again from its first micro-batch after an out-of-memory does twice, for the log."""
    twice = (["BatchNorm's running statistics take those samples in twice"] if norms.batchnorm_layers(model, True)
             else []) + (["dropout draws new masks (the random stream moves on)"] if pitfalls.dropout_layers(model)
                         else [])
    return (f". For what ran before the out-of-memory, {', and '.join(twice)}" if twice else "")
