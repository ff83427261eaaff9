"""loss=moe end to end: a tiny random Mixtral built from a config (no download) on text of varying lengths, padded per
micro-batch, windows of 16, 16 and an incomplete 9. The router's balancing loss over the window takes the big batch's
steps however the window is cut — on one device, on two gloo ranks, with activation checkpointing, with LoRA — and
balancing each micro-batch alone does not; what a user watches per step; accutrain-check; the refusals only the
model shows; a kill mid-run resumes bit-identically."""
from __future__ import annotations

import csv
import random
import re

import pytest
import test_hf
from conftest import (
    assert_identical,
    assert_one_line_error,
    final_weights,
    killed_at_step,
    read_metrics,
    run_cli,
    run_of,
    train_here,
)

pytest.importorskip("transformers")

MIXTRAL = ["model=hf_causal_lm", "+model.config.model_type=mixtral", "+model.config.hidden_size=32",
           "+model.config.intermediate_size=48", "+model.config.num_hidden_layers=2",
           "+model.config.num_attention_heads=2", "+model.config.num_key_value_heads=2",
           "+model.config.num_local_experts=4", "+model.config.num_experts_per_tok=2",
           "+model.config.max_position_embeddings=64"]
SGD = ["optim=sgd", "optim.lr=0.2", "optim.momentum=0", "optim.weight_decay=0", "trainer.progress=false"]
WORDS = "the cat sat on a mat and dog ran far away big small red blue".split()


def sentences(n: int, seed: int) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(2, 9))) for _ in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """41 training samples: windows of 16, 16 and 9 (cut [4, 4, 1]: with devices=2, rank 1 has nothing at the last
    micro-step)."""
    d = tmp_path_factory.mktemp("moe_text")
    (d / "lm.txt").write_text("\n".join(sentences(41, 1)) + "\n")
    (d / "lm_val.txt").write_text("\n".join(sentences(5, 2)) + "\n")
    return d


def moe(files, *args: str) -> list[str]:
    return [*MIXTRAL, "model.dropout=0", "data=text", f"data.train={files / 'lm.txt'}",
            f"data.val={files / 'lm_val.txt'}", "data.max_length=64", *SGD, "trainer.epochs=2", "loss=moe",
            "loss.router_aux_coef=1.0", "loss.router_z_coef=0.01", *args]


@pytest.fixture(scope="module")
def big(files, tmp_path_factory):
    """The big batch: micro_batch=16, the balancing loss over each window (one micro-batch)."""
    return train_here(tmp_path_factory.mktemp("moe_big"), "big", *moe(files, "micro_batch=16", "trainer.log_every=1"))


def largest_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_close_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert largest_difference(a, b) < 1e-5


# --- exactness ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("how", [pytest.param("accum", marks=pytest.mark.quick), "two_ranks", "checkpointing"])
def test_the_window_takes_the_big_batchs_steps(files, big, tmp_path, how):
    args = {"accum": ["micro_batch=4", "accum=4"], "two_ranks": ["devices=2", "micro_batch=4", "accum=2"],
            "checkpointing": ["micro_batch=4", "accum=4", "trainer.activation_checkpointing=true"]}[how]
    run, log = train_here(tmp_path, how, *moe(files, *args))
    assert_close_weights(final_weights(run), final_weights(big[0]))
    steps, reference = read_metrics(run)[0], read_metrics(big[0])[0]
    assert [r["samples"] for r in steps] == [16, 16, 9] * 2  # an incomplete last window each epoch
    for key in ("router_aux_window", "router_load_max_l1", "router_entropy_l0"):  # the window's, however cut
        assert [r[key] for r in steps] == pytest.approx([r[key] for r in reference], rel=1e-5)
    if how == "checkpointing":
        assert "activation checkpointing: 2 blocks" in log


@pytest.mark.slow
def test_balancing_each_micro_batch_alone_does_not(files, big, tmp_path):
    run, log = train_here(tmp_path, "micro", *moe(files, "micro_batch=4", "accum=4", "loss.router_aux=micro_batch"))
    assert largest_difference(final_weights(run), final_weights(big[0])) > 1e-4
    assert "loss.router_aux=micro_batch balances each micro-batch alone, so the accumulated step is NOT" in log
    steps = read_metrics(run)[0]
    assert all(r["router_aux"] != pytest.approx(r["router_aux_window"], rel=1e-6) for r in steps)


@pytest.mark.slow
def test_lora_and_activation_checkpointing_take_the_big_batchs_adapter_steps(files, tmp_path):
    """The adapters on the attention (the router and the experts frozen): the router's balancing gradient reaches
    them through the hidden states."""
    peft = pytest.importorskip("peft")
    lora = ["model.adapter=lora", "model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0",
            "model.lora.target_modules=[q_proj,v_proj]"]
    big_dir, _ = train_here(tmp_path, "big", *moe(files, *lora, "micro_batch=16"))
    acc_dir, log = train_here(tmp_path, "acc", *moe(files, *lora, "micro_batch=4", "accum=4",
                                                    "trainer.activation_checkpointing=true"))
    assert peft is not None and all(".lora_" in k for k in final_weights(acc_dir))
    assert_close_weights(final_weights(acc_dir), final_weights(big_dir))
    assert "activation checkpointing: 2 blocks" in log


# --- what a user watches ------------------------------------------------------------------------------------------
def test_each_steps_record_the_trackers_and_the_summary_hold_the_expert_load(files, big, tmp_path):
    run, log = big
    steps = read_metrics(run)[0]
    assert len(steps) == 6
    for record in steps:
        assert 1 <= record["router_load_max_l0"] <= 4 and 0 < record["router_entropy_l1"] <= 1.3863
        assert 1 < record["router_aux_window"] < 4  # N_E Σ f P: top-k (2) when the routing is uniform
        assert record["router_z"] > 0 and "router_aux" not in record  # window: the optimised term is the window's
    assert re.search(r"expert load \d\.\d\d× the mean at most \(layer \d of 2\), entropy ≥ [\d.]+ of "
                     r"1\.386 nats, balancing loss over the window [\d.]+", log)
    tracked, _ = train_here(tmp_path, "csv", *moe(files, "micro_batch=16", "trainer.max_steps=2", "logger=csv"))
    with open(tracked / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("router_load_max_l0")]
    assert len(rows) == 2 and float(rows[0]["router_entropy_l0"]) == pytest.approx(steps[0]["router_entropy_l0"])


def test_check_compares_the_balancing_gradient_alone_too(files):
    from accutrain.train.check import components_for_check, run_check

    exact = run_check(components_for_check(run_of(*moe(files, "micro_batch=4", "accum=4"))))
    assert exact.faithful and exact.parts["router balancing"] < 1e-5, exact.lines()
    assert any(line.strip().startswith("router balancing alone") for line in exact.lines())
    naive = run_check(components_for_check(run_of(*moe(files, "micro_batch=4", "accum=4",
                                                       "loss.router_aux=micro_batch"))))
    assert not naive.faithful and naive.parts["router balancing"] > 1e-2, naive.lines()
    assert "in its router balancing" in "\n".join(naive.lines())
    assert any("loss.router_aux=micro_batch balances each micro-batch alone" in c for c in naive.causes)


# --- refusals the model shows, and the resume ----------------------------------------------------------------------
def test_a_dense_model_and_a_negative_weight_are_one_line_before_the_run_directory(files, tmp_path):
    dense = [a for a in moe(files) if not a.startswith("+model.config.")] + ["+model.config.model_type=gpt2",
                                                                              "+model.config.n_layer=1"]
    for args, fragment in ((dense, "loss=moe balances the router of a mixture-of-experts model, and this model has "
                                   "none (a dense model)"),
                           (moe(files, "loss.router_aux_coef=-0.01"), "loss.router_aux_coef=-0.01 is not valid")):
        proc = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, check=False)
        assert proc.returncode == 2
        assert_one_line_error(proc, fragment)
        assert not (tmp_path / "run").exists()


SLOW_MOE = test_hf.SLOW_HF  # the same slowed-down hf_causal_lm factory (its forward passes aux= on)


@pytest.mark.slow
def test_a_sigkill_mid_run_resumes_bit_identically(files, tmp_path, monkeypatch):
    """Dropout (0.1) and the router's jitter on: pass 2 replays pass 1's draws, and a resumed run draws the same."""
    (tmp_path / "slow_moe.py").write_text(SLOW_MOE)
    monkeypatch.syspath_prepend(tmp_path)
    config = ",".join(a.removeprefix("+model.config.").replace("=", ": ") for a in MIXTRAL if a.startswith("+"))
    args = ["model=custom", "model._target_=slow_moe.net", f"+model.config={{{config}, router_jitter_noise: 0.1}}",
            "+model.dropout=0.1", *[a for a in moe(files, "micro_batch=4", "accum=2", "trainer.checkpoint_every=1")
                                    if not a.startswith(("model", "+model"))]]
    reference, _ = train_here(tmp_path, "reference", *args)
    killed_at_step(tmp_path, "killed", 4, *args, "+model.delay=0.05")
    resumed, log = train_here(tmp_path, "killed", *args, "resume=auto")
    assert "resumed from" in log
    assert_identical(final_weights(resumed), final_weights(reference))
    assert read_metrics(resumed)[0][-1]["router_aux_window"] == read_metrics(reference)[0][-1]["router_aux_window"]
