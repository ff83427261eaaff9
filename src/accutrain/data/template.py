"""The chat template chat records are rendered with (data.chat_template, the tokenizer's own, or the byte tokenizer's
built-in one), and a rendering's tokens with the characters each covers — what data/chat.py finds the assistant's
turns with."""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from accutrain.data.tokenizer import ByteTokenizer
from accutrain.errors import UserError

GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
Span = tuple[int, int]  # characters [start, end) of the rendering


def render_bytes(messages: list[dict], add_generation_prompt: bool) -> str:
    """The byte tokenizer's template (tokenizer.CHAT_TEMPLATE, saved with its export), rendered: `<|role|>`, a
    newline, the content and a newline per message."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")



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
class Tokens:
    """A rendering's token ids and the characters [starts[t], ends[t]) each covers (in order)."""

    ids: list[int]
    starts: Sequence[int]
    ends: Sequence[int]

    @classmethod
    def of_bytes(cls, text: str) -> Tokens:
        """The byte tokenizer's: a token per UTF-8 byte, each covering its character."""
        if text.isascii():
            return cls(list(text.encode()), range(len(text)), range(1, len(text) + 1))
        chars = [i for i, char in enumerate(text) for _ in char.encode("utf-8")]
        return cls(list(text.encode("utf-8")), chars, [c + 1 for c in chars])

    def covering(self, spans: Sequence[Span]) -> list[bool]:
        """Which tokens overlap one of the character `spans`."""
        mask = [False] * len(self.ids)
        for begin, end in spans:
            first, stop = bisect.bisect_right(self.ends, begin), bisect.bisect_left(self.starts, end)
            mask[first:stop] = [True] * max(0, stop - first)
        return mask

    def spans(self, mask: Sequence[bool]) -> list[Span]:
        """The characters the runs of `mask`ed tokens cover."""
        out: list[Span] = []
        for t, marked in enumerate(mask):
            if not marked:
                continue
            if out and t and mask[t - 1]:
                out[-1] = (out[-1][0], self.ends[t])
            else:
                out.append((self.starts[t], self.ends[t]))
        return out


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

    def tokens(self, text: str, where: str) -> Tokens:
        """The rendering's tokens, as apply_chat_template tokenizes it (no special tokens added)."""
        if self.builtin:
            return Tokens.of_bytes(text)
        try:
            encoded = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:
            raise UserError(f"{where}: {self.name} belongs to a slow (Python) tokenizer, which cannot map characters "
                            "to tokens; chat records need a fast one (tokenizer.json)") from None
        offsets = encoded["offset_mapping"]
        return Tokens(list(encoded["input_ids"]), [o[0] for o in offsets], [o[1] for o in offsets])

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
