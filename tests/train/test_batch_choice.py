"""Choosing the batch: β2 and the EMA decay that follow each window's batch, exact under any split and across a
resume; the noise scale from one rank or two; what cannot be measured or scaled, in one line."""
from pathlib import Path

import pytest
import torch
from conftest import (
    EXACT,
    RUN,
    TINY,
    assert_identical,
    assert_one_line_error,
    assert_one_line_user_error,
    assert_same_weights,
    final_weights,
    read_metrics,
    train_here,
    train_run,
)

from accutrain.config.validate import validate
from accutrain.errors import UserError

FOLLOW = ["optim=adamw", "scaling.beta2=half_life", "scaling.base_batch=8", "trainer.ema=0.9", "scaling.ema=true"]


def rewind(run_dir: Path, step: int) -> None:
    """Make a finished run look killed after optimizer step `step`: drop its newer checkpoints."""
    for path in (run_dir / "checkpoints").glob("step-*.pt"):
        if int(path.stem.split("-")[1]) > step:
            path.unlink()
    (run_dir / "checkpoints" / "last.pt").unlink()


def ema_weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["ema"]["weights"]


@pytest.mark.slow
def test_scaled_beta2_ema_and_the_noise_scale_resume_bit_identical(slow):
    args = [*RUN, *FOLLOW, "trainer.noise_scale=true"]
    run, _ = train_here(slow, "run", *args, "trainer.keep_checkpoints=20")
    weights, ema, expected = final_weights(run), ema_weights(run), read_metrics(run)[0]  # uninterrupted, it ended so
    rewind(run, 5)
    resumed, log = train_here(slow, "run", *args, "resume=auto")
    assert "at optimizer step 5" in log
    assert_identical(final_weights(resumed), weights)
    assert_identical(ema_weights(resumed), ema)
    keys = ("loss", "beta2", "ema_decay", "noise_g2", "noise_trace", "b_simple")
    got = read_metrics(resumed)[0]
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in expected]
    assert all(r["b_simple"] is not None for r in got[1:])


def test_scaled_beta2_and_ema_are_the_same_under_any_split(tmp_path):
    """micro_batch=8 accum=4 and micro_batch=32: the same windows, so the same β2 and EMA decay at every step and
    the same weights and average (up to the order of float sums); β2 scaling does change the run."""
    split, _ = train_here(tmp_path, "split", *EXACT, *FOLLOW, "micro_batch=8", "accum=4")
    whole, _ = train_here(tmp_path, "whole", *EXACT, *FOLLOW, "micro_batch=32", "accum=1")
    plain, _ = train_here(tmp_path, "plain", *EXACT, "optim=adamw", "micro_batch=32", "accum=1")
    a, b = read_metrics(split)[0], read_metrics(whole)[0]
    assert [(r["beta2"], r["ema_decay"]) for r in a] == [(r["beta2"], r["ema_decay"]) for r in b]
    assert a[0]["beta2"] == pytest.approx(0.999 ** 4, rel=1e-12) and a[0]["ema_decay"] == pytest.approx(0.9 ** 4)
    assert_same_weights(final_weights(split), final_weights(whole))
    assert_same_weights(ema_weights(split), ema_weights(whole))
    assert any(not torch.equal(value, final_weights(plain)[key]) for key, value in final_weights(whole).items())


@pytest.mark.slow
def test_the_noise_scale_of_one_rank_equals_that_of_two_on_the_same_micro_batches(tmp_path):
    """micro_batch=8 accum=4 on one rank and micro_batch=8 accum=2 on two gloo ranks: every window is cut into the
    same micro-batches (117 samples: windows 32, 32, 32, 21 = 8|8|5 and a stand-in), so the estimator's inputs are
    the same and so are its estimates, up to the order of float sums (DDP's all-reduce)."""
    common = [*TINY, "data.size=117", "trainer.epochs=2", "trainer.noise_scale=true", "micro_batch=8"]
    one, _ = train_here(tmp_path, "one", *common, "accum=4")
    two, _ = train_here(tmp_path, "two", *common, "devices=2", "accum=2")
    a, b = read_metrics(one)[0], read_metrics(two)[0]
    assert len(a) == len(b) == 8
    for key in ("noise_g2", "noise_trace", "b_simple"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-5), key


def test_noise_scale_with_nothing_to_compare_is_one_line(tmp_path):
    run_dir, proc = train_run(tmp_path, "run", *TINY, "micro_batch=8", "trainer.noise_scale=true", check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, "trainer.noise_scale=true cannot be combined with accum=1 on one device: the noise scale compares each micro-batch's gradient with the window's",
                          "accum=1 on one device")
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, message", [
    (["strategy=fsdp", "devices=2", "trainer.noise_scale=true"],
     "strategy=fsdp cannot be combined with trainer.noise_scale=true"),
    (["trainer.noise_scale=true", "global_batch=32", "micro_batch=32"], "accum=1 on one device"),
    (["trainer.noise_scale=true", "accum=2", "trainer.noise_scale_decay=1"], "trainer.noise_scale_decay=1.0 is not valid"),
])
def test_noise_scale_refusals(compose, overrides, message):
    with pytest.raises(UserError) as info:
        validate(compose(*TINY, *overrides))
    assert_one_line_user_error(info.value, message)


def test_noise_scale_with_accum_1_in_a_launched_world_is_not_refused(compose, monkeypatch):
    """Under torchrun or SLURM devices is left at its default (the processes started): one micro-batch per rank still
    gives two gradients to compare."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    validate(compose(*TINY, "trainer.noise_scale=true", "micro_batch=32"))


def test_noise_scale_of_an_element_level_loss_is_refused_before_the_run(tmp_path):
    with pytest.raises(UserError) as info:  # the refusal table: known from the config, before the run directory
        train_here(tmp_path, "run", *TINY, "accum=2", "loss.normalize=elements", "trainer.noise_scale=true")
    assert_one_line_user_error(info.value, "loss=cross_entropy cannot be combined with trainer.noise_scale=true",
                               "measures gradients per sample")
