"""The batch arithmetic: effective batch = micro_batch × accum × devices, and how many optimizer steps follow. A
stream's training set has no size before it ends (train_size None): its run is trainer.max_steps long, trainer.epochs
(when set) the most passes over the stream it makes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

from accutrain.core.batch_schedule import BatchSchedule, resolve
from accutrain.core.options import LastWindow
from accutrain.errors import UserError


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    accum: int  # with a batch schedule: the first window's
    devices: int
    train_size: Optional[int]  # None: a stream (core/streams.py)
    last_window: LastWindow
    epochs: Optional[int]
    max_steps: Optional[int]
    schedule: Optional[BatchSchedule] = None  # the effective batch by samples seen; None: one fixed batch
    micro_tokens: Optional[int] = None  # the window cut into micro-batches of at most this many padded tokens

    @property
    def effective(self) -> int:
        """Samples per optimizer step (the last window of an epoch may hold fewer; with a batch schedule, the first
        window's)."""
        return self.micro_batch * self.accum * self.devices

    @property
    def streamed(self) -> bool:
        """The training set is a stream: its size is known at its end only."""
        return self.train_size is None

    @property
    def tail(self) -> int:
        """Samples in the incomplete last window of an epoch (0 when the windows tile the epoch; fixed batch)."""
        return 0 if self.streamed else self.train_size % self.effective

    @property
    def steps_per_epoch(self) -> Optional[int]:
        """Optimizer steps of the first epoch (of every epoch when the batch is fixed); None for a stream."""
        return None if self.streamed else len(self.window_sizes(0))

    def batch_at(self, seen: int) -> int:
        """The effective batch of a window that begins after `seen` samples."""
        return self.schedule.batch_at(seen) if self.schedule else self.effective

    def window_sizes(self, epoch: int) -> tuple[int, ...]:
        """The samples of each window of epoch `epoch`, in order: full windows of the batch the schedule gives at
        the samples seen before each, then the incomplete rest (stepped on, or dropped by last_window=drop)."""
        return self._fixed_sizes if self.schedule is None else self._layout[epoch]

    def smallest_window(self) -> int:
        """The fewest samples any window of the run holds (an epoch's incomplete last one, with last_window=step)."""
        if self.streamed:  # a pass may end with one sample
            return 1 if self.last_window is LastWindow.step else self.effective
        if self.schedule is None:
            return min(self._fixed_sizes)
        return min(min(sizes) for sizes in self._layout[: self.total_epochs])

    def seen_before(self, epoch: int) -> int:
        """Samples the run has trained on when epoch `epoch` begins."""
        if self.schedule is None:
            return epoch * sum(self._fixed_sizes)
        return sum(sum(sizes) for sizes in self._layout[:epoch])

    @cached_property
    def _fixed_sizes(self) -> tuple[int, ...]:
        full, tail = divmod(self.train_size, self.effective)
        return (self.effective,) * full + ((tail,) if tail and self.last_window is LastWindow.step else ())

    @cached_property
    def _layout(self) -> list[tuple[int, ...]]:
        """Each epoch's window sizes under the schedule, up to the last epoch the run begins."""
        layout, seen, steps = [], 0, 0
        while (self.epochs is None or len(layout) < self.epochs) and (self.max_steps is None or steps < self.max_steps):
            sizes, position = [], 0
            while position < self.train_size:
                size = min(self.schedule.batch_at(seen + position), self.train_size - position)
                if size < self.schedule.batch_at(seen + position) and self.last_window is LastWindow.drop:
                    break
                sizes.append(size)
                position += size
            if not sizes:
                break
            layout.append(tuple(sizes))
            seen, steps = seen + position, steps + len(sizes)
        return layout

    @cached_property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: epochs and max_steps, whichever ends first (a stream: max_steps)."""
        if self.streamed:
            return self.max_steps
        if self.schedule is not None:
            return min(sum(len(sizes) for sizes in self._layout), self.max_steps or 2**62)
        by_epochs = self.epochs * self.steps_per_epoch if self.epochs is not None else None
        return min(s for s in (by_epochs, self.max_steps) if s is not None)

    @cached_property
    def total_epochs(self) -> int:
        """Epochs begun, the last possibly cut short by max_steps (a stream: the passes it may make)."""
        if self.streamed:
            return self.epochs if self.epochs is not None else 2**62
        if self.schedule is None:
            return math.ceil(self.total_steps / self.steps_per_epoch)
        steps, epochs = 0, 0
        while steps < self.total_steps:
            steps, epochs = steps + len(self._layout[epochs]), epochs + 1
        return epochs

    def record(self) -> dict[str, Any]:
        """The plan as data: what status.json, metrics.jsonl and checkpoints record, and reports read back."""
        return dict(effective=self.effective, micro_batch=self.micro_batch, accum=self.accum, devices=self.devices,
                    train_size=self.train_size, steps_per_epoch=self.steps_per_epoch, total_steps=self.total_steps,
                    last_window=self.last_window.value,
                    schedule=self.schedule.record() if self.schedule else None, micro_tokens=self.micro_tokens)

    def describe(self) -> list[str]:
        """The start-up lines: the arithmetic, then the optimizer steps per epoch and in total."""
        if self.streamed:
            split = (f"= micro_batch {self.micro_batch} × accum {self.accum} × devices {self.devices}"
                     if self.micro_tokens is None else
                     f"cut into micro-batches of at most {self.micro_tokens} padded tokens (micro_tokens)")
            return [f"effective batch {self.effective} {split}",
                    f"a stream: {self.total_steps} optimizer steps (trainer.max_steps) on windows of {self.effective} "
                    "cut from its shuffle buffer, " + (f"at most {self.epochs} passes over it (trainer.epochs)"
                                                       if self.epochs is not None else "as many passes as they take")]
        epochs = "epoch" if self.total_epochs == 1 else "epochs"
        if self.schedule is not None:
            first, last = self._layout[0][0], max(max(sizes) for sizes in self._layout)
            return [self.schedule.describe(),
                    f"effective batch {first} → {last} = micro_batch {self.micro_batch} × accum "
                    f"{first // (self.micro_batch * self.devices)} → {last // (self.micro_batch * self.devices)} "
                    f"× devices {self.devices}",
                    f"{self.train_size} training samples: {self.total_steps} optimizer steps in total over "
                    f"{self.total_epochs} {epochs} (windows per epoch: "
                    f"{', '.join(str(len(sizes)) for sizes in self._layout[:self.total_epochs])})"]
        whole = self.train_size // self.effective
        windows = f"{whole} window{'' if whole == 1 else 's'} of {self.effective}" if whole else ""
        split = (f"micro_batch {self.micro_batch} × accum {self.accum} × devices {self.devices}"
                 if self.micro_tokens is None else
                 f"{self.micro_batch * self.accum} per device × devices {self.devices}, the window cut into "
                 f"micro-batches of at most {self.micro_tokens} padded tokens (micro_tokens; longest samples first)")
        if self.tail and self.last_window is LastWindow.step:  # the whole epoch in one short window, or a tail
            windows += f" + 1 of {self.tail} samples" if whole else f"1 window of all {self.tail} samples"
        elif self.tail:
            windows += f"; the last {self.tail} samples of each epoch dropped (trainer.last_window=drop)"
        steps = "optimizer step" if self.steps_per_epoch == 1 else "optimizer steps"
        return [
            f"effective batch {self.effective} = {split}",
            f"{self.train_size} training samples: {self.steps_per_epoch} {steps} per epoch ({windows}), "
            f"{self.total_steps} in total over {self.total_epochs} {epochs}",
        ]


def ceil_div(a: int, b: int) -> int:
    """⌈a / b⌉ in integers (no float rounding for large counts): micro-batches of a window, windows of an epoch."""
    return -(-a // b)


def derive_accum(micro_batch: int, devices: int, accum: Optional[int], global_batch: Optional[int]) -> int:
    """accum as given, or global_batch / (micro_batch × devices); one clear line when they cannot agree."""
    if global_batch is None:
        return accum if accum is not None else 1
    per_pass = micro_batch * devices
    if global_batch % per_pass:
        raise UserError(
            f"global_batch={global_batch} is not a multiple of micro_batch {micro_batch} × devices {devices} "
            f"= {per_pass}: choose a global_batch divisible by {per_pass}, or another micro_batch"
        )
    derived = global_batch // per_pass
    if accum is not None and accum != derived:
        raise UserError(
            f"accum={accum} contradicts global_batch={global_batch} = micro_batch {micro_batch} × devices "
            f"{devices} × accum {derived}: drop accum (it is derived from global_batch) or make them agree"
        )
    return derived


def window_split(micro_batch: int, devices: int, accum: Optional[int], global_batch: Optional[int],
                 micro_tokens: Optional[int]) -> tuple[int, int]:
    """(micro_batch, accum) of the plan. With micro_tokens the window is global_batch samples (a multiple of
    devices; micro_batch and accum not used) or micro_batch × accum × devices, which the budget then cuts."""
    if micro_tokens is None or global_batch is None:
        return micro_batch, derive_accum(micro_batch, devices, accum, global_batch)
    if global_batch % devices:
        raise UserError(f"global_batch={global_batch} is not a multiple of devices {devices}: with "
                        f"micro_tokens={micro_tokens} each device takes global_batch / devices samples of a window")
    if accum is not None:
        raise UserError(f"micro_tokens={micro_tokens} with global_batch={global_batch}: the window is global_batch "
                        f"samples cut by tokens; drop accum={accum}")
    return global_batch // devices, 1


def make_plan(
    *,
    micro_batch: int,
    accum: Optional[int],
    devices: int,
    global_batch: Optional[int],
    train_size: Optional[int],
    last_window: LastWindow,
    epochs: Optional[int],
    max_steps: Optional[int],
    schedule: Any = None,
    micro_tokens: Optional[int] = None,
) -> BatchPlan:
    """The plan for a fixed effective batch (accum or global_batch), or for `schedule` (the batch_schedule config)."""
    resolved = resolve(schedule, micro_batch * devices, train_size, epochs) if schedule is not None else None
    if resolved is None:
        micro_batch, accum = window_split(micro_batch, devices, accum, global_batch, micro_tokens)
    plan = BatchPlan(
        micro_batch=micro_batch,
        accum=resolved.batch[0] // (micro_batch * devices) if resolved else accum,
        devices=devices,
        train_size=train_size,
        last_window=last_window,
        epochs=epochs,
        max_steps=max_steps,
        schedule=resolved,
        micro_tokens=micro_tokens,
    )
    if not plan.streamed and (plan.total_steps == 0 or plan.steps_per_epoch == 0):
        raise UserError(
            f"effective batch {plan.effective} is larger than the {train_size} training samples and "
            f"trainer.last_window=drop drops them all: lower micro_batch/accum or set trainer.last_window=step"
        )
    return plan
