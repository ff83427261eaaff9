"""Memory: precision, fp32 gradient buffers, activation checkpointing, offload, micro_batch=auto, OOM re-split."""
import json

import pytest
import torch
from conftest import (
    EXACT,
    OOM,
    OOM_MODEL,
    TINY,
    TINY_DATA,
    WINDOWS,
    assert_one_line_user_error,
    assert_same_weights,
    final_weights,
    read_metrics,
    run_of,
    train_here,
    train_run,
)
from torch import nn

from accutrain.core.grad_buffers import GradBuffers
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.models.checkpointing import enable_activation_checkpointing
from accutrain.signals import StopRequest
from accutrain.store.progress import Progress
from accutrain.train.auto_batch import search_micro_batch
from accutrain.train.build import build
from accutrain.train.loop import fit
from accutrain.train.metrics import MetricsLog


def close(a, b, rtol):
    for key in a:
        torch.testing.assert_close(a[key].float(), b[key].float(), rtol=rtol, atol=rtol * 0.1, msg=key)


@pytest.mark.parametrize("precision, rtol", [("bf16-mixed", 2e-2), ("16-mixed", 2e-3)])
def test_mixed_precision_keeps_the_accumulation_equivalence(tmp_path, precision, rtol):
    acc, _ = train_here(tmp_path, "acc", *EXACT, f"trainer.precision={precision}", "micro_batch=8", "accum=4")
    big, _ = train_here(tmp_path, "big", *EXACT, f"trainer.precision={precision}", "micro_batch=32")
    close(final_weights(acc), final_weights(big), rtol)
    fp32, _ = train_here(tmp_path, "fp32", *EXACT, "micro_batch=32")
    assert any(not torch.equal(final_weights(big)[k], final_weights(fp32)[k]) for k in final_weights(fp32))
    if precision == "16-mixed":
        steps = read_metrics(acc)[0]
        assert all(r["amp_scale"] == 65536.0 for r in steps)  # no overflow in this run: every step taken


def built(compose, *overrides):
    return build(run_of(*TINY, *overrides), World(), torch.device("cpu"))


def test_grad_scaler_acts_once_per_optimizer_step(tmp_path, compose):
    r = built(compose, "data.size=100", "micro_batch=5", "accum=4", "trainer.epochs=1", "trainer.precision=16-mixed")
    calls = {"scale": 0, "unscale_": 0, "step": 0, "update": 0}
    scaler = r.precision.scaler
    for name in calls:
        original = getattr(scaler, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(scaler, name, counted)
    metrics = MetricsLog(tmp_path / "m.jsonl")
    with StopRequest() as stop:
        out = fit(r, metrics, Progress(), lambda *a, **k: None, stop)
    metrics.close()
    assert out.progress.step == 5
    # scale per micro-batch, the rest per step; the loop steps the optimizer itself once the step's one read of the
    # device says the gradients are finite (GradScaler.step would wait for the device a second time to learn it)
    assert calls == {"scale": 20, "unscale_": 5, "step": 0, "update": 5}


def test_amp_overflow_skips_the_optimizer_and_scheduler_step(tmp_path, compose):
    r = built(compose, "data.size=40", "micro_batch=5", "accum=2", "trainer.epochs=5", "trainer.max_steps=16",
              "trainer.precision=16-mixed", "sched=cosine")
    r.precision.scaler._init_scale = 2.0 ** 30  # fp16 gradients overflow at this scale until it has come down
    before = [p.detach().clone() for p in r.model.parameters()]
    lrs = []
    original_step = r.scheduler.step
    r.scheduler.step = lambda *a: (lrs.append(True), original_step(*a))
    metrics = MetricsLog(tmp_path / "m.jsonl")
    with StopRequest() as stop:
        fit(r, metrics, Progress(), lambda *a, **k: None, stop)
    metrics.close()
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines() if '"loss"' in line]
    skipped = [rec for rec in records if rec.get("skipped") == "amp_overflow"]
    assert records[0]["skipped"] == "amp_overflow" and 1 <= len(skipped) < len(records)
    assert len(lrs) == len(records) - len(skipped)  # the scheduler moved only on the steps taken
    scales = [rec["amp_scale"] for rec in records]
    assert scales[0] == 2.0 ** 29 and scales == sorted(scales, reverse=True)  # halved once per skipped step
    assert any(not torch.equal(a, b) for a, b in zip(before, r.model.parameters()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp32_buffers_accumulate_half_precision_gradients_more_exactly(device):
    torch.manual_seed(0)
    layer = nn.Linear(64, 64).to(device, torch.bfloat16)
    inputs = [torch.randn(4, 64, dtype=torch.bfloat16, device=device) for _ in range(64)]
    exact = sum(torch.autograd.grad(layer.double()(x.double()).square().sum(), layer.weight)[0] for x in inputs)
    layer = layer.to(torch.bfloat16)

    def accumulated(dtype):
        layer.zero_grad(set_to_none=True)
        buffers = GradBuffers(list(layer.parameters()), dtype, offload=False) if dtype else None
        for x in inputs:
            layer(x).float().square().sum().backward()
        if buffers:
            assert all(b.dtype == torch.float32 for b in buffers.buffers.values())
            buffers.release()
            buffers.remove()
        return layer.weight.grad.double()

    in_bf16 = (accumulated(None) - exact).norm() / exact.norm()
    in_fp32 = (accumulated(torch.float32) - exact).norm() / exact.norm()
    assert in_fp32 < in_bf16 / 2, (in_fp32, in_bf16)  # one rounding at the end instead of one per micro-batch


def test_offload_buffers_give_the_plain_gradient():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    xs = [torch.randn(3, 6) for _ in range(4)]
    for x in xs:
        net(x).sum().backward()
    plain = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    buffers = GradBuffers(list(net.parameters()), None, offload=True)
    for x in xs:
        net(x).sum().backward()
        assert all(p.grad is None for p in net.parameters())  # nothing left in .grad between micro-batches
    buffers.release()
    for p, g in zip(net.parameters(), plain):
        torch.testing.assert_close(p.grad, g)


def test_bf16_true_with_fp32_accumulation_trains(tmp_path):
    run_dir, log = train_here(tmp_path, "run", *EXACT, "trainer.precision=bf16-true", "trainer.accum_dtype=float32",
                              "micro_batch=4", "accum=8")
    assert "gradients accumulate in float32 buffers" in log
    assert all(t.dtype == torch.bfloat16 for t in final_weights(run_dir).values())


@pytest.mark.parametrize("model", [["model=mlp", "model.hidden=[32,32]"], ["model=cnn"],
                                   ["model=resnet18", "data.size=40", "trainer.epochs=1"]])
def test_activation_checkpointing_gives_the_same_weights(tmp_path, model):
    args = [*TINY_DATA, *WINDOWS, *model, "micro_batch=8", "accum=4"]
    plain, _ = train_here(tmp_path, "plain", *args)
    ckpt, log = train_here(tmp_path, "ckpt", *args, "trainer.activation_checkpointing=true")
    assert "recompute their activations in backward" in log
    a, b = final_weights(plain), final_weights(ckpt)
    assert a.keys() == b.keys()  # parameter names unchanged: checkpoints interchange
    for key in a:  # BatchNorm running statistics included: the recomputation must not update them twice
        torch.testing.assert_close(a[key].float(), b[key].float(), rtol=1e-5, atol=1e-6, msg=key)


def test_activation_checkpointing_says_when_there_is_nothing_to_wrap():
    assert enable_activation_checkpointing(nn.Linear(3, 3)) == 0


def test_offload_on_the_cpu_says_it_does_nothing(tmp_path):
    plain, _ = train_here(tmp_path, "plain", *EXACT, "micro_batch=8", "accum=4")
    off, log = train_here(tmp_path, "off", *EXACT, "micro_batch=8", "accum=4", "trainer.offload_grads=true")
    assert "trainer.offload_grads=true does nothing on the CPU" in log
    assert_same_weights(final_weights(off), final_weights(plain))


def test_peak_memory_per_step_and_in_the_summary(tmp_path):
    run_dir, log = train_here(tmp_path, "run", *TINY, "data.size=40", "trainer.max_steps=2")
    assert all(r["peak_mem_mb"] > 10 for r in read_metrics(run_dir)[0])
    assert "peak memory" in log


@pytest.fixture
def oom_model(tmp_path, monkeypatch):
    (tmp_path / "oommodel.py").write_text(OOM_MODEL)
    monkeypatch.syspath_prepend(tmp_path)
    return tmp_path


def test_auto_micro_batch_finds_the_largest_that_fits_and_caches_it(oom_model):
    auto, log = train_here(oom_model, "runs/auto", *OOM, "micro_batch=auto", "global_batch=32",
                           "trainer.memory_budget_mb=1000000")
    assert "16: does not fit" in log
    assert "effective batch 32 = micro_batch 8 × accum 4 × devices 1" in log
    plain, _ = train_here(oom_model, "plain", *OOM, "micro_batch=8", "accum=4")
    assert_same_weights(final_weights(auto), final_weights(plain))  # the trials left no trace
    cache = json.loads((oom_model / "runs" / "micro_batch_auto.json").read_text())
    assert [entry["micro_batch"] for entry in cache.values()] == [8]
    _, again = train_here(oom_model, "runs/again", *OOM, "micro_batch=auto", "global_batch=32",
                          "trainer.memory_budget_mb=1000000")
    assert "micro_batch=auto: 8, cached in" in again and "trial steps" not in again


def test_out_of_memory_mid_run_resplits_the_window_exactly(oom_model):
    resplit, log = train_here(oom_model, "resplit", *OOM, "micro_batch=32", "accum=1")
    assert "re-split into 4 micro-batches of at most 8; the effective batch stays 32" in log
    assert [r["samples"] for r in read_metrics(resplit)[0]] == [32, 32, 32, 21] * 2
    plain, _ = train_here(oom_model, "plain", *OOM, "micro_batch=32", "accum=1", "+model.limit=1000")
    assert_same_weights(final_weights(resplit), final_weights(plain))


def test_auto_search_stops_at_the_budget():
    sizes = []

    def fits(size):
        sizes.append(size)
        return 500 + 10 * size <= 900, 500 + 10 * size

    best, notes = search_micro_batch(64, fits, budget_mb=900)
    assert best == 32 and sizes == [1, 2, 4, 8, 16, 32]  # 64 predicted at 1140 MiB: not even tried
    assert "64: predicted 1140 MiB > budget 900 MiB" in notes[-1]
    with pytest.raises(UserError, match="not even a micro-batch of 1 fits"):
        search_micro_batch(8, lambda size: (False, 0.0), budget_mb=None)


def test_auto_search_with_batchnorm_starts_at_two_samples(tmp_path, monkeypatch):
    (tmp_path / "bnnet.py").write_text("""
import torch.nn as nn

class Net(nn.Module):  # BatchNorm1d: one sample per micro-batch cannot train
    def __init__(self, num_classes, in_channels, image_size):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, 16), nn.BatchNorm1d(16),
                                 nn.ReLU(), nn.Linear(16, num_classes))

    def forward(self, x):
        return self.net(x)
""")
    monkeypatch.syspath_prepend(tmp_path)
    _, log = train_here(tmp_path, "run", *TINY_DATA, "model=custom", "model._target_=bnnet.Net", "micro_batch=auto",
                        "global_batch=8", "trainer.memory_budget_mb=1000000", "trainer.max_steps=1")
    assert "trial steps 1: not tried (BatchNorm in training needs 2 or more samples per micro-batch); 2: fits" in log
    assert "effective batch 8 = micro_batch 8 × accum 1 × devices 1" in log


@pytest.mark.parametrize("args, fragment", [
    (["micro_batch=auto"], "micro_batch=auto cannot be combined with global_batch=null"),
    (["micro_batch=auto", "global_batch=32", "accum=2"], "drop accum=2"),
    (["micro_batch=auto", "global_batch=32"], "needs trainer.memory_budget_mb"),
    (["micro_batch=auto", "global_batch=32", "trainer.memory_budget_mb=1"], "not even a micro-batch of 1 fits"),
    (["trainer.precision=8-mixed"], "trainer.precision=8-mixed is not valid"),
])
def test_memory_errors_are_one_line(tmp_path, args, fragment):
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "err", *TINY, "data.size=40", *args)
    assert_one_line_user_error(info.value, fragment)


TOKEN_MODEL = '''
import torch.nn as nn


class Net(nn.Module):
    """Per-token logits from an embedding: next to no compute per token."""
    def __init__(self, vocab_size, num_classes):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab_size, 4), nn.Linear(4, num_classes)

    def forward(self, x):
        return self.head(self.embed(x)).transpose(1, 2)
'''
HOST_MEMORY = {
    # 4,096 images of 3×96×96 (108 KiB each, generated per sample) in the big window: 432 MiB a held window would add.
    "samples": ["model=mlp", "model.hidden=[16]", "data=synthetic", "data.size=4100", "data.val_size=16",
                "data.image_size=96", "data.channels=3"],
    # loss=contrastive, 4,096 pairs of 3×64×64 views in the big window: 384 MiB if pass 2 kept the window's inputs
    # (it reads them again from the sampler); its embeddings (4,096 × 2 × 10 floats) are all that grows.
    "pairs": ["model=mlp", "model.hidden=[16]", "data=synthetic", "data.size=4100", "data.val_size=16",
              "data.image_size=64", "data.channels=3", "loss=contrastive", "augment.views=2", "augment=crop_flip"],
    # 4,096 sequences of 1,024 tokens, counted per token: a loss kept per micro-batch would add ~400 MiB.
    "tokens": ["data=sequences", "data.size=4100", "data.val_size=16", "data.min_length=1024",
               "data.max_length=1024", "model=custom", "model._target_=tokmodel.Net", "loss.normalize=tokens"],
}


@pytest.mark.slow
@pytest.mark.parametrize("terms", ["samples", "pairs", pytest.param("tokens", marks=pytest.mark.long)])
def test_host_memory_holds_one_micro_batch_whatever_the_window(tmp_path, terms):
    """The host's peak over one optimizer step (peak_mem_mb: the process's resident set) with a window of 4,096
    samples stays within 1.15× that of a window of 64: no window's data, and no per-micro-batch tensor, is kept."""
    (tmp_path / "tokmodel.py").write_text(TOKEN_MODEL)
    peaks = {}
    for global_batch in (64, 4096):
        run_dir, _ = train_run(tmp_path, f"g{global_batch}", *HOST_MEMORY[terms], "micro_batch=8",
                               f"global_batch={global_batch}", "trainer.max_steps=1", "trainer.progress=false",
                               fresh=True)  # the process's own resident set, from a fresh interpreter
        (step,), _ = read_metrics(run_dir)
        assert step["samples"] == global_batch
        peaks[global_batch] = step["peak_mem_mb"]
    assert peaks[4096] <= 1.15 * peaks[64], peaks
