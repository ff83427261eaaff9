"""logger=csv: metrics.csv in the run directory, one row per optimizer step and one per evaluation, with the
columns of metrics.jsonl (a column that appears later, such as val_loss, rewrites the header)."""
from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import IO, Any, Optional

from accutrain.store.files import write_atomic
from accutrain.trackers.base import RunInfo, Tracker


class CSV(Tracker):
    def __init__(self, filename: str = "metrics.csv") -> None:
        self.filename = filename
        self.path: Optional[Path] = None
        self.columns: list[str] = []
        self.file: Optional[IO[str]] = None

    def start(self, run: RunInfo) -> dict[str, Any]:
        self.path = run.run_dir / self.filename
        rows = list(run.history()) if run.resumed else []  # a resumed run: the rows up to its checkpoint, again
        self.columns = list(dict.fromkeys(key for row in rows for key in row))
        self._rewrite(rows)
        return {"path": str(self.path)}

    def log_step(self, record: dict[str, Any]) -> None:
        self._add(record)

    def log_eval(self, record: dict[str, Any]) -> None:
        self._add(record)

    def _add(self, record: dict[str, Any]) -> None:
        assert self.file is not None and self.path is not None
        if any(key not in self.columns for key in record):
            self.file.close()
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
            self.columns += [key for key in record if key not in self.columns]
            self._rewrite(rows)
        csv.DictWriter(self.file, self.columns).writerow(record)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        """The file anew with the current columns, atomically; then open it for appending, line by line."""
        assert self.path is not None
        text = io.StringIO()
        writer = csv.DictWriter(text, self.columns)
        if self.columns:
            writer.writeheader()
        writer.writerows(rows)
        write_atomic(self.path, text.getvalue())
        self.file = open(self.path, "a", newline="", buffering=1)

    def finish(self, end: Any) -> None:
        if self.file is not None:
            self.file.close()
