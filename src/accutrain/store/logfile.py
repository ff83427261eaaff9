"""train.log's handler (configs/hydra/job_logging/accutrain.yaml): a line that cannot be written (a full disk) is
one warning on stderr, not logging's traceback for every line after it; the console goes on. A train.log that is a
link leading outside its run directory is never written through: its lines go to the console only."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path


class LogFile(logging.FileHandler):
    """logging.FileHandler whose failed writes are said once per failing stretch, on stderr, in one line."""

    failing = False  # the latest line could not be written
    failed_now = False

    def _open(self):  # noqa: ANN202 (logging's own)
        path = Path(self.baseFilename)
        if leads_outside(path):
            sys.stderr.write(f"accutrain: warning: {path} is a link to {os.readlink(path)}, outside the run directory: "
                             "accutrain does not write through it; the log's lines go to the console only\n")
            return open(os.devnull, "a", encoding=self.encoding)
        return super()._open()

    def emit(self, record: logging.LogRecord) -> None:
        self.failed_now = False
        super().emit(record)  # a failed write ends in handleError
        if not self.failed_now:
            self.failing = False  # written again: a later failure is said again

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self.failed_now = True
        if not self.failing:
            self.failing = True
            try:
                sys.stderr.write(f"accutrain: warning: could not write {self.baseFilename} ({error.strerror or error}):"
                                 " its lines go to the console only while that lasts\n")
            except OSError:
                pass


def leads_outside(path: Path) -> bool:
    """Whether `path` is a link whose target lies outside the directory that holds the link."""
    return path.is_symlink() and not Path(os.path.realpath(path)).is_relative_to(path.parent.resolve())


def reopen_log_files(path: Path) -> None:
    """Every LogFile handler writing `path` closes it and opens it anew (a new file after a link there was removed)."""
    handlers = [h for logger in [logging.getLogger(), *(logging.getLogger(n) for n in logging.root.manager.loggerDict)]
                for h in getattr(logger, "handlers", [])]
    for handler in set(handlers):
        if isinstance(handler, LogFile) and Path(handler.baseFilename) == Path(os.path.abspath(path)):
            with handler.lock:
                if handler.stream is not None:
                    handler.stream.close()
                handler.stream = handler._open()
