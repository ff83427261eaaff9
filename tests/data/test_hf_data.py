"""data=hf: the `datasets` library's local files (jsonl, csv, parquet, save_to_disk), column mapping, tokenization
cached by fingerprint, chat records with the loss on the assistant's tokens only, and the bad inputs in one line."""
import json

import pytest
import torch
from conftest import assert_one_line_user_error, final_weights, read_metrics, train_here

from accutrain.data.chat import encode_conversation
from accutrain.data.hf_data import hf_data
from accutrain.data.template import chat_template
from accutrain.data.template import render_bytes as render
from accutrain.data.text import text_data
from accutrain.data.tokenizer import ByteTokenizer
from accutrain.errors import UserError

datasets = pytest.importorskip("datasets")

PAIRS = [{"prompt": f"{i} plus {i % 3} is ", "response": f"it is {i + i % 3}"} for i in range(12)]
CHATS = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i} plus 1?"},
                       {"role": "assistant", "content": f"{i + 1}."}, {"role": "user", "content": "sure?"},
                       {"role": "assistant", "content": "yes"}]} for i in range(10)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def common(tmp_path, **kwargs):
    return dict(val_fraction=0.25, tokenizer="bytes", max_length=64, packing=False, padding="longest", seed=0,
                ignore_index=-100, cache_dir=str(tmp_path / "cache"), **kwargs)


def items(split):
    return [(x["input_ids"].tolist(), x["labels"].tolist()) for x in split]


def test_jsonl_csv_parquet_and_save_to_disk_give_data_texts_items(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    text = text_data(str(path), None, 0.25, "bytes", 64, False, "longest", "text", "prompt", "response", "label", 0)
    table = datasets.Dataset.from_list([{"question": r["prompt"], "answer": r["response"]} for r in PAIRS])
    table.to_csv(str(tmp_path / "pairs.csv"), index=False)
    table.to_parquet(str(tmp_path / "pairs.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    renamed = dict(prompt="question", response="answer")
    for source, columns in ((path, None), (tmp_path / "pairs.csv", renamed), (tmp_path / "pairs.parquet", renamed),
                            (tmp_path / "saved", renamed)):
        data = hf_data(str(source), columns=columns, **common(tmp_path))
        assert items(data.train) == items(text.train), source  # the same held-out draw, masking, EOS
        assert items(data.val) == items(text.val), source
    assert data.num_classes == 259 and "prompt/response" in data.description


def test_tokenization_is_cached_by_fingerprint(tmp_path):
    path = write_jsonl(tmp_path / "lm.jsonl", [{"body": f"sample {i}", "other": f"row {i}"} for i in range(8)])
    first = hf_data(str(path), columns=dict(text="body"), **common(tmp_path))
    cached = sorted((tmp_path / "cache").rglob("cache-*.arrow"))
    assert cached  # the tokenized records, written by Dataset.map
    stamps = {p: p.stat().st_mtime_ns for p in cached}
    again = hf_data(str(path), columns=dict(text="body"), **common(tmp_path))
    assert sorted((tmp_path / "cache").rglob("cache-*.arrow")) == cached  # read back, not tokenized again
    assert {p: p.stat().st_mtime_ns for p in cached} == stamps
    assert items(again.train) == items(first.train)
    other = hf_data(str(path), columns=dict(text="other"), **common(tmp_path))
    assert len(sorted((tmp_path / "cache").rglob("cache-*.arrow"))) > len(cached)  # another tokenization: new
    assert items(other.train) != items(first.train)


def test_chat_records_count_only_the_assistants_tokens(tmp_path):
    data = hf_data(str(write_jsonl(tmp_path / "chat.jsonl", CHATS)), **{**common(tmp_path), "max_length": 256})
    for ids, labels in items(data.train) + items(data.val):
        assert bytes(t for t in ids if t < 256).decode().startswith("<|system|>\nBe brief.\n<|user|>\n")
        counted = [t for t in labels if t != -100]
        spans = bytes(t for t in counted if t < 256).decode()
        assert spans.endswith(".\nyes\n") and "user" not in spans and "plus" not in spans
        assert counted[-1] == ByteTokenizer.eos_token_id  # the end of the last answer is learnt
        first = spans[: spans.index(".")]
        assert len(counted) == len(first) + len(".\n") + len("yes\n") + 1
    assert "chat, the loss on the assistant's tokens" in data.description


def test_the_exported_byte_tokenizer_renders_the_same_chat(tmp_path):
    pytest.importorskip("transformers")
    from accutrain.data.tokenizer import fast_byte_tokenizer

    fast = fast_byte_tokenizer()
    messages = CHATS[0]["messages"]
    for generation in (False, True):
        assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation) == \
            render(messages, generation)
    ours = encode_conversation(chat_template(ByteTokenizer(), "bytes"), messages, -100, "x")
    theirs = encode_conversation(chat_template(fast, "exported"), messages, -100, "x")
    assert ours == theirs


def test_missing_columns_records_without_an_assistant_and_uncached_names_are_one_line(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"body": "x"}] * 4)
    with pytest.raises(UserError) as info:
        hf_data(str(path), **common(tmp_path))
    assert_one_line_user_error(info.value, "has none of the columns data.columns.text=text", "its columns are: body")
    lonely = [{"messages": [{"role": "user", "content": "hello?"}]}] * 4
    with pytest.raises(UserError) as info:
        hf_data(str(write_jsonl(tmp_path / "lonely.jsonl", lonely)), **common(tmp_path))
    assert_one_line_user_error(info.value, "lonely.jsonl:1 has no assistant turn (roles: user)")
    with pytest.raises(UserError) as info:  # HF_HUB_OFFLINE=1 (conftest): nothing cached under that name
        hf_data("accutrain-tests/no-such-dataset", **common(tmp_path))
    assert_one_line_user_error(info.value, "data.train=accutrain-tests/no-such-dataset could not be loaded",
                               "HF_HUB_OFFLINE=1")
    with pytest.raises(UserError) as info:
        hf_data(str(tmp_path / "nothing.jsonl"), **common(tmp_path))
    assert_one_line_user_error(info.value, "(no such file)")
    with pytest.raises(UserError) as info:
        hf_data(str(path), columns=dict(txt="body"), **common(tmp_path))
    assert_one_line_user_error(info.value, "data.columns.txt is not a role")


@pytest.mark.slow
def test_a_chat_run_with_lora_takes_the_same_steps_under_any_split(tmp_path):
    pytest.importorskip("peft")
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS * 4)  # 36 trained: windows of 16, 16 and 4
    args = ["model=hf_causal_lm", "+model.config.model_type=gpt2", "+model.config.n_layer=2", "+model.config.n_head=2",
            "+model.config.n_embd=32", "+model.config.n_positions=128", "model.dropout=0", "model.adapter=lora",
            "data=hf", f"data.train={path}", f"data.cache_dir={tmp_path / 'cache'}", "data.max_length=128",
            "optim=sgd", "optim.lr=0.5", "optim.momentum=0", "trainer.epochs=1", "trainer.progress=false"]
    big, _ = train_here(tmp_path, "big", *args, "micro_batch=16")
    acc, _ = train_here(tmp_path, "acc", *args, "micro_batch=4", "accum=4")
    for key, value in final_weights(big).items():
        torch.testing.assert_close(final_weights(acc)[key], value, rtol=1e-5, atol=1e-6)
    assert [r["elements"] for r in read_metrics(acc)[0]] == [r["elements"] for r in read_metrics(big)[0]]


def test_a_bad_record_is_named_by_its_line_in_the_file(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    lines = [json.dumps(good)] * 12 + [""] + [json.dumps(good)] * 3  # a blank line: rows and lines part ways
    for bad, fragment in (({"role": "user", "content": None}, "(user) has content null"),
                          ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]},
                           "content part of type 'image_url'"),
                          ({"role": "robot", "content": "x"}, 'has role "robot"')):
        record = {"messages": [bad, {"role": "assistant", "content": "ok"}]}
        path = tmp_path / "chat.jsonl"
        path.write_text("\n".join(lines[:15] + [json.dumps(record)] + lines[15:]) + "\n")  # line 16, row 14
        with pytest.raises(UserError) as info:
            hf_data(str(path), **common(tmp_path))  # held out or not, the record is named by its line
        assert_one_line_user_error(info.value, f"{path}:16, message 0", fragment)
    table = datasets.Dataset.from_list([good] * 5 + [{"messages": [{"role": "user", "content": "x"}]}])
    table.to_parquet(str(tmp_path / "chat.parquet"))  # no lines: its row, from 0
    with pytest.raises(UserError) as info:
        hf_data(str(tmp_path / "chat.parquet"), **common(tmp_path))
    assert_one_line_user_error(info.value, f"row 5 of {tmp_path / 'chat.parquet'} has no assistant turn")


def test_records_max_length_leaves_untrained_are_counted_dropped_and_listed(tmp_path):
    from conftest import captured_log

    long = [{"messages": [{"role": "system", "content": "Context. " * 12}, {"role": "user", "content": f"{i}?"},
                          {"role": "assistant", "content": f"{i}!"}]} for i in range(10)]
    records = [r for pair in zip(CHATS, long) for r in pair]  # every other record: its answer beyond 64 tokens
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    with captured_log() as log:
        data = hf_data(str(path), **common(tmp_path))
    line = next(line for line in log.getvalue().splitlines() if "records read" in line)
    assert line == (f"data.train={path}: 20 records read, 5 held out, 20 truncated at data.max_length=64 (lines 1, 2, "
                    "3, 4, 5, and 15 more), 10 left with no trained token and dropped (listed in train.log)")
    assert len(data.train) + len(data.val) == 10  # the rest are trained on
    for split in (data.train, data.val):
        assert all((split[i]["labels"][1:] != -100).any() for i in range(len(split)))
    dropped = [line for line in log.getvalue().splitlines() if line.startswith("data.train: dropped ")]
    assert dropped == [f"data.train: dropped {path}:{n}: no trained token left (data.max_length=64)"
                       for n in range(2, 21, 2)]  # every other line of the file, whether held out or not
    with pytest.raises(UserError) as info:
        hf_data(str(path), truncation="error", **common(tmp_path))
    assert_one_line_user_error(info.value, "10 records are left with no trained token at data.max_length=64",
                               f"{path}:2, {path}:4", "data.truncation=drop")
    with pytest.raises(UserError) as info:
        hf_data(str(path), truncation="keep", **common(tmp_path))
    assert_one_line_user_error(info.value, "data.truncation=keep is not valid")


@pytest.mark.slow
def test_bad_records_and_too_long_samples_are_refused_before_the_run_directory(tmp_path):
    from conftest import assert_one_line_error, run_cli

    records = CHATS[:6] + [{"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "a"}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    gpt2 = ["model=hf_causal_lm", "+model.config.model_type=gpt2", "+model.config.n_layer=1", "+model.config.n_head=2",
            "+model.config.n_embd=16", "+model.config.n_positions=256", "data=hf", f"data.cache_dir={tmp_path / 'c'}"]
    proc = run_cli(*gpt2, f"data.train={path}", "data.max_length=128", f"hydra.run.dir={tmp_path / 'bad'}",
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, f"{path}:7, message 0 (user) has content null")
    write_jsonl(path, CHATS)
    proc = run_cli(*gpt2, f"data.train={path}", "data.max_length=1024", f"hydra.run.dir={tmp_path / 'long'}",
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, "data.max_length=1024 is more than the model's 256 positions (n_positions)")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "long").exists()


def test_items_are_read_from_arrow_files_and_pack_as_data_texts(tmp_path):
    import pickle

    import numpy as np

    held = {}
    for words in (2, 60):  # short records and records 30 times as long: the same bookkeeping in memory
        records = [{"text": " ".join(f"w{i % 7}" for _ in range(words)) + f" {i}"} for i in range(400)]
        path = write_jsonl(tmp_path / f"lm{words}.jsonl", records)
        data = hf_data(str(path), **{**common(tmp_path), "max_length": 512})
        arrays = [v for v in vars(data.train).values() if isinstance(v, np.ndarray)]
        held[words] = sum(a.nbytes for a in arrays), len(pickle.dumps(data.train))
        assert held[words][0] <= 16 * len(data.train)  # a row and a length per record, never its tokens
        assert data.train.table.cache_files  # the tokens stay in the memory-mapped files Dataset.map wrote
    assert held[2][0] == held[60][0] and held[60][1] < held[2][1] + 1000
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 3)
    for packing in (True, "concat"):
        text = text_data(str(path), None, 0.25, "bytes", 40, packing, "longest", "text", "prompt", "response",
                         "label", 0)
        data = hf_data(str(path), **{**common(tmp_path), "max_length": 40, "packing": packing})
        assert [{k: v.tolist() for k, v in data.train[i].items()} for i in range(len(data.train))] == \
            [{k: v.tolist() for k, v in text.train[i].items()} for i in range(len(text.train))], packing
        assert data.train.lengths().tolist() == [len(text.train[i]["input_ids"]) for i in range(len(text.train))]


@pytest.mark.slow
def test_a_run_trains_on_the_records_truncation_leaves_trained(tmp_path):
    long = [{"messages": [{"role": "system", "content": "Context. " * 12}, {"role": "user", "content": f"{i}?"},
                          {"role": "assistant", "content": f"{i}!"}]} for i in range(10)]
    path = write_jsonl(tmp_path / "mixed.jsonl", [r for pair in zip(CHATS, long) for r in pair])
    run, log = train_here(tmp_path, "run", "model=hf_causal_lm", "+model.config.model_type=gpt2",
                          "+model.config.n_layer=1", "+model.config.n_head=2", "+model.config.n_embd=16",
                          "+model.config.n_positions=64", "data=hf", f"data.train={path}", "data.max_length=64",
                          "data.val_fraction=0.25",
                          f"data.cache_dir={tmp_path / 'cache'}", "micro_batch=2", "accum=2", "trainer.epochs=2",
                          "trainer.progress=false")
    assert "20 records read, 5 held out, 20 truncated at data.max_length=64 (lines 1, 2, 3, 4, 5, and 15 more), 10 " \
           "left with no trained token and dropped" in log
    import re

    kept = int(re.search(r"(\d+) training samples", log).group(1))
    assert 5 <= kept < 15  # of the 15 records not held out, those that keep a trained token
    assert all(r["elements"] > 0 for r in read_metrics(run)[0])


def test_a_malformed_local_file_names_its_line(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    path = tmp_path / "chat.jsonl"
    path.write_text(good + "\n" + '{"messages": [broken\n' + good + "\n")
    with pytest.raises(UserError) as info:
        hf_data(str(path), **common(tmp_path))
    assert_one_line_user_error(info.value, f"data.train={path} could not be read: line 2 is not a JSON record")
    assert "HF_HUB_OFFLINE" not in str(info.value)  # a local file: not a dataset name to find in the cache
