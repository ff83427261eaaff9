"""Fine-tuning Hugging Face models exactly: model=hf_causal_lm|hf_seq_cls on data=text, mapping batches padded per
micro-batch, the stand-in batch of a rank whose share of a short window is empty, and the warnings for what would
otherwise fail silently. Tiny GPT-2s built from configs (no download), on text files written here, tokenized by
the built-in byte tokenizer."""
import json
import random
import re

import pytest
import torch
from conftest import (
    assert_identical,
    assert_one_line_user_error,
    assert_same_weights,
    final_weights,
    killed_at_step,
    read_metrics,
    run_of,
    train_here,
)
from torch import nn

from accutrain.core.batches import Batch, BatchFormat, PadCollate, stand_in_guard
from accutrain.core.losses.cross_entropy import SummedLoss
from accutrain.core.step import accumulate, cut_micro_batches
from accutrain.data.text import text_data
from accutrain.data.tokenizer import ByteTokenizer
from accutrain.errors import UserError
from accutrain.models.factories import build_model

transformers = pytest.importorskip("transformers")

GPT2 = ["+model.config.model_type=gpt2", "+model.config.n_layer=2", "+model.config.n_head=2",
        "+model.config.n_embd=32", "+model.config.n_positions=64"]
SGD = ["optim=sgd", "optim.lr=0.2", "optim.momentum=0", "optim.weight_decay=0", "trainer.progress=false"]
WORDS = "the cat sat on a mat and dog ran far away big small red blue über café".split()


def sentences(n, seed):
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(2, 9))) for _ in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """41 training samples: windows of 16 end with one of 9, cut [4, 4, 1] into micro-batches of 4, so with
    devices=2 rank 1 has nothing at the last micro-step; 35 (a tail of 3): rank 1's whole share is empty."""
    d = tmp_path_factory.mktemp("text")
    (d / "lm.txt").write_text("\n".join(sentences(41, 1)) + "\n")
    (d / "lm_val.txt").write_text("\n".join(sentences(5, 2)) + "\n")
    for name, n, seed in (("cls.jsonl", 35, 3), ("cls_val.jsonl", 6, 4)):
        (d / name).write_text("".join(json.dumps({"text": s, "label": "long" if len(s) > 25 else "short"}) + "\n"
                                      for s in sentences(n, seed)))
    return d


def lm(files, *args):
    return ["model=hf_causal_lm", *GPT2, "model.dropout=0", "data=text", f"data.train={files / 'lm.txt'}",
            f"data.val={files / 'lm_val.txt'}", "data.max_length=64", *SGD, "trainer.epochs=2", *args]


def cls(files, *args):
    return ["model=hf_seq_cls", *GPT2, "model.dropout=0", "data=text", f"data.train={files / 'cls.jsonl'}",
            f"data.val={files / 'cls_val.jsonl'}", "data.max_length=64", *SGD, "trainer.epochs=2", *args]


@pytest.fixture(scope="module")
def big_lm(files, tmp_path_factory):
    """The big-batch causal LM run, exported: (run directory, log)."""
    return train_here(tmp_path_factory.mktemp("big"), "big", *lm(files, "micro_batch=16", "trainer.export=hf",
                                                                 "trainer.log_every=1"))


# --- exactness --------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("task", ["lm", "cls"])
def test_accumulated_and_two_device_runs_equal_the_big_batch(files, big_lm, tmp_path, task):
    args = lm if task == "lm" else cls
    big = big_lm[0] if task == "lm" else train_here(tmp_path, "big", *args(files, "micro_batch=16"))[0]
    acc, _ = train_here(tmp_path, "acc", *args(files, "micro_batch=4", "accum=4"))
    two, _ = train_here(tmp_path, "two", *args(files, "devices=2", "micro_batch=4", "accum=2"))
    moved = train_here(tmp_path, "other", *args(files, "micro_batch=16", "seed=1"))[0]
    assert_same_weights(final_weights(acc), final_weights(big))
    assert_same_weights(final_weights(two), final_weights(big))  # rank 1 forwarded a stand-in, which added nothing
    assert any(not torch.allclose(final_weights(moved)[k], final_weights(big)[k]) for k in final_weights(big))
    steps = read_metrics(two)[0]
    assert [r["grad_syncs"] for r in steps] == [1] * len(steps)  # one gradient all-reduce per window, stand-in too
    assert [r["samples"] for r in steps] == ([16, 16, 9] if task == "lm" else [16, 16, 3]) * 2
    if task == "lm":  # tokens, counted after the shift, the same however the window is cut
        assert [r["elements"] for r in steps] == [r["elements"] for r in read_metrics(big)[0]]
        assert [r["elements"] for r in steps] == [r["elements"] for r in read_metrics(acc)[0]]


def test_unshifted_labels_with_shift_labels_equal_pre_shifted_ones(files, big_lm, tmp_path, monkeypatch):
    """data=text gives labels = input_ids (the model's convention) and the loss shifts them; pre-shifted labels
    with loss.shift_labels=false take the same steps. Left unshifted, a warning says so."""
    monkeypatch.setattr("accutrain.data.text.text_data", preshifted)
    ours, _ = train_here(tmp_path, "pre", *lm(files, "micro_batch=16", "loss.shift_labels=false"))
    assert_same_weights(final_weights(ours), final_weights(big_lm[0]))


def preshifted(**kwargs):
    """data=text with each sample's labels shifted left already (the last position ignored)."""
    data = text_data(**kwargs)
    for split in (data.train, data.val):
        for item in split.items:
            item["labels"] = torch.cat([item["labels"][1:], torch.tensor([kwargs["ignore_index"]])])
    return data


def test_unshifted_labels_are_warned_about(files, tmp_path):
    _, log = train_here(tmp_path, "raw", *lm(files, "micro_batch=4", "accum=4", "loss.shift_labels=false",
                                             "trainer.max_steps=1"))
    assert "the targets equal the inputs at 100% of the first window's positions" in log
    assert "set loss.shift_labels=true" in log


def test_dynamic_padding_equals_padding_to_max_length(files, tmp_path):
    longest, _ = train_here(tmp_path, "longest", *lm(files, "micro_batch=4", "accum=4"))
    padded, _ = train_here(tmp_path, "padded", *lm(files, "micro_batch=4", "accum=4", "data.padding=max_length"))
    assert_same_weights(final_weights(longest), final_weights(padded))  # SDPA's blocking differs: float tolerance
    assert read_metrics(longest)[0] and [r["elements"] for r in read_metrics(longest)[0]] == \
        [r["elements"] for r in read_metrics(padded)[0]]


SLOW_HF = """
import time
from accutrain.models.hf import causal_lm

def net(delay=0.0, **kwargs):
    model = causal_lm(**kwargs)
    forward = model.forward
    def slow(**inputs):
        if model.training:
            time.sleep(delay)
        return forward(**inputs)
    model.forward = slow
    return model
"""


@pytest.mark.long  # a feature's resume: the LoRA one runs every time
@pytest.mark.slow
def test_sigkill_and_resume_is_bit_identical(files, tmp_path, monkeypatch):
    """The model's own dropout (0.1) on: its RNG state comes back too. Only the killed run needs a process."""
    (tmp_path / "slow_hf.py").write_text(SLOW_HF)
    monkeypatch.syspath_prepend(tmp_path)  # for the runs in this process; the CLI imports from its working directory
    args = [a for a in lm(files, "micro_batch=4", "accum=2", "trainer.checkpoint_every=1")
            if a not in ("model=hf_causal_lm", "model.dropout=0")]
    args = ["model=custom", "model._target_=slow_hf.net", *args]
    reference, _ = train_here(tmp_path, "reference", *args)
    killed_at_step(tmp_path, "killed", 4, *args, "+model.delay=0.05")
    resumed, log = train_here(tmp_path, "killed", *args, "resume=auto")
    assert "resumed from" in log
    assert_identical(final_weights(resumed), final_weights(reference))
    assert [r["step"] for r in read_metrics(resumed)[0]] == list(range(1, 13))  # 2 epochs of 6 windows


# --- export and checkpoints ---------------------------------------------------------------------------------------
def test_export_loads_back_with_from_pretrained_and_checkpoints_have_plain_keys(big_lm):
    run_dir, log = big_lm
    exported = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf").train(False)
    weights = final_weights(run_dir)
    assert "transformer.wte.weight" in weights and not any(k.startswith("model.") for k in weights)
    bare = transformers.AutoModelForCausalLM.from_config(exported.config).train(False)
    bare.load_state_dict(weights)  # a checkpoint's weights load into the bare Hugging Face model
    tokenizer = transformers.AutoTokenizer.from_pretrained(run_dir / "hf")
    text = ["the café", "a big red dog ran far"]
    assert tokenizer(text)["input_ids"] == ByteTokenizer()(text)["input_ids"]
    ids = torch.tensor([tokenizer(text[1])["input_ids"]])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, bare(ids).logits)
    assert "tokens/s" in log and "ppl" in log and "val_ppl" in log and "259 tokens in the vocabulary" in log
    assert re.search(r"done: .* samples seen in [\d.]+ s: \d+ samples/s \(\d+ tokens/s\) overall", log)
    evals = read_metrics(run_dir)[1]
    assert evals[-1]["val_ppl"] == pytest.approx(torch.tensor(evals[-1]["val_loss"]).exp().item(), rel=1e-6)
    assert all("tokens_per_s" in r and "ppl" in r for r in read_metrics(run_dir)[0])


def test_check_groups_below_the_adapter_and_finds_the_hf_model_faithful(files, compose):
    from accutrain.train.check import components_for_check, run_check

    result = run_check(components_for_check(run_of(*lm(files, "micro_batch=4", "accum=4"))))
    assert result.faithful, result.lines()
    assert {"wte", "wpe", "h", "ln_f"} == set(result.groups)


# --- the stand-in --------------------------------------------------------------------------------------------------
def test_a_stand_in_adds_exact_zeros_even_with_a_nan_loss_and_leaves_buffers_and_rng_alone():
    """BatchNorm's running statistics and dropout's RNG: a stand-in leaves no trace on training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    x, y, cpu = torch.randn(6, 3), torch.randint(2, (6,)), torch.device("cpu")
    real, stand_in = Batch(x[:4], y[:4]), Batch(x[4:] * float("inf"), y[4:], stand_in=True)  # a NaN loss
    buffers, rng = [b.clone() for b in model.buffers()], torch.get_rng_state()
    loss = accumulate(model, [stand_in], terms=4, device=cpu)  # the synchronising micro-batch: forwarded
    assert loss.sum() == 0 and all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())  # not NaN
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers))  # running statistics restored
    assert torch.equal(torch.get_rng_state(), rng)  # dropout's draws forked away
    torch.manual_seed(1)
    accumulate(model, [real], terms=4, device=cpu)
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    accumulate(model, [real, stand_in], terms=4, device=cpu)
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    assert SummedLoss(elements=False).terms([real, stand_in]) == 4  # the stand-in counts nothing
    with stand_in_guard(model, cpu):  # the guard alone: whatever flows back, .grad receives zeros
        model(torch.randn(2, 3)).sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))


def test_a_stand_in_under_no_sync_is_skipped():
    model = nn.Linear(3, 2)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    batches = [Batch(torch.randn(2, 3), torch.zeros(2, dtype=torch.int64), stand_in=True),
               Batch(torch.randn(2, 3), torch.zeros(2, dtype=torch.int64))]
    accumulate(model, batches, terms=2, device=torch.device("cpu"))
    assert len(calls) == 1  # the stand-in was not the synchronising micro-batch: nothing to take part in


# --- mapping batches -----------------------------------------------------------------------------------------------
def test_mapping_batches_pad_per_micro_batch_and_split_consistently():
    collate = BatchFormat(PadCollate(dict(input_ids=256, attention_mask=0, labels=-100)), ("input_ids",))
    items = [dict(input_ids=torch.arange(n), attention_mask=torch.ones(n, dtype=torch.int64), labels=torch.arange(n))
             for n in (3, 5, 2)]
    batch = collate(items)
    assert list(batch.inputs) == ["input_ids"] and batch.inputs["input_ids"].shape == (3, 5)
    assert batch.inputs["input_ids"][2].tolist() == [0, 1, 256, 256, 256]
    assert batch.target[2].tolist() == [0, 1, -100, -100, -100]
    parts = list(cut_micro_batches([batch], 2))  # the out-of-memory re-split: every tensor cut the same way
    assert [len(p) for p in parts] == [2, 1]
    assert torch.equal(parts[1].inputs["input_ids"], batch.inputs["input_ids"][2:])
    assert SummedLoss(True, -100).terms(parts) == 10 and SummedLoss(True, -100, True).terms(parts) == 7
    with pytest.raises(UserError, match="loader.target_key=target"):
        BatchFormat(PadCollate({}), None, "target")(items)


def test_text_data_masks_prompts_packs_and_holds_out_by_seed(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i}: ", "response": "ok"}) + "\n" for i in range(10)))
    common = dict(val=None, val_fraction=0.2, tokenizer="bytes", max_length=8, padding="longest", text_field="text",
                  prompt_field="prompt", response_field="response", label_field="label", seed=0, ignore_index=-100)
    data = text_data(str(path), packing=False, **common)
    ids, labels = data.train[0]["input_ids"].tolist(), data.train[0]["labels"].tolist()
    assert bytes(ids[:-1]).decode() in {f"Q{i}: ok" for i in range(10)} and ids[-1] == 257  # UTF-8 bytes, EOS
    assert labels == [-100] * 4 + list(b"ok") + [257]  # the prompt is not learnt
    assert len(data.train) == 8 and len(data.val) == 2
    again = text_data(str(path), packing=False, **{**common, "seed": 0})
    other = text_data(str(path), packing=False, **{**common, "seed": 5})
    assert [x["input_ids"].tolist() for x in again.val] == [x["input_ids"].tolist() for x in data.val]
    assert [x["input_ids"].tolist() for x in other.val] != [x["input_ids"].tolist() for x in data.val]
    packed = text_data(str(path), packing="concat", **common)  # the samples end to end, cut every 8 tokens
    assert all(len(x["input_ids"]) == 8 for x in list(packed.train)[:-1]) and len(packed.train) == 7  # 56 tokens
    assert data.num_classes == 259 and data.extra["pad_token_id"] == 256


# --- silent failures, now loud ---------------------------------------------------------------------------------------
class ClassesLast(nn.Module):
    """A per-token model returning (batch, length, classes): right only when cross_entropy's layout is not needed."""

    def __init__(self, num_classes=6):
        super().__init__()
        self.embed = nn.Embedding(10, num_classes)

    def forward(self, x):
        return self.embed(x)


def test_classes_last_is_caught_also_when_the_length_equals_the_class_count():
    x = torch.randint(10, (2, 6))  # length 6 = 6 classes: (2, 6, 6) looks right
    with pytest.raises(UserError) as info:
        build_model({"_target_": f"{__name__}.ClassesLast"}, (6,), 6, example=Batch(x, x % 6))
    assert_one_line_user_error(info.value, "classes are last", "transpose(1, 2)", "checked again on 5 positions")


def test_a_model_output_object_and_any_probe_exception_are_one_line():
    example = BatchFormat(PadCollate({}))([dict(input_ids=torch.arange(4), labels=torch.tensor(1))] * 2)
    with pytest.raises(UserError) as info:
        build_model({"_target_": f"{__name__}.bare_gpt2"}, (4,), 3, example=example)
    assert_one_line_user_error(info.value, "model test_hf.bare_gpt2 returns a SequenceClassifierOutputWithPast",
                               "model=hf_causal_lm or model=hf_seq_cls", ".logits")
    with pytest.raises(UserError) as info:
        build_model({"_target_": f"{__name__}.Refuses"}, (4,), 3, example=example)
    assert_one_line_user_error(info.value, "the model test_hf.Refuses raised ValueError: no thanks in forward, on a "
                               "batch of 2 4 inputs")


def bare_gpt2(num_classes):
    return transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=16, num_labels=num_classes, pad_token_id=0))


class Refuses(nn.Module):
    def __init__(self, num_classes):
        super().__init__()

    def forward(self, input_ids):
        raise ValueError("no thanks")


def test_hf_dropout_with_accumulation_is_warned_about_at_start(files, tmp_path):
    args = [a for a in lm(files, "micro_batch=4", "accum=4", "trainer.max_steps=1") if a != "model.dropout=0"]
    _, log = train_here(tmp_path, "dropout", *args)
    assert "dropout layers are active" in log and "model.dropout=0" in log


def test_seed_reaches_custom_data_and_shift_labels_needs_token_targets(tmp_path, files):
    _, log = train_here(tmp_path, "seeded", "model=mlp", "model.hidden=[8]", "data=custom", "seed=7",
                        f"data._target_={__name__}.seeded", "micro_batch=8", "trainer.max_steps=1")
    assert "seeded with 7" in log
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "cls", *cls(files, "micro_batch=4", "loss.shift_labels=true", "trainer.max_steps=1"))
    assert_one_line_user_error(info.value, "loss.shift_labels=true needs a target per token")


def seeded(seed):
    """A data=custom factory taking the run's seed."""
    from accutrain.data.datasets import synthetic

    data = synthetic(40, 8, 8, 3, 1, 1.0, seed)
    data.description = f"seeded with {seed}"
    return data


def test_missing_transformers_and_unloadable_names_are_one_line(monkeypatch):
    from accutrain.models import hf_load

    with pytest.raises(UserError) as info:
        hf_load.load("AutoModelForCausalLM", name_or_path="./no/such/dir")
    assert_one_line_user_error(info.value, "model.name_or_path=./no/such/dir: no such directory")
    with pytest.raises(UserError) as info:  # HF_HUB_OFFLINE=1 (conftest): not cached, and no network
        hf_load.load("AutoModelForCausalLM", name_or_path="accutrain-tests/not-a-model")
    assert_one_line_user_error(info.value, "model.name_or_path=accutrain-tests/not-a-model could not be loaded")
    with pytest.raises(UserError) as info:
        hf_load.load("AutoModelForCausalLM")
    assert_one_line_user_error(info.value, "+model.config.model_type=gpt2")
    with pytest.raises(UserError) as info:
        hf_load.load("AutoModelForCausalLM", config={"model_type": "gpt2", "n_layers": 2})
    assert_one_line_user_error(info.value, "model.config.n_layers: GPT2Config has no such key (did you mean n_layer?)")
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(UserError) as info:
        hf_load.load("AutoModelForSequenceClassification", config={"model_type": "gpt2"})
    assert_one_line_user_error(info.value, "model=hf_seq_cls needs the transformers package",
                               "pip install 'accutrain[hf]'")


def test_dropout_zero_reaches_what_no_dropout_layer_holds():
    """Llama keeps its attention dropout as a float handed to SDPA: found by the warning, zeroed by model.dropout=0."""
    from accutrain.models import hf_dropout
    from accutrain.models.pitfalls import dropout_layers

    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=16,
                                      attention_dropout=0.5)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(16, (2, 5))

    def twice():
        torch.manual_seed(0)
        first = model(input_ids=ids).logits
        torch.manual_seed(1)
        return torch.equal(first, model(input_ids=ids).logits)

    assert dropout_layers(model) == ["model.layers.0.self_attn"] and not twice()
    assert hf_dropout.set_dropout_config(config, 0.0) == ["attention_dropout"]
    assert hf_dropout.set_dropout_modules(model, 0.0) >= 1
    assert dropout_layers(model) == [] and twice()


@pytest.mark.slow
def test_per_sequence_loss_is_exact_under_any_split_and_across_ranks(files, big_lm, tmp_path):
    """loss.normalize=sequences: the mean over the window's sequences of each one's token mean; its |W| is the
    window's samples, so rank 1's empty last micro-step (a stand-in) adds nothing."""
    args = ("loss.normalize=sequences",)
    big, log = train_here(tmp_path, "big", *lm(files, *args, "micro_batch=16"))
    assert "best val_loss" in log  # trainer.monitor=auto: a language model's loss, per sequence too
    acc, _ = train_here(tmp_path, "acc", *lm(files, *args, "micro_batch=4", "accum=4"))
    two, _ = train_here(tmp_path, "two", *lm(files, *args, "devices=2", "micro_batch=4", "accum=2"))
    assert_same_weights(final_weights(acc), final_weights(big))
    assert_same_weights(final_weights(two), final_weights(big))
    tokens = final_weights(big_lm[0])  # the token mean takes other steps
    assert any(not torch.allclose(tokens[k], final_weights(big)[k]) for k in tokens)
