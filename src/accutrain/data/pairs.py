"""Text pairs and triples for embedding training (loss=contrastive): records with an anchor, its positive and zero or
more mined (hard) negatives — from data=text's .jsonl files or data=hf's columns (`data.columns.anchor`,
`.positive`, `.negative`: a column of one text, a column of a list of texts, or a list of columns).

Each record is one sample: its texts tokenized into one item {anchor.input_ids, anchor.attention_mask,
positive.input_ids, …, negative.<k>.input_ids, …, labels}, so that an anchor, its positive and its negatives travel
together through every split (the window, the micro-batches, the ranks). `labels` holds each candidate text's key (a
hash of its text: the positive's, then the negatives'), by which loss.mask_duplicates finds another sample's copy of
a positive. A micro-batch pads each text role to its own longest (PadCollate).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from accutrain.core.batches import PadCollate
from accutrain.data.splits import Datasets, Tokenized
from accutrain.data.tokenizer import pad_id
from accutrain.errors import UserError

log = logging.getLogger("accutrain")


@dataclass(frozen=True)
class PairColumns:
    """Which field of a record holds each role; `negative`: one field (a text, or a list of texts) or several."""

    anchor: str = "anchor"
    positive: str = "positive"
    negative: Any = "negative"

    def negatives(self, fields: Sequence[str]) -> list[str]:
        """The negative fields among `fields` (a record's, or a dataset's columns)."""
        named = [self.negative] if isinstance(self.negative, str) else list(self.negative or [])
        return [name for name in named if name in fields]


def is_pairs(fields: Sequence[str], columns: PairColumns) -> bool:
    """Whether records with these fields are pairs: they have an anchor or a positive (the other one missing is
    then said by the record)."""
    return columns.anchor in fields or columns.positive in fields


def text_key(text: str) -> int:
    """A text's key: 63 bits of its BLAKE2 hash, the same in every process and run."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def texts_of(record: dict[str, Any], columns: PairColumns, negatives: list[str], where: str) -> list[str]:
    """The record's texts in order: anchor, positive, negatives; one line naming the record for a missing or empty
    one."""
    texts = []
    for role, name in (("anchor", columns.anchor), ("positive", columns.positive)):
        value = record.get(name)
        if not isinstance(value, str) or not value.strip():
            what = "has no" if value is None else "has an empty" if isinstance(value, str) else \
                f"holds a {type(value).__name__} as its"
            raise UserError(f"{where} {what} {role} (data.columns.{role}={name}): expected a text in every record")
        texts.append(value)
    for name in negatives:
        value = record.get(name)
        found = [value] if isinstance(value, str) else value if isinstance(value, list) else None
        if not found or not all(isinstance(v, str) and v.strip() for v in found):
            raise UserError(f"{where} has no usable negative in {name!r} (data.columns.negative): expected a text, or "
                            f"a list of texts, in every record (got {value!r:.60})")
        texts += found
    return texts


def pair_items(records: Sequence[dict[str, Any]], columns: PairColumns, tok: Any, max_length: int, source: str,
               line_of: Any = None) -> Tokenized:
    """The records as items, every record with as many negatives as the first (a window's candidates are each
    sample's positive and negatives: a record short of one is refused, naming it); `line_of(i)`: record i's line in
    its file, for messages (else its row)."""
    if not records:
        raise UserError(f"{source} holds no record")
    negatives = columns.negatives(list(records[0]))
    per_record: list[list[str]] = []
    for i, record in enumerate(records):
        where = f"{source}:{line_of(i) if line_of else i + 1}"
        texts = texts_of(record, columns, negatives, where)
        if per_record and len(texts) != len(per_record[0]):
            raise UserError(f"{where} has {len(texts) - 2} negatives, the records before it "
                            f"{len(per_record[0]) - 2}: every record needs as many (a window's candidates are each "
                            "sample's positive and negatives)")
        per_record.append(texts)
    flat = [text for texts in per_record for text in texts]
    ids = tok(flat)["input_ids"]
    roles = ["anchor", "positive", *(f"negative.{k}" for k in range(len(per_record[0]) - 2))]
    items, at = [], 0
    for texts in per_record:
        item: dict[str, torch.Tensor] = {}
        for role in roles:
            tokens = torch.tensor(ids[at][:max_length], dtype=torch.int64)
            item[f"{role}.input_ids"], item[f"{role}.attention_mask"] = tokens, torch.ones_like(tokens)
            at += 1
        item["labels"] = torch.tensor([text_key(t) for t in texts[1:]], dtype=torch.int64)
        items.append(item)
    return Tokenized(items)


def pair_datasets(splits: list[Tokenized], tok: Any, max_length: int, padding: str, description: str) -> Datasets:
    """Pair items as Datasets: each text role padded per micro-batch (or to max_length) with the tokenizer's
    padding token; the tokenizer's vocabulary and padding token offered to the model (a random initialisation)."""
    if padding == "free":
        raise UserError("data.padding=free lays a micro-batch's samples end to end in one row; text pairs embed each "
                        "text alone (an embedding per row): use data.padding=longest")
    warn_one_candidate(splits[0], description)
    pad = pad_id(tok)
    roles = [key.removesuffix(".input_ids") for key in splits[0][0] if key.endswith(".input_ids")]
    collate = PadCollate({f"{role}.input_ids": pad for role in roles}, default=0,
                         length=max_length if padding == "max_length" else None)
    negatives = len(roles) - 2
    if negatives:
        description += f", {negatives} negative{'s' if negatives > 1 else ''} per anchor"
    return Datasets(splits[0], splits[1], 2, (max_length,), description, test=splits[2] if len(splits) > 2 else None,
                    extra=dict(vocab_size=len(tok), pad_token_id=pad, eos_token_id=tok.eos_token_id,
                               max_length=max_length),
                    collate=collate, tokenizer=tok, classes="")  # no classes: num_classes is unused


def warn_one_candidate(train: Tokenized, description: str) -> None:
    """A warning at load when every training record's positive (and negative) is the same text: a window's
    candidates are then all alike, and the contrastive loss has nothing to tell apart — its gradient is 0."""
    keys = {int(k) for item in train for k in item["labels"].tolist()}
    if len(keys) == 1 and len(train) > 1:
        log.warning(f"data: every one of the {len(train):,} training records of {description.split(' (')[0]} has the "
                    "same positive text (and no other negative): a window's candidates are all alike, so the "
                    "contrastive loss has nothing to tell apart and nothing is learned (its gradient is 0) — give "
                    "records with different positives")


def describe(columns: PairColumns, fields: Sequence[str]) -> str:
    negatives = columns.negatives(fields)
    return (f"pairs {columns.anchor} → {columns.positive}" + (f" with negatives {', '.join(negatives)}"
                                                              if negatives else ""))


def line_numbers(records: Sequence[Any]) -> Optional[Any]:
    """record i → its line in its file, where the records know it (data=text's)."""
    if records and hasattr(records[0], "line"):
        return lambda i: records[i].line
    return None
