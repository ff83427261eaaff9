"""The capabilities added after the first GPU session, each on a real GPU (`pytest -m cuda`; they skip without one):
the regression and multi-label losses and the contrastive window under every split, the gradient noise scale under
16-mixed (GradScaler's scale divided out), LoRA with bf16 and activation checkpointing, and QLoRA (4-bit,
bitsandbytes). The contrastive second pass replaying CUDA's dropout masks is tests/core/test_gradcache.py's."""
import pytest
import torch
from conftest import EXACT, TINY, final_weights, read_metrics, train_here

from accutrain.core.precision import tolerance

pytestmark = pytest.mark.cuda
GPU = ["trainer.device=cuda", "trainer.deterministic=true"]


def close(a: dict, b: dict, rtol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key].float().cpu(), b[key].float().cpu(), rtol=rtol, atol=rtol * 0.1,
                                   msg=lambda m, key=key: f"{key}: {m}")


LOSSES = {
    "mse": ["loss=mse", "data.target=regression"],
    "bce": ["loss=bce", "data.target=multilabel", "optim=adamw", "optim.lr=0.003"],
    "contrastive": ["loss=contrastive", "augment.views=2", "augment.crop=pad", "augment.padding=1",
                    "loss.learn_temperature=true", "optim=adamw", "optim.lr=0.003", "loss.temperature=0.2"],
}


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_each_loss_accumulated_equals_the_big_batch_on_cuda(tmp_path, name, precision):
    args = [*EXACT, *LOSSES[name], *GPU, f"trainer.precision={precision}"]  # 110 samples: a short tail
    big, _ = train_here(tmp_path, "big", *args, "micro_batch=32")
    acc, _ = train_here(tmp_path, "acc", *args, "micro_batch=8", "accum=4")
    close(final_weights(acc), final_weights(big), tolerance(precision))
    assert [r["samples"] for r in read_metrics(acc)[0]][:4] == [32, 32, 32, 14]


def test_the_noise_scale_under_16_mixed_matches_float32_on_cuda(tmp_path):
    """GradScaler multiplies every gradient by its scale (2¹⁶ at first): the estimator divides it out, so the noise
    scale of a 16-mixed run is float32's up to half precision's rounding."""
    common = [*TINY, *GPU, "data.size=117", "trainer.epochs=2", "trainer.noise_scale=true", "micro_batch=8", "accum=4"]
    fp32, _ = train_here(tmp_path, "fp32", *common)
    half, _ = train_here(tmp_path, "half", *common, "trainer.precision=16-mixed")
    a, b = read_metrics(fp32)[0], read_metrics(half)[0]
    assert len(a) == len(b) == 8 and all(r.get("skipped") is None for r in b)
    for key in ("noise_g2", "noise_trace"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=0.05), key


# --- adapters -----------------------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 128, "n_positions": 128, "vocab_size": 512}
LORA = ["model.adapter=lora", "model.lora.r=8", "model.lora.alpha=16", "model.lora.dropout=0",
        "model.lora.target_modules=[c_attn,c_fc]"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import random
    d = tmp_path_factory.mktemp("corpus")
    r = random.Random(0)
    words = "the cat sat on a mat and dog ran far away big small red blue green".split()
    for name, n in (("train.txt", 75), ("val.txt", 10)):
        (d / name).write_text("\n".join(" ".join(r.choice(words) for _ in range(r.randint(3, 30))) for _ in range(n)))
    return d


def lm_args(corpus, *args):
    config = [f"+model.config.{k}={v}" for k, v in GPT2.items()]
    return ["model=hf_causal_lm", *config, "model.dropout=0", "data=text", f"data.train={corpus / 'train.txt'}",
            f"data.val={corpus / 'val.txt'}", "data.max_length=128", "optim=adamw", "optim.lr=0.001",
            "trainer.epochs=2", *GPU, *args]


def test_lora_with_bf16_and_activation_checkpointing_keeps_the_equivalence_on_cuda(tmp_path, corpus):
    pytest.importorskip("peft")
    args = lm_args(corpus, *LORA, "trainer.precision=bf16-mixed", "trainer.activation_checkpointing=true")
    big, _ = train_here(tmp_path, "big", *args, "micro_batch=16")
    acc, log = train_here(tmp_path, "acc", *args, "micro_batch=4", "accum=4")
    weights = final_weights(acc)
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    close(weights, final_weights(big), tolerance("bf16-mixed"))
    steps = read_metrics(acc)[0]
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_qlora_trains_four_bit_base_with_an_adapter_on_cuda(tmp_path, corpus):
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    base = tmp_path / "base"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**{k: v for k, v in GPT2.items() if k != "model_type"})
                                 ).save_pretrained(base)
    common = ["model=hf_causal_lm", f"model.name_or_path={base}", "model.dropout=0", "data=text",
              f"data.train={corpus / 'train.txt'}", f"data.val={corpus / 'val.txt'}", "data.max_length=128",
              "data.tokenizer=bytes", "optim=adamw", "optim.lr=0.001", "trainer.epochs=2", *GPU, *LORA,
              "trainer.precision=bf16-mixed"]
    run, log = train_here(tmp_path, "q", *common, "model.quantize=4bit", "micro_batch=4", "accum=4")
    weights = final_weights(run)
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    steps = read_metrics(run)[0]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps) and steps[-1]["loss"] < steps[0]["loss"]
    big, _ = train_here(tmp_path, "qbig", *common, "model.quantize=4bit", "micro_batch=16")
    close(weights, final_weights(big), 5e-2)  # 4-bit base, bf16 compute: the same step up to bf16 rounding
    print("qlora peak_mem_mb", steps[-1].get("peak_mem_mb"), "log tail:", log[-300:])
