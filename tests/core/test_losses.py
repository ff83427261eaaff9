"""loss=: every loss sums per-term losses and counts its terms from the targets, so the accumulated gradient is the
gradient of the window's mean, whatever the split; evaluation sums are exact over any cut of the held-out split."""
import math
import sys

import hydra
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_one_line_user_error
from torch import nn

from accutrain.core.losses import elements as losses
from accutrain.core.losses.cross_entropy import SummedLoss
from accutrain.core.step import accumulate, evaluate
from accutrain.errors import UserError
from accutrain.models.losses import build_loss
from accutrain.train.monitor import Monitor


def fixture(n=14, out=3, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, out)).double()
    return model, torch.randn(n, 5, dtype=torch.float64)


def accumulated(model, loss, x, y, size):
    model.zero_grad(set_to_none=True)
    chunks = list(zip(x.split(size), y.split(size)))
    accumulate(model, chunks, loss.terms(chunks), torch.device("cpu"), loss=loss)
    return [p.grad.clone() for p in model.parameters()]


def reference(model, mean_loss):
    model.zero_grad(set_to_none=True)
    mean_loss.backward()
    return [p.grad.clone() for p in model.parameters()]


MISSING = -100.0


@pytest.mark.parametrize("name, torch_mean", [
    ("mse", lambda x, y: F.mse_loss(x, y)), ("l1", lambda x, y: F.l1_loss(x, y)),
    ("huber", lambda x, y: F.huber_loss(x, y, delta=1.0)),
    ("bce", lambda x, y: F.binary_cross_entropy_with_logits(x, y))])
def test_each_element_loss_accumulates_to_torchs_mean_on_a_short_tail(name, torch_mean):
    model, x = fixture()
    y = torch.rand(14, 3, dtype=torch.float64).round() if name == "bce" else torch.randn(14, 3, dtype=torch.float64)
    loss = getattr(losses, name)()  # auto: the mean over elements, torch's own default reduction
    assert loss.elements and loss.terms([(x, y)]) == 42
    expected = reference(model, torch_mean(model(x), y))
    for size in (4, 5, 14):  # 4, 4, 4, 2 | 5, 5, 4 | one batch
        for got, want in zip(accumulated(model, loss, x, y, size), expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_samples_normalisation_sums_each_samples_elements():
    model, x = fixture()
    y = torch.randn(14, 3, dtype=torch.float64)
    loss = losses.mse(normalize="samples")
    assert not loss.elements and loss.terms([(x[:4], y[:4]), (x[4:], y[4:])]) == 14
    expected = reference(model, F.mse_loss(model(x), y, reduction="sum") / 14)
    for got, want in zip(accumulated(model, loss, x, y, 4), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_ignored_target_elements_count_in_neither_the_sum_nor_the_mean():
    model, x = fixture()
    y = torch.randn(14, 3, dtype=torch.float64)
    y[2, 1] = y[9, 0] = y[13, 2] = MISSING  # unknown values, one in the short tail
    loss = losses.mse()
    assert loss.terms([(x, y)]) == 39
    known = y != MISSING
    expected = reference(model, F.mse_loss(model(x)[known], y[known]))
    for got, want in zip(accumulated(model, loss, x, y, 4), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_a_custom_per_sample_loss_is_summed_and_counted_by_accutrain():
    model, x = fixture()
    y = torch.randn(14, 3, dtype=torch.float64)
    loss = losses.custom(lambda out, t: (out - t).abs().pow(3).sum(1), "mine.cubic")  # one loss per sample
    expected = reference(model, (model(x) - y).abs().pow(3).sum(1).mean())
    for got, want in zip(accumulated(model, loss, x, y, 4), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("returns, said", [(lambda out, t: F.mse_loss(out, t), "returned a scalar"),
                                           (lambda out, t: (out - t).square().sum(0), "returned shape (3,) for 4")])
def test_a_custom_loss_that_is_not_per_term_is_one_line_naming_it(returns, said):
    model, x = fixture()
    loss = losses.custom(returns, "mine.loss")
    with pytest.raises(UserError) as e:
        loss(model(x[:4]), torch.randn(4, 3, dtype=torch.float64))
    assert_one_line_user_error(e.value, "loss._target_=mine.loss", said, "reduction='none'")


def test_custom_elements_need_losses_in_the_targets_shape():
    loss = losses.custom(lambda out, t: (out - t).square().sum(1), "mine.loss", normalize="elements")
    with pytest.raises(UserError) as e:
        loss(torch.zeros(4, 3), torch.zeros(4, 3))
    assert_one_line_user_error(e.value, "loss.normalize=elements", "target's shape")


def test_evaluation_sums_are_the_same_however_the_split_is_cut():
    model, x = fixture()
    torch.manual_seed(1)
    for loss, y in ((losses.mse(), torch.randn(14, 3, dtype=torch.float64)),
                    (losses.bce(), torch.rand(14, 3, dtype=torch.float64).round())):
        whole = evaluate(model, [(x, y)], torch.device("cpu"), loss=loss)
        parts = evaluate(model, list(zip(x.split(3), y.split(3))), torch.device("cpu"), loss=loss)
        torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
        metrics = loss.eval_metrics(whole.tolist())
        out = model(x).detach()
        if loss.task == "regression":
            assert metrics["val_mae"] == pytest.approx(float((out - y).abs().mean()))
            assert metrics["val_rmse"] == pytest.approx(math.sqrt(float((out - y).square().mean())))
        else:
            pred, true = out > 0, y > 0.5
            tp, fp, fn = (pred & true).sum(), (pred & ~true).sum(), (~pred & true).sum()
            assert metrics["val_f1"] == pytest.approx(float(2 * tp / (2 * tp + fp + fn)))
        assert metrics["val_loss"] == pytest.approx(float(loss(out, y) / loss.terms([(x, y)])))


@pytest.mark.parametrize("option, kind, monitor", [
    ("cross_entropy", SummedLoss, "val_acc"), ("mse", losses.PerTermLoss, "val_loss"),
    ("huber", losses.PerTermLoss, "val_loss"), ("bce", losses.PerTermLoss, "val_loss")])
def test_the_loss_node_instantiates_to_the_loss_and_chooses_the_monitor(compose, option, kind, monitor):
    cfg = compose("debug=fast", f"loss={option}")
    loss = hydra.utils.instantiate(cfg.loss)  # every key of the node is a keyword argument of its _target_
    assert isinstance(loss, kind) and loss.monitor == monitor
    assert build_loss(cfg.loss) == loss or option != "cross_entropy"
    assert Monitor.from_config(cfg.trainer, loss.task, loss.monitor).metric == monitor


def test_a_monitor_the_loss_does_not_measure_is_one_line(compose):
    cfg = compose("debug=fast", "loss=mse", "trainer.monitor=val_acc")
    loss = build_loss(cfg.loss)
    with pytest.raises(UserError) as e:
        Monitor.from_config(cfg.trainer, loss.task, loss.monitor)
    assert_one_line_user_error(e.value, "trainer.monitor=val_acc", "val_mae")


def test_cross_entropy_keys_still_work_and_a_language_model_monitors_its_loss(compose):
    cfg = compose("debug=fast", "loss.label_smoothing=0.1", "loss.normalize=elements")
    loss = build_loss(cfg.loss)
    assert loss.label_smoothing == 0.1 and loss.elements and loss.monitor == "val_loss"


def test_a_custom_class_gets_the_nodes_other_keys(compose, tmp_path, monkeypatch):
    (tmp_path / "mylosses.py").write_text(
        "class Scaled:\n    def __init__(self, weight):\n        self.weight = weight\n"
        "    def __call__(self, out, t):\n        return self.weight * (out - t).square()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mylosses", raising=False)  # not another test's module of that name
    cfg = compose("debug=fast", "loss=custom", "loss._target_=mylosses.Scaled", "+loss.weight=3.0",
                  "loss.normalize=elements")
    loss = build_loss(cfg.loss)
    assert loss.task == "custom" and loss.elements and loss.per_term.weight == 3.0
    assert float(loss(torch.ones(2, 2), torch.zeros(2, 2))) == 12.0
