"""The sampler that cuts the seed's permutation of the training set into windows of micro-batches.

A window is every sample of one optimizer step: a contiguous slice of the epoch's permutation, which depends
on (seed, epoch) only. How the window is cut into micro-batches and ranks never changes which samples are in
it, so `micro_batch=8 accum=4` and `micro_batch=32 accum=1` take their steps on the same samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import Sampler

from accutrain.config import LastWindow
from accutrain.plan import BatchPlan


@dataclass(frozen=True)
class Window:
    index: int  # position in the epoch
    size: int  # samples in the whole window, all ranks together: the loss normaliser
    micro: list[list[int]]  # this rank's micro-batches (dataset indices); every rank has as many, some maybe empty


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of range(n) that epoch `epoch` of a run seeded `seed` visits."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def split_window(samples: list[int], micro_batch: int, rank: int, world: int) -> list[list[int]]:
    """Cut a window into consecutive micro-batches; micro-batch k runs at micro-step k // world on rank k % world.

    A full window gives every rank `accum` micro-batches of `micro_batch`; a short one leaves the last
    micro-step of some ranks short or empty, never padded or duplicated.
    """
    chunks = [samples[i : i + micro_batch] for i in range(0, len(samples), micro_batch)]
    steps = -(-len(chunks) // world)
    return [chunks[k] if k < len(chunks) else [] for k in range(rank, steps * world, world)]


class WindowSampler(Sampler[list[int]]):
    """Batch sampler for a DataLoader: yields this rank's non-empty micro-batches, window after window."""

    def __init__(self, plan: BatchPlan, seed: int, rank: int = 0, world: int = 1) -> None:
        self.plan, self.seed, self.rank, self.world = plan, seed, rank, world
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start_window: int = 0) -> None:
        """Select the epoch (and the window to begin at, for resuming) that the next iteration visits."""
        self.epoch, self.start = epoch, start_window

    def windows(self) -> Iterator[Window]:
        order = epoch_order(self.plan.train_size, self.seed, self.epoch)
        size = self.plan.effective
        for index in range(self.start, self.plan.steps_per_epoch):
            samples = order[index * size : (index + 1) * size].tolist()
            assert len(samples) == size or self.plan.last_window is LastWindow.step
            yield Window(index, len(samples), split_window(samples, self.plan.micro_batch, self.rank, self.world))

    def __iter__(self) -> Iterator[list[int]]:
        for window in self.windows():
            yield from (mb for mb in window.micro if mb)

    def __len__(self) -> int:
        return sum(1 for w in self.windows() for mb in w.micro if mb)
