"""A stop signal in the middle of a window: finish the window when it will end well inside the grace the signal
leaves (`trainer.stop_grace_s`), else abandon it at once.

The weights do not change inside a window, so abandoning one is exact: its partial gradients are dropped, and what
the window's forward passes moved is put back as it was when the window began — every RNG (dropout's masks) and the
running statistics of BatchNorm layers in training mode — so the checkpoint of the last completed step holds what a
checkpoint written right after that step would hold; the resumed run computes the window anew, bit for bit.

Only a window that will not end within FINISH_WITHIN of the grace, at the pace of the window before it (as every
rank agrees: its time travels with the step's all-reduce), may be abandoned; any other finishes on a stop, and costs
nothing here. In one that may, one rank looks at its own stop request between micro-batches (free); several ranks
must decide alike, so they vote — a small all-reduce on the host, over gloo, which waits for no device — at the
same micro-batches, every grace / POLLS_PER_GRACE seconds of the window (every micro-batch with a grace of 0).
"""
from __future__ import annotations

import logging
import random
import time
from typing import Any, Optional

import numpy as np
import torch

from accutrain import dist
from accutrain.models import norms
from accutrain.signals import StopRequest
from accutrain.train.components import Components

log = logging.getLogger("accutrain")

FINISH_WITHIN = 0.5  # a window is finished when its estimated rest takes at most this share of the grace
POLLS_PER_GRACE = 60  # several ranks vote every grace / 60 seconds of a long window (1 s of a 60 s grace)


class Abandoned(BaseException):
    """The window in progress is given up for a stop signal (a BaseException: the out-of-memory retry must not take
    it for an error of the window's)."""

    def __init__(self, done: int, total: int, rest_s: float) -> None:
        super().__init__(f"abandoned after {done} of {total} micro-batches")
        self.done, self.total, self.rest_s = done, total, rest_s


class WindowWatch:
    """Between the micro-batches of each window: has a stop been asked for, and can the window still finish?"""

    def __init__(self, parts: Components, stop: StopRequest) -> None:
        self.parts, self.stop = parts, stop
        self.grace = float(parts.trainer.stop_grace_s)
        self.batchnorms = [m for _, m in norms.batchnorm_layers(parts.model, training_only=True)
                           if m.track_running_stats]
        self.began, self.decided = 0.0, False
        self.first: Optional[tuple[int, float]] = None  # this window's first vote: its micro-batch and time
        self.last_s, self.previous_total = 0.0, 0  # the previous window's time on this rank, and its micro-batches
        self.pace: Optional[float] = None  # seconds per micro-batch, the same on every rank (None: not known yet)
        self.next_vote: Optional[int] = 1  # the micro-batch at which several ranks vote next (None: not this window)
        self.rng: Optional[tuple[Any, ...]] = None
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def begin(self, total: int) -> None:
        """A window of `total` micro-batches (per rank) begins: decide whether a stop may abandon it, and where the
        ranks vote in it; if it may, remember what its forward passes may move — the RNG states (NumPy's copy alone
        takes 0.1-0.7 ms, so not for a window that a stop never abandons) and BatchNorm's running statistics."""
        self.began, self.decided, self.first = time.perf_counter(), False, None
        if self.pace is None:
            self.next_vote = 1  # the first window: from its first micro-batch (which gives the pace)
        elif self.pace * total <= FINISH_WITHIN * self.grace:
            self.next_vote = None  # the whole window ends within the grace: a stop waits for the step's end
        else:
            self.next_vote = self.every()
        if self.next_vote is None:
            self.rng, self.buffers = None, []
            return
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                    torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
        self.buffers = [(b, b.detach().clone()) for m in self.batchnorms for b in m.buffers() if b is not None]

    def every(self) -> int:
        """Micro-batches between two votes: grace / POLLS_PER_GRACE seconds of them, at least one (every one on a
        single rank, which asks itself)."""
        if self.parts.world.size == 1 or not self.pace:
            return 1
        return max(1, int(self.grace / POLLS_PER_GRACE / self.pace))

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def ended(self, previous_s: float, total: int) -> None:
        """The window of `total` micro-batches ended, its step's all-reduce read (the device has caught up): keep its
        time, which the next step's all-reduce takes to every rank; `previous_s` is the previous window's, as every
        rank agrees (the ranks' mean; 0 for none), and gives the pace."""
        if previous_s > 0 and self.previous_total:
            self.pace = previous_s / self.previous_total
        self.last_s, self.previous_total = self.elapsed(), total

    def between(self, done: int, total: int) -> None:
        """`done` of this rank's `total` micro-batches of the window have been handed out (every rank has as many,
        so every rank asks at the same ones). Raise Abandoned when a stop has been asked for (on any rank) and the
        window's rest, at its pace so far, would take more than FINISH_WITHIN of trainer.stop_grace_s (on any rank);
        when it would not, say that the window finishes, and ask no more."""
        if self.decided or self.next_vote is None or done < self.next_vote:
            return
        now = self.elapsed()
        self.first = self.first or (done, now)
        several, stopping = self.parts.world.size > 1, self.stop.signum is not None
        if not several and not stopping:
            return
        # The loss reads a micro-batch ahead (core.step.micro_steps): of the `done` handed out, done - 1 have run.
        # The pace is that of those run since this window's first vote (at the first, the pace every rank agreed on
        # before): a vote's time over its own count says nothing early in a window (at the first, nothing ran).
        first, at = self.first
        ran = done - 1
        pace = (now - at) / (done - first) if done > first else self.pace
        if pace is None:  # the first vote of the first window (on every rank alike): the next one judges
            self.next_vote = done + 1
            return
        rest = pace * (total - ran)
        votes = dist.vote_sum(torch.tensor([float(stopping), float(rest > FINISH_WITHIN * self.grace), pace]),
                              self.parts.world).tolist()
        if several:
            self.pace = votes[2] / self.parts.world.size
        self.next_vote = done + self.every()
        if votes[0] == 0:
            return
        self.decided = True
        if votes[1] > 0:
            raise Abandoned(ran, total, rest)
        if self.parts.world.main:
            log.warning(f"{self.stop.name or 'stop'}: finishing the window ({total - ran} of {total} micro-batches "
                        f"left, about {rest:.1f} s, within trainer.stop_grace_s={self.grace:g}), then checkpointing")

    def finished(self, step: int) -> None:
        """A stop came during the window of optimizer step `step`, which was finished: say so, unless between() did."""
        if not self.decided and self.parts.world.main:
            log.warning(f"{self.stop.name or 'stop'}: finished the window of optimizer step {step} (it ends within "
                        f"{FINISH_WITHIN:g} × trainer.stop_grace_s={self.grace:g} at its pace), then checkpointing")

    def drop(self, abandoned: Abandoned, step: int) -> None:
        """Put back what the abandoned window moved: no gradient, the RNG states and running statistics of its
        beginning."""
        parts = self.parts
        parts.optimizer.zero_grad(set_to_none=True)
        parts.model.zero_grad(set_to_none=True)
        if parts.buffers:
            parts.buffers.clear()
        for buffer, saved in self.buffers:
            buffer.copy_(saved)
        assert self.rng is not None
        python, numpy, cpu, cuda = self.rng
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if parts.world.main:
            log.warning(f"{self.stop.name or 'stop'}: abandoned the window of optimizer step {step + 1} after "
                        f"{abandoned.done} of {abandoned.total} micro-batches (the rest would take about "
                        f"{abandoned.rest_s:.1f} s, more than {FINISH_WITHIN:g} × trainer.stop_grace_s="
                        f"{self.grace:g}); checkpointing optimizer step {step}: the resume computes that window anew")
