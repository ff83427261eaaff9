"""metrics.jsonl and the final summary line (the progress bar and the console: accutrain.train.console)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from accutrain.store.files import json_text
from accutrain.trackers import Trackers


class MetricsLog:
    """Appends one JSON object per line (strict JSON: a value that is not finite, an infinite val_loss say, is
    null), each with its `kind` first — plan, step, eval or test (a dataframe's column: accutrain.report.runs.
    metrics_frame); the optimizer steps' and evaluations' records go to the trackers as well, as measured.

    Step records are buffered and written together — every `FLUSH_RECORDS` records or `FLUSH_S` seconds, at each
    evaluation, before each checkpoint (the loop calls flush()) and at close — so a killed run loses only records
    after its last checkpoint, which a resume drops anyway (resume.keep_metrics_until). With no path (ranks other
    than 0) it writes nothing. A write that fails (a full disk) is cut back to the last whole line, said in one line,
    and tried again at the next flush with every record since: training goes on.
    """

    FLUSH_RECORDS, FLUSH_S = 100, 2.0

    def __init__(self, path: Optional[Path], trackers: Optional[Trackers] = None) -> None:
        self.path = path
        self.file = open(path, "ab", buffering=0) if path is not None else None
        self.trackers = trackers or Trackers()
        self.pending: list[dict[str, Any]] = []
        self.flushed = time.monotonic()
        self.failure: Optional[str] = None  # why the latest write failed, while it has not succeeded since

    def write(self, record: dict[str, Any], kind: Optional[str] = None) -> None:
        """Write `record` now, after the pending ones (as a record of `kind`, when it says none itself)."""
        self.pending.append(record if kind is None or "kind" in record else {"kind": kind, **record})
        self.flush()

    def flush(self) -> None:
        """Put every pending record in the file (one write) and hand it to the OS; on a failed write keep them."""
        self.flushed = time.monotonic()
        if self.file is None or not self.pending:
            self.pending.clear()
            return
        data = "".join(json_text(record) + "\n" for record in self.pending).encode()
        fd = self.file.fileno()
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[self.file.write(view):]
        except OSError as e:
            try:
                os.ftruncate(fd, start)  # no half line for the next write to run into
            except OSError:
                pass
            if self.failure is None:
                logging.getLogger("accutrain").error(
                    f"could not write {self.path} ({e.strerror or e}): training goes on, its records are kept and "
                    "written with the next ones")
            self.failure = e.strerror or str(e)
            return
        if self.failure is not None:
            logging.getLogger("accutrain").info(f"{self.path}: written again ({len(self.pending)} records had waited)")
            self.failure = None
        self.pending.clear()

    def step(self, record: dict[str, Any]) -> None:
        """An optimizer step's record."""
        if self.file is not None:
            self.pending.append({"kind": "step", **record})
            if len(self.pending) >= self.FLUSH_RECORDS or time.monotonic() - self.flushed >= self.FLUSH_S:
                self.flush()
        self.trackers.log_step(record)

    def evaluation(self, record: dict[str, Any]) -> None:
        """An evaluation's record (kind eval; the test stage's says kind test)."""
        self.write(record, "eval")
        self.trackers.log_eval(record)

    def close(self) -> None:
        """Write what is pending; records that still cannot be written are said in one line."""
        if self.file is not None:
            self.flush()
            if self.pending:
                logging.getLogger("accutrain").error(
                    f"{len(self.pending)} records (up to optimizer step "
                    f"{max((r.get('step', 0) for r in self.pending), default=0)}) could not be written to "
                    f"{self.path} ({self.failure})")
            self.file.close()
            self.file = None


def summary_lines(steps: int, samples: int, session_samples: int, seconds: float, last_loss: Optional[float],
                  best: Optional[str], peak_mb: float = 0.0, session_tokens: Optional[int] = None,
                  ranks: int = 1, median_per_s: Optional[float] = None) -> list[str]:
    """The closing lines, each short enough for a terminal: what was done — steps and samples of the whole run, this
    session's time (a resume is one) and its speed overall (in tokens/s too when the loss terms are tokens), beside
    `median_per_s`, the run's median optimizer step's (the samples/s of its summary table) — then the results: the
    last loss, the best evaluation of the monitored metric (`best`, as Monitor.describe says it), the peak memory
    (the most of any rank's when `ranks` > 1)."""
    def per_s(n: int) -> float:
        return n / seconds if seconds > 0 else float("nan")

    speed = f"{per_s(session_samples):.0f} samples/s" + (
        f" ({per_s(session_tokens):.0f} tokens/s)" if session_tokens is not None else "") + " overall"
    if median_per_s is not None:
        speed += f", {median_per_s:.0f} at the median step"
    results = [f"last loss {last_loss:.4f}"] if last_loss is not None else []
    if best is not None:
        results.append(best)
    if peak_mb:
        results.append(f"peak memory {peak_mb:.0f} MiB" + (f" (the most of {ranks} ranks)" if ranks > 1 else ""))
    done = f"{steps} optimizer step{'' if steps == 1 else 's'}, {samples} samples seen in {seconds:.1f} s"
    return [f"done: {done}: {speed}",
            *([", ".join(results)] if results else [])]
