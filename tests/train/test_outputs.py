"""What a run writes for its user beside the training itself: the test stage (data.test), checkpoint names that
carry the epoch and step, the weights alone (trainer.export=weights), metrics.jsonl's record kinds and loss.png's
panels. One small run (TESTED) serves them all."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, run_of, train_here

from accutrain.data.datasets import digits, sequences, synthetic
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.store import mark
from accutrain.store.status import read_status, write_status
from accutrain.train.build import build

# lr 0.5 reaches val_acc 1.0 at step 20: the best evaluation (the first of the best) is not the last (step 30).
TESTED = [*TINY, "data.test=40", "trainer.epochs=3", "optim.lr=0.5", "trainer.ema=0.9", "trainer.checkpoint_every=4",
          "trainer.keep_checkpoints=2", "trainer.export=weights"]


@pytest.fixture(scope="module")
def tested(tmp_path_factory):
    """(the run directory, its log) of one TESTED run, in this process (marked, and status.json begun, as the CLI
    begins it)."""
    root = tmp_path_factory.mktemp("outputs")
    (root / "run").mkdir()
    mark.write_new(root / "run", "run")
    write_status(root / "run", "running")
    return train_here(root, "run", *TESTED)


def by_hand(model: torch.nn.Module, weights: dict, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of `weights` on the whole set at once."""
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        logits = model(inputs)
    return F.cross_entropy(logits, labels).item(), (logits.argmax(1) == labels).sum().item() / len(labels)


def test_the_test_stage_evaluates_the_last_and_the_best_weights_over_the_whole_split(tested):
    run_dir, log = tested
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    test = records[-1]
    evals = [r for r in records if "val_acc" in r]
    best = max(evals, key=lambda r: r["val_acc"])
    assert test["kind"] == "test" and test["best_step"] == best["step"] == 20 and test["step"] == 30
    assert {"test_loss_ema", "test_acc_ema", "test_loss_ema_best", "test_acc_ema_best"} <= test.keys()
    held = synthetic(300, 50, 8, 10, 1, 1.0, seed=0, test=40).test
    model = build(run_of(*TESTED), World(), torch.device("cpu")).model
    for name, suffix in (("last.pt", ""), ("best.pt", "_best")):
        loss, acc = by_hand(model, torch.load(run_dir / "checkpoints" / name, weights_only=True)["model"],
                            held.images, held.labels)
        assert test[f"test_loss{suffix}"] == pytest.approx(loss, rel=1e-5)
        assert test[f"test_acc{suffix}"] == pytest.approx(acc, abs=1e-9)
    assert test["test_loss"] != test["test_loss_best"]
    assert read_status(run_dir)["test"] == {k: v for k, v in test.items() if k != "kind"}
    assert f"test (optimizer step 30): test_loss {test['test_loss']:.4f}" in log
    assert f"test_acc {test['test_acc']:.4f} (best weights {test['test_acc_best']:.4f})" in log  # the summary line


def test_the_trackers_take_the_test_stage_as_test_scalars():
    from accutrain.trackers.base import scalars

    record = {"kind": "test", "step": 30, "epoch": 3, "test_loss": 0.2, "test_acc": 0.9, "best_step": 20,
              "test_loss_best": 0.3, "test_acc_best": 0.95}
    assert scalars(record) == {"test/loss": 0.2, "test/acc": 0.9, "test/loss_best": 0.3, "test/acc_best": 0.95}
    assert scalars({"step": 30, "val_acc": 0.9}) == {"val/acc": 0.9}


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
    with pytest.raises(UserError, match=r"data.test=1438 is not valid: expected 0 \(none\) to 1437 samples held out"):
        digits(test=1438)


def test_torchvision_data_tests_its_own_test_split_and_validates_on_training_images(tmp_path, monkeypatch):
    import torchvision
    from PIL import Image

    from accutrain.data.datasets import torchvision_dataset

    class Fake(torch.utils.data.Dataset):  # CIFAR-10's interface: (root, train, download), PIL images
        def __init__(self, root: str, train: bool, download: bool) -> None:
            self.n, self.shade = (50, 0) if train else (20, 100)

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int):
            return Image.new("RGB", (32, 32), (self.shade + i, 0, 0)), i % 10

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", Fake)
    plain = torchvision_dataset("cifar10", str(tmp_path), False)
    tested = torchvision_dataset("cifar10", str(tmp_path), False, test=True, val_size=10, seed=1)
    assert (len(plain.train), len(plain.val), plain.test) == (50, 20, None)
    assert (len(tested.train), len(tested.val), len(tested.test)) == (40, 10, 20)
    assert torch.equal(tested.test[3][0], plain.val[3][0])  # the official test split, in the evaluation view
    shades = lambda split: {round(float(split[i][0][0, 0, 0]), 4) for i in range(len(split))}  # noqa: E731
    assert not shades(tested.train) & shades(tested.val) and shades(tested.train) | shades(tested.val) == shades(
        plain.train)
    with pytest.raises(UserError, match="data.val_size=50 is not valid"):
        torchvision_dataset("cifar10", str(tmp_path), False, test=True, val_size=50)


def test_checkpoints_carry_their_epoch_and_step_and_best_its_value_as_names_of_the_same_files(tested):
    folder = tested[0] / "checkpoints"
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("abandoned"))
    # every 4 steps and at the end (30), the newest 2 kept, with their names; the best evaluation: step 20, epoch 2
    assert names == ["best-epoch2-step20-val_acc1.pt", "best.pt", "epoch3-step28.pt", "epoch3-step30.pt", "last.pt",
                     "step-00000028.pt", "step-00000030.pt"]
    for name, same in (("epoch3-step28.pt", "step-00000028.pt"), ("epoch3-step30.pt", "last.pt"),
                       ("best-epoch2-step20-val_acc1.pt", "best.pt")):
        assert os.path.samefile(folder / name, folder / same)  # one file, two names: no second copy
    assert torch.load(folder / "epoch3-step28.pt", weights_only=True)["step"] == 28


def test_export_weights_writes_the_last_weights_alone_for_the_bare_model(tested):
    from safetensors import safe_open
    from safetensors.torch import load_file

    run_dir = tested[0]
    model = build(run_of(*TESTED), World(), torch.device("cpu")).model
    model.load_state_dict(load_file(run_dir / "model.safetensors"), strict=True)
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(model.state_dict()[k], last[k]) for k in last)
    with safe_open(run_dir / "model.safetensors", "pt") as f:
        assert f.metadata() == {"step": "30", "model": "accutrain.models.mlp"}
    assert "exported the weights" in tested[1]


def test_every_metrics_record_says_its_kind_and_reads_as_a_dataframe_per_kind(tested, tmp_path):
    from accutrain.report.runs import metrics_frame, metrics_records

    run_dir = tested[0]
    kinds = [json.loads(line)["kind"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["plan"] + (["step"] * 10 + ["eval"]) * 3 + ["test"]
    steps = metrics_frame(run_dir, "step")
    assert len(steps) == 30 and list(steps["step"]) == list(range(1, 31)) and steps["loss"].notna().all()
    assert list(metrics_frame(run_dir, "eval")["val_acc"]) == [r["val_acc"] for r in metrics_records(run_dir, "eval")]
    assert metrics_frame(run_dir, "plan")["plan.total_steps"].tolist() == [30]
    old = tmp_path / "metrics.jsonl"  # a file written before records said their kind
    old.write_text('{"plan": {"effective": 8}}\n{"step": 1, "loss": 2.0}\n{"step": 1, "val_loss": 1.5}\n')
    assert [r["kind"] for r in metrics_records(old)] == ["plan", "step", "eval"]
    with pytest.raises(ValueError, match="kind='steps': expected one of plan, step, eval, test"):
        metrics_records(run_dir, "steps")


def test_loss_png_draws_the_validation_metric_beside_the_loss_on_a_log_scale_when_it_spans_decades(tested):
    from accutrain.report.plots import run_figure, spans_decades
    from accutrain.report.runs import read_run

    loss, metric = run_figure(read_run(tested[0], "run")).axes
    assert loss.get_yscale() == "log" and loss.get_ylabel() == "loss (log scale)"  # 2.3 down to ~0.001
    assert metric.get_title() == "val_acc" and [len(line.get_xdata()) for line in metric.lines] == [3, 1, 1]
    assert [t.get_text() for t in metric.get_legend().get_texts()] == [
        "val acc", "test, last weights: 0.975", "test, best weights: 0.975"]
    assert spans_decades([2.3, 0.05]) and not spans_decades([2.3, 0.5]) and not spans_decades([1.0, -1.0])


def test_the_long_waits_show_a_bar_on_a_terminal_and_none_in_a_log(monkeypatch):
    import io
    import sys

    from accutrain.train import console
    from accutrain.train.evaluation import measure

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(console, "WAIT_DELAY_S", 0.0)  # (1 s: an evaluation that takes less shows no bar)
    monkeypatch.setattr(sys, "stderr", Terminal())
    c = build(run_of(*TINY, "trainer.progress=true", "micro_batch=auto", "trainer.memory_budget_mb=100000",
                      "global_batch=8"), World(), torch.device("cpu"))
    assert "micro_batch=auto: trial steps" in sys.stderr.getvalue() and c.plan.micro_batch == 8
    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        measure(c, "")
        assert ("evaluating (val)" in stream.getvalue()) is shown


def test_the_run_summary_shows_the_test_stage_of_the_last_and_the_best_weights(tested):
    import csv

    from accutrain.report.summary import write_report

    report = write_report(tested[0])
    assert "test: last / best weights" in report.text and "test_acc 0.9750 / 0.9750" in report.text
    with open(tested[0] / "summary.csv") as f:
        row = next(csv.DictReader(f))
    assert (row["test_metric"], float(row["test_last"]), float(row["test_best"])) == ("test_acc", 0.975, 0.975)
