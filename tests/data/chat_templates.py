"""Chat templates written for the tests — ones that break the prefix property the ways real ones do, a Qwen2.5-like
one, one with generation markers, ones that cannot be labelled — and a small BPE tokenizer trained here (no download)
to render them with, as a Hugging Face fast tokenizer."""
from __future__ import annotations

from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen2.5-Instruct's template, abridged (no `tools` preamble): every turn rendered alike, a default system prompt,
# tool calls after the content, tool results as a user turn. It renders a conversation's beginning as a prefix.
QWEN25 = r"""
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3's way, abridged: an assistant turn after the last user query renders its reasoning in a <think> block —
# the last turn always, an empty block when it has none — and turns before it lose their reasoning. Neither the
# conversation up to an earlier turn nor (for that turn) up to the last one renders as a prefix of the whole.
QWEN3_LIKE = r"""
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role in ('system', 'user') %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
            {{- (tool_call.function.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# A block only on the last turn (an empty reasoning block, as Qwen3 gives its final answer).
LAST_TURN_BLOCK = r"""
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.role == 'assistant' and loop.last %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
    {{- message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# History turns rendered without their reasoning: only assistant turns after the last user message show it.
HISTORY_WITHOUT_REASONING = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.role == 'assistant' and loop.index0 > ns.last_user and message.reasoning_content %}
        {{- '<think>' + message.reasoning_content + '</think>' }}
    {%- endif %}
    {{- message.content | trim }}{{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# Generation markers around what the assistant says (transformers' return_assistant_tokens_mask).
MARKERS = r"""
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.role == 'assistant' %}
        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}{{- '\n' }}
    {%- else %}
        {{- message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# Cannot be labelled: the assistant's content is rendered transformed (upper-cased), so it is nowhere as written.
SHOUTING = r"""
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.role == 'assistant' %}{{- message.content | upper }}{%- else %}{{- message.content }}{%- endif %}
    {{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

TEMPLATES = dict(qwen25=QWEN25, qwen3_like=QWEN3_LIKE, last_turn_block=LAST_TURN_BLOCK,
                 history_without_reasoning=HISTORY_WITHOUT_REASONING, markers=MARKERS)
TOOLS = ("qwen25", "qwen3_like")  # the templates that render tool calls


def conversations(count: int = 12, reasoning: bool = True, tools: bool = False) -> list[list[dict]]:
    """Multi-turn conversations: a system prompt, then three user questions each answered (with reasoning), and —
    `tools` — a turn that calls a tool, its result, and the answer after it (with reasoning)."""
    out = []
    for i in range(count):
        messages = [{"role": "system", "content": "You add numbers."}]
        for turn in range(3):
            a, b = i + turn, 2 * turn + 1
            messages.append({"role": "user", "content": f"What is {a} plus {b}?"})
            answer = {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}
            if reasoning:
                answer["reasoning_content"] = f"Count {b} up from {a}: {a + b}."
            messages.append(answer)
        if tools:
            messages += [{"role": "user", "content": f"And the weather in city {i}?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"type": "function", "function": {"name": "get_weather",
                                                               "arguments": {"city": f"city {i}"}}}]},
                         {"role": "tool", "content": f'{{"city {i}": "sunny, {20 + i} C"}}'},
                         {"role": "assistant", "content": f"It is sunny in city {i}, {20 + i} C."}]
            if reasoning:
                messages[-1]["reasoning_content"] = f"The tool says city {i} is sunny."
        out.append(messages)
    return out


def bpe_tokenizer(template: str = QWEN25, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer (vocabulary 600) trained here on the test conversations' texts, the chat tokens
    special (<|im_end|> its EOS), `template` its chat template: a fast tokenizer like a real instruct model's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = corpus or [m["content"] + " " + m.get("reasoning_content", "") for c in conversations(tools=True)
                       for m in c]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts * 4, trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_tokens(ADDED)
    fast.chat_template = template
    return fast


def saved_tokenizer(directory: Path, template: str = QWEN25) -> Path:
    """bpe_tokenizer saved with save_pretrained (data.tokenizer=<directory>)."""
    bpe_tokenizer(template).save_pretrained(directory)
    return directory
