"""data=hf: records read with the Hugging Face `datasets` library (the `datasets` extra) — local .json/.jsonl/.csv/
.parquet files, a directory written by save_to_disk, or a dataset name from the local cache — tokenized once by
`Dataset.map` (cached by the library's fingerprinting, so a second start reads the cache) into memory-mapped Arrow
files, from which the items data=text makes — {input_ids, attention_mask, labels} — are read on demand
(data/arrow_items.py): host memory stays flat in the number of records. `streaming=true` reads the records as a
stream instead (data/stream.py).

`columns` maps the roles to the dataset's columns: text (language modelling), prompt + response (the prompt masked
out of the loss), messages (chat records: the loss on the assistant's tokens, data/chat.py), label (with text:
sequence classification). A new kind of record adds its roles to ROLES, its columns to NEEDS and its encoding to
`encode_batch`. Every record is accounted for (data/records.py): truncated at max_length, those left with no trained
token dropped (or refused), counted at load, named by their line in the file.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from accutrain.data.arrow_items import ArrowItems
from accutrain.data.chat import encode_chat
from accutrain.data.datasets import Datasets
from accutrain.data.packing import describe, packing_mode, packing_name
from accutrain.data.template import Template, chat_template
from accutrain.data.records import Tally, Where, check_truncation, log_tallies, trained
from accutrain.data.text import HELD_OUT_STREAM, check_lengths, encode, tokenized_datasets
from accutrain.data.tokenizer import fast_byte_tokenizer, load_tokenizer
from accutrain.errors import UserError
from accutrain.seeding import generator

log = logging.getLogger("accutrain")

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
JSON_CHUNK = 1 << 20  # datasets' JSON reader parses a file this many bytes at a time (its default, 10 MiB, holds
# the parse of 10 MiB of records in memory at once: that, not the number of records, is data=hf's peak at load)
ROLES = ("text", "prompt", "response", "messages", "label")
NEEDS = {"chat": ("messages",), "classes": ("text", "label"), "text": ("text",), "pairs": ("prompt", "response")}


def require_datasets() -> Any:
    """The datasets package (its progress bars off), or one line saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the datasets package: pip install 'accutrain[datasets]'") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
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
        raise UserError(f"{key}={source} could not be loaded ({line[:200]}); a dataset name loads from the local "
                        "cache when HF_HUB_OFFLINE=1 (load it once with network access)") from None


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


def task(columns: list[str], roles: dict[str, str], where: str) -> str:
    """What the records are, from the columns they have: chat, pairs (prompt/response), classes or text."""
    has = {role: roles[role] in columns for role in ROLES}
    for kind in ("chat", "classes", "text", "pairs"):
        if all(has[role] for role in NEEDS[kind]):
            return kind
    wanted = ", ".join(f"data.columns.{r}={roles[r]}" for r in ("text", "messages", "prompt", "response"))
    raise UserError(f"{where} has none of the columns {wanted} (prompt with response); its columns are: "
                    f"{', '.join(columns)} — map one with data.columns.<role>=<column>")


def encode_batch(batch: dict[str, list], rows: list[int], kind: str, tok: Any, template: Optional[Template],
                 roles: dict[str, str], ignore_index: int, where: Where) -> list[tuple[list[int], list[int]]]:
    """A batch of records as (token ids, labels) — labels empty for classes."""
    if kind == "chat":
        return encode_chat(batch[roles["messages"]], template, ignore_index, where, rows)
    fields = {role: roles[role] for role in ("text", "prompt", "response")}
    names = [roles[r] for r in (("text",) if kind in ("text", "classes") else ("prompt", "response"))]
    for name in names:
        for value, row in zip(batch[name], rows):
            if not isinstance(value, str):  # a csv column of numbers, a null
                raise UserError(f"{where(row)}: column {name!r} holds a {type(value).__name__} ({value!r}): "
                                "expected text in every record")
    records = [dict(zip(names, values)) for values in zip(*(batch[n] for n in names))]
    return encode(records, tok, fields, kind != "classes", ignore_index, where.source)


def tokenize(batch: dict[str, list], rows: list[int], *, kind: str, tok: Any, template: Optional[Template],
             roles: dict[str, str], ignore_index: int, max_length: Optional[int], where: Where,
             classes: Optional[dict[Any, int]]) -> dict[str, list]:
    """Dataset.map's batched function: records as input_ids and labels truncated to max_length (None: kept whole,
    for packing=concat), with their row, length, trained tokens, whether they were truncated (and class)."""
    out: dict[str, list] = dict(input_ids=[], labels=[], row=[], length=[], trained=[], truncated=[])
    for (ids, labels), row in zip(encode_batch(batch, rows, kind, tok, template, roles, ignore_index, where), rows):
        cut = max_length is not None and len(ids) > max_length
        ids, labels = (ids[:max_length], labels[:max_length]) if cut else (ids, labels)
        for key, value in dict(input_ids=ids, labels=labels, row=row, length=len(ids), truncated=cut,
                               trained=trained(labels, ignore_index) if kind != "classes" else 1).items():
            out[key].append(value)
    if classes is not None:
        out["class"] = []
        for value, row in zip(batch[roles["label"]], rows):
            if value not in classes:
                raise UserError(f"{where(row)}: label {value!r} is not among the training records' classes "
                                f"({', '.join(map(str, list(classes)[:8]))}{', …' if len(classes) > 8 else ''})")
            out["class"].append(classes[value])
    return out


def class_names(table: Any, column: str, where: str) -> dict[Any, int]:
    """The training records' classes: non-negative integers as they are, or names by their sorted place."""
    values = table.unique(column)
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return {i: i for i in range(max(values) + 1)}
    if not all(isinstance(v, str) for v in values):
        raise UserError(f"{where}: column {column!r} (data.columns.label) holds {sorted(map(repr, values))[:3]}: "
                        "expected non-negative integers or class names in every record")
    return {name: i for i, name in enumerate(sorted(values))}


def tokenized(datasets: Any, part: Any, kind: str, **arguments: Any) -> Any:
    """`part`'s records tokenized by Dataset.map (cached by fingerprint), into the columns tokenize makes."""
    int32 = datasets.Value("int32")
    features = dict(input_ids=datasets.List(int32), labels=datasets.List(int32), row=datasets.Value("int64"),
                    length=int32, trained=int32, truncated=datasets.Value("bool"))
    if arguments["classes"] is not None:
        features["class"] = datasets.Value("int64")
    return part.map(functools.partial(tokenize, kind=kind, **arguments), batched=True, with_indices=True,
                    remove_columns=part.column_names, features=datasets.Features(features))


def hold_out(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """data.text.hold_out's draw (the same records of the same file) as arrays: (the rows trained on, the rows held
    out), each in order."""
    if not 0 < val_fraction < 1 or n < 2:
        raise UserError(f"data.val_fraction={val_fraction} with {n} samples: expected a fraction in (0, 1) of at "
                        "least 2 samples, or data.val=<file>")
    import torch

    order = torch.randperm(n, generator=generator(seed, HELD_OUT_STREAM)).numpy()
    n_val = max(1, round(n * val_fraction))
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def hf_data(train: str, val: Optional[str] = None, val_fraction: float = 0.1, split: str = "train",
            val_split: str = "validation", tokenizer: str = "bytes", max_length: int = 512, packing: Any = False,
            padding: str = "longest", columns: Optional[dict] = None, cache_dir: Optional[str] = None,
            seed: int = 0, ignore_index: int = -100, test: Optional[str] = None, test_split: str = "test",
            truncation: str = "drop", chat_template: Optional[str] = None, streaming: bool = False,
            buffer_size: int = 1000) -> Datasets:
    """data=hf: `train` (and `val`, else `val_fraction` of `train` held out by the seed; `test` when given) read with
    `datasets`, tokenized once (cached), as language modelling, prompt/response, chat or sequence-classification
    items read on demand; `streaming`: `train` read as a stream (data/stream.py)."""
    check_lengths(max_length, padding)
    check_truncation(truncation)
    packing = packing_mode(packing)
    roles = {role: role for role in ROLES} | {k: v for k, v in dict(columns or {}).items() if v is not None}
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise UserError(f"data.columns.{unknown[0]} is not a role: expected one of {', '.join(ROLES)}")
    datasets = require_datasets()
    if streaming:
        from accutrain.data.stream import stream_data

        return stream_data(datasets, locals())
    source = load(datasets, train, split, cache_dir, "data.train")
    kind = task(source.column_names, roles, train)
    if packing and kind == "classes":
        raise UserError(f"data.packing={packing_name(packing)} packs language-modelling samples; these records carry "
                        f"labels (data.columns.label={roles['label']})")
    tok, template = tokenizer_for(kind, tokenizer, chat_template)
    classes = class_names(source, roles["label"], train) if kind == "classes" else None
    arguments = dict(tok=tok, template=template, roles=roles, ignore_index=ignore_index, classes=classes,
                     max_length=None if packing == "concat" else max_length)
    sources = [("data.train", train, source)]
    if val is not None:
        sources.append(("data.val", val, load(datasets, val, val_split, cache_dir, "data.val")))
    if test is not None:
        sources.append(("data.test", test, load(datasets, test, test_split, cache_dir, "data.test")))
    tables, tallies, wheres = [], [], []
    for key, name, part in sources:
        missing = [roles[r] for r in NEEDS[kind] if roles[r] not in part.column_names]
        if missing:
            raise UserError(f"{name} has no column {missing[0]!r} (data.columns); its columns are: "
                            f"{', '.join(part.column_names)}")
        wheres.append(Where(name))
        tables.append(tokenized(datasets, part, kind, where=wheres[-1], **arguments))
        tallies.append(Tally(key, name, read=len(part), truncated=int(np.sum(column(tables[-1], "truncated")))))
    splits = [np.arange(len(table)) for table in tables]
    if val is None:
        kept, out = hold_out(len(tables[0]), val_fraction, seed)
        splits[0:1] = [kept, out]
        tables.insert(1, tables[0])
        tallies[0].held_out = len(out)
    items = []
    for table, rows, tally in zip(tables, splits, [tallies[0]] * (1 + (val is None)) + tallies[1:]):
        if kind != "classes":
            untrained = column(table, "trained")[rows] == 0
            tally.untrained += column(table, "row")[rows[untrained]].tolist()
            rows = rows[~untrained]
        if not len(rows):
            raise UserError(f"{tally.key}={tally.source}: no record is left with a trained token at "
                            f"data.max_length={max_length}: raise data.max_length")
        items.append(ArrowItems(table, rows, max_length, packing, ignore_index, classes=kind == "classes"))
    log_tallies(tallies, wheres, truncation, max_length, lm=kind != "classes")
    names = [str(name) for name in classes] if classes is not None else None
    what = {"chat": "chat, the loss on the assistant's tokens" + labelled_by(template), "pairs": "prompt/response",
            "text": "language modelling", "classes": f"{len(names or [])} classes"}[kind]
    return tokenized_datasets(items, tok, names, max_length, padding, ignore_index,
                              f"hf {train} ({what}{describe(packing)}; tokenizer {tokenizer}, "
                              f"max_length {max_length})")


def column(table: Any, name: str) -> np.ndarray:
    """One column of a tokenized table as an array (the table's own rows, whatever was selected)."""
    return np.asarray(table.data.column(name).to_numpy())


def tokenizer_for(kind: str, tokenizer: str, chat_template_value: Optional[str]) -> tuple[Any, Optional[Template]]:
    """The tokenizer, and for chat records the template (data.chat_template, else the tokenizer's own)."""
    if chat_template_value is not None and kind != "chat":
        raise UserError(f"data.chat_template renders chat records; these records are {kind} (no "
                        "data.columns.messages column): drop data.chat_template")
    if chat_template_value is not None and tokenizer == "bytes":  # a template of one's own: Jinja, via transformers
        from accutrain.models.hf import require_transformers

        require_transformers("data.chat_template with data.tokenizer=bytes")
        tok = fast_byte_tokenizer()
    else:
        tok = load_tokenizer(tokenizer)
    return tok, (chat_template(tok, tokenizer, chat_template_value) if kind == "chat" else None)


def labelled_by(template: Optional[Template]) -> str:
    """How the assistant's tokens are found, for the data's description."""
    if template is None:
        return ""
    return ", by its generation markers" if template.markers else ", located in each rendering"
