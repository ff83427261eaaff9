"""A chat record's messages as a chat template takes them, from every format people have — or one line naming the
record (its line in the file) and what is wrong.

- `content`: a string; or a list of parts (the OpenAI / Hugging Face format), whose text parts are joined — an image,
  audio, video or file part is refused (text-only training); `null` is refused, but on an assistant message that
  carries `tool_calls` (the OpenAI format of a turn that only calls tools), where it is the empty string.
- `role`: system, user, assistant or tool (a tool's result, rendered as context).
- `tool_calls` on assistant messages: [{"type": "function", "function": {"name", "arguments"}}] (or the function's
  fields alone); `arguments` given as a JSON string are parsed into the object chat templates expect — arguments
  that are not a JSON object (or a string holding one) are refused, naming the record.
- `reasoning_content` on assistant messages (a string), for templates that render reasoning.
Keys left null by the datasets library (a column every record has, this one without a value) are dropped.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from accutrain.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
NOT_TEXT = ("image", "image_url", "input_image", "audio", "input_audio", "video", "video_url", "file")


def text_of(content: Any, where: str, n: int) -> str:
    """Message `n`'s content as text: a string as it is, a list of parts as its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in NOT_TEXT:
                raise UserError(f"{where}, message {n} has a content part of type {kind!r} (part {p}): only text is "
                                "supported (accutrain trains language models on text); drop the part or the record")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise UserError(f"{where}, message {n}: content part {p} is {json.dumps(part, default=str)[:80]}: "
                                'expected {"type": "text", "text": "…"}')
            texts.append(part["text"])
        return "".join(texts)
    raise UserError(f"{where}, message {n}: content is {json.dumps(content, default=str)[:80]}: expected a string or "
                    'a list of {"type": "text", "text": "…"} parts')


def tool_call(call: Any, where: str, n: int) -> dict[str, Any]:
    """One tool call of message `n` as chat templates take it: {"type": "function", "function": {"name",
    "arguments": {…}}}."""
    function = call.get("function") if isinstance(call, Mapping) and call.get("function") is not None else call
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise UserError(f"{where}, message {n}: tool call {json.dumps(call, default=str)[:80]}: expected "
                        '{"type": "function", "function": {"name": "…", "arguments": {…}}}')
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # the OpenAI format: the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}, message {n}: tool call {function['name']!r} has arguments that are not JSON "
                            f"({e}: {function['arguments']!r:.60}): expected a JSON object, or a string holding "
                            "one — a chat template renders the arguments as an object") from None
    if arguments is not None and not isinstance(arguments, Mapping):
        raise UserError(f"{where}, message {n}: tool call {function['name']!r} has arguments "
                        f"{json.dumps(arguments, default=str)[:60]}: expected a JSON object (name → value), or a "
                        "string holding one")
    out = {k: v for k, v in call.items() if v is not None and k != "function"} if isinstance(call, Mapping) else {}
    return {**out, "type": "function", "function": {"name": function["name"], "arguments": arguments or {}}}


def message(raw: Any, n: int, where: str) -> dict[str, Any]:
    """Message `n` of a record, normalised (see the module's docstring)."""
    if not isinstance(raw, Mapping) or "role" not in raw:
        raise UserError(f"{where}, message {n}: expected a {{\"role\": …, \"content\": …}} message, got "
                        f"{json.dumps(raw, default=str)[:80]}")
    role = raw["role"]
    if role not in ROLES:
        raise UserError(f"{where}, message {n} has role {json.dumps(role, default=str)}: expected one of "
                        f"{', '.join(ROLES)}")
    out = {k: v for k, v in raw.items() if v is not None}
    calls = raw.get("tool_calls")
    if calls:
        if role != "assistant":
            raise UserError(f"{where}, message {n}: a {role} message carries tool_calls; only an assistant's turn "
                            "calls tools")
        if not isinstance(calls, (list, tuple)):
            raise UserError(f"{where}, message {n}: tool_calls is {json.dumps(calls, default=str)[:80]}: expected "
                            "a list")
        out["tool_calls"] = [tool_call(call, where, n) for call in calls]
    else:
        out.pop("tool_calls", None)
    content = raw.get("content")
    if content is None:
        if not calls:
            raise UserError(f"{where}, message {n} ({role}) has content null: expected its text (null is for an "
                            "assistant turn that only calls tools)")
        content = ""
    out["content"] = text_of(content, where, n)
    if role == "assistant" and "reasoning_content" in out and not isinstance(out["reasoning_content"], str):
        raise UserError(f"{where}, message {n}: reasoning_content is "
                        f"{json.dumps(out['reasoning_content'], default=str)[:80]}: expected a string")
    return out


def messages_of(raw: Any, where: str) -> list[dict[str, Any]]:
    """A record's messages, normalised, with at least one assistant turn; or one line naming `where`."""
    if not isinstance(raw, (list, tuple)):
        raise UserError(f"{where}: expected a list of {{\"role\": …, \"content\": …}} messages, got "
                        f"{json.dumps(raw, default=str)[:80]}")
    messages = [message(m, n, where) for n, m in enumerate(raw)]
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where} has no assistant turn (roles: {', '.join(m['role'] for m in messages) or 'none'}): "
                        "the loss is on the assistant's tokens, so a record needs at least one")
    return messages
