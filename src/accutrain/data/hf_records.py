"""data=hf's records as token ids and labels: what they are (their columns, mapped by data.columns to roles), how
each kind is encoded (data/chat.py for chat records, data/text.py's encode for the others), truncated and counted
(data/records.py) — by Dataset.map into Arrow files (hf_data.py), or record by record as a stream comes (stream.py).

A new kind of record adds its roles to ROLES, its columns to NEEDS and its encoding to `encode_batch`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from accutrain.data.arrow_items import ArrowItems
from accutrain.data.chat import encode_chat
from accutrain.data.json_records import decoded, fields, is_json_table
from accutrain.data.packing import describe
from accutrain.data.records import LISTED, Tally, Where, trained
from accutrain.data.template import Template, chat_template
from accutrain.data.text import encode
from accutrain.data.tokenizer import fast_byte_tokenizer, load_tokenizer
from accutrain.errors import UserError

ROLES = ("text", "prompt", "response", "messages", "label", "anchor", "positive", "negative", "chosen", "rejected",
         "completion")  # pairs: data/pairs.py
NEEDS = {"chat": ("messages",), "classes": ("text", "label"), "text": ("text",), "pairs": ("prompt", "response")}


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
             classes: Optional[dict[Any, int]], json_text: bool = False) -> dict[str, list]:
    """Dataset.map's batched function: records as input_ids and labels truncated to max_length (None: kept whole,
    for packing=concat), with their row, length, trained tokens, whether they were truncated (and class);
    `json_text`: the batch is a json_table's (data/json_records.py)."""
    batch = decoded(batch, json_text)
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
            if isinstance(value, (dict, list)) or value not in classes:
                raise UserError(f"{where(row)}: label {value!r} is not among the training records' classes "
                                f"({', '.join(map(str, list(classes)[:8]))}{', …' if len(classes) > 8 else ''})")
            out["class"].append(classes[value])
    return out


def class_names(table: Any, column: str, where: str) -> dict[Any, int]:
    """The training records' classes: non-negative integers as they are, or names by their sorted place."""
    values = fields(table.unique(column)) if is_json_table(table) else table.unique(column)
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return {i: i for i in range(max(values) + 1)}
    if not all(isinstance(v, str) for v in values):
        raise UserError(f"{where}: column {column!r} (data.columns.label) holds {sorted(map(repr, values))[:3]}: "
                        "expected non-negative integers or class names in every record")
    return {name: i for i, name in enumerate(sorted(values))}


def tokenized(datasets: Any, part: Any, **arguments: Any) -> Any:
    """`part`'s records tokenized by Dataset.map (cached by fingerprint), into the columns tokenize makes."""
    int32 = datasets.Value("int32")
    features = dict(input_ids=datasets.List(int32), labels=datasets.List(int32), row=datasets.Value("int64"),
                    length=int32, trained=int32, truncated=datasets.Value("bool"))
    if arguments["classes"] is not None:
        features["class"] = datasets.Value("int64")
    return part.map(functools.partial(tokenize, json_text=is_json_table(part), **arguments), batched=True,
                    with_indices=True,
                    remove_columns=part.column_names, features=datasets.Features(features))


@dataclass(frozen=True)
class Reading:
    """data=hf's settings (hf_data's arguments), as the functions reading the records take them."""

    train: str
    val: Optional[str]
    val_fraction: float
    split: str
    val_split: str
    tokenizer: str
    max_length: int
    packing: Optional[str]  # data.packing as packing_mode gives it
    padding: str
    roles: dict[str, str]  # data.columns: each role's column
    cache_dir: Optional[str]
    seed: int
    ignore_index: int
    test: Optional[str]
    test_split: str
    truncation: str
    chat_template: Optional[str]
    buffer_size: int


def encoding(r: Reading, kind: str, tok: Any, template: Optional[Template], classes: Optional[dict]
             ) -> dict[str, Any]:
    """tokenize's arguments for these records (records kept whole for packing=concat)."""
    return dict(kind=kind, tok=tok, template=template, roles=r.roles, ignore_index=r.ignore_index, classes=classes,
                max_length=None if r.packing == "concat" else r.max_length)


def tokenized_split(datasets: Any, key: str, name: str, part: Any, kind: str, arguments: dict[str, Any]
                    ) -> tuple[Any, Tally, Where]:
    """One source's records tokenized (cached), counted, and named by their line: (table, tally, where)."""
    roles = arguments["roles"]
    missing = [roles[role] for role in NEEDS[kind] if roles[role] not in part.column_names]
    if missing:
        raise UserError(f"{name} has no column {missing[0]!r} (data.columns); its columns are: "
                        f"{', '.join(part.column_names)}")
    where = Where(name)
    table = tokenized(datasets, part, where=where, **arguments)
    cut = column(table, "truncated").astype(bool)
    return table, Tally(key, name, read=len(part), truncated=int(np.sum(cut)),
                        truncated_rows=column(table, "row")[cut][:LISTED].tolist()), where


def kept_items(table: Any, rows: np.ndarray, tally: Tally, r: Reading, kind: str, split: str) -> ArrowItems:
    """The records `rows` of a tokenized table — the `split` ones (training, held-out, test) — as items, those left
    with no trained token counted and left out."""
    if kind != "classes":
        untrained = column(table, "trained")[rows] == 0
        tally.untrained += column(table, "row")[rows[untrained]].tolist()
        rows = rows[~untrained]
    if not len(rows):
        raise UserError(f"{tally.key}={tally.source}: none of its {split} records is left with a trained token at "
                        f"data.max_length={r.max_length}: raise data.max_length")
    return ArrowItems(table, rows, r.max_length, r.packing, r.ignore_index, classes=kind == "classes")


def description(r: Reading, kind: str, template: Optional[Template], names: Optional[list[str]]) -> str:
    """What the data is, for the log."""
    what = {"chat": "chat, the loss on the assistant's tokens" + labelled_by(template), "pairs": "prompt/response",
            "text": "language modelling", "classes": f"{len(names or [])} classes"}[kind]
    return f"hf {r.train} ({what}{describe(r.packing)}; tokenizer {r.tokenizer}, max_length {r.max_length})"


def column(table: Any, name: str) -> np.ndarray:
    """One column of a tokenized table as an array (the table's own rows, whatever was selected)."""
    return np.asarray(table.data.column(name).to_numpy())


def tokenizer_for(kind: str, tokenizer: str, chat_template_value: Optional[str]) -> tuple[Any, Optional[Template]]:
    """The tokenizer, and for chat records the template (data.chat_template, else the tokenizer's own)."""
    if chat_template_value is not None and kind != "chat":
        raise UserError(f"data.chat_template renders chat records; these records are {kind} (no "
                        "data.columns.messages column): drop data.chat_template")
    if chat_template_value is not None and tokenizer == "bytes":  # a template of one's own: Jinja, via transformers
        from accutrain.models.hf_load import require_transformers

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
