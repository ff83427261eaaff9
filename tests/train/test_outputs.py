"""What a run writes for its user beside the training itself: the test stage (data.test)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from accutrain.config.train import compose
from accutrain.data.datasets import digits, sequences, synthetic
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.train.build import build
from conftest import TINY, train_here

# lr 0.5 reaches val_acc 1.0 at step 20: the best evaluation (the first of the best) is not the last (step 30).
TESTED = [*TINY, "data.test=40", "trainer.epochs=3", "optim.lr=0.5", "trainer.ema=0.9"]


def by_hand(model: torch.nn.Module, weights: dict, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of `weights` on the whole set at once."""
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        logits = model(inputs)
    return F.cross_entropy(logits, labels).item(), (logits.argmax(1) == labels).sum().item() / len(labels)


def test_the_test_stage_evaluates_the_last_and_the_best_weights_over_the_whole_split(tmp_path):
    run_dir, log = train_here(tmp_path, "run", *TESTED)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    test = records[-1]
    evals = [r for r in records if "val_acc" in r]
    best = max(evals, key=lambda r: r["val_acc"])
    assert test["kind"] == "test" and test["best_step"] == best["step"] == 20 and test["step"] == 30
    assert {"test_loss_ema", "test_acc_ema", "test_loss_ema_best", "test_acc_ema_best"} <= test.keys()
    held = synthetic(300, 50, 8, 10, 1, 1.0, seed=0, test=40).test
    model = build(compose(*TESTED), World(), torch.device("cpu")).model
    for name, suffix in (("last.pt", ""), ("best.pt", "_best")):
        loss, acc = by_hand(model, torch.load(run_dir / "checkpoints" / name, weights_only=True)["model"],
                            held.images, held.labels)
        assert test[f"test_loss{suffix}"] == pytest.approx(loss, rel=1e-5)
        assert test[f"test_acc{suffix}"] == pytest.approx(acc, abs=1e-9)
    assert test["test_loss"] != test["test_loss_best"]
    assert f"test (optimizer step 30): test_loss {test['test_loss']:.4f}" in log
    assert f"test_acc {test['test_acc']:.4f} (best weights {test['test_acc_best']:.4f})" in log  # the summary line


def test_a_test_split_leaves_the_training_and_validation_data_as_they_were():
    plain, tested = digits(), digits(test=100, seed=3)
    assert (len(tested.train), len(tested.val), len(tested.test)) == (1338, 359, 100)
    assert torch.equal(plain.images.val.images, tested.images.val.images)  # raw pixels (normalised by train's)
    rows = lambda images: {tuple(x.flatten().tolist()) for x in images}  # noqa: E731
    train, test = rows(tested.images.train.images), rows(tested.images.test.images)
    assert not train & test and train | test == rows(plain.images.train.images)
    assert torch.equal(digits(test=100, seed=3).test.images, tested.test.images)
    for make in (lambda test: synthetic(30, 5, 6, 3, 1, 1.0, seed=4, test=test),
                 lambda test: sequences(30, 5, 8, 2, 6, seed=4, test=test)):
        a, b = make(0), make(7)
        assert a.test is None and len(b.test) == 7
        for split in ("train", "val"):
            assert torch.equal(getattr(a, split).images, getattr(b, split).images)
            assert torch.equal(getattr(a, split).labels, getattr(b, split).labels)
    with pytest.raises(UserError, match=r"data.test=1438 is not valid: expected 0 \(no test split\) to 1437"):
        digits(test=1438)
