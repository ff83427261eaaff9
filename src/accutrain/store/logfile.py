"""train.log's handler (configs/hydra/job_logging/accutrain.yaml): a line that cannot be written (a full disk) is
one warning on stderr, not logging's traceback for every line after it; the console goes on."""
from __future__ import annotations

import logging
import sys


class LogFile(logging.FileHandler):
    """logging.FileHandler whose failed writes are said once per failing stretch, on stderr, in one line."""

    failing = False  # the latest line could not be written
    failed_now = False

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
