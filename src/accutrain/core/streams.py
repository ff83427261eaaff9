"""Windows cut from a stream (data.streaming=true): a corpus read as it comes, never held whole, whose length is
not known before it ends.

Each pass over the stream (an epoch) goes through a shuffle buffer seeded by (seed, epoch): the buffer is kept full
from the stream and each sample leaves it at a uniformly drawn place, so the order depends on the seed, the pass and
the stream alone. Windows are then cut from that order — |W| consecutive samples each, the pass's last one shorter
(trainer.last_window) — and only then into micro-batches and ranks, as a map-style dataset's windows are: every rank
reads the stream and cuts the same windows, each taking its share, so the windows do not depend on micro_batch,
accum or the number of devices. What a global permutation gives cannot hold: a sample can only move within the
buffer's reach.

Exact resume: before cutting each window the sampler notes where the stream is (the source's own position, the
buffer's samples and the generator's state); a checkpoint holds that note for the window after its step, and a
resumed run continues from it bit for bit."""
from __future__ import annotations

from typing import Any, Iterator, Optional, Protocol

import torch

from accutrain import seeding
from accutrain.core.plan import BatchPlan, ceil_div
from accutrain.core.token_budget import TokenLengths
from accutrain.core.windows import MicroBatch, Window, rank_share
from accutrain.errors import UserError

STREAM_KEY = 5  # keyed_seed(seed, STREAM_KEY, epoch): one pass's shuffle buffer draws
KEPT = 3  # windows whose starting point is kept (the loop's, the one a loader reading ahead began, one more)


class Source(Protocol):
    """A stream of samples (mapping items) that can be opened at its beginning or at a position it gave."""

    def open(self, state: Optional[Any]) -> Iterator[Any]:
        """Its samples from `state` (None: the beginning)."""

    def state(self) -> Any:
        """Where the iterator open() returned last stands: what open(state) continues from."""


class Shuffled:
    """One pass's samples through a shuffle buffer of `size`: kept full from the stream, each sample drawn from it at
    a uniform place by `generator`."""

    def __init__(self, source: Source, size: int, generator: torch.Generator, state: Optional[dict] = None) -> None:
        self.source, self.size, self.generator = source, size, generator
        self.buffer: list[Any] = list(state["buffer"]) if state else []
        self.ended = bool(state["ended"]) if state else False
        if state:
            generator.set_state(state["generator"])
        self.items = source.open(state["source"] if state else None)

    def fill(self) -> None:
        while not self.ended and len(self.buffer) < self.size:
            item = next(self.items, None)
            if item is None:
                self.ended = True
            else:
                self.buffer.append(item)

    def take(self, count: int) -> list[Any]:
        """The next `count` samples (fewer where the pass ends)."""
        out = []
        for _ in range(count):
            self.fill()
            if not self.buffer:
                break
            place = int(torch.randint(len(self.buffer), (1,), generator=self.generator))
            out.append(self.buffer[place])
            self.buffer[place] = self.buffer[-1]
            self.buffer.pop()
        return out

    def exhausted(self) -> bool:
        self.fill()
        return not self.buffer

    def state(self) -> dict:
        """Where the pass stands (a checkpoint's): the source's position, the buffer, the generator."""
        return dict(source=self.source.state(), buffer=list(self.buffer), ended=self.ended,
                    generator=self.generator.get_state())


class StreamSampler:
    """The train loader's batch sampler for a stream: this rank's micro-batches, window after window — each
    MicroBatch carrying its samples (`items`), numbered by their place in the pass. The interface of
    core.windows.WindowSampler (the loop's, the check's, the checkpoint's)."""

    mixer = None  # no MixUp/CutMix: token data
    streamed = True

    def __init__(self, plan: BatchPlan, source: Source, seed: int, buffer_size: int, rank: int = 0, world: int = 1,
                 padded_to: Optional[int] = None, free: bool = False) -> None:
        self.plan, self.source, self.seed, self.buffer_size = plan, source, seed, buffer_size
        self.rank, self.world, self.padded_to, self.free = rank, world, padded_to, free
        self.epoch, self.start = 0, 0
        self.restored: Optional[dict] = None  # a checkpoint's note, for the window it names
        self.notes: dict[tuple[int, int], dict] = {}  # (epoch, window) → where the stream stood before it
        self.cut_windows: dict[tuple[int, int], tuple[list[int], list[Any]]] = {}  # its positions and samples

    def alone(self) -> StreamSampler:
        """The same stream as rank 0 of 1 (every device's micro-batches: accutrain-check)."""
        return StreamSampler(self.plan, self.source, self.seed, self.buffer_size, padded_to=self.padded_to,
                             free=self.free)

    def set_epoch(self, epoch: int, start_window: int = 0) -> None:
        """Select the pass (and the window to begin at, for resuming) that the next iteration visits."""
        self.epoch, self.start = epoch, start_window

    def load_state_dict(self, state: Optional[dict]) -> None:
        """A checkpoint's note of where the stream stood (state_dict), the next windows to continue from it."""
        self.restored = state

    def state_dict(self, epoch: int, window: int) -> dict:
        """Where the stream stood before window `window` of pass `epoch` (the next one after a checkpoint's step)."""
        if (epoch, window) in self.notes:
            return self.notes[(epoch, window)]
        if window == 0:
            return dict(epoch=epoch, window=0, position=0, pass_state=None)
        raise RuntimeError(f"no note of the stream before window {window} of pass {epoch}")

    def opened(self) -> tuple[Shuffled, int]:
        """The pass selected by set_epoch, at its start window: (its samples, the place of the next one)."""
        note = self.restored
        if self.start and (note is None or (note["epoch"], note["window"]) != (self.epoch, self.start)):
            raise UserError(f"resuming a stream at window {self.start} of pass {self.epoch + 1} needs the checkpoint's "
                            "note of the stream's position, which it does not hold")
        generator = torch.Generator().manual_seed(seeding.keyed_seed(self.seed, STREAM_KEY, self.epoch))
        if self.start and note["pass_state"] is not None:
            return Shuffled(self.source, self.buffer_size, generator, note["pass_state"]), int(note["position"])
        return Shuffled(self.source, self.buffer_size, generator), 0

    def windows(self) -> Iterator[list[MicroBatch]]:
        """This rank's micro-batches of each window of the pass, from the start window on."""
        shuffled, position = self.opened()
        index, size = self.start, self.plan.effective
        while True:
            note = dict(epoch=self.epoch, window=index, position=position, pass_state=shuffled.state())
            samples = shuffled.take(size)
            if not samples or (len(samples) < size and self.plan.last_window.value == "drop"):
                return
            last = len(samples) < size or shuffled.exhausted()
            positions = list(range(position, position + len(samples)))
            self.remember((self.epoch, index), note, positions, samples)
            share = self.share(positions, samples)
            window = Window(self.epoch, index, len(samples), tuple(len(m) for m in share), size, last=last)
            yield [MicroBatch([p for p, _ in m], window, items=[s for _, s in m]) for m in share]
            if last:
                return
            index, position = index + 1, position + len(samples)

    def remember(self, key: tuple[int, int], note: dict, positions: list[int], samples: list[Any]) -> None:
        self.notes[key], self.cut_windows[key] = note, (positions, samples)
        for old in sorted(self.notes)[:-KEPT]:
            del self.notes[old], self.cut_windows[old]

    def budget(self, samples: list[Any]) -> Optional[TokenLengths]:
        """The window's lengths and micro_tokens' budget (None without one)."""
        if self.plan.micro_tokens is None:
            return None
        lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.int64)
        return TokenLengths(lengths, self.padded_to, self.plan.micro_tokens, free=self.free)

    def share(self, positions: list[int], samples: list[Any]) -> list[list[tuple[int, Any]]]:
        """This rank's micro-batches of a window: consecutive micro_batch samples, or micro_tokens' cut of the whole
        window, dealt as rank_share does."""
        pairs = list(zip(positions, samples))
        tokens = self.budget(samples)
        if tokens is None:
            return rank_share(pairs, self.plan.micro_batch, self.rank, self.world)
        if tokens.longest > self.plan.micro_tokens:
            raise UserError(f"micro_tokens={self.plan.micro_tokens} is less than a sample of {tokens.longest} tokens "
                            "the stream holds: set micro_tokens ≥ data.max_length")
        chunks = tokens.cut(range(len(samples)))
        steps = ceil_div(len(chunks), self.world)
        return [[pairs[p] for p in chunks[k]] if k < len(chunks) else []
                for k in range(self.rank, steps * self.world, self.world)]

    def micro_batches_of(self, window: Window) -> list[MicroBatch]:
        """This rank's micro-batches of `window` again (a cut window is kept until KEPT later ones are cut)."""
        positions, samples = self.cut_windows[(window.epoch, window.index)]
        return [MicroBatch([p for p, _ in m], window, items=[s for _, s in m]) for m in self.share(positions, samples)]

    def share_of(self, window: Window) -> list[int]:
        return [p for m in self.micro_batches_of(window) for p in m]

    def padding(self, window: Window) -> Optional[tuple[int, int]]:
        """(tokens, padded tokens) of the whole window's micro-batches, every rank's."""
        positions, samples = self.cut_windows[(window.epoch, window.index)]
        lengths = TokenLengths(torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.int64),
                               self.padded_to, self.plan.micro_tokens, free=self.free)
        if self.plan.micro_tokens is not None:
            return lengths.padding(lengths.cut(range(len(samples))))
        size = self.plan.micro_batch
        return lengths.padding([range(i, min(i + size, len(samples))) for i in range(0, len(samples), size)])

    def __iter__(self) -> Iterator[MicroBatch]:
        for micro_batches in self.windows():
            yield from micro_batches
