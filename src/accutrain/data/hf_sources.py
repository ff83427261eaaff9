"""Sources read with the Hugging Face `datasets` library (the `datasets` extra), for data=hf: local .json/.jsonl/.csv/
.parquet files, a directory written by save_to_disk, or a dataset name from the local cache — as a Dataset
(memory-mapped Arrow) or, streaming, an IterableDataset. Whatever fails is one line naming the key."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from accutrain.errors import UserError

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
JSON_CHUNK = 1 << 20  # datasets' JSON reader parses a file this many bytes at a time (its default, 10 MiB, holds
# the parse of 10 MiB of records in memory at once: that, not the number of records, is data=hf's peak at load)

def require_datasets() -> Any:
    """The datasets package (its progress bars off), or one line saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the datasets package: pip install 'accutrain[datasets]'") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors come back as accutrain's one line
    return datasets


def load(datasets: Any, source: str, split: str, cache_dir: Optional[str], key: str, streaming: bool = False) -> Any:
    """`source` as a datasets.Dataset (an IterableDataset when `streaming`): a local file by its suffix, a
    save_to_disk directory, or a dataset name (its `split`) — from the local cache when HF_HUB_OFFLINE=1. Anything
    that fails is one line naming `key`."""
    path = Path(source).expanduser()
    try:
        if path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
            found = datasets.load_from_disk(str(path))
            found = found[split] if isinstance(found, datasets.DatasetDict) else found
            return found.to_iterable_dataset() if streaming else found
        if path.suffix in BUILDERS and path.is_file():
            options = dict(chunksize=JSON_CHUNK) if BUILDERS[path.suffix] == "json" else {}
            try:
                return datasets.load_dataset(BUILDERS[path.suffix], data_files=str(path), split="train",
                                             cache_dir=cache_dir, streaming=streaming, **options)
            except ValueError:  # datasets' JSON reader fails on a blank line when a column's types vary
                if path.suffix == ".csv" or (plain := without_blank_lines(datasets, path, cache_dir)) is None:
                    raise
            return datasets.load_dataset("json", data_files=str(plain), split="train", cache_dir=cache_dir,
                                         streaming=streaming, **options)
        if path.exists() or source.startswith((".", "/", "~")) or path.suffix in BUILDERS:
            raise UserError(f"{key}={source}: expected a .json, .jsonl, .csv or .parquet file, a directory written "
                            "by save_to_disk, or a dataset name" + ("" if path.exists() else " (no such file)"))
        return datasets.load_dataset(source, split=split, cache_dir=cache_dir, streaming=streaming)
    except UserError:
        raise
    except (Exception, SystemExit) as e:  # not cached offline, no such split, a malformed file (DatasetGenerationError)
        cause = e.__cause__ or e
        line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        if path.is_file():  # the file itself: where it is malformed, not how datasets are found
            raise UserError(f"{key}={source} could not be read: {not_json_lines(path) or line[:200]}") from None
        raise UserError(f"{key}={source} could not be loaded ({line[:200]}); a dataset name loads from the local "
                        "cache when HF_HUB_OFFLINE=1 (load it once with network access)") from None


def not_json_lines(path: Path) -> Optional[str]:
    """Where a .json/.jsonl file that is not one JSON document is not JSON lines either: its first line that is not
    a JSON record (None when every line is one, or the file is not JSON)."""
    import json

    if BUILDERS.get(path.suffix) != "json":
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        json.loads(text)
        return None  # one JSON document: datasets' complaint stands
    except ValueError:
        pass
    for number, raw in enumerate(text.splitlines(), 1):
        try:
            if raw.strip():
                json.loads(raw)
        except ValueError as e:
            return f"line {number} is not a JSON record ({e}): each line must hold one JSON object"
    return None


def without_blank_lines(datasets: Any, path: Path, cache_dir: Optional[str]) -> Optional[Path]:
    """A copy of the JSON-lines file `path` without its blank lines (None when it has none), kept in the cache: the
    same records in the same rows, for datasets' JSON reader, which fails on a blank line where the records' types
    vary (a content that is a string in one message, a list of parts in another)."""
    import hashlib

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    copy = Path(cache_dir or datasets.config.HF_DATASETS_CACHE).expanduser() / "accutrain-jsonl" / f"{key}.jsonl"
    if copy.is_file():
        return copy
    copy.parent.mkdir(parents=True, exist_ok=True)
    partial, blank = copy.with_suffix(".partial"), 0
    with open(path, encoding="utf-8") as f, open(partial, "w", encoding="utf-8") as out:
        for line in f:  # blank lines hold no record
            if line.strip():
                out.write(line if line.endswith("\n") else line + "\n")
            else:
                blank += 1
    if not blank:
        partial.unlink()
        return None
    partial.replace(copy)
    return copy
