"""Windows: the seed's permutation of the training set, cut into windows, cut into this rank's micro-batches (the
loader that reads them is accutrain.core.loader).

A window is every sample of one optimizer step: a contiguous slice of the epoch's permutation, which depends
on (seed, epoch) only. How the window is cut into micro-batches and ranks never changes which samples are in
it, so `micro_batch=8 accum=4` and `micro_batch=32 accum=1` take their steps on the same samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch.utils.data import Sampler

from accutrain import seeding
from accutrain.core.mixing import Mix, Mixer
from accutrain.core.plan import BatchPlan, ceil_div
from accutrain.core.token_budget import TokenLengths


@dataclass(frozen=True)
class Window:
    """One optimizer step's samples, as this rank sees them."""

    epoch: int
    index: int  # position in the epoch
    size: int  # samples in the whole window, all ranks together
    sizes: tuple[int, ...]  # this rank's micro-batches, in samples (every rank has as many; the last ones may be 0)
    batch: int  # the effective batch it stands for: its size, or more for an epoch's incomplete last window
    last: bool = False  # the epoch's last window


class MicroBatch(list):
    """The dataset indices of one of this rank's micro-batches (possibly none), its window, (MixUp/CutMix) how each
    sample is mixed, and — from a stream (core/streams.py) — the samples, indexed by their places in the pass."""

    def __init__(self, indices: Iterable[int], window: Window, mixes: Optional[list[Mix]] = None,
                 items: Optional[list[Any]] = None) -> None:
        super().__init__(indices)
        self.window, self.mixes, self.items = window, mixes, items

    @classmethod
    def join(cls, parts: list[MicroBatch]) -> MicroBatch:
        """The micro-batches of one window as one."""
        mixes = None if parts[0].mixes is None else [m for part in parts for m in part.mixes or []]
        items = None if parts[0].items is None else [s for part in parts for s in part.items or []]
        return cls([i for part in parts for i in part], parts[0].window, mixes, items)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of range(n) that epoch `epoch` of a run seeded `seed` visits."""
    return torch.randperm(n, generator=seeding.generator(seed, epoch))


def rank_share(samples: list[int], micro_batch: int, rank: int, world: int) -> list[list[int]]:
    """Cut a window into consecutive micro-batches; micro-batch k runs at micro-step k // world on rank k % world.

    A full window gives every rank `accum` micro-batches of `micro_batch`; a short one leaves the last
    micro-step of some ranks short or empty, never padded or duplicated.
    """
    chunks = [samples[i : i + micro_batch] for i in range(0, len(samples), micro_batch)]
    steps = ceil_div(len(chunks), world)
    return [chunks[k] if k < len(chunks) else [] for k in range(rank, steps * world, world)]


class WindowSampler(Sampler[MicroBatch]):
    """Batch sampler for a DataLoader: this rank's micro-batches, window after window, empty ones included. With
    token data, `tokens` knows each sample's length: its budget (micro_tokens) cuts the windows, and padding()
    says what a window's micro-batches pad. (core/streams.py's sampler cuts windows from a stream: `streamed`.)"""
    streamed = False

    def __init__(self, plan: BatchPlan, seed: int, rank: int = 0, world: int = 1, mixer: Optional[Mixer] = None,
                 tokens: Optional[TokenLengths] = None) -> None:
        self.plan, self.seed, self.rank, self.world, self.mixer = plan, seed, rank, world, mixer
        self.tokens = tokens
        self.budget = tokens is not None and tokens.budget is not None
        self.epoch, self.start = 0, 0
        self._orders: dict[int, tuple[torch.Tensor, list[int]]] = {}  # epoch → (permutation, its windows' starts)

    def set_epoch(self, epoch: int, start_window: int = 0) -> None:
        """Select the epoch (and the window to begin at, for resuming) that the next iteration visits."""
        self.epoch, self.start = epoch, start_window

    def alone(self) -> WindowSampler:
        """The same windows as rank 0 of 1 (every device's micro-batches: accutrain-check)."""
        return WindowSampler(self.plan, self.seed)

    def state_dict(self, epoch: int, window: int) -> None:  # the seed, epoch and window say where the data is
        return None

    def load_state_dict(self, state: None) -> None:  # (a stream's sampler, core/streams.py, keeps its position)
        pass

    def windows(self) -> Iterator[list[MicroBatch]]:
        """This rank's micro-batches of each window of the epoch, from the start window on."""
        order, starts = self.order(self.epoch)
        seen = self.plan.seen_before(self.epoch)
        for index in range(self.start, len(starts) - 1):
            samples = order[starts[index] : starts[index + 1]].tolist()
            share = self.share(samples)
            window = Window(self.epoch, index, len(samples), tuple(len(indices) for indices in share),
                            self.plan.batch_at(seen + starts[index]), last=index == len(starts) - 2)
            yield self.cut(window, samples, share)

    def share(self, samples: list[int], items: Optional[list[Any]] = None) -> list[list[Any]]:
        """This rank's micro-batches of a window's `samples` — or of `items` (their mixes), cut alike: consecutive
        micro_batch samples, or the token budget's micro-batches (core/token_budget.py), dealt as rank_share does."""
        items = samples if items is None else items
        if not self.budget:
            return rank_share(items, self.plan.micro_batch, self.rank, self.world)
        chunks = self.tokens.cut(samples)
        steps = ceil_div(len(chunks), self.world)
        return [[items[p] for p in chunks[k]] if k < len(chunks) else []
                for k in range(self.rank, steps * self.world, self.world)]

    def padding(self, window: Window) -> Optional[tuple[int, int]]:
        """(tokens, padded tokens) of the whole window's micro-batches, every rank's (token data only; before any
        out-of-memory re-split)."""
        if self.tokens is None or not self.tokens.real:
            return None
        samples = self.samples_of(window)
        if self.budget:
            chunks = [[samples[p] for p in chunk] for chunk in self.tokens.cut(samples)]
        else:
            size = self.plan.micro_batch
            chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
        return self.tokens.padding(chunks)

    def cut(self, window: Window, samples: list[int], share: list[list[int]]) -> list[MicroBatch]:
        """This rank's `share` of the window's `samples` as micro-batches, with their mixes."""
        if self.mixer is None:
            return [MicroBatch(indices, window) for indices in share]
        # the whole window's draws, cut like its samples: every rank knows every partner
        mixes = self.share(samples, self.mixer.plan(window.epoch, window.index, samples))
        return [MicroBatch(indices, window, mix) for indices, mix in zip(share, mixes)]

    def order(self, epoch: int) -> tuple[torch.Tensor, list[int]]:
        """The epoch's permutation and where each of its windows starts in it (and where the last ends), kept for
        the epoch the loop is in and the one a loader reading ahead may have begun."""
        if epoch not in self._orders:
            for old in sorted(self._orders)[: max(0, len(self._orders) - 1)]:
                del self._orders[old]
            starts = [0]
            for size in self.plan.window_sizes(epoch):
                starts.append(starts[-1] + size)
            self._orders[epoch] = (epoch_order(self.plan.train_size, self.seed, epoch), starts)
        return self._orders[epoch]

    def samples_of(self, window: Window) -> list[int]:
        """The window's samples on every rank, in order (each rank's share is cut from this list)."""
        order, starts = self.order(window.epoch)
        return order[starts[window.index] : starts[window.index + 1]].tolist()

    def micro_batches_of(self, window: Window) -> list[MicroBatch]:
        """This rank's micro-batches of `window` again, as windows() gave them: the same samples and mixes (a window is
        a function of the seed, its epoch and its index), to read a window anew instead of keeping it."""
        samples = self.samples_of(window)
        return self.cut(window, samples, self.share(samples))

    def share_of(self, window: Window) -> list[int]:
        """This rank's samples of `window`."""
        return [i for indices in self.share(self.samples_of(window)) for i in indices]

    def __iter__(self) -> Iterator[MicroBatch]:
        for micro_batches in self.windows():
            yield from micro_batches

    def __len__(self) -> int:
        """This rank's micro-batches from the start window to the end of the epoch (empty ones included)."""
        if self.budget:
            order, starts = self.order(self.epoch)
            return sum(ceil_div(len(self.tokens.cut(order[starts[i] : starts[i + 1]].tolist())), self.world)
                       for i in range(self.start, len(starts) - 1))
        sizes = self.plan.window_sizes(self.epoch)[self.start :]
        return sum(ceil_div(ceil_div(size, self.plan.micro_batch), self.world) for size in sizes)


