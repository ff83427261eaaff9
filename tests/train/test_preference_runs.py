"""loss=dpo and loss=kto as a user runs them (model=hf_causal_lm from a config, LoRA, data=text .jsonl): the weights
of micro_batch=2 accum=4, and of 2 gloo ranks, equal micro_batch=8's, with an uneven last window (19 samples: windows
of 8, 8, 3); KTO at micro_batch=1 accum=8 too; the window's figures in metrics.jsonl; the held-out rewards followed by
trainer.monitor=auto."""
import json
import random

import pytest
from conftest import assert_same_weights, final_weights, read_metrics, train_here

pytest.importorskip("transformers")
pytest.importorskip("peft")

WORDS = "the cat sat on a mat and dog ran far away big small red blue".split()
LLAMA = ["model=hf_causal_lm", "+model.config.model_type=llama", "+model.config.hidden_size=32",
         "+model.config.intermediate_size=64", "+model.config.num_hidden_layers=2",
         "+model.config.num_attention_heads=2", "+model.config.num_key_value_heads=2",
         "+model.config.max_position_embeddings=128", "model.dropout=0", "model.adapter=lora",
         "model.lora.target_modules=[q_proj,v_proj]", "data=text", "data.max_length=64", "optim=sgd", "optim.lr=0.5",
         "optim.momentum=0", "optim.weight_decay=0", "sched=constant", "trainer.epochs=1", "trainer.progress=false"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d, r = tmp_path_factory.mktemp("records"), random.Random(1)

    def phrase(lo, hi):
        return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))

    for split, n in (("train", 19), ("val", 4)):
        pairs = [{"prompt": phrase(1, 4), "chosen": " " + phrase(1, 5), "rejected": " " + phrase(2, 6) + " no"}
                 for _ in range(n)]
        feedback = [{"prompt": phrase(1, 4), "completion": " " + phrase(1, 6), "label": i % 3 != 0}
                    for i in range(n)]
        (d / f"pairs_{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in pairs))
        (d / f"feedback_{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in feedback))
    return d


def args(files, kind, *more):
    return [*LLAMA, f"data.train={files}/{kind}_train.jsonl", f"data.val={files}/{kind}_val.jsonl", *more]


@pytest.mark.slow
@pytest.mark.parametrize("loss", [["loss=dpo", "loss.beta=0.5", "loss.nll_coef=0.5"],
                                  ["loss=kto", "loss.beta=0.5", "loss.undesirable_weight=1.33"]])
def test_accumulated_and_two_rank_runs_equal_the_big_batch(files, tmp_path, loss):
    kind = "pairs" if loss[0] == "loss=dpo" else "feedback"
    big, _ = train_here(tmp_path, "big", *args(files, kind, *loss, "micro_batch=8"))
    acc, _ = train_here(tmp_path, "acc", *args(files, kind, *loss, "micro_batch=2", "accum=4"))
    two, _ = train_here(tmp_path, "two", *args(files, kind, *loss, "devices=2", "micro_batch=2", "accum=2"))
    assert_same_weights(final_weights(acc), final_weights(big))
    assert_same_weights(final_weights(two), final_weights(big))
    steps, evals = read_metrics(two)
    assert [r["samples"] for r in steps] == [8, 8, 3]
    figure = "rewards_accuracy" if kind == "pairs" else "kl"
    for ours, theirs in zip(steps, read_metrics(big)[0]):  # the window's figures, whatever the split
        assert ours[figure] == pytest.approx(theirs[figure], abs=1e-6)
    assert "val_rewards_accuracy" in evals[-1] if kind == "pairs" else "val_kl" in evals[-1]
    if kind == "feedback":
        one, _ = train_here(tmp_path, "one", *args(files, kind, *loss, "micro_batch=1", "accum=8"))
        assert_same_weights(final_weights(one), final_weights(big))


def test_monitor_auto_follows_the_held_out_reward_accuracy(files, tmp_path):
    run, log = train_here(tmp_path, "dpo", *args(files, "pairs", "loss=dpo", "micro_batch=4", "accum=2"))
    assert "best val_rewards_accuracy" in log and "rewards: chosen" in log
    steps, evals = read_metrics(run)
    assert {"rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy"} <= set(steps[0])
