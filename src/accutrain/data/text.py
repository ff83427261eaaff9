"""data=text: local .txt / .jsonl files, tokenized once, as mapping items {input_ids, attention_mask, labels}.

- Language modelling: labels = input_ids (the model's convention; the loss shifts them, loss.shift_labels), the
  sample ending with the tokenizer's end-of-sequence token; prompt/response records mask the prompt out of the
  loss (its labels are loss.ignore_index). `packing` packs the samples into blocks of max_length (data/packing.py).
- Sequence classification: records carrying `label_field` (an integer class, or a name: classes are the sorted
  names of the training file); the label is the sample's target.
Micro-batches are padded to their own longest sample (PadCollate), so the tokens a window counts are exact.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import torch

from accutrain.core.batches import FlatCollate, PadCollate
from accutrain.data.datasets import Datasets
from accutrain.data.packing import describe, pack, packing_mode, packing_name
from accutrain.data.pairs import PairColumns, is_pairs, line_numbers, pair_datasets, pair_items
from accutrain.data.pairs import describe as describe_pairs
from accutrain.data.preference import PreferenceFields, preference_kind
from accutrain.data.preference_items import text_preference
from accutrain.data.records import Tally, Where, check_truncation, common_prefix, log_tallies
from accutrain.data.records import kept as kept_samples
from accutrain.data.splits import Tokenized
from accutrain.data.tokenizer import load_tokenizer, pad_id
from accutrain.errors import UserError
from accutrain.seeding import generator

HELD_OUT_STREAM = 1_000_002  # the seed's stream that picks the held-out samples (epochs use streams 0, 1, …)


class Record(dict):
    """A sample as read: a .jsonl file's JSON object, or a .txt file's line as {"text": line}; `line` is its line
    number in the file, for messages."""

    def __init__(self, fields: dict[str, Any], line: int) -> None:
        super().__init__(fields)
        self.line = line


def hold_out(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(the indices trained on, the indices held out): `val_fraction` of n samples, drawn by the seed, in order."""
    if not 0 < val_fraction < 1 or n < 2:
        raise UserError(f"data.val_fraction={val_fraction} with {n} samples: expected a fraction in (0, 1) of at "
                        "least 2 samples, or data.val=<file>")
    order = torch.randperm(n, generator=generator(seed, HELD_OUT_STREAM)).tolist()
    n_val = max(1, round(n * val_fraction))
    return sorted(order[n_val:]), sorted(order[:n_val])


def read_records(path: str, key: str) -> list[dict[str, Any]]:
    """A .txt file's non-empty lines as {"text": line}, or a .jsonl file's objects (one per non-empty line), each a
    Record knowing its line."""
    file = Path(path).expanduser()
    if file.suffix not in (".txt", ".jsonl"):
        raise UserError(f"{key}={path}: expected a .txt file (a sample per line) or a .jsonl file (a JSON object "
                        "per line)")
    try:
        lines = re.split(r"\r\n|\r|\n", file.read_text(encoding="utf-8"))  # not str.splitlines: a JSON string may
        # hold U+2028, U+0085 … as they are
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{key}={path}: cannot read it ({e})") from None
    if file.suffix == ".txt":
        records = [Record({"text": line}, number) for number, line in enumerate(lines, 1) if line.strip()]
    else:
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{file}:{number} is not JSON ({e})") from None
            if not isinstance(record, dict):
                raise UserError(f"{file}:{number}: expected a JSON object per line, got {type(record).__name__}")
            records.append(Record(record, number))
    if not records:
        raise UserError(f"{key}={path} holds no sample")
    return records


def class_index(records: list[dict], label_field: str, names: Optional[list[str]], where: str
                ) -> tuple[list[int], list[str]]:
    """Each record's class index: integers as they are, names by their place in `names` (from the training file)."""
    labels = [r.get(label_field) for r in records]
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in labels):
        names = names or [str(i) for i in range(max(labels) + 1)]
        if max(labels) >= len(names):
            raise UserError(f"{where}: label {max(labels)} is beyond the training file's {len(names)} classes")
        return labels, names
    if not all(isinstance(v, str) for v in labels):
        raise UserError(f"{where}: every record needs data.label_field={label_field!r}, all non-negative integers "
                        "or all class names")
    names = names or sorted(set(labels))
    unknown = sorted(set(labels) - set(names))
    if unknown:
        raise UserError(f"{where}: labels {unknown[:5]} are not among the training file's classes")
    index = {name: i for i, name in enumerate(names)}
    return [index[v] for v in labels], names


def encode(records: list[dict], tok: Any, fields: dict[str, str], lm: bool, ignore_index: int, where: str
           ) -> list[tuple[list[int], list[int]]]:
    """(token ids, labels) per record: labels = ids (LM; prompt tokens ignored), empty for classification."""
    text, prompt, response = fields["text"], fields["prompt"], fields["response"]
    if all(text in r for r in records):
        strings(records, (text,), where)
        ids = tok([r[text] for r in records])["input_ids"]
        prompt_lengths = [0] * len(records)
    elif lm and all(prompt in r and response in r for r in records):
        strings(records, (prompt, response), where)
        ids = tok([r[prompt] + r[response] for r in records])["input_ids"]
        alone = tok([r[prompt] for r in records])["input_ids"]
        prompt_lengths = [common_prefix(a, b) for a, b in zip(alone, ids)]
    else:
        wanted = f"{text!r}" + (f", or {prompt!r} and {response!r}" if lm else "")
        raise UserError(f"{where}: every record needs the field {wanted} (data.text_field, data.prompt_field, "
                        "data.response_field)")
    eos = tok.eos_token_id
    out = []
    for sample, masked in zip(ids, prompt_lengths):
        sample = list(sample)
        if lm and eos is not None and (not sample or sample[-1] != eos):
            sample.append(eos)  # the model learns where a sample ends
        labels = [ignore_index] * masked + sample[masked:] if lm else []
        out.append((sample, labels))
    return out


def strings(records: list[dict], keys: tuple[str, ...], where: str) -> None:
    """Refuse, naming the file and the line, a record whose field `keys` is not a string (the tokenizer's input)."""
    for r in records:
        for key in keys:
            if not isinstance(r[key], str):
                raise UserError(f"{where}:{getattr(r, 'line', '?')}: \"{key}\" is {json.dumps(r[key])}: expected a "
                                "string (the text to tokenize)")


def as_items(samples: list[tuple], classes: Optional[list[int]], max_length: int) -> Tokenized:
    """(ids, labels[, document ids]) as items {input_ids, attention_mask, labels[, document_ids]}, truncated."""
    items = []
    for i, (ids, labels, *documents) in enumerate(samples):
        ids = torch.tensor(ids[:max_length], dtype=torch.int64)
        target = torch.tensor(classes[i]) if classes is not None else torch.tensor(labels[:max_length])
        items.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=target))
        if documents:  # packed by documents: the model keeps each one's positions and attention to itself
            items[-1]["document_ids"] = torch.tensor(documents[0][:max_length], dtype=torch.int64)
    return Tokenized(items)


def text_data(train: str, val: Optional[str], val_fraction: float, tokenizer: str, max_length: int, packing: Any,
              padding: str, text_field: str, prompt_field: str, response_field: str, label_field: Optional[str],
              seed: int, ignore_index: int = -100, test: Optional[str] = None, anchor_field: str = "anchor",
              positive_field: str = "positive", negative_field: Any = "negative", truncation: str = "drop"
              ) -> Datasets:
    """data=text: a training file and a held-out file (or `val_fraction` of the training file, drawn by the seed),
    and a test file when `test` is given, tokenized; language modelling, sequence classification when the records
    carry `label_field`, or text pairs (data.pairs) when they carry `anchor_field` and `positive_field`. Every
    language-modelling record is accounted for (data/records.py)."""
    check_lengths(max_length, padding)
    check_truncation(truncation)
    packing = packing_mode(packing)
    records = read_records(train, "data.train")
    tallies = [Tally("data.train", train, read=len(records))]
    parts = [(records, list(range(len(records))), tallies[0])]
    if val is not None:
        held_out = read_records(val, "data.val")
        tallies.append(Tally("data.val", val, read=len(held_out)))
        parts.append((held_out, list(range(len(held_out))), tallies[-1]))
    else:
        kept, out = hold_out(len(records), val_fraction, seed)
        parts = [([records[i] for i in kept], kept, tallies[0]), ([records[i] for i in out], out, tallies[0])]
        tallies[0].held_out = len(out)
    if test is not None:
        tested = read_records(test, "data.test")
        tallies.append(Tally("data.test", test, read=len(tested)))
        parts.append((tested, list(range(len(tested))), tallies[-1]))
    names = PreferenceFields(prompt=prompt_field, label=label_field or "label")
    if (kind := preference_kind(list(records[0]), names)) is not None:  # loss=dpo, orpo, kto's records
        return text_preference(parts, kind, names, tokenizer, max_length, packing, padding, ignore_index, truncation,
                               train)
    columns = PairColumns(anchor_field, positive_field, negative_field)
    if is_pairs(list(records[0]), columns):
        return text_pairs([(part, tally.source) for part, _, tally in parts], columns, tokenizer, max_length, packing,
                          padding, train)
    lm = not (label_field and label_field in records[0])
    if packing and not lm:
        raise UserError(f"data.packing={packing_name(packing)} packs language-modelling samples; these records carry "
                        f"labels (data.label_field={label_field}): use data.packing=false, or data.label_field=null")
    tok = load_tokenizer(tokenizer)
    fields = dict(text=text_field, prompt=prompt_field, response=response_field)
    splits, names = [], None
    for (part, rows, tally), split in zip(parts, ("training", "held-out", "test")):
        where = tally.source
        samples = encode(part, tok, fields, lm, ignore_index, where)
        classes = None
        if not lm:
            classes, names = class_index(part, label_field, names, where)
            for row in (row for (ids, _), row in zip(samples, rows) if len(ids) > max_length):
                tally.count_truncated(row)
        else:
            samples = kept_samples(samples, rows, None if packing == "concat" else max_length, ignore_index, lm, tally)
            if not samples:
                raise UserError(f"{tally.key}={tally.source}: none of its {split} records is left with a trained "
                                f"token at data.max_length={max_length}: raise data.max_length")
            if packing:
                samples = pack(samples, max_length, packing, ignore_index)
        splits.append(as_items(samples, classes, max_length))
    log_tallies(tallies, [Where(t.source) for t in tallies], truncation, max_length, lm)
    task = "language modelling" + describe(packing) if lm else f"{len(names)} classes"
    return tokenized_datasets(splits, tok, None if lm else names, max_length, padding, ignore_index,
                              f"text {train} ({task}; tokenizer {tokenizer}, max_length {max_length})")


def text_pairs(parts: list[tuple[list[Record], str]], columns: PairColumns, tokenizer: str, max_length: int,
               packing: Any, padding: str, train: str) -> Datasets:
    """data=text's records of text pairs (and triples), each split as pair items (data.pairs)."""
    if packing:
        raise UserError(f"data.packing={packing_name(packing)} packs language-modelling samples; {train} holds text "
                        "pairs (an anchor and a positive per record): use data.packing=false")
    tok = load_tokenizer(tokenizer)
    splits = [pair_items(part, columns, tok, max_length, where, line_numbers(part)) for part, where in parts]
    return pair_datasets(splits, tok, max_length, padding, f"text {train} ({describe_pairs(columns, parts[0][0][0])}; "
                         f"tokenizer {tokenizer}, max_length {max_length})")


def check_lengths(max_length: int, padding: str) -> None:
    """data.max_length and data.padding, or one line."""
    if max_length < 2:
        raise UserError(f"data.max_length={max_length} is not valid: expected at least 2 tokens")
    if padding not in ("longest", "max_length", "free"):
        raise UserError(f"data.padding={padding} is not valid: expected longest, max_length or free (padding-free: "
                        "a micro-batch's samples end to end in one row)")


def tokenized_datasets(splits: list[Tokenized], tok: Any, class_names: Optional[list[str]], max_length: int,
                       padding: str, ignore_index: int, description: str) -> Datasets:
    """The training and held-out items as Datasets: padded per micro-batch (or to max_length) with the tokenizer's
    padding token (`free`: end to end in one row, core.batches.FlatCollate), language modelling over its
    vocabulary, or classes when `class_names` are given."""
    pad = pad_id(tok)
    collate = PadCollate(dict(input_ids=pad, attention_mask=0, labels=ignore_index, document_ids=0),
                         length=max_length if padding == "max_length" else None)
    lm = class_names is None
    if padding == "free":
        if not lm:
            raise UserError("data.padding=free lays a micro-batch's samples end to end in one row, which a sequence "
                            "classifier (one label per sample) cannot take: use data.padding=longest")
        collate = FlatCollate(ignore_index)
    return Datasets(splits[0], splits[1], len(tok) if lm else len(class_names), (max_length,), description,
                    test=splits[2] if len(splits) > 2 else None,
                    extra=dict(vocab_size=len(tok), pad_token_id=pad, eos_token_id=tok.eos_token_id,
                               **({} if lm else dict(class_names=class_names))),
                    collate=collate, tokenizer=tok, classes="tokens in the vocabulary" if lm else "classes",
                    class_names=() if lm else tuple(class_names))
