"""Exceptions that end a run on purpose, and how a user error reads in one line."""
from __future__ import annotations


class UserError(Exception):
    """A bad config value, missing data, a bad checkpoint: something the user can fix, not a bug."""


class NonFinite(UserError):
    """A NaN/Inf loss or gradient stopped the run (trainer.on_nonfinite=stop); the session adds where its last
    checkpoint is."""


class CorruptCheckpoint(UserError):
    """A checkpoint whose bytes cannot be read (found only while loading it, as a sharded one's shards are):
    resume=auto goes on to the previous one."""


class Preempted(Exception):
    """The run stopped early on a signal, after writing a checkpoint it can resume from."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class RankDied(Exception):
    """A rank's process was killed (SIGKILL, the OOM killer) or exited: every rank stopped; said in one line, the
    command exiting with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def one_line(error: BaseException) -> str:
    """A user error's own message (from a DataLoader worker: the original one, not the worker's traceback);
    anything else as `Type: message`, first line only."""
    message = str(error).strip()
    if isinstance(error, UserError) and "Original Traceback" in message:
        message = message.splitlines()[-1].split(f"{UserError.__module__}.{UserError.__name__}: ", 1)[-1]
    elif not isinstance(error, UserError):
        message = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return message.splitlines()[0] if message else type(error).__name__
