"""Chat records — `{"messages": [{"role": …, "content": …}, …]}` — as (token ids, labels): the conversation
rendered with the tokenizer's chat template, the labels `ignore_index` everywhere but on the assistant's tokens.

Each assistant turn's tokens are found in the rendering of the whole conversation, whatever the template does:
- a template with generation markers (`{% generation %}`) says which tokens are the assistant's
  (`return_assistant_tokens_mask`);
- otherwise the turn's content is located in the rendering (character offsets, mapped to tokens by the tokenizer's
  offsets). It begins where the conversation before it, with the generation prompt, ends — when that rendering is a
  prefix of the whole; else at its content — and ends where the conversation up to it ends — when that is a prefix
  of the whole (a template that adds a block only to the last turn, or drops the reasoning of earlier ones, is not);
  else after its content (and tool calls) at the template's end-of-turn token (the tokenizer's EOS text).
Either way every conversation is verified: each assistant turn's content (and each tool call's name) lies inside its
trained tokens. A template that fails it is refused in one line naming the record and the remedy.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from accutrain.data.messages import messages_of
from accutrain.data.records import Named
from accutrain.data.template import Span, Template
from accutrain.errors import UserError


def find(text: str, content: str, cursor: int) -> Optional[Span]:
    """Where the rendering holds `content` from `cursor` on: as it is, stripped (templates trim), or — reasoning
    written into the content — its answer after `</think>`."""
    answer = content.split("</think>")[-1].strip() if "</think>" in content else ""
    for candidate in dict.fromkeys((content, content.strip(), answer)):
        if candidate:
            at = text.find(candidate, cursor)
            if at >= 0:
                return at, at + len(candidate)
    return None


def prefix_end(template: Template, messages: list[dict], add_generation_prompt: bool, text: str) -> Optional[int]:
    """Where the rendering of `messages` ends inside `text`, when it is a prefix of it (None when not)."""
    try:
        head = template.render(messages, add_generation_prompt, "")
    except UserError:  # a template may refuse a conversation's beginning (one that ends with a user turn, say)
        return None
    return len(head) if text.startswith(head) else None


def locate(template: Template, messages: list[dict], text: str, prefixes: bool, where: str
           ) -> tuple[list[Optional[int]], list[Optional[Span]]]:
    """Where each message's content lies in `text`, the rendering of `messages`, searched in order; with `prefixes`,
    where each assistant turn begins when the conversation before it (with the generation prompt) renders as a
    prefix of `text` (None elsewhere). An assistant's content found more than once whose place cannot be verified
    is one line."""
    starts: list[Optional[int]] = []
    contents: list[Optional[Span]] = []
    cursor = 0
    for i, m in enumerate(messages):
        start = prefix_end(template, messages[:i], True, text) if prefixes and m["role"] == "assistant" else None
        cursor = max(cursor, start or 0)
        span = find(text, m["content"], cursor) if m["content"] else None
        if span is not None and m["role"] == "assistant" and text.find(text[span[0]:span[1]], span[0] + 1) >= 0:
            span = placed(template, messages, i, text, span, cursor)  # found more than once: which is the turn's?
            if span is None:
                raise unlabelled(template, where, i, f"with its content ({m['content']!r:.40}) also in the template's "
                                 "own text around it, and where the turn is cannot be verified")
        if span is not None:
            cursor = span[1]
        starts.append(start)
        contents.append(span)
    return starts, contents


SENTINEL = "\ue000accutrain\ue001"  # stands in for a turn's content, to see where a template puts it


def placed(template: Template, messages: list[dict], i: int, text: str, span: Span, cursor: int) -> Optional[Span]:
    """Where message `i`'s content lies in `text` when it is found there more than once from `cursor` on (a short
    answer is also in the template's own text: `a` in `<|assistant|>`): the place a sentinel put in its stead takes
    in the rendering — every other character the same — or None when the template does not render it so."""
    found, content = text[span[0]:span[1]], messages[i]["content"]
    k = content.find(found) if found in (content, content.strip()) else content.rfind(found)  # else: after </think>
    probe = [*messages[:i], {**messages[i], "content": content[:k] + SENTINEL + content[k + len(found):]},
             *messages[i + 1:]]
    try:
        other = template.render(probe, False, "")
    except UserError:
        return None
    at = other.find(SENTINEL)
    after = other[at + len(SENTINEL):]
    if at < cursor or SENTINEL in after or other[:at] != text[:at] or text[at:] != found + after:
        return None
    return at, at + len(found)


def turn_spans(template: Template, messages: list[dict], text: str, starts: list[Optional[int]],
               contents: list[Optional[Span]], where: str) -> list[Span]:
    """The characters of each assistant turn in `text` (see the module's docstring)."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        content, begin = contents[i], starts[i]
        if content is None and m["content"]:
            raise unlabelled(template, where, i, "without its content")
        if begin is None or (content is not None and begin > content[0]):
            begin = content[0] if content is not None else None
        if begin is None:
            raise unlabelled(template, where, i, "so that its beginning cannot be found (it has no content and the "
                             "conversation before it does not render as a prefix of the whole)")
        content_end = content[1] if content is not None else begin
        end = prefix_end(template, messages[: i + 1], False, text)
        if end is None or end < content_end:
            later = [c[0] for c in contents[i + 1 :] if c is not None]
            end = closed(template, text, content_end, min(later, default=len(text)))
        spans.append((begin, end))
    return spans


def closed(template: Template, text: str, start: int, limit: int) -> int:
    """The end of the turn whose content (and tool calls) begin closing at `start`: after the template's end-of-turn
    token when it follows before `limit` (the next message's content), else `start`."""
    eos = template.eos_text
    at = text.find(eos, start) if eos else -1
    return at + len(eos) if at >= 0 and at + len(eos) <= limit else start


def unlabelled(template: Template, where: str, turn: int, how: str) -> UserError:
    """The one line for an assistant message (`turn`) whose tokens the template's rendering does not show."""
    return UserError(f"{where}: {template.name} renders message {turn} (the assistant's) {how}, so its tokens "
                     "cannot be told apart: give a template that renders each turn's content as it is, or one with "
                     "{% generation %} markers (data.chat_template=<a Jinja file>)")


def inside(spans: Sequence[Span], begin: int, end: int) -> bool:
    """Whether the characters [begin, end) lie inside one of `spans`."""
    return any(s <= begin and end <= e for s, e in spans)


def verify(template: Template, messages: list[dict], text: str, trained: Sequence[Span],
           contents: list[Optional[Span]], where: str) -> None:
    """Each assistant turn's content, tool calls and (the final turn's) reasoning lie inside the `trained`
    characters; else one line."""
    cursor = 0
    for i, m in enumerate(messages):
        span = contents[i]
        cursor = span[1] if span is not None else cursor
        if m["role"] != "assistant":
            continue
        if m["content"] and (span is None or not inside(trained, *span)):
            raise unlabelled(template, where, i, "without its content inside the tokens marked as the assistant's"
                             if template.markers else "without its content")
        for call in m.get("tool_calls", ()):
            name = call["function"]["name"]
            at = text.find(name, cursor)
            if at < 0 or not inside(trained, at, at + len(name)):
                raise UserError(f"{where}: {template.name} does not render message {i}'s tool call "
                                f"{name!r} as the assistant's tokens: it does not support tool calls; use a "
                                "template that does (data.chat_template=<a Jinja file>), or drop tool_calls")
            cursor = at + len(name)
    last = messages[-1]
    reasoning = last.get("reasoning_content", "").strip() if last["role"] == "assistant" else ""
    if reasoning and reasoning not in text:
        raise UserError(f"{where}: {template.name} does not render the final assistant turn's reasoning_content: "
                        "its reasoning would not be trained; use a template that renders reasoning "
                        "(data.chat_template=<a Jinja file>), or write the reasoning into the content")


def final_turn(mask: Sequence[bool]) -> range:
    """The token positions of the last run of trained tokens (the final assistant turn's)."""
    end = max((t for t, m in enumerate(mask) if m), default=-1) + 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return range(start, end)


def encode_conversation(template: Template, messages: list[dict], ignore_index: int, where: str
                        ) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one normalised conversation (data.messages): labels are the ids on the assistant's
    tokens — the EOS after a final assistant turn too (appended when the template does not end the turn with it)."""
    text = template.render(messages, False, where)
    tokens = template.tokens(text, where)
    starts, contents = locate(template, messages, text, not template.markers, where)
    if template.markers:
        mask = template.marked(messages, len(tokens.ids), where)
        trained = tokens.spans(mask)
    else:
        trained = turn_spans(template, messages, text, starts, contents, where)
        mask = tokens.covering(trained)
    verify(template, messages, text, trained, contents, where)
    ids = tokens.ids
    labels = [t if m else ignore_index for t, m in zip(ids, mask)]
    eos = template.tok.eos_token_id
    if messages[-1]["role"] == "assistant" and eos is not None and eos not in [ids[t] for t in final_turn(mask)]:
        ids, labels = ids + [eos], labels + [eos]  # the model learns where its answer ends
    return ids, labels


def encode_chat(conversations: list[Any], template: Template, ignore_index: int, where: Callable[[int], str],
                rows: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """(token ids, labels) per conversation; `where(row)` names the record `rows[k]` in a message."""
    out = []
    for raw, row in zip(conversations, rows):
        here = Named(where, row)  # the file is read for a record's line only when a message names it
        out.append(encode_conversation(template, messages_of(raw, here), ignore_index, here))
    return out
