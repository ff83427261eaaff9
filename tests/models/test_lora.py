"""LoRA adapters (model.adapter=lora, the peft extra) on a tiny randomly initialised GPT-2, on the CPU, no download:
only the adapter trained and checkpointed, the same adapter weights under any split and on 2 ranks, a SIGKILL
resumed bit-identically (the frozen base rebuilt from the factory and the seed), the exported adapter loading with
PEFT onto the base model, the merged export, and the bad values in one line."""

import json

import hydra
import pytest
import test_hf
import torch
from conftest import (
    assert_identical,
    assert_one_line_error,
    assert_one_line_user_error,
    assert_same_weights,
    final_weights,
    killed_at_step,
    read_metrics,
    run_cli,
    train_here,
)
from omegaconf import OmegaConf

from accutrain.errors import UserError
from accutrain.seeding import seed_everything

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

files, lm, SLOW_HF = test_hf.files, test_hf.lm, test_hf.SLOW_HF  # test_hf's text files (a fixture), its run

LORA = ["model.adapter=lora", "model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0",
        "model.lora.target_modules=[c_attn,c_fc]"]


def lora(files, *args):
    return lm(files, *LORA, *args)


@pytest.fixture(scope="module")
def big_lora(files, tmp_path_factory):
    """The big-batch LoRA run, its adapter exported: (run directory, log)."""
    return train_here(tmp_path_factory.mktemp("lora"), "big", *lora(files, "micro_batch=16", "trainer.export=hf"))


def rebuilt(run_dir, **model):
    """The run's model as config.yaml's model node builds it (seeded as the run seeded it), with `model` changed."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    seed_everything(cfg.seed)
    return hydra.utils.instantiate(OmegaConf.merge(cfg.model, model)).train(False)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([list(b"the cat sat on a mat")])


@pytest.mark.slow
def test_lora_accumulated_and_two_device_runs_end_with_the_adapter_weights_of_the_big_batch(files, big_lora, tmp_path):
    big = final_weights(big_lora[0])
    acc = final_weights(train_here(tmp_path, "acc", *lora(files, "micro_batch=4", "accum=4"))[0])
    two_dir, _ = train_here(tmp_path, "two", *lora(files, "devices=2", "micro_batch=4", "accum=2"))
    assert_same_weights(acc, big)
    assert_same_weights(final_weights(two_dir), big)
    initial = rebuilt(big_lora[0]).state_dict()  # the adapter as initialised: training moved it
    assert any(not torch.allclose(initial[k], big[k]) for k in big)
    assert [r["samples"] for r in read_metrics(two_dir)[0]] == [16, 16, 9] * 2


def test_checkpoints_hold_the_adapter_and_its_optimizer_state_only(big_lora):
    run_dir, log = big_lora
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["model"] and all(".lora_A." in k or ".lora_B." in k for k in state["model"])
    assert len(state["model"]) == 2 * 2 * 2  # 2 layers × (c_attn, c_fc) × (A, B)
    held = [name for group in state["optimizer"]["param_groups"] for name in group["params"]]
    assert sorted(held) == sorted("model." + k for k in state["model"])  # the optimizer holds the adapter only
    model = rebuilt(run_dir)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"model." + k for k in state["model"]}
    assert "model.adapter=lora: 2,304 of" in log  # 2 layers × (c_attn 32·4 + 4·96, c_fc 32·4 + 4·128)
    with pytest.raises(RuntimeError, match="missing"):  # a checkpoint of another model is refused
        model.load_state_dict({k: v for k, v in state["model"].items() if "c_fc" not in k})


def test_the_exported_adapter_loads_with_peft_onto_the_base_and_gives_the_checkpoints_logits(big_lora):
    run_dir, _ = big_lora
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in (run_dir / "hf").iterdir()}
    trained = rebuilt(run_dir)
    trained.load_state_dict(final_weights(run_dir))
    base = rebuilt(run_dir, adapter=None).model  # the frozen base: the factory's model under the run's seed
    loaded = peft.PeftModel.from_pretrained(base, run_dir / "hf").train(False)
    assert torch.equal(logits(loaded, IDS), logits(trained.model, IDS))
    assert not torch.equal(logits(loaded, IDS), logits(rebuilt(run_dir, adapter=None).model, IDS))



def test_an_adapter_on_a_base_built_from_a_config_is_exported_with_that_base_and_loads_from_the_export(big_lora):
    """PEFT names no base for a model initialised at random (base_model_name_or_path null): the base goes beside
    the adapter, named by it, and the log says how to load the two — no accutrain, no seed needed."""
    run_dir, log = big_lora
    hf = (run_dir / "hf").resolve()
    assert json.loads((hf / "adapter_config.json").read_text())["base_model_name_or_path"] == str(hf / "base")
    record = json.loads((hf / "accutrain_base.json").read_text())
    assert record["factory"] == "accutrain.models.hf.causal_lm" and record["arguments"]["config"]["n_layer"] == 2
    base = transformers.AutoModelForCausalLM.from_pretrained(hf / "base")
    loaded = peft.PeftModel.from_pretrained(base, hf).train(False)
    trained = rebuilt(run_dir)
    trained.load_state_dict(final_weights(run_dir))
    assert torch.equal(logits(loaded, IDS), logits(trained.model, IDS))
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(hf).train(False)  # the adapter alone names its base
    assert torch.equal(logits(auto, IDS), logits(trained.model, IDS))
    assert (f"PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained('{hf / 'base'}'), "
            f"'{hf}')") in log

def test_merged_export_is_a_plain_model_with_the_adapters_logits(files, tmp_path):
    run_dir, log = train_here(tmp_path, "merged", *lora(files, "micro_batch=16", "trainer.max_steps=2",
                                                        "trainer.export=merged"))
    assert "the adapter merged in" in log
    assert not (run_dir / "hf" / "adapter_config.json").exists()
    merged = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf").train(False)
    trained = rebuilt(run_dir)
    trained.load_state_dict(final_weights(run_dir))
    torch.testing.assert_close(logits(merged, IDS), logits(trained.model, IDS), rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_with_adapters_takes_the_same_steps_and_bf16_trains(files, big_lora, tmp_path):
    """The adapted model is called with use_cache=False too: a key/value cache made the recomputation's shapes
    differ from the forward's."""
    recomputed, log = train_here(tmp_path, "ckpt", *lora(files, "micro_batch=16",
                                                         "trainer.activation_checkpointing=true"))
    assert "activation checkpointing: 2 blocks" in log
    assert_same_weights(final_weights(recomputed), final_weights(big_lora[0]))
    bf16, _ = train_here(tmp_path, "bf16", *lora(files, "micro_batch=4", "accum=4", "trainer.precision=bf16-mixed",
                                                 "trainer.activation_checkpointing=true", "trainer.max_steps=2"))
    steps = read_metrics(bf16)[0]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)


@pytest.mark.slow
def test_sigkill_with_adapters_resumes_bit_identically(files, tmp_path, monkeypatch):
    """The adapter's own dropout (0.1) on, so its RNG state must come back too; the resumed process rebuilds the
    frozen base from the factory and the seed."""
    (tmp_path / "slow_hf.py").write_text(SLOW_HF)
    monkeypatch.syspath_prepend(tmp_path)
    args = [a for a in lora(files, "micro_batch=4", "accum=2", "trainer.checkpoint_every=1")
            if not a.startswith(("model=", "model.adapter", "model.lora", "model.dropout"))]
    args = ["model=custom", "model._target_=slow_hf.net", "+model.adapter=lora", "+model.lora={r: 4, dropout: 0.1}",
            *args]
    reference, _ = train_here(tmp_path, "reference", *args)
    killed_at_step(tmp_path, "killed", 4, *args, "+model.delay=0.05")
    resumed, log = train_here(tmp_path, "killed", *args, "resume=auto")
    assert "resumed from" in log
    assert_identical(final_weights(resumed), final_weights(reference))
    assert all(".lora_" in k for k in final_weights(resumed))


def test_a_resume_onto_another_frozen_base_is_refused_in_one_line(files, tmp_path):
    """Issue 44: the checkpoint holds the adapter only, and a resume rebuilt the base from whatever the config now
    said — another initialisation (or another pretrained model) trained on without a word. The checkpoint records
    the base (factory, arguments, name and revision, a fingerprint of its weights); another one is refused."""
    args = lora(files, "micro_batch=16", "trainer.checkpoint_every=1")
    run_dir, _ = train_here(tmp_path, "run", *args, "trainer.max_steps=1")
    base = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["base"]
    assert base["factory"] == "accutrain.models.hf.causal_lm" and len(base["fingerprint"]) == 16
    assert "adapter" not in base["arguments"] and base["arguments"]["config"]["n_layer"] == 2
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
    with pytest.raises(UserError) as info:  # the same architecture, other random weights: the adapter would load
        train_here(tmp_path, "run", *args, "trainer.max_steps=2", "resume=auto", "+model.config.initializer_range=0.5")
    assert_one_line_user_error(info.value, "step-00000001.pt holds an adapter trained on the frozen base causal_lm "
                               f"initialised at random (weights {base['fingerprint']}); this run's base is causal_lm "
                               "initialised at random (weights ", "model.config.initializer_range: None → 0.5",
                               "an adapter continues only on the base it was trained on")
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == before
    _, log = train_here(tmp_path, "run", *args, "trainer.max_steps=2", "resume=auto")  # the same base goes on
    assert "resumed from" in log and len(read_metrics(run_dir)[0]) == 2


# --- bad values ------------------------------------------------------------------------------------------------
def test_unknown_target_modules_are_one_line(files, tmp_path):
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "bad", *lm(files, "model.adapter=lora", "model.lora.target_modules=[c_atn]"))
    assert_one_line_user_error(info.value, "model.lora.target_modules=[c_atn]: no layer named c_atn",
                               "c_attn", "did you mean c_attn?")


def test_an_adapter_on_a_model_that_is_not_hugging_faces_is_one_line(tmp_path):
    proc = run_cli("model=mlp", "model.adapter=lora", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "model.adapter=lora: adapters and quantization are for the Hugging Face models",
                          "model=hf_causal_lm")
    assert proc.returncode == 2


def test_4bit_on_the_cpu_merged_without_adapter_and_missing_peft_are_one_line(files, tmp_path, monkeypatch):
    from accutrain.models import adapters

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as info:
        adapters.check("lora", "4bit")
    assert_one_line_user_error(info.value, "model.quantize=4bit (QLoRA) needs a CUDA GPU and bitsandbytes")
    with pytest.raises(UserError) as info:
        adapters.check(None, "4bit")
    assert_one_line_user_error(info.value, "model.quantize=4bit trains nothing without an adapter")
    with pytest.raises(UserError) as info:
        adapters.check("prefix", None)
    assert_one_line_user_error(info.value, "model.adapter=prefix is not valid: expected one of lora")
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "merged", *lm(files, "micro_batch=16", "trainer.export=merged", "trainer.max_steps=1"))
    assert_one_line_user_error(info.value, "trainer.export=merged cannot be combined with model.adapter=null",
                               "model.adapter=lora")
    monkeypatch.setitem(__import__("sys").modules, "peft", None)
    with pytest.raises(UserError) as info:
        adapters.require_peft("model.adapter=lora")
    assert_one_line_user_error(info.value, "model.adapter=lora needs the peft package", "accutrain[peft]")
