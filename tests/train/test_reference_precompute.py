"""loss.reference=precompute (issue 50): the reference log-probabilities taken in one pass before training and kept in
run_dir/reference.pt give the LoRA reference's step; a run killed with SIGKILL resumes bit-identically reading the file
back (not taking it again); a resume on changed data, or on another base, is refused in one line."""
import json
import os
import random

import pytest
import torch
from conftest import (
    assert_identical,
    assert_one_line_error,
    final_weights,
    killed_at_step,
    read_metrics,
    train_here,
    train_run,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from accutrain.core.batches import BatchFormat  # noqa: E402
from accutrain.core.losses.dpo import dpo  # noqa: E402
from accutrain.core.losses.precomputed import Splits, prepare_table  # noqa: E402
from accutrain.core.step import FP32  # noqa: E402
from accutrain.data.text import text_data  # noqa: E402
from accutrain.errors import UserError  # noqa: E402
from accutrain.store.checkpoint import save_atomic  # noqa: E402

WORDS = "the cat sat on a mat and dog ran far away big small red blue".split()
LLAMA = ["model=hf_causal_lm", "+model.config.model_type=llama", "+model.config.hidden_size=32",
         "+model.config.intermediate_size=64", "+model.config.num_hidden_layers=2",
         "+model.config.num_attention_heads=2", "+model.config.num_key_value_heads=2",
         "+model.config.max_position_embeddings=128", "model.dropout=0", "model.adapter=lora",
         "model.lora.target_modules=[q_proj,v_proj]", "data=text", "data.max_length=64", "optim=sgd", "optim.lr=0.5",
         "optim.momentum=0", "optim.weight_decay=0", "sched=constant", "trainer.progress=false", "loss=dpo",
         "loss.beta=0.5", "loss.reference=precompute", "micro_batch=2", "accum=2", "trainer.checkpoint_every=1"]
TAKEN = "loss.reference=precompute took the reference log-probabilities"


def records(path, n, seed):
    r = random.Random(seed)

    def phrase(lo, hi):
        return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))

    pairs = [{"prompt": phrase(1, 4), "chosen": " " + phrase(1, 5), "rejected": " " + phrase(2, 6) + " no"}
             for _ in range(n)]
    path.write_text("".join(json.dumps(x) + "\n" for x in pairs))
    return path


def tiny_lora():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=160)
    from accutrain.models.hf import HFCausalLM

    model = HFCausalLM(peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])))
    with torch.no_grad():  # B = 0 would make the policy the reference: move it off
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def first_step(data, reference):
    """The LoRA weights after one SGD step on the first window of 8 (micro-batches of 2), and its loss."""
    model, loss, fmt = tiny_lora(), dpo(beta=0.5, reference=reference), BatchFormat(data.collate)
    loss.attach(model)
    splits = Splits(train=data.train, collate=fmt, rows=3, held_out=(), directory=None, base="tiny", save=None)
    lines = loss.prepare(model, splits, torch.device("cpu"), FP32)
    assert (loss.ref is None and len(lines) == 1) if reference == "precompute" else (loss.ref is not None and not lines)
    batches = [fmt([data.train[i] for i in range(k, k + 2)]) for k in range(0, 8, 2)]
    summed = loss.accumulate(model, batches, 8, torch.device("cpu"))
    return {n: (p - 0.5 * p.grad).detach() for n, p in model.named_parameters() if p.requires_grad}, summed


def test_the_precomputed_reference_gives_the_lora_references_first_step(tmp_path):
    path = records(tmp_path / "pairs.jsonl", 12, 0)
    data = text_data(str(path), str(path), 0.1, "bytes", 64, False, "longest", "text", "prompt", "response", "label", 0)
    lora, lora_loss = first_step(data, "model")
    kept, kept_loss = first_step(data, "precompute")
    assert abs(lora_loss.item() - kept_loss.item()) < 1e-6
    assert max((lora[n] - kept[n]).abs().max().item() for n in lora) < 1e-6
    assert max(p.abs().max().item() for p in lora.values()) > 0.01  # the step moved something


@pytest.mark.slow
def test_a_killed_precompute_run_resumes_bit_identical_without_taking_it_again(tmp_path):
    run = [*LLAMA, f"data.train={records(tmp_path / 'train.jsonl', 24, 1)}",
           f"data.val={records(tmp_path / 'val.jsonl', 4, 2)}", "trainer.epochs=6"]
    reference, log = train_here(tmp_path, "reference", *run)
    assert TAKEN in log and (reference / "reference.pt").is_file()
    killed = killed_at_step(tmp_path, "killed", 4, *run)
    kept = os.stat(killed / "reference.pt")
    resumed, proc = train_run(tmp_path, "killed", *run, "resume=auto")
    assert "resumed from" in proc.stderr and "read back from" in proc.stderr and TAKEN not in proc.stderr
    now = os.stat(resumed / "reference.pt")
    assert (now.st_ino, now.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)  # not written again
    assert_identical(final_weights(resumed), final_weights(reference))
    assert [r["loss"] for r in read_metrics(resumed)[0]] == [r["loss"] for r in read_metrics(reference)[0]]


@pytest.mark.slow
def test_a_resume_on_changed_data_is_refused_in_one_line(tmp_path):
    train = records(tmp_path / "train.jsonl", 16, 1)
    run = [*LLAMA, f"data.train={train}", "trainer.epochs=1"]
    first, _ = train_here(tmp_path, "run", *run)
    before = (first / "reference.pt").read_bytes()
    records(train, 16, 3)  # the same size, other tokens
    _, proc = train_run(tmp_path, "run", *run, "resume=auto", "trainer.epochs=2", check=False)
    assert_one_line_error(proc, "reference.pt holds the reference log-probabilities of another training split",
                          "14 samples", "the data changed since")
    assert (first / "reference.pt").read_bytes() == before


def test_the_file_is_read_back_and_refused_for_another_base(tmp_path):
    path = records(tmp_path / "pairs.jsonl", 6, 0)
    data = text_data(str(path), str(path), 0.1, "bytes", 64, False, "longest", "text", "prompt", "response", "label", 0)
    calls = []

    def logps(batch):
        calls.append(len(batch))
        return [({k: batch.inputs[f"{r}.{k}"] for k in ("input_ids", "attention_mask")}, batch.inputs[f"{r}.labels"],
                 torch.arange(float(len(batch)))) for r in ("chosen", "rejected")]

    def splits(base):
        return Splits(train=data.train, collate=BatchFormat(data.collate), rows=2, held_out=(), directory=tmp_path,
                      base=base, save=save_atomic)

    taken, _ = prepare_table(splits("a"), logps, "dpo", torch.device("cpu"))
    assert calls and (tmp_path / "reference.pt").is_file()
    calls.clear()
    again, lines = prepare_table(splits("a"), logps, "dpo", torch.device("cpu"))
    assert not calls and "read back from" in lines[0] and again.values == taken.values
    with pytest.raises(UserError, match="another base \\(weights a; this run's: b\\)"):
        prepare_table(splits("b"), logps, "dpo", torch.device("cpu"))
    (tmp_path / "reference.pt").write_bytes(b"not a torch file")
    with pytest.raises(UserError, match="cannot be read .*remove it"):
        prepare_table(splits("a"), logps, "dpo", torch.device("cpu"))
