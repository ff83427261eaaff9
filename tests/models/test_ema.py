"""What moves once per optimizer step, continued: the average of the weights (trainer.ema), checkpoints/best.pt
and early stopping, exact under any split and bit-identical after a resume."""
import json
import signal

import pytest
import torch
from conftest import (
    EXACT,
    NAN_DATA,
    RUN,
    TINY,
    WAIT_S,
    assert_identical,
    assert_one_line_user_error,
    final_weights,
    read_metrics,
    run_of,
    start,
    train_here,
    train_run,
    wait_for_steps,
)
from torch import nn

from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.models.ema import EMA
from accutrain.report import runs
from accutrain.signals import StopRequest
from accutrain.store.progress import Progress
from accutrain.train.build import build
from accutrain.train.loop import fit
from accutrain.train.metrics import MetricsLog


def test_one_update_is_the_formula_and_buffers_follow_timm():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ema = EMA(net, decay=0.9)
    before = {k: v.clone() for k, v in ema.weights.items()}
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    net(torch.randn(5, 3))  # BatchNorm's running statistics and num_batches_tracked move
    ema.update(net)
    now = net.state_dict()
    for key in ("0.weight", "0.bias", "1.weight", "1.running_mean", "1.running_var"):  # averaged: buffers too
        torch.testing.assert_close(ema.weights[key], 0.9 * before[key] + 0.1 * now[key])
    assert ema.weights["1.num_batches_tracked"] == now["1.num_batches_tracked"] == 1  # integers are copied
    warm = EMA(net, decay=0.999, warmup=True)
    assert [warm.current_decay()] == [pytest.approx(1 / 10)]
    warm.update(net)
    assert warm.current_decay() == pytest.approx(2 / 11) and warm.updates == 1


def test_the_average_of_half_precision_weights_is_float32():
    net = nn.Linear(4, 4).to(torch.bfloat16)
    ema = EMA(net, decay=0.999)
    assert ema.weights["weight"].dtype == torch.float32
    start_value = ema.weights["weight"].clone()
    with torch.no_grad():
        net.weight.add_(0.01)
    ema.update(net)  # a 1e-5 move: bf16 would round it away
    assert not torch.equal(ema.weights["weight"], start_value)


def test_the_average_moves_once_per_optimizer_step_taken(tmp_path, monkeypatch, compose):
    """8 windows of 2 micro-batches, 2 of them skipped for a NaN: 6 updates, not 16 (micro-batches) nor 8."""
    (tmp_path / "emanandata.py").write_text(NAN_DATA)
    monkeypatch.syspath_prepend(tmp_path)
    c = build(run_of("model=mlp", "data=custom", "data._target_=emanandata.make", "micro_batch=8", "accum=2",
                      "trainer.epochs=2", "trainer.on_nonfinite=skip", "trainer.ema=0.9", "trainer.progress=false"),
              World(), torch.device("cpu"))
    calls = []
    update = c.ema.update
    c.ema.update = lambda model, *power: (calls.append(True), update(model, *power))
    metrics = MetricsLog(tmp_path / "m.jsonl")
    with StopRequest() as stop:
        out = fit(c, metrics, Progress(), lambda *a, **k: None, stop)
    metrics.close()
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines() if '"loss"' in line]
    assert out.progress.step == len(records) == 8 and sum("skipped" in r for r in records) == 2
    assert len(calls) == c.ema.updates == 6


def ema_of(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["ema"]["weights"]


def test_the_average_is_the_same_for_every_split(tmp_path):
    args = [*EXACT, "trainer.ema=0.8", "trainer.ema_warmup=true"]
    big, _ = train_here(tmp_path, "big", *args, "micro_batch=32")
    acc, log = train_here(tmp_path, "acc", *args, "micro_batch=8", "accum=4")
    cpu, _ = train_here(tmp_path, "cpu", *args, "micro_batch=8", "accum=4", "trainer.ema_device=cpu")
    for key, value in ema_of(big).items():
        torch.testing.assert_close(ema_of(acc)[key], value, rtol=1e-5, atol=1e-6, msg=key)
        torch.testing.assert_close(ema_of(cpu)[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert any(not torch.allclose(ema_of(big)[k], final_weights(big)[k]) for k in final_weights(big))  # it averages
    _, evals = read_metrics(acc)
    assert all({"val_loss_ema", "val_acc_ema"} <= e.keys() for e in evals)
    assert "(ema: val_loss" in log


def test_best_checkpoint_holds_the_best_evaluation(tmp_path):
    run_dir, log = train_here(tmp_path, "run", *TINY, "data.size=64", "micro_batch=8", "trainer.epochs=3",
                              "trainer.eval_every=2", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=100",
                              "trainer.monitor=val_loss")
    _, evals = read_metrics(run_dir)
    best = min(evals, key=lambda e: e["val_loss"])
    state = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert state["step"] == best["step"] and state["progress"]["best"] == best["val_loss"]
    assert_identical(state["model"], torch.load(run_dir / "checkpoints" / f"step-{best['step']:08d}.pt",
                                                weights_only=True)["model"])
    assert f"best val_loss {best['val_loss']:.4f} (step {best['step']})" in log


PLATEAU = ["trainer.eval_every=2", "trainer.monitor=val_loss", "trainer.min_delta=10", "trainer.early_stopping=4"]


def test_early_stopping_stops_at_the_evaluation_patience_runs_out(tmp_path):
    """min_delta 10 on val_loss: no evaluation after the first improves; patience 4 at every 2 steps → step 10."""
    run_dir, log = train_here(tmp_path, "run", *TINY, "data.size=64", "micro_batch=8", "trainer.epochs=3",
                              *PLATEAU)
    steps, evals = read_metrics(run_dir)
    assert [e["step"] for e in evals] == [2, 4, 6, 8, 10] and len(steps) == 10
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 10
    assert "early stopping after optimizer step 10 of 24: val_loss has not improved by more than 10 for 4 " \
           "evaluations (best val_loss" in log


@pytest.mark.long  # a feature's resume: the core kill-and-resume test runs every time
@pytest.mark.slow
def test_killed_run_with_the_average_best_checkpoint_and_early_stopping_resumes_bit_identical(slow):
    args = [*RUN, "trainer.ema=0.7", *PLATEAU]  # 4 steps per epoch × 3: early stopping ends both at step 10
    reference, _ = train_run(slow, "reference", *args)
    proc = start(slow, "killed", *args, "+model.delay=0.02")
    wait_for_steps(slow / "killed", 5, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=WAIT_S)
    resumed, proc = train_run(slow, "killed", *args, "resume=auto")
    assert "resumed from" in proc.stderr and "early stopping after optimizer step 10" in proc.stderr
    assert_identical(final_weights(resumed), final_weights(reference))
    assert_identical(ema_of(resumed), ema_of(reference))
    best = {name: json.loads((d / "status.json").read_text())["best"] for name, d in
            (("reference", reference), ("resumed", resumed))}
    assert best["resumed"]["step"] == best["reference"]["step"]
    assert best["resumed"]["value"] == best["reference"]["value"]
    row = runs.read_run(resumed, "killed")  # what accutrain-report and the sweep summary show
    assert (row.monitor, row.best, row.best_step) == ("val_loss", best["reference"]["value"], best["reference"]["step"])
    assert row.best_val_acc_ema is not None


@pytest.mark.parametrize("args, fragments", [
    (["trainer.ema=1.5"], ["trainer.ema=1.5", "between 0 and 1"]),
    (["trainer.monitor=val_acc_ema"], ["trainer.monitor=val_acc_ema", "trainer.ema"]),
    (["trainer.monitor=val_f1"], ["trainer.monitor=val_f1", "val_loss, val_acc"]),
    (["trainer.early_stopping=0"], ["trainer.early_stopping=0", "patience"]),
    (["trainer.ema=0.9", "trainer.ema_device=cuda"], ["trainer.ema_device=cuda", "cpu"]),
    (["trainer.monitor_mode=up"], ["trainer.monitor_mode=up", "min, max"]),
])
def test_bad_keys_are_one_line(tmp_path, args, fragments):
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "err", *TINY, *args)
    assert_one_line_user_error(info.value, *fragments)
