"""data=hf: records read with the Hugging Face `datasets` library (the `datasets` extra) — local .json/.jsonl/.csv/
.parquet files, a directory written by save_to_disk, or a dataset name from the local cache — tokenized once by
`Dataset.map` (cached by the library's fingerprinting, so a second start reads the cache) into the items data=text
makes: {input_ids, attention_mask, labels}, map-style, in the files' order (the seed permutes them per epoch).

`columns` maps the roles to the dataset's columns: text (language modelling), prompt + response (the prompt masked
out of the loss), messages (chat records: the loss on the assistant's tokens, data.chat), label (with text: sequence
classification). The rest — EOS, prompt masking, truncation, packing, padding — is data.text's.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Optional

from accutrain.data.chat import encode_chat
from accutrain.data.datasets import Datasets
from accutrain.data.packing import describe, pack, packing_mode, packing_name
from accutrain.data.pairs import PairColumns, is_pairs, pair_datasets, pair_items
from accutrain.data.pairs import describe as describe_pairs
from accutrain.data.text import as_items, check_lengths, class_index, encode, hold_out, tokenized_datasets
from accutrain.data.tokenizer import load_tokenizer
from accutrain.errors import UserError

log = logging.getLogger("accutrain")

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
ROLES = ("text", "prompt", "response", "messages", "label", "anchor", "positive", "negative")


def require_datasets() -> Any:
    """The datasets package (its progress bars off), or one line saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the datasets package: pip install 'accutrain[datasets]'") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def load(datasets: Any, source: str, split: str, cache_dir: Optional[str], key: str) -> Any:
    """`source` as a datasets.Dataset: a local file by its suffix, a save_to_disk directory, or a dataset name
    (its `split`) — from the local cache when HF_HUB_OFFLINE=1. Anything that fails is one line naming `key`."""
    path = Path(source).expanduser()
    try:
        if path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
            found = datasets.load_from_disk(str(path))
            return found[split] if isinstance(found, datasets.DatasetDict) else found
        if path.suffix in BUILDERS and path.is_file():
            return datasets.load_dataset(BUILDERS[path.suffix], data_files=str(path), split="train",
                                         cache_dir=cache_dir)
        if path.exists() or source.startswith((".", "/", "~")) or path.suffix in BUILDERS:
            raise UserError(f"{key}={source}: expected a .json, .jsonl, .csv or .parquet file, a directory written "
                            "by save_to_disk, or a dataset name" + ("" if path.exists() else " (no such file)"))
        return datasets.load_dataset(source, split=split, cache_dir=cache_dir)
    except UserError:
        raise
    except (Exception, SystemExit) as e:  # not cached offline, no such split, a malformed file (DatasetGenerationError)
        cause = e.__cause__ or e
        line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise UserError(f"{key}={source} could not be loaded ({line[:200]}); a dataset name loads from the local "
                        "cache when HF_HUB_OFFLINE=1 (load it once with network access)") from None


def task(columns: list[str], roles: dict[str, str], where: str) -> str:
    """What the records are, from the columns they have: chat, pairs (prompt/response), classes or text."""
    has = {role: roles[role] in columns for role in ROLES}
    for kind, needs in (("chat", ("messages",)), ("classes", ("text", "label")), ("text", ("text",)),
                        ("pairs", ("prompt", "response"))):
        if all(has[role] for role in needs):
            return kind
    wanted = ", ".join(f"data.columns.{r}={roles[r]}" for r in ("text", "messages", "prompt", "response"))
    raise UserError(f"{where} has none of the columns {wanted} (prompt with response); its columns are: "
                    f"{', '.join(columns)} — map one with data.columns.<role>=<column>")


def tokenize(batch: dict[str, list], tok: Any, kind: str, roles: dict[str, str], tokenizer: str, ignore_index: int,
             where: str) -> dict[str, list]:
    """Dataset.map's batched function: a batch of records as input_ids and labels (empty for classes)."""
    if kind == "chat":
        samples = encode_chat(batch[roles["messages"]], tok, ignore_index, tokenizer, where)
    else:
        fields = {role: roles[role] for role in ("text", "prompt", "response")}
        names = [roles[r] for r in (("text",) if kind in ("text", "classes") else ("prompt", "response"))]
        for name in names:
            odd = next((v for v in batch[name] if not isinstance(v, str)), "")
            if not isinstance(odd, str):  # a csv column of numbers, a null
                raise UserError(f"{where}: column {name!r} holds a {type(odd).__name__} ({odd!r}): expected text "
                                "in every record")
        records = [dict(zip(names, values)) for values in zip(*(batch[n] for n in names))]
        samples = encode(records, tok, fields, kind != "classes", ignore_index, where)
    return dict(input_ids=[ids for ids, _ in samples], labels=[labels for _, labels in samples])


def hf_data(train: str, val: Optional[str] = None, val_fraction: float = 0.1, split: str = "train",
            val_split: str = "validation", tokenizer: str = "bytes", max_length: int = 512, packing: Any = False,
            padding: str = "longest", columns: Optional[dict] = None, cache_dir: Optional[str] = None,
            seed: int = 0, ignore_index: int = -100, test: Optional[str] = None, test_split: str = "test") -> Datasets:
    """data=hf: `train` (and `val`, else `val_fraction` of `train` held out by the seed; `test` when given) read with
    `datasets`,
    tokenized once (cached), as language modelling, prompt/response, chat or sequence-classification items."""
    check_lengths(max_length, padding)
    packing = packing_mode(packing)
    roles = {role: role for role in ROLES} | {k: v for k, v in dict(columns or {}).items() if v is not None}
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise UserError(f"data.columns.{unknown[0]} is not a role: expected one of {', '.join(ROLES)}")
    datasets = require_datasets()
    source = load(datasets, train, split, cache_dir, "data.train")
    rows: list[Optional[list[int]]] = [None, None]  # each split's records' rows in its file (held out: the file's)
    if val is not None:
        held = load(datasets, val, val_split, cache_dir, "data.val")
    else:
        kept, out = hold_out(len(source), val_fraction, seed)
        source, held, rows = source.select(kept), source.select(out), [kept, out]
    parts = [(source, train), (held, val or train)]
    if test is not None:
        parts.append((load(datasets, test, test_split, cache_dir, "data.test"), test))
    pair_columns = PairColumns(roles["anchor"], roles["positive"], roles["negative"])
    if is_pairs(source.column_names, pair_columns):
        return hf_pairs(parts, rows + [None], pair_columns, tokenizer, max_length, packing, padding, train)
    kind = task(source.column_names, roles, train)
    if packing and kind == "classes":
        raise UserError(f"data.packing={packing_name(packing)} packs language-modelling samples; these records carry labels "
                        f"(data.columns.label={roles['label']})")
    tok = load_tokenizer(tokenizer)
    splits, names = [], None
    for part, where in parts:
        missing = [roles[r] for r in {"chat": ("messages",), "classes": ("text", "label"), "text": ("text",),
                                      "pairs": ("prompt", "response")}[kind] if roles[r] not in part.column_names]
        if missing:
            raise UserError(f"{where} has no column {missing[0]!r} (data.columns); its columns are: "
                            f"{', '.join(part.column_names)}")
        classes = None
        if kind == "classes":
            classes, names = class_index([{"label": v} for v in part[roles["label"]]], "label", names, where)
        tokenized = part.map(functools.partial(tokenize, tok=tok, kind=kind, roles=roles, tokenizer=tokenizer,
                                               ignore_index=ignore_index, where=where),
                             batched=True, remove_columns=part.column_names)
        samples = list(zip(tokenized["input_ids"], tokenized["labels"]))
        if packing:
            samples = pack(samples, max_length, packing, ignore_index)
        splits.append(as_items(samples, classes, max_length))
    what = {"chat": "chat, the loss on the assistant's tokens", "pairs": "prompt/response",
            "text": "language modelling", "classes": f"{len(names or [])} classes"}[kind]
    return tokenized_datasets(splits, tok, names, max_length, padding, ignore_index,
                              f"hf {train} ({what}{describe(packing)}; tokenizer {tokenizer}, "
                              f"max_length {max_length})")


def hf_pairs(parts: list[tuple[Any, str]], rows: list[Optional[list[int]]], columns: PairColumns, tokenizer: str,
             max_length: int, packing: Any, padding: str, train: str) -> Datasets:
    """data=hf's records of text pairs (and triples), each split as pair items (data.pairs); a record named by its
    row in its file."""
    if packing:
        raise UserError(f"data.packing={packing_name(packing)} packs language-modelling samples; {train} holds text "
                        "pairs (data.columns.anchor and .positive): use data.packing=false")
    tok = load_tokenizer(tokenizer)
    splits = []
    for (part, where), row in zip(parts, rows):
        wanted = [c for c in (columns.anchor, columns.positive, *columns.negatives(part.column_names))]
        missing = [c for c in wanted[:2] if c not in part.column_names]
        if missing:
            raise UserError(f"{where} has no column {missing[0]!r} (data.columns); its columns are: "
                            f"{', '.join(part.column_names)}")
        records = part.select_columns(wanted).to_list()
        splits.append(pair_items(records, columns, tok, max_length, where,
                                 (lambda i, row=row: row[i] + 1) if row is not None else None))
    return pair_datasets(splits, tok, max_length, padding, f"hf {train} ({describe_pairs(columns, wanted)}; "
                         f"tokenizer {tokenizer}, max_length {max_length})")
