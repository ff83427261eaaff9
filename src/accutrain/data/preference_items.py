"""Preference records (data/preference.py) as items and Datasets, from data=text's .jsonl files and data=hf's sources.

A pair's item: {chosen.input_ids, chosen.attention_mask, chosen.labels, rejected.… , labels}; a feedback record's:
{input_ids, attention_mask, completion.labels, prompt.length, desirable, labels}. `labels`, the target, is the
sample's place in its split (what loss.reference=precompute keeps its reference log-probabilities by); a micro-batch
pads each sequence to its own longest (PadCollate), so `micro_tokens` counts a pair's two sequences."""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch

from accutrain.core.batches import PadCollate
from accutrain.data.preference import FEEDBACK, PAIRS, Encoder, PreferenceFields, encode_records
from accutrain.data.records import Tally, Where, log_tallies
from accutrain.data.splits import Datasets, Tokenized
from accutrain.data.template import chat_template
from accutrain.data.tokenizer import load_tokenizer, pad_id
from accutrain.errors import UserError

log = logging.getLogger("accutrain")
Part = tuple[Sequence[dict], Sequence[int], Tally, Callable[[int], Any]]  # records, their rows, tally, names


def sequence(ids: list[int], labels: list[int]) -> dict[str, torch.Tensor]:
    tokens = torch.tensor(ids, dtype=torch.int64)
    return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens),
            "labels": torch.tensor(labels, dtype=torch.int64)}


def items_of(encoded: list[tuple[list, Any]], kind: str) -> Tokenized:
    """The encoded records as items (see the module's docstring)."""
    items = []
    for index, (sequences, label) in enumerate(encoded):
        item: dict[str, torch.Tensor] = {}
        if kind == PAIRS:
            for role, (ids, labels, _) in zip(("chosen", "rejected"), sequences):
                item.update({f"{role}.{k}": v for k, v in sequence(ids, labels).items()})
        else:
            (ids, labels, k), = sequences
            whole = sequence(ids, labels)
            item.update(input_ids=whole["input_ids"], attention_mask=whole["attention_mask"])
            item["completion.labels"] = whole["labels"]
            item["prompt.length"] = torch.tensor(k, dtype=torch.int64)
            item["desirable"] = torch.tensor(int(bool(label)), dtype=torch.int64)
        item["labels"] = torch.tensor(index, dtype=torch.int64)
        items.append(item)
    return Tokenized(items)


def preference_datasets(parts: list[Part], kind: str, names: PreferenceFields, tok: Any, tokenizer: str,
                        chat_template_value: Optional[str], max_length: int, padding: str, ignore_index: int,
                        truncation: str, description: str) -> Datasets:
    """Every split's records encoded, counted and made items; the tallies logged; Datasets padded per micro-batch."""
    if padding == "free":
        raise UserError("data.padding=free lays a micro-batch's samples end to end in one row; preference records "
                        "keep each sequence in a row of its own: use data.padding=longest")
    encoder = Encoder(tok, lambda: chat_template(tok, tokenizer, chat_template_value), ignore_index)
    splits = []
    for (records, rows, tally, where), split in zip(parts, ("training", "held-out", "test")):
        encoded = encode_records(records, kind, names, encoder, where, rows, max_length, tally)
        if not encoded:
            raise UserError(f"{tally.key}={tally.source}: none of its {split} records is left with a completion "
                            f"token at data.max_length={max_length}: raise data.max_length")
        if kind == FEEDBACK and split == "training":
            classes = {bool(label) for _, label in encoded}
            if len(classes) == 1:
                log.warning(f"{tally.key}={tally.source}: every training record is "
                            f"{'desirable' if classes.pop() else 'undesirable'} (label): loss=kto learns from both "
                            "kinds; with one only, it pushes the completions one way without a contrast")
        splits.append(items_of(encoded, kind))
    tallies = list({id(t): t for _, _, t, _ in parts}.values())
    log_tallies(tallies, [Where(t.source) for t in tallies], truncation, max_length, lm=True)
    pad = pad_id(tok)
    pads = {"input_ids": pad, "chosen.input_ids": pad, "rejected.input_ids": pad, "chosen.labels": ignore_index,
            "rejected.labels": ignore_index, "completion.labels": ignore_index}
    collate = PadCollate(pads, default=0, length=max_length if padding == "max_length" else None)
    what = "pairs: prompt, chosen, rejected" if kind == PAIRS else "feedback: prompt, completion, label"
    return Datasets(splits[0], splits[1], len(tok), (max_length,), f"{description} ({what})",
                    test=splits[2] if len(splits) > 2 else None,
                    extra=dict(vocab_size=len(tok), pad_token_id=pad, eos_token_id=tok.eos_token_id),
                    collate=collate, tokenizer=tok, classes="tokens in the vocabulary")


def text_preference(parts: list[tuple[list, list[int], Tally]], kind: str, names: PreferenceFields, tokenizer: str,
                    max_length: int, packing: Any, padding: str, ignore_index: int, truncation: str,
                    train: str) -> Datasets:
    """data=text's preference records (each knows its line), every split."""
    if packing:
        raise UserError(f"data.packing={packing} packs language-modelling samples; {train} holds preference records: "
                        "use data.packing=false")
    named: list[Part] = []
    for records, rows, tally in parts:
        lines = {row: getattr(record, "line", row + 1) for record, row in zip(records, rows)}
        named.append((records, rows, tally, lambda row, lines=lines, tally=tally: f"{tally.source}:{lines[row]}"))
    return preference_datasets(named, kind, names, load_tokenizer(tokenizer), tokenizer, None, max_length, padding,
                               ignore_index, truncation, f"text {train}")
