"""End to end through the real `accutrain` console script: the core promise, the outputs, each dataset, errors."""
import json

import pytest
import torch

from conftest import TINY, assert_one_line_error, final_weights, read_metrics, run_cli, train_run
from test_data import make_image_folder

# 110 samples = 3 windows of 32 + a window of 14: with micro_batch 8 the last micro-batch holds 6 samples.
# grad_clip makes per-micro-batch clipping (a classic bug) show up as different weights.
EXACT = [*TINY, "data.size=110", "trainer.epochs=3", "trainer.grad_clip=0.5", "optim.weight_decay=1e-3"]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def test_accumulated_runs_equal_the_big_batch_run(tmp_path):
    big, _ = train_run(tmp_path, "big", *EXACT, "micro_batch=32", "accum=1")
    acc, _ = train_run(tmp_path, "acc", *EXACT, "micro_batch=8", "accum=4")
    glob, _ = train_run(tmp_path, "glob", *EXACT, "micro_batch=4", "global_batch=32")
    assert_same_weights(final_weights(acc), final_weights(big))
    assert_same_weights(final_weights(glob), final_weights(big))

    # the weights moved, and another seed would not match: the equality above is not vacuous
    other, _ = train_run(tmp_path, "other", *EXACT, "micro_batch=32", "seed=1")
    assert any(not torch.allclose(final_weights(other)[k], final_weights(big)[k]) for k in final_weights(big))

    steps = {name: read_metrics(d)[0] for name, d in (("big", big), ("acc", acc), ("glob", glob))}
    for name, records in steps.items():  # one record per optimizer step, windows of the real sizes
        assert [r["step"] for r in records] == list(range(1, 13)), name
        assert [r["samples"] for r in records] == [32, 32, 32, 14] * 3, name
    assert [r["micro_batches"] for r in steps["acc"]] == [4, 4, 4, 2] * 3
    assert [r["micro_batches"] for r in steps["glob"]] == [8, 8, 8, 4] * 3
    assert [r["micro_batches"] for r in steps["big"]] == [1] * 12
    for name in ("acc", "glob"):  # the scheduler moved once per optimizer step; the logged loss is the window's
        assert [r["lr"] for r in steps[name]] == pytest.approx([r["lr"] for r in steps["big"]], rel=1e-12)
        assert [r["loss"] for r in steps[name]] == pytest.approx([r["loss"] for r in steps["big"]], rel=1e-5)
        assert [r["grad_norm"] for r in steps[name]] == pytest.approx([r["grad_norm"] for r in steps["big"]],
                                                                       rel=1e-4)


def test_drop_policy_skips_the_incomplete_window_for_every_split(tmp_path):
    a, _ = train_run(tmp_path, "a", *EXACT, "micro_batch=8", "accum=4", "trainer.last_window=drop")
    b, _ = train_run(tmp_path, "b", *EXACT, "micro_batch=32", "trainer.last_window=drop")
    assert [r["samples"] for r in read_metrics(a)[0]] == [32] * 9
    assert_same_weights(final_weights(a), final_weights(b))


def test_a_run_writes_its_outputs_into_the_run_directory(tmp_path):
    run_dir, proc = train_run(tmp_path, "run", *TINY, "data.size=100", "micro_batch=10", "accum=2",
                              "trainer.max_steps=7", "trainer.eval_every=3")
    log = proc.stderr
    assert "effective batch 20 = micro_batch 10 × accum 2 × devices 1" in log
    assert "5 optimizer steps per epoch (5 windows of 20), 7 in total over 2 epochs" in log
    assert "done: 7 optimizer steps, 140 samples seen" in log
    assert (run_dir / "train.log").read_text().count("effective batch 20") == 1
    assert "micro_batch: 10" in (run_dir / "config.yaml").read_text()

    steps, evals = read_metrics(run_dir)
    assert len(steps) == 7
    for key in ("step", "epoch", "loss", "samples", "micro_batches", "lr", "grad_norm", "samples_per_s"):
        assert key in steps[0], key
    assert [r["epoch"] for r in steps] == [1] * 5 + [2] * 2
    assert [e["step"] for e in evals] == [3, 6, 7]  # every 3 steps, and at the end
    assert all(0 <= e["val_acc"] <= 1 and e["val_loss"] > 0 for e in evals)

    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "step", "config"} <= ckpt.keys()
    assert ckpt["step"] == 7 and ckpt["config"]["micro_batch"] == 10


def test_progress_bar_counts_optimizer_steps_and_stays_short_in_a_log(tmp_path):
    _, proc = train_run(tmp_path, "run", *[a for a in TINY if a != "trainer.progress=false"], "data.size=400",
                        "micro_batch=4", "accum=5", "trainer.epochs=3")
    bar_lines = [line for line in proc.stderr.splitlines() if "step/s" in line or "?step" in line]
    assert 1 <= len(bar_lines) <= 4, proc.stderr  # the first and last states, not one line per refresh
    assert "60/60" in bar_lines[-1]  # 3 epochs × 20 optimizer steps, not 300 micro-batches


def test_digits_run(tmp_path):
    run_dir, _ = train_run(tmp_path, "digits", "model=mlp", "data=digits", "trainer.epochs=3",
                           "micro_batch=16", "accum=2", "trainer.progress=false")
    _, evals = read_metrics(run_dir)
    assert evals[-1]["val_acc"] > 0.85


def test_synthetic_cnn_run_learns(tmp_path):
    run_dir, _ = train_run(tmp_path, "synthetic", "model=cnn", "data=synthetic", "data.size=300",
                           "data.image_size=8", "trainer.epochs=4", "micro_batch=8", "accum=2", "optim=adamw",
                           "trainer.progress=false")
    _, evals = read_metrics(run_dir)
    assert evals[-1]["val_acc"] > 0.5  # ten classes: chance is 0.1


def test_imagefolder_run(tmp_path):
    root = make_image_folder(tmp_path / "images")
    run_dir, proc = train_run(tmp_path, "folder", "model=cnn", "data=imagefolder", f"data.root={root}",
                              "data.image_size=8", "micro_batch=4", "accum=2", "trainer.epochs=2",
                              "trainer.progress=false")
    assert "18 train / 6 val, 3×8×8, 3 classes" in proc.stderr
    assert len(read_metrics(run_dir)[0]) == 6  # 18 samples / 8 → 2 full windows + 1 of 2, over 2 epochs


def test_custom_model_by_target(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch.nn as nn\n"
        "def net(num_classes, in_channels, image_size, width=16):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, width), nn.ReLU(),\n"
        "                         nn.Linear(width, num_classes))\n")
    run_dir, proc = train_run(tmp_path, "custom", *TINY[2:], "model=custom", "model._target_=mymodels.net",
                              "+model.width=5", "trainer.max_steps=2")
    assert final_weights(run_dir)["1.weight"].shape == (5, 64)


@pytest.mark.parametrize("args, fragments", [
    (["micro_batch=0"], ["micro_batch=0", "positive integer"]),
    (["micro_batch=abc"], ["micro_batch='abc'", "positive integer"]),
    (["accum=2.5"], ["accum=2.5", "positive integer"]),
    (["global_batch=100", "micro_batch=8"], ["global_batch=100", "micro_batch 8 × devices 1 = 8"]),
    (["global_batch=64", "micro_batch=8", "accum=4"], ["accum=4 contradicts global_batch=64"]),
    (["model=torchvision", "model.name=resnet19"], ["model.name='resnet19'", "resnet18"]),
    (["data=cifar10", "data.root=/nonexistent/cifar"], ["/nonexistent/cifar", "data.download=true"]),
    (["data=imagefolder", "data.root=/nonexistent/images"], ["/nonexistent/images", "train/"]),
    (["devices=0"], ["devices=0", "positive integer or auto"]),
    (["trainer.device=cuda"], ["trainer.device=cuda", "no CUDA device"]),
])
def test_user_errors_end_in_one_line(tmp_path, args, fragments):
    if "trainer.device=cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _, proc = train_run(tmp_path, "err", *args, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, *fragments)


@pytest.mark.parametrize("args, fragment", [
    (["model=resnet19"], "Could not find 'model/resnet19'"),
    (["data=imagenet"], "Could not find 'data/imagenet'"),
    (["trainer.epochs=abc"], "trainer.epochs"),
    (["model.nope=1"], "Key 'nope' not in 'TorchvisionModel'"),
])
def test_unknown_groups_keys_and_types_are_refused_by_hydra(tmp_path, args, fragment):
    _, proc = train_run(tmp_path, "err", *args, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert fragment in proc.stderr
    assert not (tmp_path / "err" / "metrics.jsonl").exists()  # refused before anything started


def test_help_lists_the_config_groups(tmp_path):
    out = run_cli("--help", cwd=tmp_path).stdout
    for group in ("model:", "data:", "optim:", "sched:"):
        assert group in out
    assert "resnet18" in out and "digits" in out
    assert not (tmp_path / "outputs").exists()  # asking for help writes nothing


def test_metrics_lines_are_json(tmp_path):
    run_dir, _ = train_run(tmp_path, "run", *TINY, "data.size=30", "trainer.max_steps=1")
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
