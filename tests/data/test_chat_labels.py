"""Labels that follow the chat template, whatever it is: every assistant turn's content inside the trained tokens —
checked token by token against the content — on multi-turn conversations, with templates that break the prefix
property the ways real ones do (a block only on the last turn, history turns without their reasoning), a Qwen2.5-like
one with tool calls, one with generation markers and accutrain's own; a template that cannot be labelled is one
line."""
import pytest
from chat_templates import QWEN25, SHOUTING, TEMPLATES, TOOLS, bpe_tokenizer, conversations
from conftest import assert_one_line_user_error

from accutrain.data.chat import encode_conversation
from accutrain.data.messages import messages_of
from accutrain.data.template import chat_template
from accutrain.data.text import common_prefix
from accutrain.data.tokenizer import ByteTokenizer, fast_byte_tokenizer
from accutrain.errors import UserError

pytest.importorskip("transformers")
REASONING = ("qwen3_like", "history_without_reasoning")  # the templates that render reasoning_content
BREAK_PREFIXES = ("qwen3_like", "last_turn_block", "history_without_reasoning")


def rendering(tok, messages):
    """(the text, its token ids, each token's characters) as the tokenizer renders the conversation."""
    text = tok.apply_chat_template(messages, tokenize=False)
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return text, encoded["input_ids"], encoded["offset_mapping"]


def tokens_of(offsets, start, end):
    return [t for t, (s, e) in enumerate(offsets) if s < end and e > start]


def prefix_labels(tok, messages, ignore=-100):
    """What data/chat.py did before: a turn from where the conversation before it (with the generation prompt)
    stops agreeing with the whole, to where the conversation up to it does — right only for prefix templates."""
    def ids(m, generation):
        return list(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=generation)["input_ids"])
    whole = ids(messages, False)
    labels = [ignore] * len(whole)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = common_prefix(ids(messages[:i], True), whole), common_prefix(ids(messages[: i + 1], False),
                                                                                       whole)
            labels[start:end] = whole[start:end]
    return labels


def turns_without_a_token(tok, messages, labels):
    """The assistant turns whose content has no trained token in `labels` (of the whole rendering's tokens)."""
    text, _, offsets = rendering(tok, messages)
    cursor, empty = 0, 0
    for m in messages:
        at = text.find(m["content"], cursor) if m["content"] else -1
        if at < 0:
            continue
        cursor = at + len(m["content"])
        if m["role"] == "assistant":
            empty += all(labels[t] == -100 for t in tokens_of(offsets, at, cursor) if t < len(labels))
    return empty


@pytest.mark.parametrize("name", [*TEMPLATES, "accutrain"])
def test_every_assistant_turn_is_trained_token_by_token_whatever_the_template(name):
    tok = fast_byte_tokenizer() if name == "accutrain" else bpe_tokenizer(TEMPLATES[name])
    template = chat_template(tok, name)
    assert template.markers == (name == "markers")
    chats = conversations(12, reasoning=name in REASONING, tools=name in TOOLS)
    turns = untrained_before = 0
    for raw in chats:
        messages = messages_of(raw, "test")
        ids, labels = encode_conversation(template, messages, -100, "test")
        text, rendered, offsets = rendering(tok, messages)
        assert ids[: len(rendered)] == rendered
        cursor = 0
        for m in messages:  # each message's content, in order, token by token
            if not m["content"]:
                continue
            at = text.index(m["content"].strip(), cursor)
            cursor = at + len(m["content"].strip())
            trained = [labels[t] == ids[t] for t in tokens_of(offsets, at, cursor)]
            assert trained and all(trained) if m["role"] == "assistant" else not any(trained), (name, m)
            turns += m["role"] == "assistant"
        for m in messages:
            for call in m.get("tool_calls", ()):  # the assistant's tool call is trained, the tool's result is not
                at = text.index(call["function"]["name"])
                assert all(labels[t] == ids[t] for t in tokens_of(offsets, at, at + len("get_weather")))
        if name in REASONING:  # the final turn's reasoning is rendered, and trained
            reasoning = messages[-1]["reasoning_content"]
            at = text.index(reasoning)
            assert all(labels[t] == ids[t] for t in tokens_of(offsets, at, at + len(reasoning)))
        assert tok.eos_token_id in [ids[t] for t in range(len(ids)) if labels[t] != -100][-2:]  # the end learnt
        if name != "markers":
            untrained_before += turns_without_a_token(tok, messages, prefix_labels(tok, messages))
    assert turns >= len(chats) * 3
    # the test's templates break the former labelling the ways real ones do: turns left without a trained token
    assert (untrained_before > 0) == (name in BREAK_PREFIXES), untrained_before


def test_a_template_that_cannot_be_labelled_is_one_line():
    messages = messages_of(conversations(1, reasoning=False)[0], "x")
    with pytest.raises(UserError) as info:
        encode_conversation(chat_template(bpe_tokenizer(SHOUTING), "shouting"), messages, -100, "chat.jsonl:3")
    assert_one_line_user_error(info.value, "chat.jsonl:3: the chat template of data.tokenizer=shouting renders "
                               "message 2 (the assistant's)", "without its content", "{% generation %} markers",
                               "data.chat_template=")
    with_tools = messages_of(conversations(1, reasoning=False, tools=True)[0], "x")
    with pytest.raises(UserError) as info:  # the byte tokenizer's template renders no tool call
        encode_conversation(chat_template(ByteTokenizer(), "bytes"), with_tools, -100, "chat.jsonl:4")
    assert_one_line_user_error(info.value, "chat.jsonl:4", "does not render message 8's tool call 'get_weather'",
                               "does not support tool calls")
    reasoning = messages_of(conversations(1)[0], "x")
    with pytest.raises(UserError) as info:  # Qwen2.5's renders no reasoning: it would be lost without a word
        encode_conversation(chat_template(bpe_tokenizer(QWEN25), "qwen25"), reasoning, -100, "chat.jsonl:5")
    assert_one_line_user_error(info.value, "chat.jsonl:5", "does not render the final assistant turn's "
                               "reasoning_content")


def test_every_message_format_becomes_the_same_conversation():
    plain = [{"role": "user", "content": "Hi there"},
             {"role": "assistant", "content": "Hello", "tool_calls": None, "name": None}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Hello", "image_url": None}]}]
    assert messages_of(parts, "x") == messages_of(plain, "x") == [{"role": "user", "content": "Hi there"},
                                                                   {"role": "assistant", "content": "Hello"}]
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    assert messages_of([{"role": "user", "content": "go"}, call], "x")[1] == {
        "role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    for bad, fragments in (
            ([{"role": "user", "content": None}, {"role": "assistant", "content": "a"}], ("message 0 (user) has "
                                                                                          "content null",)),
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
              {"role": "assistant", "content": "a"}], ("content part of type 'image_url'", "only text")),
            ([{"role": "user", "content": [{"type": "input_audio"}]}, {"role": "assistant", "content": "a"}],
             ("'input_audio'",)),
            ([{"role": "bot", "content": "a"}], ("message 0 has role \"bot\"", "system, user, assistant, tool")),
            ([{"role": "user", "content": 7}, {"role": "assistant", "content": "a"}], ("content is 7",)),
            ([{"role": "user", "content": "a"}], ("has no assistant turn",))):
        with pytest.raises(UserError) as info:
            messages_of(bad, "chat.jsonl:9")
        assert_one_line_user_error(info.value, "chat.jsonl:9", *fragments)
