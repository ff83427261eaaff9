"""Every record accounted for: records named by their line in the file, truncation to data.max_length, and the one
line of counts at load — records read, held out, truncated, left with no trained token (dropped, listed in
train.log, or refused with data.truncation=error).

A record's trained tokens are those whose label is not ignore_index at positions 1 on: the loss shifts the labels,
so position 0 is never predicted. A record left with none would add nothing to the loss and, a window made of such
records, no term to divide by: it is never trained on.
"""
from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from accutrain.errors import UserError

log = logging.getLogger("accutrain")
detail = logging.getLogger("accutrain.detail")  # train.log only (configs/hydra/job_logging/accutrain.yaml)
TRUNCATION = ("drop", "error")  # data.truncation: what happens to a record left with no trained token
LISTED = 5  # records named in a one-line message


class Where:
    """Names records of `source` (a path, or a dataset's name) for messages: by their line in a .jsonl, .json (JSON
    lines), .txt or .csv file — `chat.jsonl:12` — else by their row (`row 11 of data.parquet`), counted from 0. A
    record's row is its place among the file's records (blank lines hold none)."""

    def __init__(self, source: str) -> None:
        self.source = source
        path = Path(source).expanduser()
        self.path = path if path.is_file() and path.suffix in (".jsonl", ".json", ".txt", ".csv") else None

    def __call__(self, row: int) -> str:
        return self.lines([row])[row]

    def lines(self, rows: Iterable[int]) -> dict[int, str]:
        """The names of `rows`, the file read once whatever their number."""
        wanted = sorted(set(int(r) for r in rows))
        if self.path is None or not wanted:
            return {r: f"row {r} of {self.source}" for r in wanted}
        found: dict[int, int] = {}
        with open(self.path, encoding="utf-8", errors="replace", newline="") as f:
            if self.path.suffix == ".csv":
                starts = csv_starts(f)
            else:
                if self.path.suffix == ".json" and f.read(64).lstrip().startswith("["):  # an array: no lines
                    return {r: f"record {r} of {self.source}" for r in wanted}
                f.seek(0)
                starts = (number for number, line in enumerate(f, 1) if line.strip())
            targets = iter(wanted)
            target = next(targets)
            for row, line in enumerate(starts):
                if row == target:
                    found[row] = line
                    target = next(targets, None)
                    if target is None:
                        break
        return {r: f"{self.source}:{found[r]}" if r in found else f"row {r} of {self.source}" for r in wanted}


class Named:
    """A record's name (Where's) for a message, worked out only when a message is written with it."""

    def __init__(self, where: Where, row: int) -> None:
        self.where, self.row = where, row

    def __str__(self) -> str:
        return self.where(self.row)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def csv_starts(f: Iterable[str]) -> Iterable[int]:
    """The line each data row of a CSV file begins on (the header is line 1; a quoted field may span lines)."""
    reader = csv.reader(f)
    next(reader, None)
    previous = reader.line_num
    for _ in reader:
        yield previous + 1
        previous = reader.line_num


def trained(labels: Sequence[int], ignore_index: int) -> int:
    """A sample's trained tokens: labels other than ignore_index after the first (the shift predicts from 1 on)."""
    return sum(1 for label in labels[1:] if label != ignore_index)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share: the prompt's tokens inside prompt+response (a token merging the
    prompt's end with the response's start counts as the response's)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_truncation(truncation: str) -> None:
    if truncation not in TRUNCATION:
        raise UserError(f"data.truncation={truncation} is not valid: expected drop (a record that data.max_length "
                        "leaves with no trained token is dropped, and listed in train.log) or error (refused)")


@dataclass
class Tally:
    """One split's records as loaded: how many were read, held out, truncated, and which are left untrained."""

    key: str  # data.train, data.val, data.test
    source: str
    read: int = 0
    held_out: int = 0  # of `read`, drawn into the held-out split (data.val_fraction)
    truncated: int = 0  # longer than data.max_length, cut to it
    truncated_rows: list[int] = field(default_factory=list)  # the first LISTED of them, named in the load's line
    untrained: list[int] = field(default_factory=list)  # rows left with no trained token (dropped)

    def settle(self, where: Where, truncation: str, max_length: int, lm: bool) -> str:
        """The load's line of counts; the untrained records listed in train.log — or, data.truncation=error, one
        UserError naming them."""
        if self.untrained and truncation == "error":
            names = where.lines(self.untrained[:LISTED])
            raise UserError(f"{self.key}={self.source}: {len(self.untrained):,} record"
                            f"{'s are' if len(self.untrained) > 1 else ' is'} left with no trained token at "
                            f"data.max_length={max_length} ({', '.join(names.values())}"
                            f"{', …' if len(self.untrained) > LISTED else ''}): raise data.max_length, or set "
                            "data.truncation=drop to train on the others")
        if self.untrained:
            for row, name in where.lines(self.untrained).items():
                detail.info(f"{self.key}: dropped {name}: no trained token left (data.max_length={max_length})")
        parts = [f"{self.read:,} records read"] + ([f"{self.held_out:,} held out"] if self.held_out else []) + [
            f"{self.truncated:,} truncated at data.max_length={max_length}{self.cut(where)}"]
        if lm:
            parts.append(f"{len(self.untrained):,} left with no trained token"
                         + (" and dropped (listed in train.log)" if self.untrained else ""))
        return f"{self.key}={self.source}: {', '.join(parts)}"

    def cut(self, where: Where) -> str:
        """The truncated records named for the load's line: ` (chat.jsonl:3, chat.jsonl:9)`, the first LISTED
        then a count; '' when none is known by its row."""
        rows = sorted(self.truncated_rows)[:LISTED]
        if not rows:
            return ""
        more, names = self.truncated - len(rows), list(where.lines(rows).values())
        if all(name.startswith(f"{self.source}:") for name in names):  # the line's own file: its line numbers
            names = ["lines " + ", ".join(name[len(self.source) + 1:] for name in names)]
        return f" ({', '.join(names)}{f', and {more:,} more' if more > 0 else ''})"

    def count_truncated(self, row: int) -> None:
        """One more truncated record, row `row` (the first LISTED rows are kept, to be named)."""
        self.truncated += 1
        if len(self.truncated_rows) < LISTED:
            self.truncated_rows.append(row)


def log_tallies(tallies: Sequence[Tally], where: Sequence[Where], truncation: str, max_length: int, lm: bool
                ) -> None:
    """Every split's counts (and its untrained records) logged, or one UserError."""
    lines = [t.settle(w, truncation, max_length, lm) for t, w in zip(tallies, where)]
    for line in lines:
        log.info(line)


def kept(samples: list[tuple[list[int], list[int]]], rows: Sequence[int], max_length: Optional[int],
         ignore_index: int, lm: bool, tally: Tally) -> list[tuple[list[int], list[int]]]:
    """In-memory samples (data=text) truncated to max_length (None: not truncated, packing=concat), counted in
    `tally`, the language-modelling ones left with no trained token dropped."""
    out = []
    for (ids, labels), row in zip(samples, rows):
        if max_length is not None and len(ids) > max_length:
            ids, labels = ids[:max_length], labels[:max_length]
            tally.count_truncated(row)
        if lm and not trained(labels, ignore_index):
            tally.untrained.append(row)
            continue
        out.append((ids, labels))
    return out
