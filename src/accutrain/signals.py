"""Preemption: the first of the preemption signals (`trainer.preempt_signals`: SIGTERM, SIGINT, SIGUSR1, SIGUSR2 by
default) asks the loop to stop after the current optimizer step (or, when its window is far from its end, to
abandon that window: train/stopping.py) and checkpoint; a second SIGINT stops at once. And
the parent-death signal that ends a rank whose command was killed outright."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable, Iterable, Iterator, Optional

log = logging.getLogger("accutrain")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_numbers(names: Iterable[str]) -> tuple[signal.Signals, ...]:
    """The signals `trainer.preempt_signals` names (validated beforehand)."""
    return tuple(signal.Signals[name] for name in names)


class StopRequest:
    """Signal handlers for the training process; `signum` is set once a stop has been asked for."""

    def __init__(self, on_request: Optional[Callable[[int], None]] = None, announce: bool = True,
                 signals: Iterable[int] = SIGNALS) -> None:
        self.signum: Optional[int] = None
        self.on_request, self.announce, self.signals = on_request, announce, tuple(signals)
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is None:
            self.signum = signum
            if self.announce:
                log.info(f"{signal.Signals(signum).name}: stopping at the end of the current window, or at once "
                         "when its end is further off than trainer.stop_grace_s allows; then checkpointing (a second "
                         "Ctrl-C stops at once)")
            if self.on_request:
                self.on_request(signum)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def __enter__(self) -> "StopRequest":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


@contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """A Ctrl-C during the block is a KeyboardInterrupt at its end."""
    pressed = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if pressed:
        raise KeyboardInterrupt


def die_with_parent() -> None:
    """Linux: this process is killed (SIGKILL) when the one that started it exits — a rank when the fork server that
    forked it does, the fork server when the command does — so that a command killed outright (SIGKILL, the OOM
    killer) leaves no rank training on, writing its run directory and holding its device. Elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):  # no libc's prctl here
        return
    if os.getppid() != parent:  # the parent exited before the request took effect
        os._exit(128 + signal.SIGKILL)
