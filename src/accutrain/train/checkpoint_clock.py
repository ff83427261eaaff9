"""trainer.checkpoint_minutes: a checkpoint after that many minutes since the last one, and at every epoch end, so
that a kill (SIGKILL, an out-of-memory killer, a lost node) sets a run back by a bounded time by default.

Every rank must decide alike (a checkpoint is collective): the time since the last checkpoint travels with the
window's one all-reduce (window_step.settle) and the ranks' mean decides, so no rank's clock is read alone."""
from __future__ import annotations

import time
from typing import Optional

from accutrain.config.train import TrainerConfig


class CheckpointClock:
    """The time since this rank's last checkpoint (or the start), and whether the agreed time makes one due."""

    def __init__(self, trainer: TrainerConfig) -> None:
        self.minutes: Optional[float] = trainer.checkpoint_minutes
        self.every: Optional[int] = trainer.checkpoint_every
        self.since = time.monotonic()

    def seconds(self) -> float:
        """This rank's seconds since its last checkpoint (settle averages them over the ranks)."""
        return time.monotonic() - self.since

    def due(self, agreed_s: float, epoch_end: bool) -> bool:
        """A checkpoint by the clock or at an epoch's end; `agreed_s` is the ranks' mean of `seconds` (the same
        number on every rank)."""
        return self.minutes is not None and (epoch_end or agreed_s >= self.minutes * 60)

    def written(self) -> None:
        """A checkpoint was just written (or tried): the clock starts again."""
        self.since = time.monotonic()

    def promise(self) -> str:
        """How far back a kill can set this run, said at its start."""
        every = f" and every {self.every} optimizer steps (trainer.checkpoint_every)" if self.every else ""
        if self.minutes is None:
            if self.every:
                return (f"checkpoints every {self.every} optimizer steps (trainer.checkpoint_every), at the end and "
                        f"on a stop signal: a kill (SIGKILL) loses at most {self.every} optimizer steps")
            return ("checkpoints at the end and on a stop signal only (trainer.checkpoint_minutes=null): a kill "
                    "(SIGKILL) loses the whole run; resume=auto then starts again at step 0")
        return (f"checkpoints every {self.minutes:g} minutes of training (trainer.checkpoint_minutes), at every "
                f"epoch's end{every}, at the end and on a stop signal: a kill (SIGKILL) sets the run back by at "
                f"most {self.minutes:g} minutes of training (less when an epoch ends sooner)")
