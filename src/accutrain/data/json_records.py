"""Local JSON files (.jsonl, .json) read for data=hf as the user wrote them, by Python's json module: a string stays
the string in the file — never the number, list or document the `datasets` library's type inference would make of
it (`"0."` is not 0.0, `"\\"yes\\""` keeps its quotes, a string holding JSON is not decoded) — and a field missing
from one record is not added to it. Read into a memory-mapped Arrow table (kept in the cache) whose columns hold each
record's field as JSON text (`fields` turns them back), or as a stream that resumes at its byte offset. A line that
is not one JSON object, or not UTF-8, is one line naming the file, the line and the byte.

JSON lines (blank lines hold no record), a .json array of records, or a .json object of columns (lists of equal
length), as the `datasets` library's JSON reader takes them.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, Optional

from accutrain.errors import UserError

MARK = "accutrain: each column holds a record's field as its JSON text"  # the tables json_table writes
VERSION = 1  # of the cached tables' layout


def kind_of(value: Any) -> str:
    return {dict: "object", list: "list", str: "string"}.get(type(value), type(value).__name__)


def lines(path: Path, label: str, start: int = 0, line: int = 0) -> Iterator[tuple[int, int, dict]]:
    """(line number, the byte offset after it, record) of each non-blank line from byte `start` (line `line` ended
    there); one line naming the file, the line and its byte for text that is not UTF-8 or not a JSON object."""
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        for raw in f:
            line += 1
            at, offset = offset, offset + len(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{label}: line {line} is not UTF-8 text (byte {at + e.start:,} of the file is "
                                f"{raw[e.start:e.start + 1]!r}): save the file as UTF-8") from None
            text = text.lstrip("\ufeff") if at == 0 else text  # a byte-order mark
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except ValueError as e:
                raise UserError(f"{label}: line {line} is not a JSON record ({e}): each line must hold one JSON "
                                "object") from None
            if not isinstance(record, dict):
                raise UserError(f"{label}: line {line} is a JSON {kind_of(record)}, not a record: each line must "
                                "hold one JSON object")
            yield line, offset, record


def document(path: Path, label: str) -> Optional[list[dict]]:
    """The records of a .json file that is one JSON document (an array of records, or an object of columns); None
    when its first line is a whole JSON value (JSON lines)."""
    if path.suffix != ".json":
        return None
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    first = head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if first == b"{":
        try:
            json.loads(head.split(b"\n", 1)[0].decode("utf-8", errors="replace"))
            return None
        except ValueError:
            pass
    elif first != b"[":
        return None
    try:
        value = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise UserError(f"{label}: byte {e.start:,} of the file is not UTF-8 text: save the file as UTF-8") from None
    except ValueError as e:
        raise UserError(f"{label}: it is not JSON ({e}): expected JSON lines, an array of records or an object of "
                        "columns") from None
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()) and len(
            {len(v) for v in value.values()}) == 1:
        value = [dict(zip(value, row)) for row in zip(*value.values())]
    if not isinstance(value, list):
        raise UserError(f"{label}: it is a JSON {kind_of(value)}: expected JSON lines, an array of records or an "
                        "object of columns (lists of equal length)")
    for i, record in enumerate(value):
        if not isinstance(record, dict):
            raise UserError(f"{label}: record {i} is a JSON {kind_of(record)}: expected an object")
    return value


def records(path: Path, label: str, start: int = 0, line: int = 0) -> Iterator[tuple[int, int, dict]]:
    """(position to resume after it, its line, record) of each record from `start` (a byte offset, line `line`
    ended there; in a document, a record's index)."""
    whole = document(path, label)
    if whole is not None:
        yield from ((i + 1, i + 1, record) for i, record in enumerate(whole[start:], start))
        return
    yield from ((offset, number, record) for number, offset, record in lines(path, label, start, line))


def json_table(datasets: Any, path: Path, label: str, cache_dir: Optional[str]) -> Any:
    """The file's records as a Dataset whose columns hold each field's JSON text (null where a record lacks the
    field), written once into the cache, keyed by the file's path, size and time."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{VERSION}".encode()).hexdigest()[:24]
    table = Path(cache_dir or datasets.config.HF_DATASETS_CACHE).expanduser() / "accutrain-json" / f"{key}.arrow"
    columns: dict[str, None] = {}
    if not table.is_file():
        for _, _, record in records(path, label):  # the columns: every record's fields, in the order first seen
            columns.update(dict.fromkeys(record))
        if not columns:
            raise UserError(f"{label}: it holds no record")
        from datasets.arrow_writer import ArrowWriter

        features = datasets.Features({name: datasets.Value("string") for name in columns})
        table.parent.mkdir(parents=True, exist_ok=True)
        partial = table.with_suffix(".partial")
        writer = ArrowWriter(features=features, path=str(partial), writer_batch_size=1000)
        try:
            for _, _, record in records(path, label):
                writer.write({name: json.dumps(record[name]) if name in record else None for name in columns})
            writer.finalize()
        finally:
            writer.close()
        partial.replace(table)
    return datasets.Dataset.from_file(str(table), info=datasets.DatasetInfo(description=MARK))


def is_json_table(table: Any) -> bool:
    """Whether `table` (or a selection of it) is json_table's."""
    return getattr(getattr(table, "info", None), "description", None) == MARK


def fields(values: list[Optional[str]]) -> list[Any]:
    """A json_table column's values as the file holds them."""
    return [None if v is None else json.loads(v) for v in values]


def decoded(batch: dict[str, list], table: bool) -> dict[str, list]:
    """A batch of rows of a json_table (`table`) as the file's values; any other batch as it is."""
    return {name: fields(values) for name, values in batch.items()} if table else batch


class JsonStream:
    """A local JSON file as a stream of records, with the interface data/stream.py uses of an IterableDataset
    (iteration, state_dict, load_state_dict): its state is the byte offset after the last record given."""

    def __init__(self, path: Path, label: str) -> None:
        self.path, self.label = path, label
        self.position, self.line = 0, 0

    def state_dict(self) -> dict:
        return dict(position=self.position, line=self.line)

    def load_state_dict(self, state: dict) -> None:
        if "position" not in state:
            raise UserError(f"{self.label}: the checkpoint's stream position was written by another reader of the "
                            "file (an earlier accutrain): start the run again, or resume it with that version")
        self.position, self.line = int(state["position"]), int(state["line"])

    def __iter__(self) -> Iterator[dict]:
        for position, line, record in records(self.path, self.label, self.position, self.line):
            self.position, self.line = position, line
            yield record
