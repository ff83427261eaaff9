"""The terminal while a run trains: the progress bar over optimizer steps, bars for the other waits (an evaluation,
micro_batch=auto's trial steps), and log lines that share stderr with them.

A log line never lands on the bar's line: the console handler lifts the bar (tqdm's external write mode), writes
the line, and draws the bar again below it. A message's first line is what the console shows; the lines after it
are its detail, which train.log (the file handler, a plain formatter) keeps in full. In a log file (stderr not a
terminal) the bar is one plain line every 30 s at most, and one at the end with the last step's figures.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Optional

from tqdm import tqdm


class ConsoleFormatter(logging.Formatter):
    """`[hh:mm:ss] message`, with the level named when it is not INFO; the message's first line only (the rest is
    its detail, for train.log)."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"[{self.formatTime(record, '%H:%M:%S')}] {level}{record.getMessage().partition(chr(10))[0]}"


class ConsoleHandler(logging.StreamHandler):
    """A StreamHandler that takes the progress bar off its terminal line for each record and draws it again below
    (a bar writing to a log file, not a terminal, is left alone)."""

    def emit(self, record: logging.LogRecord) -> None:
        with tqdm.external_write_mode(file=self.stream):
            super().emit(record)


class _LogLines:
    """A file for tqdm when stderr is a log, not a terminal: every refresh becomes one plain line."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


class StepBar(tqdm):
    """tqdm over optimizer steps whose postfix is set only when it is about to be drawn (a few µs per step saved),
    and whose final display shows the last step's figures — once, also in a log file."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.interactive = sys.stderr.isatty()
        self.latest: Optional[tuple[float, float, str, float]] = None  # the last step's figures
        super().__init__(total=total, initial=initial, unit="step", disable=not enabled, dynamic_ncols=True,
                         file=sys.stderr if self.interactive else _LogLines(sys.stderr),
                         mininterval=0.25 if self.interactive else 30.0)

    def step(self, loss: float, lr: float, unit: str, per_s: float) -> None:
        """One optimizer step with its loss, learning rate and speed (`unit` per second): shown when the bar redraws
        (formatted only then) and at its end."""
        self.latest = (loss, lr, unit, per_s)
        if self._time() - self.last_print_t >= self.mininterval:  # update() is about to redraw
            self.set_postfix(self.figures(), refresh=False)
        self.update()

    def figures(self) -> dict[str, str]:
        """The postfix of the last step's figures."""
        loss, lr, unit, per_s = self.latest
        return {"loss": f"{loss:.4f}", "lr": f"{lr:.3g}", f"{unit}_s": f"{per_s:.0f}"}

    def close(self) -> None:
        """The last display, with the last step's figures; in a log file none when the line printed at the last
        update already was it (its figures were set just before it was drawn)."""
        if not self.disable and self.latest is not None:
            self.set_postfix(self.figures(), refresh=False)
            if not self.interactive and self.last_print_n == self.n:
                self.leave = False  # nothing more to say: tqdm's close then clears (no line in a log)
        super().close()


WAIT_DELAY_S = 1.0  # a wait's bar appears only once it has lasted this long: a short evaluation shows none


def wait_bar(iterable: Any = None, total: Optional[int] = None, desc: str = "", unit: str = "it",
             enabled: bool = True) -> tqdm:
    """A bar for a wait a user sits through — the evaluation of a large split, micro_batch=auto's trial steps — on a
    terminal only (none in a log file), drawn once the wait has lasted WAIT_DELAY_S, and gone when it ends (below
    the step bar while that is drawn)."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, delay=WAIT_DELAY_S, dynamic_ncols=True,
                disable=not (enabled and sys.stderr.isatty()), file=sys.stderr)
