"""Sources read with the Hugging Face `datasets` library (the `datasets` extra), for data=hf: local .json/.jsonl/.csv/
.parquet files, a directory written by save_to_disk, or a dataset name from the local cache — as a Dataset
(memory-mapped Arrow) or, streaming, an IterableDataset. Local JSON files are read as written (data/json_records.py),
not by the library's JSON reader, whose type inference changes the text. Whatever fails is one line naming the
key."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from accutrain.data.json_records import JsonStream, json_table
from accutrain.errors import UserError

# the roles whose columns hold text
TEXT_ROLES = ("text", "prompt", "response", "anchor", "positive", "negative", "chosen", "rejected", "completion")

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}

def require_datasets() -> Any:
    """The datasets package (its progress bars off), or one line saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the datasets package: pip install 'accutrain[datasets]'") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors come back as accutrain's one line
    return datasets


def load(datasets: Any, source: str, split: str, cache_dir: Optional[str], key: str, streaming: bool = False,
         text: Sequence[str] = ()) -> Any:
    """`source` as a datasets.Dataset (an IterableDataset when `streaming`): a local file by its suffix, a
    save_to_disk directory, or a dataset name (its `split`) — from the local cache when HF_HUB_OFFLINE=1. A .csv
    file's `text` columns are read as the strings they hold (`0.` is not 0.0, `NA` not null). Anything that fails is
    one line naming `key`."""
    path = Path(source).expanduser()
    try:
        if path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
            found = datasets.load_from_disk(str(path))
            found = found[split] if isinstance(found, datasets.DatasetDict) else found
            return found.to_iterable_dataset() if streaming else found
        if BUILDERS.get(path.suffix) == "json" and path.is_file():  # read as written (data/json_records.py)
            label = f"{key}={source} could not be read"
            return JsonStream(path, label) if streaming else json_table(datasets, path, label, cache_dir)
        if path.suffix in BUILDERS and path.is_file():
            options = csv_options(path, text) if path.suffix == ".csv" else {}
            return datasets.load_dataset(BUILDERS[path.suffix], data_files=str(path), split="train",
                                         cache_dir=cache_dir, streaming=streaming, **options)
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
            raise UserError(f"{key}={source} could not be read: {line[:200]}") from None
        raise UserError(f"{key}={source} could not be loaded ({line[:200]}); a dataset name loads from the local "
                        "cache when HF_HUB_OFFLINE=1 (load it once with network access)") from None


def text_columns(roles: dict[str, Any]) -> list[str]:
    """The columns data.columns maps a text role to (a list of negative columns, each)."""
    out: list[str] = []
    for role in TEXT_ROLES:
        value = roles.get(role)
        out += [value] if isinstance(value, str) else [v for v in (value or []) if isinstance(v, str)]
    return out


def csv_options(path: Path, text: Sequence[str]) -> dict[str, Any]:
    """pandas' reading options for a .csv file whose `text` columns hold strings as they are (no number read from
    `0.`, no null from `NA` or an empty field); the other columns as pandas reads them by default."""
    import csv

    from pandas._libs.parsers import STR_NA_VALUES

    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        header = next(csv.reader(f), [])
    others = {name: sorted(STR_NA_VALUES) for name in header if name not in text}
    return dict(converters={name: str for name in header if name in text}, keep_default_na=False, na_values=others)
