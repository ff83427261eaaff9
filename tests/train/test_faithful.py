"""Faithfulness: accutrain-check's verdicts and causes, the BatchNorm remedies, element-normalised losses."""

import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, assert_same_weights, final_weights, read_metrics, run_cli, run_of, train_here
from torch import nn

from accutrain.core.step import accumulate
from accutrain.core.summing import count_terms, summed_cross_entropy
from accutrain.data.datasets import sequences
from accutrain.models.factories import char_lm, mlp, torchvision_classifier
from accutrain.models.norms import batchnorm_warning, convert_norm
from accutrain.train.check import components_for_check, run_check
from accutrain.train.check_report import batch_dependent_modules

DIGITS = ["micro_batch=8", "accum=4"]
SEQ = ["data=sequences", "data.size=150", "data.val_size=20", "data.max_length=16", "model=char_lm",
       "model.hidden=32", "optim=adamw", "trainer.epochs=2", "trainer.progress=false"]


def check(compose, *args):
    return run_check(components_for_check(run_of(*args)))


@pytest.mark.parametrize("args, faithful", [
    pytest.param(["model=mlp"], True, marks=pytest.mark.quick),  # the quick tier's accutrain-check
    ([], False),  # stock resnet18: BatchNorm
])
def test_check_verdicts_and_exit_codes(tmp_path, args, faithful):
    proc = run_cli(*args, *DIGITS, cwd=tmp_path, script="accutrain-check", check=False)
    assert proc.returncode == (0 if faithful else 1), proc.stdout + proc.stderr
    assert ("verdict: faithful" if faithful else "verdict: NOT faithful") in proc.stdout
    assert "overall" in proc.stdout
    if not faithful:
        assert "conv1" in proc.stdout
        assert "20 BatchNorm layers in training mode" in proc.stdout and "batchnorm.convert=group" in proc.stdout
    assert not (tmp_path / "outputs").exists()  # a check writes no run directory


@pytest.mark.parametrize("args", [["model=cnn"], ["batchnorm.convert=group"]])
def test_check_finds_models_without_batchnorm_faithful(compose, args):
    result = check(compose, *args, *DIGITS)
    assert result.faithful and "verdict: faithful" in "\n".join(result.lines())
    if "batchnorm.convert=group" in args:
        assert "conv1" in result.groups


def test_check_user_error_is_one_line(tmp_path):
    proc = run_cli("model=mlp", "micro_batch=0", cwd=tmp_path, script="accutrain-check", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "micro_batch=0 is not valid" in proc.stderr


BATCH_CENTERING = '''
import torch.nn as nn

class Center(nn.Module):
    """Subtracts the batch mean: a sample's output depends on the other samples."""
    def forward(self, x):
        return x - x.mean(0, keepdim=True)

def net(num_classes, in_channels, image_size):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, 16), Center(), nn.ReLU(),
                         nn.Linear(16, num_classes))
'''


def test_check_names_any_module_whose_output_depends_on_the_batch(tmp_path, monkeypatch, compose):
    (tmp_path / "centered.py").write_text(BATCH_CENTERING)
    monkeypatch.syspath_prepend(tmp_path)
    result = check(compose, "model=custom", "model._target_=centered.net", *DIGITS)
    assert not result.faithful
    assert "depends on the other samples of its batch: 2" in "\n".join(result.lines())  # the Center module


def test_batch_dependence_probe_finds_batchnorm_and_only_the_innermost():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Sequential(nn.BatchNorm2d(4), nn.ReLU()), nn.Flatten())
    assert batch_dependent_modules(model, (torch.randn(6, 1, 5, 5), torch.zeros(6))) == ["1.0"]
    assert batch_dependent_modules(mlp(3, 1, 4, [8]), (torch.randn(6, 1, 4, 4), torch.zeros(6))) == []


def test_dropout_is_named(compose):
    assert "dropout layers in training mode" in "\n".join(check(compose, "model=mlp", "model.dropout=0.3",
                                                                *DIGITS).lines())


@pytest.mark.parametrize("normalize, faithful", [("elements", True), ("samples", False)])
def test_check_on_token_losses_names_a_non_mean_reduction(compose, normalize, faithful):
    result = check(compose, *SEQ, f"loss.normalize={normalize}", "micro_batch=4", "accum=8")
    assert result.faithful is faithful
    assert ("use loss.normalize=elements" in "\n".join(result.lines())) is not faithful


@pytest.mark.slow
@pytest.mark.quick  # the quick tier's cross-entropy over tokens (element-normalised)
def test_element_normalised_accumulation_equals_the_big_batch(tmp_path):
    """Variable-length padded sequences: the window's mean is over its real tokens, however it is cut."""
    args = [*SEQ, "loss.normalize=elements", "trainer.grad_clip=1.0"]
    acc, _ = train_here(tmp_path, "acc", *args, "micro_batch=4", "accum=8")
    big, _ = train_here(tmp_path, "big", *args, "micro_batch=32")
    two, _ = train_here(tmp_path, "two", *args, "devices=2", "micro_batch=4", "accum=4")
    assert_same_weights(final_weights(acc), final_weights(big))
    assert_same_weights(final_weights(two), final_weights(big))
    steps = read_metrics(acc)[0]
    assert len({r["elements"] for r in steps}) > 1  # the windows really hold different numbers of tokens
    assert [r["elements"] for r in steps] == [r["elements"] for r in read_metrics(two)[0]]


def test_per_micro_batch_token_means_would_be_wrong():
    """The 2024 Transformers Trainer bug: averaging each micro-batch's token mean over accum steps."""
    data = sequences(size=16, val_size=1, vocab=6, min_length=2, max_length=12, seed=3)
    torch.manual_seed(0)
    model = char_lm(6, 6, embedding=4, hidden=8)
    x = torch.stack([data.train[i][0] for i in range(16)])
    y = torch.stack([data.train[i][1] for i in range(16)])
    micro = list(zip(x.split(4), y.split(4)))

    def grads():
        out = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    F.cross_entropy(model(x), y, ignore_index=-100).backward()  # the big batch: mean over every real token
    big = grads()
    accumulate(model, micro, count_terms(micro, True), torch.device("cpu"))
    for a, b in zip(grads(), big):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for xb, yb in micro:  # the bug
        (F.cross_entropy(model(xb), yb, ignore_index=-100) / len(micro)).backward()
    assert not all(torch.allclose(a, b, rtol=1e-3) for a, b in zip(grads(), big))


def test_summed_loss_ignores_padding_and_counts_elements():
    logits = torch.randn(2, 5, 3)  # batch, classes, length
    target = torch.tensor([[1, 2, -100], [0, -100, -100]])
    assert count_terms([(None, target)], True) == 3 and count_terms([(None, target)], False) == 2
    expected = F.cross_entropy(logits, target, reduction="sum", ignore_index=-100)
    torch.testing.assert_close(summed_cross_entropy(logits, target), expected)


def test_sequences_are_deterministic_and_padded():
    a, b = sequences(50, 10, 8, 3, 10, seed=1), sequences(50, 10, 8, 3, 10, seed=1)
    xa, ya = a.train[7]
    assert torch.equal(xa, b.train[7][0]) and torch.equal(ya, b.train[7][1])
    real = ya != -100
    assert 3 <= int(real.sum()) <= 10 and not real[int(real.sum()):].any()  # padding at the end only
    assert (xa[~real] == 0).all() and (xa[real] > 0).all()
    assert torch.equal(xa[1:][real[1:]], ya[:-1][real[1:]])  # each target is the next token


@pytest.mark.parametrize("model, micro, accum, devices, sync, warned", [
    ("resnet", 8, 4, 1, False, True),
    ("resnet", 32, 1, 1, False, False),
    ("resnet", 16, 1, 2, False, True),  # each device's BatchNorm sees half the window
    ("resnet", 16, 1, 2, True, False),  # SyncBatchNorm: the window
    ("resnet", 8, 2, 2, True, True),
    ("group", 8, 4, 1, False, False),
    ("frozen", 8, 4, 1, False, False),
    ("mlp", 8, 4, 1, False, False),
])
def test_batchnorm_warning_appears_exactly_when_it_should(model, micro, accum, devices, sync, warned):
    net = mlp(10, 1, 8, [16]) if model == "mlp" else torchvision_classifier("resnet18", 10, 1, 8)
    if model in ("group", "frozen"):
        convert_norm(net, model, 32)
    warning = batchnorm_warning(net.train(), micro, micro * accum * devices, devices, sync)
    assert (warning is not None and "BatchNorm layers take their statistics over" in warning) is warned
    if warned:
        assert "batchnorm.convert=group" in warning and "batchnorm.sync=true" in warning


def test_norm_frozen_keeps_batchnorm_in_eval_mode_and_its_names():
    net = torchvision_classifier("resnet18", 10, 1, 8)
    names = set(net.state_dict())
    convert_norm(net, "frozen", 32)
    net.train()
    assert all(not m.training for m in net.modules() if isinstance(m, nn.BatchNorm2d))
    assert net.training and set(net.state_dict()) == names  # pretrained checkpoints still load
    grouped = torchvision_classifier("resnet18", 10, 1, 8)
    assert convert_norm(grouped, "group", 32) == 20
    assert not any(isinstance(m, nn.BatchNorm2d) for m in grouped.modules())
    assert {m.num_groups for m in grouped.modules() if isinstance(m, nn.GroupNorm)} == {32}


def test_training_runs_the_check_first_when_asked(tmp_path):
    _, log = train_here(tmp_path, "run", *TINY, "data.size=64", "micro_batch=8", "accum=2", "trainer.max_steps=1",
                        "trainer.check=true")
    assert "check: verdict: faithful" in log


OOM_ON_DEVICE = '''
import torch
import torch.nn as nn

class Net(nn.Module):
    """Runs out of memory above 8 samples, except in float64 on the CPU (where the check's reference goes)."""
    def __init__(self, num_classes, in_channels, image_size):
        super().__init__()
        self.fc = nn.Linear(in_channels * image_size ** 2, num_classes)

    def forward(self, x):
        if self.training and x.shape[0] > 8 and x.dtype != torch.float64:
            raise torch.OutOfMemoryError("simulated")
        return self.fc(x.flatten(1))
'''


def test_check_computes_a_window_that_does_not_fit_in_float64_on_the_cpu(tmp_path, monkeypatch, compose):
    (tmp_path / "tight.py").write_text(OOM_ON_DEVICE)
    monkeypatch.syspath_prepend(tmp_path)
    result = check(compose, "model=custom", "model._target_=tight.Net", *DIGITS)
    assert result.faithful
    assert "the CPU in float64" in "\n".join(result.lines())


@pytest.mark.parametrize("loss", [["loss=mse", "data.target=regression"], ["loss=l1", "data.target=regression"],
                                  ["loss=huber", "data.target=regression"], ["loss=bce", "data.target=multilabel"],
                                  ["loss=bce", "loss.normalize=samples", "data.target=multilabel"]])
def test_check_covers_every_loss(compose, loss):
    result = check(compose, "debug=fast", "model.hidden=[32]", "micro_batch=8", "accum=4", *loss)
    assert result.faithful and result.overall < 1e-6, result.lines()


def test_check_covers_a_custom_loss(compose, tmp_path, monkeypatch):
    (tmp_path / "mylosses.py").write_text("def cubic(output, target):\n    return (output - target).abs().pow(3)\n")
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(sys.modules, "mylosses", raising=False)  # not another test's module of that name
    args = ["debug=fast", "micro_batch=8", "accum=4", "loss=custom", "loss._target_=mylosses.cubic",
            "data.target=regression"]
    result = check(compose, *args, "model.hidden=[32]")
    assert result.faithful and result.overall < 1e-6, result.lines()


def test_check_covers_the_contrastive_window_loss(compose):
    args = ["debug=fast", "model.hidden=[32]", "loss=contrastive", "augment.views=2", "augment.crop=pad",
            "augment.padding=1", "micro_batch=8", "accum=4"]
    exact = check(compose, *args, "loss.learn_temperature=true")
    assert exact.faithful and exact.overall < 1e-6, exact.lines()
    naive = check(compose, *args, "loss.window=false")  # each micro-batch its own negatives: not the big batch's
    assert not naive.faithful and naive.overall > 1e-2
