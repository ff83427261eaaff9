"""The property the data readers keep: the tokens a record trains decode to exactly the text its file holds — over
generated chat and pair files whose texts look like JSON (quoted strings, numbers, lists, objects, nulls), hold
unicode (line separators included), are empty or one character long — under several chat templates (prefix ones,
ones that mark the last turn, generation markers, a BPE tokenizer), for data=hf (read whole and streamed) and
data=text. Each assistant turn's trained tokens are its content followed by nothing but the template's end of turn."""
import json
import random

import pytest
from chat_templates import LAST_TURN_BLOCK, MARKERS, QWEN25, saved_tokenizer

from accutrain.data.hf_data import hf_data
from accutrain.data.text import text_data

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

EOS = 257  # the byte tokenizer's (data.tokenizer=bytes, with a template of one's own too)
VALUES = ['"yes"', "'quoted'", "0.", "0", "-1.5e3", "null", "true", "[]", "{}", '[1, "two", null]',
          '{"a": {"b": [1]}}', '[{"type":"text","text":"hi"}]', "NaN", "héllo wörld", "日本語", "🙂👍",
          "a\u2028b", "x\x85y", "tab\there", " spaced ", "a", "t", "<", "|", ">", "\n", ".", "{", '"', "\\", "s"]
LAST_MARKED = (r"{%- for message in messages %}{{- '<|' + message.role + ('_final' if loop.last else '') + '|>\n' + "
               r"message.content + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}"
               r"{%- endif %}")
# name: (data.chat_template, what may follow a turn's content in its trained tokens, what may precede it — what
# the template has the assistant write after its generation prompt —, whether an answer may be empty)
TEMPLATES = {"builtin": (None, ("\n",), ("",), True), "qwen25": (QWEN25, ("<|im_end|>\n",), ("",), True),
             "markers": (MARKERS, ("<|im_end|>",), ("",), True),
             "last_turn_block": (LAST_TURN_BLOCK, ("", "<|im_end|>\n"), ("", "<think>\n\n</think>\n\n"), False),
             "last_marked": (LAST_MARKED, ("", "\n"), ("",), False)}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def conversations(seed, empty):
    """Chat records whose every text is drawn from VALUES: each value an answer at least once, some users' messages
    lists of parts (so that the file's content column has mixed types)."""
    rng = random.Random(seed)
    answers = VALUES + ([""] if empty else [])
    rng.shuffle(answers)
    records = []
    while answers:
        messages = []
        for _ in range(min(len(answers), rng.randint(1, 3))):
            user = rng.choice(VALUES)
            messages.append({"role": "user", "content": [{"type": "text", "text": user}] if rng.random() < 0.2
                             else user})
            messages.append({"role": "assistant", "content": answers.pop()})
        records.append({"messages": messages})
    return records


def runs(labels):
    """The runs of trained positions' labels, in order (the EOS appended after a conversation, alone in its run
    where the template's end of turn is not trained, left out)."""
    out, run = [], []
    for label in labels + [-100]:
        if label != -100:
            run.append(label)
        elif run:
            out.append(run)
            run = []
    return out[:-1] if len(out) > 1 and out[-1] == [EOS] else out


def decode(tok, ids):
    ids = ids[:-1] if ids and ids[-1] == EOS and tok is None else ids
    return bytes(ids).decode("utf-8") if tok is None else tok.decode(ids, clean_up_tokenization_spaces=False)


def assert_trains_the_answers(samples, records, endings, openings=("",), tok=None):
    assert len(samples) == len(records)
    for (_, labels), record in zip(samples, records):
        answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        trained = [decode(tok, run) for run in runs(labels)]
        assert len(trained) == len(answers), (trained, answers)
        for text, answer in zip(trained, answers):
            assert any(text == start + answer + end for start in openings for end in endings), (text, answer)


def read(data, streaming):
    items = data.stream.open(None) if streaming else data.train
    return [(s["input_ids"].tolist(), s["labels"].tolist()) for s in items]


def options(tmp_path, **kwargs):
    return dict(dict(tokenizer="bytes", max_length=512, packing=False, padding="longest", seed=0, ignore_index=-100,
                     cache_dir=str(tmp_path / "cache")), **kwargs)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_every_assistant_turn_trains_exactly_the_files_text(tmp_path, name, streaming):
    template, endings, openings, empty = TEMPLATES[name]
    records = conversations(len(name), empty)
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    before = path.read_bytes()
    data = hf_data(str(path), val=str(path), chat_template=template, streaming=streaming, **options(tmp_path))
    assert_trains_the_answers(read(data, streaming), records, endings, openings)
    assert path.read_bytes() == before


def test_a_bpe_tokenizer_trains_exactly_the_files_text(tmp_path):
    tokenizer = saved_tokenizer(tmp_path / "tok", QWEN25)
    records = conversations(1, True)
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    for streaming in (False, True):
        data = hf_data(str(path), val=str(path), streaming=streaming, **options(tmp_path, tokenizer=str(tokenizer)))
        assert_trains_the_answers(read(data, streaming), records, ("<|im_end|>\n",), tok=tok)


def pairs(seed):
    rng = random.Random(seed)
    return [{"prompt": rng.choice(VALUES), "response": response} for response in VALUES + [""]]


@pytest.mark.parametrize("reader", ["text", "hf", "hf streamed"])
def test_every_response_trains_exactly_the_files_text(tmp_path, reader):
    records = pairs(3)
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    if reader == "text":
        data = text_data(str(path), str(path), 0.25, "bytes", 512, False, "longest", "text", "prompt", "response",
                         None, 0)
    else:
        data = hf_data(str(path), val=str(path), streaming=reader == "hf streamed", **options(tmp_path))
    samples = read(data, reader == "hf streamed")  # the empty response trains nothing: dropped (and counted)
    assert [[decode(None, run) for run in runs(labels)] for _, labels in samples] == [
        [r["response"]] for r in records if r["response"]]


@pytest.mark.parametrize("reader", ["text", "hf"])
def test_every_text_of_a_pair_is_the_files_text(tmp_path, reader):
    texts = [v for v in VALUES if v.strip()]
    records = [{"anchor": a, "positive": p} for a, p in zip(texts, texts[1:] + texts[:1])]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    if reader == "text":
        data = text_data(str(path), str(path), 0.25, "bytes", 512, False, "longest", "text", "prompt", "response",
                         None, 0)
    else:
        data = hf_data(str(path), val=str(path), **options(tmp_path))
    read_back = [{role: decode(None, item[f"{role}.input_ids"].tolist()) for role in ("anchor", "positive")}
                 for item in data.train]
    assert read_back == records
