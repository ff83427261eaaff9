"""loss=mse|huber|bce|custom keep the promise: every split of the same effective batch — one device or two gloo
ranks — ends with the big batch's weights, on windows with a short last micro-batch and an incomplete last window."""
import sys

import pytest
import torch
from conftest import (
    EXACT,
    TINY,
    assert_one_line_error,
    assert_same_weights,
    final_weights,
    read_metrics,
    train_here,
    train_run,
)

pytestmark = pytest.mark.slow

# A user's per-sample loss (loss=custom): a pseudo-Huber error per sample, its elements summed; reduction none.
CUSTOM_LOSS = '''
import torch

def pseudo_huber(output, target, delta=1.0):
    return (delta ** 2 * (torch.sqrt(1 + ((output - target) / delta) ** 2) - 1)).sum(1)
'''

LOSSES = {
    "mse": ["loss=mse", "data.target=regression"],
    "huber": ["loss=huber", "loss.delta=0.5", "data.target=regression"],
    "bce": ["loss=bce", "data.target=multilabel", "optim=adamw", "optim.lr=0.003"],
    "custom": ["loss=custom", "loss._target_=mylosses.pseudo_huber", "+loss.delta=0.7", "data.target=regression"],
}
METRICS = {"mse": "val_rmse", "huber": "val_mae", "bce": "val_f1", "custom": "val_loss"}


@pytest.fixture
def mylosses(tmp_path, monkeypatch):
    (tmp_path / "mylosses.py").write_text(CUSTOM_LOSS)
    monkeypatch.syspath_prepend(tmp_path)  # for the runs in this process; the CLI imports from its working directory
    monkeypatch.delitem(sys.modules, "mylosses", raising=False)  # not another test's module of that name
    return tmp_path


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.quick) if n == "mse" else n for n in LOSSES])
def test_each_loss_accumulated_equals_the_big_batch(mylosses, name):  # mse: the quick tier's per-term loss
    tmp_path = mylosses
    args = [*EXACT, *LOSSES[name]]  # 110 samples: windows of 32, 32, 32, 14; micro-batches of 8 end with 6
    big, _ = train_here(tmp_path, "big", *args, "micro_batch=32", "accum=1")
    acc, _ = train_here(tmp_path, "acc", *args, "micro_batch=8", "accum=4")
    assert_same_weights(final_weights(acc), final_weights(big))
    steps, evals = read_metrics(acc)
    assert [r["samples"] for r in steps] == [32, 32, 32, 14] * 3
    assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in read_metrics(big)[0]], rel=1e-5)
    assert METRICS[name] in evals[-1] and "val_acc" not in evals[-1]
    # the loss's own monitor: val_loss (min), and the weights moved
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    other, _ = train_here(tmp_path, "other", *args, "micro_batch=32", "seed=1")
    assert any(not torch.allclose(final_weights(other)[k], final_weights(big)[k]) for k in final_weights(big))


@pytest.mark.parametrize("name", list(LOSSES))
def test_each_loss_on_two_ranks_equals_the_big_batch(mylosses, name):
    tmp_path = mylosses
    # 117 samples: the last window of 21 is cut 8|8 then 5|0 — rank 1's last share is empty
    args = [*TINY, "data.size=117", "trainer.epochs=2", "trainer.grad_clip=0.5", *LOSSES[name]]
    two, _ = train_here(tmp_path, "two", *args, "devices=2", "micro_batch=8", "accum=2")
    big, _ = train_here(tmp_path, "big", *args, "micro_batch=32", "accum=1")
    assert_same_weights(final_weights(two), final_weights(big))
    assert read_metrics(two)[1][-1]["val_loss"] == pytest.approx(read_metrics(big)[1][-1]["val_loss"], rel=1e-5)


def test_a_regression_loss_on_class_indices_is_one_line(tmp_path):
    _, proc = train_run(tmp_path, "bad", *TINY, "loss=mse", check=False)
    assert_one_line_error(proc, "loss=mse needs float targets", "data.target=regression")
    assert proc.returncode == 2


def test_a_custom_loss_returning_a_mean_is_one_line(tmp_path):
    (tmp_path / "mylosses.py").write_text("import torch.nn.functional as F\n\n"
                                          "def mean_mse(output, target):\n    return F.mse_loss(output, target)\n")
    _, proc = train_run(tmp_path, "bad", *TINY, "loss=custom", "loss._target_=mylosses.mean_mse",
                        "data.target=regression", check=False)
    assert_one_line_error(proc, "loss._target_=mylosses.mean_mse returned a scalar", "reduction='none'")
    assert proc.returncode == 2
