"""data=hf: records read with the Hugging Face `datasets` library (the `datasets` extra) — local .json/.jsonl/.csv/
.parquet files, a directory written by save_to_disk, or a dataset name from the local cache — tokenized once by
`Dataset.map` (cached by the library's fingerprinting, so a second start reads the cache) into memory-mapped Arrow
files, from which the items data=text makes — {input_ids, attention_mask, labels} — are read on demand
(data/arrow_items.py): host memory stays flat in the number of records. `streaming=true` reads the records as a
stream instead (data/stream.py).

`columns` maps the roles to the dataset's columns: text (language modelling), prompt + response (the prompt masked
out of the loss), messages (chat records: the loss on the assistant's tokens, data/chat.py), label (with text:
sequence classification) — data/hf_records.py encodes each kind. Every record is accounted for (data/records.py):
truncated at max_length, those left with no trained token dropped (or refused), counted at load, named by their line
in the file.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from accutrain.data.datasets import Datasets
from accutrain.data.hf_records import (
    ROLES,
    Reading,
    class_names,
    description,
    encoding,
    kept_items,
    task,
    tokenized_split,
    tokenizer_for,
)
from accutrain.data.hf_sources import load, require_datasets, text_columns
from accutrain.data.json_records import decoded, is_json_table
from accutrain.data.packing import packing_mode, packing_name
from accutrain.data.pairs import PairColumns, is_pairs, pair_datasets, pair_items
from accutrain.data.pairs import describe as describe_pairs
from accutrain.data.preference import PAIRS, PreferenceFields, preference_kind
from accutrain.data.preference_items import Part, preference_datasets
from accutrain.data.records import Named, Tally, Where, check_truncation, log_tallies
from accutrain.data.text import HELD_OUT_STREAM, check_lengths, tokenized_datasets
from accutrain.data.tokenizer import load_tokenizer
from accutrain.errors import UserError
from accutrain.seeding import generator


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
    roles = {role: role for role in ROLES} | {k: v for k, v in dict(columns or {}).items() if v is not None}
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise UserError(f"data.columns.{unknown[0]} is not a role: expected one of {', '.join(ROLES)}")
    r = Reading(train, val, val_fraction, split, val_split, tokenizer, max_length, packing_mode(packing), padding,
                roles, cache_dir, seed, ignore_index, test, test_split, truncation, chat_template, buffer_size)
    datasets = require_datasets()
    if streaming:
        from accutrain.data.stream import stream_data

        return stream_data(datasets, r)
    text = text_columns(roles)
    source = load(datasets, train, split, cache_dir, "data.train", text=text)
    names = PreferenceFields(roles["prompt"], roles["chosen"], roles["rejected"], roles["completion"], roles["label"])
    if (preference := preference_kind(source.column_names, names)) is not None:  # loss=dpo, orpo, kto's records
        return hf_preference(datasets, r, source, preference, names)
    pair_columns = PairColumns(roles["anchor"], roles["positive"], roles["negative"])
    if is_pairs(source.column_names, pair_columns):
        return hf_pairs(datasets, r, source, pair_columns)
    kind = task(source.column_names, roles, train)
    if r.packing and kind == "classes":
        raise UserError(f"data.packing={packing_name(r.packing)} packs language-modelling samples; these records "
                        f"carry labels (data.columns.label={roles['label']})")
    tok, template = tokenizer_for(kind, tokenizer, chat_template)
    classes = class_names(source, roles["label"], train) if kind == "classes" else None
    arguments = encoding(r, kind, tok, template, classes)
    parts = [tokenized_split(datasets, "data.train", train, source, kind, arguments)]
    parts += [tokenized_split(datasets, key, name, load(datasets, name, part_split, cache_dir, key, text=text), kind,
                              arguments)
              for key, name, part_split in (("data.val", val, val_split), ("data.test", test, test_split))
              if name is not None]
    splits = [(table, np.arange(len(table)), tally) for table, tally, _ in parts]
    if val is None:
        kept, out = hold_out(len(parts[0][0]), val_fraction, seed)
        splits[0:1] = [(parts[0][0], kept, parts[0][1]), (parts[0][0], out, parts[0][1])]
        parts[0][1].held_out = len(out)
    items = [kept_items(table, rows, tally, r, kind, split)
             for (table, rows, tally), split in zip(splits, ("training", "held-out", "test"))]
    log_tallies([t for _, t, _ in parts], [w for _, _, w in parts], truncation, max_length, lm=kind != "classes")
    names = [str(name) for name in classes] if classes is not None else None
    return tokenized_datasets(items, tok, names, max_length, padding, ignore_index, description(r, kind, template,
                                                                                                names))


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


def hf_pairs(datasets: Any, r: Reading, source: Any, columns: PairColumns) -> Datasets:
    """data=hf's records of text pairs (and triples), each split as pair items (data.pairs); a record named by its
    row in its file."""
    if r.packing:
        raise UserError(f"data.packing={packing_name(r.packing)} packs language-modelling samples; {r.train} holds "
                        "text pairs (data.columns.anchor and .positive): use data.packing=false")
    rows: list[Optional[list[int]]] = [None, None]  # each split's records' rows in its file (held out: the file's)
    if r.val is not None:
        held = load(datasets, r.val, r.val_split, r.cache_dir, "data.val", text=text_columns(r.roles))
    else:
        kept, out = (part.tolist() for part in hold_out(len(source), r.val_fraction, r.seed))
        source, held, rows = source.select(kept), source.select(out), [kept, out]
    parts = [(source, r.train), (held, r.val or r.train)]
    if r.test is not None:
        parts.append((load(datasets, r.test, r.test_split, r.cache_dir, "data.test", text=text_columns(r.roles)),
                      r.test))
    tok = load_tokenizer(r.tokenizer)
    splits = []
    for (part, where), row in zip(parts, rows + [None]):
        wanted = [c for c in (columns.anchor, columns.positive, *columns.negatives(part.column_names))]
        missing = [c for c in wanted[:2] if c not in part.column_names]
        if missing:
            raise UserError(f"{where} has no column {missing[0]!r} (data.columns); its columns are: "
                            f"{', '.join(part.column_names)}")
        records = part.select_columns(wanted).to_dict()
        records = [dict(zip(records, row)) for row in zip(*decoded(records, is_json_table(part)).values())]
        splits.append(pair_items(records, columns, tok, r.max_length, where,
                                 (lambda i, row=row: row[i] + 1) if row is not None else None))
    return pair_datasets(splits, tok, r.max_length, r.padding, f"hf {r.train} ({describe_pairs(columns, wanted)}; "
                         f"tokenizer {r.tokenizer}, max_length {r.max_length})")


def hf_preference(datasets: Any, r: Any, source: Any, kind: str, names: PreferenceFields) -> Datasets:
    """data=hf's preference records: train (and val, or val_fraction of train held out by the seed; test), each
    record named by its line (or row) in its file."""
    if r.packing:
        raise UserError(f"data.packing={r.packing} packs language-modelling samples; {r.train} holds preference "
                        "records: use data.packing=false")
    wanted = [names.prompt, *((names.chosen, names.rejected) if kind == PAIRS else (names.completion, names.label))]
    train_tally = Tally("data.train", r.train, read=len(source))
    sources = [(source, list(range(len(source))), train_tally)]
    if r.val is not None:
        held = load(datasets, r.val, r.val_split, r.cache_dir, "data.val", text=text_columns(r.roles))
        sources.append((held, list(range(len(held))), Tally("data.val", r.val, read=len(held))))
    else:
        kept, out = (part.tolist() for part in hold_out(len(source), r.val_fraction, r.seed))
        sources = [(source, kept, train_tally), (source, out, train_tally)]
        train_tally.held_out = len(out)
    if r.test is not None:
        tested = load(datasets, r.test, r.test_split, r.cache_dir, "data.test", text=text_columns(r.roles))
        sources.append((tested, list(range(len(tested))), Tally("data.test", r.test, read=len(tested))))
    parts: list[Part] = []
    for table, rows, tally in sources:
        missing = [c for c in wanted if c not in table.column_names]
        if missing:
            raise UserError(f"{tally.source} has no column {missing[0]!r} (data.columns); its columns are: "
                            f"{', '.join(table.column_names)}")
        columns = decoded(table.select(rows).select_columns(wanted).to_dict(), is_json_table(table))
        records = [dict(zip(columns, values)) for values in zip(*columns.values())]
        where = Where(tally.source)
        parts.append((records, rows, tally, lambda row, where=where: Named(where, row)))
    return preference_datasets(parts, kind, names, load_tokenizer(r.tokenizer), r.tokenizer, r.chat_template,
                               r.max_length, r.padding, r.ignore_index, r.truncation, f"hf {r.train}")

