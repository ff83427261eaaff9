"""Chat records — `{"messages": [{"role": …, "content": …}, …]}` — as (token ids, labels): the conversation rendered
with the tokenizer's chat template, the labels `ignore_index` everywhere but on the assistant's tokens.

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

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from accutrain.data.tokenizer import ByteTokenizer
from accutrain.errors import UserError

GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
Span = tuple[int, int]  # characters [start, end) of the rendering


def render_bytes(messages: list[dict], add_generation_prompt: bool) -> str:
    """The byte tokenizer's template (tokenizer.CHAT_TEMPLATE, saved with its export), rendered: `<|role|>`, a
    newline, the content and a newline per message."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


render = render_bytes  # the name other modules and the tests know it by


def template_source(value: str) -> str:
    """data.chat_template: a file holding a Jinja chat template, or the template itself."""
    path = Path(value).expanduser()
    if "{{" in value or "{%" in value:
        return value
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"data.chat_template={value}: expected a file holding a Jinja chat template, or the template "
                        f"itself ({getattr(e, 'strerror', None) or e})") from None


@dataclass(frozen=True)
class Template:
    """How a tokenizer renders a conversation and tokenizes the rendering, and how its turns are found."""

    tok: Any
    name: str  # for messages: whose template it is
    markers: bool  # {% generation %} blocks mark the assistant's tokens

    @property
    def builtin(self) -> bool:
        return isinstance(self.tok, ByteTokenizer)

    def render(self, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
        """The conversation as the template renders it; a template that refuses it is one line."""
        if self.builtin:
            return render_bytes(messages, add_generation_prompt)
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2's TemplateError (raise_exception), a template's TypeError …
            line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"{where}: {self.name} cannot render it ({line[:200]})") from None

    def tokens(self, text: str, where: str) -> tuple[list[int], list[Span]]:
        """The rendering's token ids (as apply_chat_template tokenizes it: no special tokens added) and each token's
        characters."""
        if self.builtin:
            ids, offsets = [], []
            for i, char in enumerate(text):
                encoded = char.encode("utf-8")
                ids += encoded
                offsets += [(i, i + 1)] * len(encoded)
            return ids, offsets
        try:
            encoded = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:
            raise UserError(f"{where}: {self.name} belongs to a slow (Python) tokenizer, which cannot map characters "
                            "to tokens; chat records need a fast one (tokenizer.json)") from None
        return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]

    def marked(self, messages: list[dict], count: int, where: str) -> list[bool]:
        """The template's generation markers: which of the rendering's `count` tokens are the assistant's."""
        out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
        mask = [bool(m) for m in out["assistant_masks"]]
        if len(mask) != count:
            raise UserError(f"{where}: {self.name}'s generation markers cover {len(mask)} tokens, its rendering has "
                            f"{count}")
        return mask

    @property
    def eos_text(self) -> Optional[str]:
        """The end-of-turn token's text (the tokenizer's EOS), as a rendering holds it."""
        return None if self.builtin else getattr(self.tok, "eos_token", None)


def chat_template(tok: Any, tokenizer: str, chat_template: Optional[str] = None) -> Template:
    """The template chat records are rendered with: data.chat_template (set on the tokenizer, so that an export
    keeps it) or the tokenizer's own; the byte tokenizer's built-in one."""
    if chat_template is not None:
        tok.chat_template = template_source(chat_template)
        name = f"the chat template data.chat_template={chat_template if len(chat_template) < 60 else '…'}"
    elif isinstance(tok, ByteTokenizer):
        return Template(tok, "the byte tokenizer's built-in chat template", markers=False)
    elif not getattr(tok, "chat_template", None):
        raise UserError(f"data.tokenizer={tokenizer} has no chat template: chat records (data.columns.messages) "
                        "need a tokenizer that has one (an instruct model's), data.chat_template=<a Jinja file>, or "
                        "data.tokenizer=bytes")
    else:
        name = f"the chat template of data.tokenizer={tokenizer}"
    source = tok.chat_template if isinstance(tok.chat_template, str) else str(tok.chat_template)
    return Template(tok, name, markers=bool(GENERATION.search(source)))


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


def locate(template: Template, messages: list[dict], text: str, prefixes: bool
           ) -> tuple[list[Optional[int]], list[Optional[Span]]]:
    """Where each message's content lies in `text`, the rendering of `messages`, searched in order; with `prefixes`,
    where each assistant turn begins when the conversation before it (with the generation prompt) renders as a
    prefix of `text` (None elsewhere)."""
    starts: list[Optional[int]] = []
    contents: list[Optional[Span]] = []
    cursor = 0
    for i, m in enumerate(messages):
        start = prefix_end(template, messages[:i], True, text) if prefixes and m["role"] == "assistant" else None
        cursor = max(cursor, start or 0)
        span = find(text, m["content"], cursor) if m["content"] else None
        if span is not None:
            cursor = span[1]
        starts.append(start)
        contents.append(span)
    return starts, contents


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
    return UserError(f"{where}: {template.name} renders assistant turn {turn} (message {turn}) {how}, so its tokens "
                     "cannot be told apart: give a template that renders each turn's content as it is, or one with "
                     "{% generation %} markers (data.chat_template=<a Jinja file>)")


def covered(offsets: Sequence[Span], spans: Sequence[Span]) -> list[bool]:
    """Which tokens (their characters `offsets`) overlap one of `spans`."""
    mask = [False] * len(offsets)
    for begin, end in spans:
        for t, (s, e) in enumerate(offsets):
            if s >= end:
                break
            if e > begin or (s == e and s >= begin):
                mask[t] = True
    return mask


def verify(template: Template, messages: list[dict], text: str, offsets: Sequence[Span], mask: Sequence[bool],
           contents: list[Optional[Span]], where: str) -> None:
    """Each assistant turn's content, tool calls and (the final turn's) reasoning lie inside the trained tokens;
    else one line."""
    trained = [False] * (len(text) + 1)
    for (s, e), m in zip(offsets, mask):
        if m:
            trained[s:e] = [True] * (e - s)
    cursor = 0
    for i, m in enumerate(messages):
        span = contents[i]
        cursor = span[1] if span is not None else cursor
        if m["role"] != "assistant":
            continue
        if m["content"] and (span is None or not all(trained[span[0] : span[1]])):
            raise unlabelled(template, where, i, "without its content inside the tokens marked as the assistant's"
                             if template.markers else "without its content")
        for call in m.get("tool_calls", ()):
            name = call["function"]["name"]
            at = text.find(name, cursor)
            if at < 0 or not all(trained[at : at + len(name)]):
                raise UserError(f"{where}: {template.name} does not render assistant turn {i}'s tool call "
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
    ids, offsets = template.tokens(text, where)
    starts, contents = locate(template, messages, text, prefixes=not template.markers)
    if template.markers:
        mask = template.marked(messages, len(ids), where)
    else:
        mask = covered(offsets, turn_spans(template, messages, text, starts, contents, where))
    verify(template, messages, text, offsets, mask, contents, where)
    labels = [t if m else ignore_index for t, m in zip(ids, mask)]
    eos = template.tok.eos_token_id
    if messages[-1]["role"] == "assistant" and eos is not None and eos not in [ids[t] for t in final_turn(mask)]:
        ids, labels = ids + [eos], labels + [eos]  # the model learns where its answer ends
    return ids, labels


def encode_chat(conversations: list[Any], template: Template, ignore_index: int, where: Callable[[int], str],
                rows: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """(token ids, labels) per conversation; `where(row)` names the record `rows[k]` in messages."""
    from accutrain.data.messages import messages_of

    out = []
    for raw, row in zip(conversations, rows):
        here = where(row)
        out.append(encode_conversation(template, messages_of(raw, here), ignore_index, here))
    return out
