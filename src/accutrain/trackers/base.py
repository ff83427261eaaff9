"""What a tracker is told, and the names its metrics take.

A tracker is a plain object, built by its `_target_` from the keys of its `logger.<name>` config and called by rank 0
only: `start(run)` once, `log_step(record)` once per optimizer step, `log_eval(record)` once per evaluation, `flush()`
before each checkpoint and `finish(end)` once at the end. Every method is optional; `Tracker` is a base class with
nothing to do, for whoever likes one. A method that raises switches its tracker off with one warning line.
"""
from __future__ import annotations

import math
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union
from urllib.parse import urlsplit

from accutrain.errors import UserError
from accutrain.store.files import read_jsonl

Number = Union[int, float, str, bool]


@dataclass
class RunInfo:
    """The run a tracker starts on (or, on resume, continues)."""

    run_dir: Path
    name: str  # the run directory's name and the job's overrides
    group: Optional[str]  # the sweep this run is a job of (its directory), None for a single run
    job: Optional[int]  # the job's number in the sweep
    config: dict[str, Any]  # the resolved config, nested, with the batch plan under `plan`
    params: dict[str, Number]  # the same flattened: {"optim.lr": 0.05, "model.hidden": "[32]", "plan.accum": 4, …}
    step: int  # training continues after this optimizer step: 0, or the checkpoint's step when resuming
    resumed: bool  # this session continues an earlier session of this run directory (resume=…)
    saved: dict[str, Any] = field(default_factory=dict)  # what this tracker's start() returned in that session

    def history(self) -> Iterator[dict[str, Any]]:
        """The step and evaluation records of metrics.jsonl up to `step`, in order, as they were logged (without the
        file's `kind` but the test stage's): for a tracker that joins a resumed run, or whose backend lost the tail of
        the killed session, to log again."""
        for _, record in read_jsonl(self.run_dir / "metrics.jsonl"):
            if isinstance(record.get("step"), int) and record["step"] <= self.step:
                yield record if record.get("kind") == "test" else {k: v for k, v in record.items() if k != "kind"}


@dataclass
class RunEnd:
    status: str  # completed | interrupted (a signal; the run can resume) | failed
    summary: dict[str, float]  # steps, samples_seen, last_loss, best_<monitor>, best_step, skipped; seconds,
    #                            samples_per_s, peak_mem_mb (this session) when training got to its end
    loss_plot: Optional[Path]  # loss.png, drawn for the trackers


class Tracker:
    """The interface, with nothing to do: override what your tracker needs."""

    def start(self, run: RunInfo) -> Optional[dict[str, Any]]:
        """Open (or, when run.resumed, continue) the tracker's run; return what a resume needs (ids), which comes
        back as run.saved (kept in the run directory's trackers.json)."""
        return None

    def log_step(self, record: dict[str, Any]) -> None:
        """An optimizer step's metrics.jsonl record: step, epoch, loss (the window's mean), samples, lr, …"""

    def log_eval(self, record: dict[str, Any]) -> None:
        """An evaluation's metrics.jsonl record: step, epoch, val_loss, val_acc; at the end, the test stage's (kind
        "test": test_loss, test_acc of the last weights, test_loss_best, test_acc_best of the best ones)."""

    def flush(self) -> None:
        """A checkpoint is about to be written: what was logged so far must survive a crash after it."""

    def finish(self, end: RunEnd) -> None:
        """The run ended (or stopped for a signal, or failed): the summary, the loss plot, then close."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as the trackers' scalars: an optimizer step's numbers as `train/<key>` (`skipped` as 1 on
    a step that was not taken, a non-finite value left out), an evaluation's `val_<key>` as `val/<key>`, the test
    stage's `test_<key>` as `test/<key>` (`test/acc_best`: the best weights'). The step is the axis, not a scalar."""
    evaluation = "loss" not in record
    out = {}
    for key, value in record.items():
        if key == "step" or (evaluation and not key.startswith(("val_", "test_"))):
            continue
        if key == "skipped":
            value = 1.0
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out["/".join(key.split("_", 1)) if evaluation else f"train/{key}"] = float(value)
    return out


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Number]:
    """{"optim": {"lr": 0.1}, "model": {"hidden": [32]}} → {"optim.lr": 0.1, "model.hidden": "[32]"}: scalars as they
    are, None as "null", lists as text (what hyperparameter tables accept)."""
    flat: dict[str, Number] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        elif value is None:
            flat[name] = "null"
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def needs(package: str, extra: str) -> UserError:
    """The one line for a tracker whose library is not installed."""
    return UserError(f"logger={extra} needs the {package} package: pip install \"accutrain[{extra}]\"")


REACH_S = 3.0  # how long a network tracker's server may take to accept a connection at start


def reach(uri: str, key: str, seconds: float = REACH_S) -> None:
    """Open (and close) a TCP connection to the server of an http(s) `uri` within `seconds`, or raise ConnectionError
    naming `key`: a tracker whose server does not answer is switched off at start instead of holding the run in its
    client's retries (minutes). Other URIs (files, sqlite) are left alone."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise ConnectionError(f"{key}={uri}: {e}") from None
    began = time.monotonic()
    try:
        socket.create_connection((parts.hostname, port), timeout=seconds).close()
    except OSError as e:
        raise ConnectionError(f"{key}={uri}: no server answered at {parts.hostname}:{port} within "
                              f"{seconds:g} s ({e.strerror or type(e).__name__}, after "
                              f"{time.monotonic() - began:.1f} s)") from None
