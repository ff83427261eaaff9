"""Chat records — `{"messages": [{"role": …, "content": …}, …]}` — as (token ids, labels): the conversation rendered
with the tokenizer's chat template (the byte tokenizer has a simple built-in one, CHAT_TEMPLATE), the labels
`ignore_index` everywhere but on the assistant's tokens, so the loss counts only what the assistant says.

An assistant turn's tokens are found by rendering: they start where the conversation before it, followed by the
generation prompt, stops agreeing with the whole rendering, and end where the conversation up to and including it
does; this holds for any template that renders a conversation's prefix as a prefix of the whole.
"""
from __future__ import annotations

from typing import Any

from accutrain.data.text import common_prefix
from accutrain.data.tokenizer import ByteTokenizer
from accutrain.errors import UserError


def render(messages: list[dict], add_generation_prompt: bool) -> str:
    """The byte tokenizer's template (tokenizer.CHAT_TEMPLATE, saved with its export), rendered: `<|role|>`, a
    newline, the content and a newline per message."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def chat_ids(tok: Any, messages: list[dict], add_generation_prompt: bool, tokenizer: str) -> list[int]:
    """The token ids of `messages` as the tokenizer's chat template renders them."""
    if isinstance(tok, ByteTokenizer):
        return tok([render(messages, add_generation_prompt)])["input_ids"][0]
    if not getattr(tok, "chat_template", None):
        raise UserError(f"data.tokenizer={tokenizer} has no chat template: chat records (data.columns.messages) "
                        "need a tokenizer that has one (an instruct model's), or data.tokenizer=bytes")
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def check(messages: Any, where: str) -> list[dict]:
    """The record's messages, or one line saying what is wrong with them."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                 for m in messages):
        raise UserError(f"{where}: expected a list of {{\"role\": …, \"content\": …}} messages")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where} has no assistant turn (roles: {', '.join(m['role'] for m in messages) or 'none'}): "
                        "the loss is on the assistant's tokens, so a record needs at least one")
    return messages


def encode_chat(conversations: list[Any], tok: Any, ignore_index: int, tokenizer: str, where: str
                ) -> list[tuple[list[int], list[int]]]:
    """(token ids, labels) per conversation: labels are the ids on the assistant's tokens (the end-of-sequence
    token after a final assistant turn included), `ignore_index` elsewhere."""
    out = []
    for n, messages in enumerate(conversations):
        messages = check(messages, f"{where}: record {n}")
        ids = chat_ids(tok, messages, False, tokenizer)
        eos = tok.eos_token_id
        if eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]  # the model learns where its answer ends
        labels = [ignore_index] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = common_prefix(chat_ids(tok, messages[:i], True, tokenizer), ids)
            end = common_prefix(chat_ids(tok, messages[: i + 1], False, tokenizer), ids)
            labels[start:end] = ids[start:end]
        if messages[-1]["role"] == "assistant":
            labels[-1] = ids[-1]
        out.append((ids, labels))
    return out
