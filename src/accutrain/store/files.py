"""Files a crash cannot leave half-written, and JSON-lines files read while they may end mid-line."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Union

Content = Union[str, bytes, Callable[[IO[bytes]], None]]


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, content: Content, durable: bool = False) -> None:
    """Write `content` (text, bytes, or a function writing to a binary file) to a temporary file beside `path`, then
    rename it over `path`: a reader sees the old file or the new one, never part of one. durable: fsync the file and
    the directory as well, so that a power loss keeps one of the two. A failed write leaves no temporary file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def finite_json(value: Any) -> Any:
    """`value` with every float that is not finite (NaN, ±infinity) made None, in dicts, lists and tuples too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def json_text(record: Any) -> str:
    """`record` as strict JSON, which has no NaN or Infinity: a value that is not finite is written null (as
    metrics.jsonl writes a non-finite loss), so that every JSON reader, not Python's alone, parses the file."""
    try:
        return json.dumps(record, allow_nan=False)  # the common case: nothing to replace, nothing copied
    except ValueError:
        return json.dumps(finite_json(record), allow_nan=False)


def read_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, record) for each line of `path` that holds a JSON object; any other line (such as the half-written last
    line of a running or killed run) is skipped. Nothing when the file cannot be read."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield line, record
