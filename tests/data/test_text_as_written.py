"""The text a user wrote is the text trained: local JSON files read as written (a string that looks like JSON, a
number or a list stays the string), a chat template's own text never trained as an answer, tool calls whose
arguments are not a JSON object refused by line, a stream's bad line and a file's non-UTF-8 bytes one line naming
them."""
import json

import pytest
from chat_templates import QWEN25 as QWEN
from conftest import assert_one_line_error, assert_one_line_user_error, train_run

from accutrain.data.chat import encode_conversation
from accutrain.data.hf_data import hf_data
from accutrain.data.messages import messages_of
from accutrain.data.template import chat_template
from accutrain.data.tokenizer import fast_byte_tokenizer
from accutrain.errors import UserError

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

EOS = 257  # the byte tokenizer's
# A template that marks the last message (its role header differs), so that no conversation's beginning renders as
# a prefix of the whole: a turn's place is found by searching for its content.
LAST_MARKED = (r"{%- for message in messages %}{{- '<|' + message.role + ('_final' if loop.last else '') + '|>\n' + "
               r"message.content + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}"
               r"{%- endif %}")
# … and one that also upper-cases the last answer: where a short answer is, the rendering cannot tell.
LAST_SHOUTED = LAST_MARKED.replace("message.content + '\\n'", "(message.content | upper if loop.last else "
                                   "message.content) + '\\n'")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def options(tmp_path, **kwargs):
    return dict(val_fraction=0.25, tokenizer="bytes", max_length=256, packing=False, padding="longest", seed=0,
                ignore_index=-100, cache_dir=str(tmp_path / "cache"), **kwargs)


def chat(*answers, user="q"):
    messages = []
    for answer in answers:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def trained_text(labels):
    """The bytes a sample's labels train, as text (the EOS the byte tokenizer appends left out)."""
    return bytes(t for t in labels if 0 <= t < 256).decode("utf-8")


def samples(data, streaming):
    if streaming:
        return [(s["input_ids"].tolist(), s["labels"].tolist()) for s in data.stream.open(None)]
    return [(s["input_ids"].tolist(), s["labels"].tolist()) for s in data.train]


@pytest.mark.parametrize("streaming", [False, True])
def test_strings_that_look_like_json_or_numbers_are_trained_as_written(tmp_path, streaming):
    answers = ['"yes"', '[{"type":"text","text":"hi"}]', "0.", "1e5", "null", '{"a": [1, 2]}']
    records = [chat(a) for a in answers]
    records.append({"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]},
                                 {"role": "assistant", "content": "[1, 2]"}]})  # a list of parts: mixed types
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    before = path.read_bytes()
    data = hf_data(str(path), val=str(path), streaming=streaming, **options(tmp_path))
    assert [trained_text(labels) for _, labels in samples(data, streaming)] == [a + "\n" for a in answers + ["[1, 2]"]]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "response": a} for a in answers] +
                        [{"prompt": "p", "response": "x", "extra": [1]}, {"prompt": "p", "response": "7"}])
    data = hf_data(str(pairs), val=str(pairs), streaming=streaming, **options(tmp_path))
    assert [trained_text(labels) for _, labels in samples(data, streaming)] == answers + ["x", "7"]
    assert path.read_bytes() == before


@pytest.mark.parametrize("streaming", [False, True])
def test_a_csv_files_text_columns_are_read_as_the_strings_they_hold(tmp_path, streaming):
    import csv

    responses = ["0.", "NA", "null", '"yes"', "007", "1e5", "nan"]
    path = tmp_path / "pairs.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "response", "score"])
        writer.writerows([["p", r, "" if i == 2 else i] for i, r in enumerate(responses)])  # a score left empty
    before = path.read_bytes()
    data = hf_data(str(path), val=str(path), streaming=streaming, **options(tmp_path))
    assert [trained_text(labels) for _, labels in samples(data, streaming)] == responses
    assert path.read_bytes() == before


def test_a_json_array_or_object_of_columns_reads_as_its_json_lines(tmp_path):
    records = [chat('"yes"'), {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]},
                                            {"role": "assistant", "content": "0."}]}]
    lines = write_jsonl(tmp_path / "chat.jsonl", records)
    array = tmp_path / "array.json"
    array.write_text(json.dumps(records, indent=2))
    columns = tmp_path / "columns.json"
    columns.write_text(json.dumps({"messages": [r["messages"] for r in records]}, indent=1))
    expected = [trained_text(labels) for _, labels in samples(hf_data(str(lines), val=str(lines),
                                                                      **options(tmp_path)), False)]
    assert expected == ['"yes"\n', "0.\n"]
    for path in (array, columns):
        assert [trained_text(labels) for _, labels in samples(hf_data(str(path), val=str(path), **options(tmp_path)),
                                                              False)] == expected


def test_a_template_marking_the_last_message_never_trains_its_header():
    template = chat_template(fast_byte_tokenizer(), "bytes", LAST_MARKED)
    for answer in ("t", "a", "<", "|", "\n", "yes"):
        ids, labels = encode_conversation(template, messages_of(chat(answer, answer)["messages"], "x"), -100, "x")
        runs, run = [], []
        for t, label in enumerate(labels):
            if label != -100:
                run.append(label)
            elif run:
                runs.append(run)
                run = []
        runs.append(run)
        assert [bytes(t for t in r if t < 256).decode() for r in runs] == [answer, answer + "\n"], answer


def test_an_answer_whose_place_the_rendering_cannot_tell_is_refused_by_its_line(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat("fine answer", "OK"), chat("ok", "t")])
    with pytest.raises(UserError) as info:
        hf_data(str(path), val=str(path), chat_template=LAST_SHOUTED, **options(tmp_path))
    assert_one_line_user_error(info.value, f"{path}:2", "message 3 (the assistant's)", "cannot be verified")


@pytest.mark.parametrize("arguments, said", [('{"city": ', "are not JSON"), ("[1, 2]", "expected a JSON object"),
                                             (7, "expected a JSON object")])
def test_tool_call_arguments_that_are_not_a_json_object_are_refused_by_line(tmp_path, arguments, said):
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    good = {**chat("sure"), "messages": [*chat("sure")["messages"], {"role": "user", "content": "weather?"},
                                         {**call, "tool_calls": [{"type": "function", "function": {
                                             "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]}
    path = write_jsonl(tmp_path / "tools.jsonl", [good, {"messages": [{"role": "user", "content": "weather?"}, call]}])
    with pytest.raises(UserError) as info:
        hf_data(str(path), val=str(path), chat_template=QWEN, **options(tmp_path))
    assert_one_line_user_error(info.value, f"{path}:2, message 1", "'get_weather'", said)


def test_a_malformed_line_mid_stream_is_one_line_naming_it(tmp_path):
    lines = [json.dumps(chat(f"answer {i}")) for i in range(50)]
    lines[39] = '{"messages": [broken'
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    val = write_jsonl(tmp_path / "val.jsonl", [chat("v")])
    data = hf_data(str(path), val=str(val), streaming=True, **options(tmp_path))
    stream = data.stream.open(None)
    assert len([next(stream) for _ in range(39)]) == 39  # the records before it
    with pytest.raises(UserError) as info:
        next(stream)
    assert_one_line_user_error(info.value, f"data.train={path} could not be read: line 40 is not a JSON record")


@pytest.mark.parametrize("kind", ["chat", "pairs"])
def test_bytes_that_are_not_utf8_are_one_line_naming_the_file_the_line_and_the_byte(tmp_path, kind):
    good = json.dumps(chat("yes") if kind == "chat" else {"anchor": "a cat", "positive": "un chat"}).encode()
    path = tmp_path / "bad.jsonl"
    path.write_bytes(good + b"\n" + good.replace(b"yes" if kind == "chat" else b"un chat", b"caf\xe9") + b"\n")
    before = path.read_bytes()
    for streaming in (False, True) if kind == "chat" else (False,):
        with pytest.raises(UserError) as info:
            data = hf_data(str(path), val=str(path), streaming=streaming, **options(tmp_path))
            list(data.stream.open(None))
        at = len(good) + 1 + good.index(b"yes" if kind == "chat" else b"un chat") + 3
        assert_one_line_user_error(info.value, f"data.train={path} could not be read: line 2 is not UTF-8 text "
                                   f"(byte {at} of the file is b'\\xe9')")
    assert path.read_bytes() == before


def test_a_stream_that_fails_keeps_the_steps_before_and_a_buffer_of_nothing_is_refused_before_the_run(tmp_path):
    lines = [json.dumps(chat(f"{i} plus 1 is {i + 1}.")) for i in range(50)]
    lines[39] = '{"messages": [broken'
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    write_jsonl(tmp_path / "val.jsonl", [chat("v")])
    args = ["data=hf", f"data.train={tmp_path / 'train.jsonl'}", f"data.val={tmp_path / 'val.jsonl'}",
            "data.streaming=true", "data.buffer_size=12", f"data.cache_dir={tmp_path / 'cache'}", "data.max_length=64",
            "trainer.epochs=null", "trainer.max_steps=20", "trainer.progress=false", "model=hf_causal_lm",
            "+model.config.model_type=gpt2", "+model.config.n_layer=1", "+model.config.n_head=2",
            "+model.config.n_embd=16", "+model.config.n_positions=64", "micro_batch=4", "accum=2",
            "trainer.checkpoint_every=1"]
    for size in ("0", "-3"):
        run, proc = train_run(tmp_path, f"buffer{size}", *args, f"data.buffer_size={size}", check=False)
        assert_one_line_error(proc, f"data.buffer_size={size} is not valid")
        assert not run.exists()
    run, proc = train_run(tmp_path, "run", *args, check=False)
    assert_one_line_error(proc, "line 40 is not a JSON record")
    assert (run / "checkpoints" / "step-00000002.pt").is_file()  # the windows cut before line 40: trained, kept
    assert json.loads((run / "status.json").read_text())["state"] == "failed"


@pytest.mark.parametrize("reader", ["text", "hf"])
def test_pairs_whose_positives_are_all_the_same_text_are_warned_of_at_load(tmp_path, reader):
    from conftest import captured_log

    from accutrain.data.text import text_data

    def load(records):
        path = write_jsonl(tmp_path / f"pairs{len(records)}.jsonl", records)
        with captured_log() as log:
            if reader == "text":
                text_data(str(path), str(path), 0.25, "bytes", 64, False, "longest", "text", "prompt", "response",
                          None, 0)
            else:
                hf_data(str(path), val=str(path), **options(tmp_path))
        return log.getvalue()

    same = load([{"anchor": f"query {i}", "positive": "the same passage"} for i in range(8)])
    assert "every one of the 8 training records" in same and "has the same positive text" in same
    assert "has the same positive" not in load([{"anchor": f"query {i}", "positive": f"passage {i % 2}"}
                                                for i in range(6)])
