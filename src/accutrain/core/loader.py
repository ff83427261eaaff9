"""The train loader: a window's micro-batches read (augmented, mixed, each sample with its seed) in this process or by
worker processes, and grouped back into windows for the loop (`windows_of`). Which samples a window holds is
accutrain.core.windows' to decide."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from accutrain import seeding
from accutrain.core import samples
from accutrain.core.batches import Batch, BatchFormat
from accutrain.core.mixing import Mix, Mixer
from accutrain.core.windows import MicroBatch, Window, WindowSampler
from accutrain.errors import UserError

SAMPLE_STREAM = 4  # keyed_seed(seed, SAMPLE_STREAM, epoch, sample): a sample's own draws in the model (NEFTune)


class WindowData(Dataset):
    """The training set as the train loader reads it: a MicroBatch's samples, as a Batch, with its window. A dataset
    with random views (accutrain.data.views.Views) gives each sample its view of the window's epoch; with a `mixer`
    each sample is mixed with its partner, which this loader reads too (accutrain.core.mixing). An empty micro-batch (a
    rank whose share of a short window ran out: it still takes part in the window's gradient all-reduce) becomes a
    stand-in — the first two samples, marked so that they add nothing (many models cannot take zero samples) — or,
    with `stand_in=False` (SyncBatchNorm, which handles empty inputs), zero samples. `sample_seeds` (the seed; NEFTune)
    gives each mapping item its `sample_seed` from (seed, epoch, sample), whichever micro-batch or rank reads it."""

    def __init__(self, dataset: Dataset, batch_format: BatchFormat = BatchFormat(), stand_in: bool = True,
                 mixer: Optional[Mixer] = None, sample_seeds: Optional[int] = None) -> None:
        self.dataset, self.format, self.stand_in, self.mixer = dataset, batch_format, stand_in, mixer
        self.sample_seeds = sample_seeds
        self._empty: Optional[Batch] = None
        # A dataset of in-memory tensors (accutrain.data.InMemory) gathers a micro-batch in one indexing, where
        # torch's own collate would stack the same rows item by item.
        plain = batch_format.collate is default_collate and mixer is None
        self.gather: Optional[Callable[[list[int]], tuple[Any, Any]]] = getattr(dataset, "gather", None) if plain \
            else None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def item(self, epoch: int, index: int) -> Any:
        """Sample `index` as epoch `epoch` sees it."""
        view = getattr(self.dataset, "view", None)
        try:
            return view(epoch, index) if view is not None else self.dataset[index]
        except UserError:
            raise
        except Exception as e:  # in a loader worker too: one line naming the sample, not the worker's traceback
            raise samples.sample_failure("training", index, e) from e

    def __getitems__(self, micro_batch: MicroBatch) -> tuple[Window, Batch]:
        if not micro_batch:
            if self._empty is None:
                if self.stand_in:  # two samples: BatchNorm refuses one in training mode
                    items = self.unmixed([self.dataset[0], self.dataset[min(1, len(self) - 1)]])
                    self._empty = dataclasses.replace(self.format(items), stand_in=True)
                else:
                    self._empty = self.format(self.unmixed([self.dataset[0]])).head(0)
            return micro_batch.window, self._empty
        if self.gather is not None:
            return micro_batch.window, Batch(*self.gather(micro_batch))
        epoch = micro_batch.window.epoch
        items = micro_batch.items if micro_batch.items is not None else [self.item(epoch, i) for i in micro_batch]
        if self.sample_seeds is not None:
            seeds = [seeding.keyed_seed(self.sample_seeds, SAMPLE_STREAM, epoch, i) for i in micro_batch]
            items = [{**item, "sample_seed": torch.tensor(seed)} for item, seed in zip(items, seeds)]
        if self.mixer is not None and micro_batch.mixes is not None:
            items = [self.mixer.mixed(item, self.item(epoch, mix.partner) if mix.lam < 1.0 else None, mix)
                     for item, mix in zip(items, micro_batch.mixes)]
        return micro_batch.window, samples.collate(self.format, items, "training", micro_batch)

    def unmixed(self, items: list[Any]) -> list[Any]:
        """Items as the loss takes them: with a mixer, soft (one-hot) targets."""
        return items if self.mixer is None else [self.mixer.mixed(item, None, Mix(0)) for item in items]


def _collated(item: tuple[Window, Batch]) -> tuple[Window, Batch]:
    return item  # WindowData.__getitems__ collates already


class InProcessLoader:
    """The train loader without worker processes: each of the sampler's micro-batches read in this process when the
    loop asks for it, as torch's DataLoader reads them with num_workers=0 — without its per-batch machinery (a
    profiler range, the fetcher, the bookkeeping of its worker protocol), measured at ≈ 6 % of a small MLP's optimizer
    step (docs/benchmarks.md)."""

    def __init__(self, dataset: WindowData, sampler: WindowSampler, pin_memory: bool) -> None:
        self.dataset, self.batch_sampler, self.pin_memory = dataset, sampler, pin_memory

    def __iter__(self) -> Iterator[tuple[Window, Batch]]:
        for micro_batch in self.batch_sampler:
            window, batch = self.dataset.__getitems__(micro_batch)
            yield window, batch.pin_memory() if self.pin_memory else batch

    def __len__(self) -> int:
        return len(self.batch_sampler)


def window_loader(dataset: Dataset, sampler: WindowSampler, num_workers: int, pin_memory: bool,
                  generator: torch.Generator, batch_format: BatchFormat = BatchFormat(), stand_in: bool = True,
                  sample_seeds: Optional[int] = None) -> DataLoader | InProcessLoader:
    """The train loader: it yields (window, batch) for each of this rank's micro-batches, in the sampler's order
    (mixed as the sampler's mixer draws them; each sample with its seed, given `sample_seeds`) — read in this
    process, or by torch's DataLoader in `num_workers` worker processes (seeded from `generator`)."""
    windows = WindowData(dataset, batch_format, stand_in, sampler.mixer, sample_seeds)
    if num_workers == 0:
        return InProcessLoader(windows, sampler, pin_memory)
    return DataLoader(windows, batch_sampler=sampler, collate_fn=_collated, num_workers=num_workers,
                      pin_memory=pin_memory, persistent_workers=True, generator=generator)


def windows_of(loader: Iterable[tuple[Window, Any]]) -> Iterator[tuple[Window, Iterator[Any]]]:
    """The loader's micro-batches grouped by window: (window, its batches), each batch loaded when it is asked for."""
    items = iter(loader)
    pending = next(items, None)
    def batches(window: Window) -> Iterator[Any]:
        nonlocal pending
        while pending is not None and pending[0] == window:
            batch, pending = pending[1], None
            yield batch
            pending = next(items, None)

    while pending is not None:
        window = pending[0]
        group = batches(window)
        yield window, group
        for _ in group:  # what the consumer left of the window
            pass
