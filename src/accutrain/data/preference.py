"""Preference records for loss=dpo, orpo (pairs: prompt, chosen, rejected) and loss=kto (feedback: prompt,
completion, label), in TRL's two formats: plain text (strings), and conversational (the prompt a list of messages,
each completion a list of assistant messages, rendered with the chat template; the labels follow any template as chat
records' do, data/chat.py).

A record is one sample: a pair's chosen and rejected travel together through every split (windows, micro-batches,
ranks), each a sequence prompt + completion whose labels are the completion's tokens (the prompt's are
ignore_index). Every record is accounted for: a pair whose chosen equals its rejected, an empty completion, a label
that is not a boolean, a missing field — one line naming the record's line; a record data.max_length leaves with no
completion token — dropped and listed in train.log (or refused, data.truncation=error), as chat records are."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from accutrain.data.chat import encode_conversation
from accutrain.data.messages import message, messages_of
from accutrain.data.records import Tally, common_prefix, trained
from accutrain.data.template import Template
from accutrain.errors import UserError

PAIRS, FEEDBACK = "pairs", "feedback"
Encoded = tuple[list[int], list[int], int]  # token ids, labels (the completion's), the prompt's tokens


@dataclass(frozen=True)
class PreferenceFields:
    """Which field (column) holds each part of a preference record."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    completion: str = "completion"
    label: str = "label"


def preference_kind(fields: Sequence[str], names: PreferenceFields) -> Optional[str]:
    """pairs (a chosen or a rejected field), feedback (a completion and a label), or None (other records)."""
    if names.chosen in fields or names.rejected in fields:
        return PAIRS
    if names.completion in fields and names.label in fields:
        return FEEDBACK
    return None


class Encoder:
    """A prompt and one completion as (ids, labels, prompt tokens): plain text tokenized as prompt + completion (the
    prompt's tokens those it shares with the prompt alone, an end-of-sequence token appended), or a conversation
    rendered with the chat template (`template()`, made on first use) and labelled as chat records are, the prompt's
    own turns then ignored."""

    def __init__(self, tok: Any, template: Callable[[], Template], ignore_index: int) -> None:
        self.tok, self.make_template, self.ignore_index = tok, template, ignore_index
        self.template: Optional[Template] = None

    def __call__(self, prompt: Any, completion: Any, where: str, role: str) -> Encoded:
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():
                raise UserError(f"{where}: the {role} is empty: expected a completion's text")
            ids = list(self.tok([prompt + completion])["input_ids"][0])
            k = common_prefix(list(self.tok([prompt])["input_ids"][0]), ids)
            eos = self.tok.eos_token_id
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            return ids, [self.ignore_index] * k + ids[k:], k
        if isinstance(prompt, (list, tuple)) and isinstance(completion, (list, tuple)):
            return self.conversation(list(prompt), list(completion), where, role)
        raise UserError(f"{where}: the prompt is a {kind_of(prompt)} and the {role} a {kind_of(completion)}: expected "
                        "both texts (plain) or both lists of messages (conversational)")

    def conversation(self, prompt: list, completion: list, where: str, role: str) -> Encoded:
        if not completion or any(not isinstance(m, dict) or m.get("role") != "assistant" for m in completion):
            raise UserError(f"{where}: the {role} must be the assistant's messages ([{{\"role\": \"assistant\", "
                            "\"content\": …}]), got " + repr(completion)[:80])
        if not any(str(m.get("content") or "").strip() or m.get("tool_calls") for m in completion):
            raise UserError(f"{where}: the {role} is empty: expected the assistant's text")
        if self.template is None:
            self.template = self.make_template()
        template = self.template
        messages = messages_of(prompt + completion, where)
        ids, labels = encode_conversation(template, messages, self.ignore_index, where)
        head = [message(m, n, where) for n, m in enumerate(prompt)]
        text = template.render(head, True, where)
        k = common_prefix(template.tokens(text, where).ids, ids)
        labels = [self.ignore_index] * k + labels[k:]
        return ids, labels, k


def kind_of(value: Any) -> str:
    return "text" if isinstance(value, str) else "list" if isinstance(value, (list, tuple)) else \
        type(value).__name__


def field_of(record: dict, name: str, where: str, key: str) -> Any:
    if name not in record or record[name] is None:
        raise UserError(f"{where} has no {name!r} ({key}): every preference record needs a prompt and "
                        + ("a chosen and a rejected completion" if key != "label" else "a completion and a label"))
    return record[name]


def encode_record(record: dict, kind: str, names: PreferenceFields, encode: Encoder, where: str
                  ) -> list[Encoded]:
    """A record's sequences: [chosen, rejected] (pairs) or [completion] (feedback); one line for a bad record."""
    prompt = field_of(record, names.prompt, where, "prompt")
    if kind == PAIRS:
        chosen = field_of(record, names.chosen, where, "chosen")
        rejected = field_of(record, names.rejected, where, "rejected")
        if chosen == rejected:
            raise UserError(f"{where}: its chosen equals its rejected: a pair must differ (drop the record)")
        return [encode(prompt, chosen, where, "chosen"), encode(prompt, rejected, where, "rejected")]
    label = field_of(record, names.label, where, "label")
    if not isinstance(label, bool):
        raise UserError(f"{where}: label is {label!r}: expected true (desirable) or false (undesirable)")
    return [encode(prompt, field_of(record, names.completion, where, "completion"), where, "completion")]


def encode_records(records: Sequence[dict], kind: str, names: PreferenceFields, encode: Encoder,
                   where: Callable[[int], Any], rows: Sequence[int], max_length: int, tally: Tally
                   ) -> list[tuple[list[Encoded], Any]]:
    """Each record's sequences truncated to max_length, with its label (feedback) — those left with a sequence
    without a completion token counted in `tally` (dropped, listed) and left out."""
    out = []
    for record, row in zip(records, rows):
        sequences = encode_record(record, kind, names, encode, where(row))
        if any(len(ids) > max_length for ids, _, _ in sequences):
            tally.truncated += 1
            sequences = [(ids[:max_length], labels[:max_length], min(k, max_length)) for ids, labels, k in sequences]
        if any(not trained(labels, encode.ignore_index) for _, labels, _ in sequences):
            tally.untrained.append(row)
            continue
        out.append((sequences, record[names.label] if kind == FEEDBACK else None))
    return out
