"""Preference records (data/preference.py): pairs and feedback in TRL's plain and conversational formats, from
data=text (.jsonl) and data=hf; a pair is one sample whose two sequences share the prompt's tokens; the completion's
tokens are the labelled ones (after any chat template); every bad record one line naming its line; records
data.max_length leaves without a completion token dropped and counted; a feedback split of one class warned."""
import json
import logging

import pytest
import torch
from conftest import assert_one_line_user_error

from accutrain.core.batches import BatchFormat
from accutrain.core.losses.dpo import dpo
from accutrain.core.losses.kto import kto
from accutrain.data.hf_data import hf_data
from accutrain.data.text import text_data
from accutrain.data.tokenizer import ByteTokenizer
from accutrain.train.show_sample import preference_sample

PLAIN = {"prompt": "the cat", "chosen": " sat", "rejected": " ran away"}
CHAT = {"prompt": [{"role": "user", "content": "hi there"}], "chosen": [{"role": "assistant", "content": "hello"}],
        "rejected": [{"role": "assistant", "content": "go away"}]}


def write(path, records):
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in records))
    return str(path)


def read(path, reader="text", **kw):
    if reader == "text":
        return text_data(path, path, 0.1, "bytes", kw.get("max_length", 64), False, "longest", "text", "prompt",
                         "response", "label", 0, truncation=kw.get("truncation", "drop"))
    return hf_data(path, val=path, max_length=kw.get("max_length", 64))


def completion_text(item, role):
    ids, labels = item[f"{role}.input_ids"].tolist(), item[f"{role}.labels"].tolist()
    return bytes(t for t, label in zip(ids, labels) if label != -100 and t < 256).decode()


@pytest.mark.parametrize("reader", ["text", "hf"])
def test_pairs_plain_and_conversational_label_the_completions_only(tmp_path, reader):
    path = write(tmp_path / "pairs.jsonl", [PLAIN, PLAIN | {"prompt": "a dog"}] if reader == "hf" else [PLAIN, CHAT])
    data = read(path, reader)
    first = data.train[0]
    assert completion_text(first, "chosen") == " sat" and completion_text(first, "rejected") == " ran away"
    assert first["chosen.input_ids"][:7].tolist() == list(b"the cat")  # the prompt's tokens, shared, not labelled
    if reader == "text":  # the byte tokenizer's template: the assistant's turn is what is labelled
        chat = data.train[1]
        assert completion_text(chat, "chosen") == "hello\n" and completion_text(chat, "rejected") == "go away\n"
        assert b"hi there" in bytes(t for t in chat["chosen.input_ids"].tolist() if t < 256)
    batch = BatchFormat(data.collate)([data.train[i] for i in range(len(data.train))])
    assert len(batch) == len(data.train)  # a pair is one sample
    assert set(batch.inputs) >= {"chosen.input_ids", "rejected.input_ids", "chosen.labels", "rejected.labels"}


def test_micro_tokens_counts_both_sequences_of_a_pair(tmp_path):
    from accutrain.data.lengths import token_lengths

    data = read(write(tmp_path / "pairs.jsonl", [PLAIN, PLAIN | {"prompt": "a"}]))
    tokens = token_lengths(data, BatchFormat(data.collate), 200)
    item = data.train[0]
    assert tokens.totals[0] == len(item["chosen.input_ids"]) + len(item["rejected.input_ids"])


@pytest.mark.parametrize("record, fragment", [
    (PLAIN | {"rejected": " sat"}, "bad.jsonl:2: its chosen equals its rejected"),
    (PLAIN | {"chosen": "  "}, "bad.jsonl:2: the chosen is empty"),
    ({"prompt": "a", "chosen": "b"}, "bad.jsonl:2 has no 'rejected'"),
    ({"prompt": "a", "completion": " b", "label": "yes"}, "bad.jsonl:2: label is 'yes'"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}, "the prompt is a list"),
])
def test_a_bad_record_is_one_line_naming_it(tmp_path, record, fragment):
    first = {"prompt": "x", "completion": " y", "label": True} if "completion" in record else PLAIN
    path = write(tmp_path / "bad.jsonl", [first, record])
    with pytest.raises(Exception) as e:
        read(path)
    assert_one_line_user_error(e.value, fragment)


def test_records_left_without_a_completion_token_are_dropped_and_counted(tmp_path, caplog):
    long = PLAIN | {"prompt": "x" * 40}
    path = write(tmp_path / "pairs.jsonl", [PLAIN, long, PLAIN | {"prompt": "a"}])
    with caplog.at_level(logging.INFO, logger="accutrain"):
        data = read(path, max_length=20)
    assert len(data.train) == 2 and "1 left with no trained token and dropped" in caplog.text
    with pytest.raises(Exception) as e:
        read(path, max_length=20, truncation="error")
    assert_one_line_user_error(e.value, "pairs.jsonl:2")


def test_feedback_of_one_class_is_warned(tmp_path, caplog):
    path = write(tmp_path / "fb.jsonl", [{"prompt": "a", "completion": " b", "label": True}] * 3)
    with caplog.at_level(logging.WARNING, logger="accutrain"):
        data = read(path)
    assert "every training record is desirable" in caplog.text
    assert int(data.train[0]["desirable"]) == 1 and int(data.train[0]["prompt.length"]) == 1


def test_pair_data_with_a_feedback_loss_and_the_reverse_are_one_line(tmp_path):
    pairs = read(write(tmp_path / "pairs.jsonl", [PLAIN, PLAIN | {"prompt": "b"}]))
    feedback = read(write(tmp_path / "fb.jsonl", [{"prompt": "a", "completion": " b", "label": True}] * 2))
    for data, loss, fragment in ((pairs, kto(), "loss=kto trains on feedback records"),
                                 (feedback, dpo(), "loss=dpo trains on preference pairs")):
        batch = BatchFormat(data.collate)([data.train[0]])
        with pytest.raises(Exception) as e:
            loss.probe(batch)
        assert_one_line_user_error(e.value, fragment)
    with pytest.raises(Exception) as e:
        dpo(beta=0)
    assert_one_line_user_error(e.value, "loss.beta=0")


def test_show_sample_marks_a_pairs_completions(tmp_path):
    data = read(write(tmp_path / "pairs.jsonl", [PLAIN, PLAIN | {"prompt": "b"}]))
    shown = preference_sample(data.train[0], ByteTokenizer(), -100, "head")
    assert "── chosen:" in shown and "the cat⟦ sat<eos>⟧" in shown and "the cat⟦ ran away<eos>⟧" in shown
    assert isinstance(data.train[0]["labels"], torch.Tensor)


@pytest.mark.parametrize("name", ["qwen25", "qwen3_like", "last_turn_block", "history_without_reasoning", "markers"])
def test_conversational_completions_are_labelled_whatever_the_template(name):
    """A multi-turn prompt and an assistant completion: the completion's content lies in the labelled tokens, the
    prompt's turns (its own assistant turn too) do not, with templates that break the prefix property."""
    pytest.importorskip("transformers")
    from chat_templates import TEMPLATES, bpe_tokenizer

    from accutrain.data.preference import Encoder
    from accutrain.data.template import chat_template

    tok = bpe_tokenizer(TEMPLATES[name])
    encode = Encoder(tok, lambda: chat_template(tok, "bpe"), -100)
    prompt = [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "on a mat"},
              {"role": "user", "content": "and the dog"}]
    for completion in ("ran far away", "sat on a red mat"):
        ids, labels, k = encode(prompt, [{"role": "assistant", "content": completion}], "p.jsonl:1", "chosen")
        labelled = tok.decode([t for t, label in zip(ids, labels) if label != -100])
        assert completion in labelled and "on a mat" not in labelled and "dog" not in labelled
        assert all(label == -100 for label in labels[:k]) and tok.decode(ids[:k]).count("the dog") == 1
