"""A failure on one of several ranks this machine started, said as one device says it: one line naming the rank.
A user plug-in's exception (a custom loss, model or data) is the line one device prints (config.targets
plugin_failure), exit code 2, its traceback in train.log; a rank whose process exited (os._exit, sys.exit) is one line
with that exit code, the command's own."""
from __future__ import annotations

import logging
import traceback
from typing import Any

from accutrain.config.targets import plugin_failure
from accutrain.config.train import TrainConfig
from accutrain.errors import RankDied, UserError

trace_log = logging.getLogger("accutrain.traceback")  # train.log only (configs/hydra/job_logging/accutrain.yaml)


def rank_failure(error: Exception, rank: int, size: int, args: tuple) -> tuple[Any, ...]:
    """In a worker: what the parent says of `error` — (rank, the one line[, its traceback]) — a UserError's line,
    or the line of a user plug-in's exception; anything else is a bug of accutrain's, raised again (its traceback as
    usual). `args`: train_rank's."""
    if isinstance(error, UserError):
        return rank, str(error)
    cfg = next((a for a in args if isinstance(a, TrainConfig)), None)
    culprit = plugin_failure(error, cfg) if cfg is not None else None
    if culprit is None:
        raise error
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return rank, f"rank {rank} of {size}: {culprit}; the full traceback is in train.log", text


def reported(item: Any) -> UserError:
    """The UserError the parent raises for a rank's error (rank, message[, traceback]) from the workers' queue; a
    traceback goes to train.log."""
    rank, message, *rest = item
    if rest and rest[0]:
        trace_log.error(f"rank {rank}'s traceback:\n{rest[0]}")
    return UserError(message)


def exited(rank: int, size: int, code: int, newest: str) -> RankDied:
    """A rank whose process exited with `code` without saying why (os._exit, sys.exit in the user's code): one line,
    and the command exits with the same code, as one device's process would."""
    return RankDied(f"rank {rank} of {size} exited with code {code} (os._exit or sys.exit in the code it ran): every "
                    f"rank stopped; {newest}", exit_code=code)
