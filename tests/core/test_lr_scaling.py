"""scaling.lr, scaling.beta2, scaling.ema: the learning rate, Adam's β2 and the EMA's decay follow the effective batch,
say so (at start, per step), and refuse a missing base or nothing to scale."""
import math

import pytest
import torch
from conftest import TINY, assert_one_line_user_error, read_metrics, train_here

from accutrain.config.validate import validate
from accutrain.core.lr_scaling import (
    BatchScaling,
    WindowScaling,
    describe,
    half_life_samples,
    scaled_lr,
    window_hparams,
)
from accutrain.core.options import Beta2Scaling, LRScaling
from accutrain.errors import UserError
from accutrain.models.ema import EMA


@pytest.mark.parametrize("rule, effective, base, expected", [
    (LRScaling.none, 256, None, 0.05),
    (LRScaling.none, 256, 32, 0.05),
    (LRScaling.linear, 64, 32, 0.1),
    (LRScaling.linear, 16, 32, 0.025),
    (LRScaling.sqrt, 128, 32, 0.1),
    (LRScaling.sqrt, 64, 32, 0.05 * math.sqrt(2)),
])
def test_scaled_lr(rule, effective, base, expected):
    assert scaled_lr(0.05, effective, rule, base) == pytest.approx(expected, rel=1e-12)


def test_the_start_up_line():
    assert describe(0.05, 64, LRScaling.linear, 32) == (
        "lr 0.1 = 0.05 × 64/32 (scaling.lr=linear, base_batch 32)")
    assert describe(1e-3, 128, LRScaling.sqrt, 32) == (
        "lr 0.002 = 0.001 × √(128/32) (scaling.lr=sqrt, base_batch 32)")
    assert describe(0.05, 64, LRScaling.none, 32) is None


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_every_optimizer_defaults_to_no_scaling(compose, optim):
    cfg = compose(f"optim={optim}")
    assert cfg.scaling.lr is LRScaling.none and cfg.scaling.base_batch is None


@pytest.mark.parametrize("overrides, message", [
    (["scaling.lr=linear"], "scaling.lr=linear cannot be combined with scaling.base_batch=null: it needs scaling.base_batch"),
    (["scaling.lr=sqrt"], "scaling.lr=sqrt cannot be combined with scaling.base_batch=null: it needs scaling.base_batch"),
    (["scaling.base_batch=0"], "scaling.base_batch=0 is not valid"),
])
def test_scaling_needs_a_positive_base_batch(compose, overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        validate(compose(*overrides))


def test_an_unknown_rule_is_refused_by_name(compose):
    with pytest.raises(Exception) as info:
        compose("scaling.lr=cubic")
    assert "expected one of [none, linear, sqrt]" in str(info.value) + str(info.value.__cause__)


def test_a_run_scales_its_learning_rate_and_logs_it(tmp_path):
    run_dir, log = train_here(tmp_path, "run", *TINY, "data.size=64", "micro_batch=4", "accum=4", "sched=constant",
                              "optim.lr=0.05", "scaling.lr=linear", "scaling.base_batch=8",
                              "trainer.max_steps=3")
    assert "lr 0.1 = 0.05 × 16/8 (scaling.lr=linear, base_batch 8)" in log
    steps, _ = read_metrics(run_dir)
    assert [r["lr"] for r in steps] == pytest.approx([0.1] * 3, rel=1e-12)

    with pytest.raises(UserError) as info:
        train_here(tmp_path, "missing", *TINY, "scaling.lr=sqrt")
    assert_one_line_user_error(info.value, "scaling.lr=sqrt cannot be combined with scaling.base_batch=null: it needs scaling.base_batch")


# --- scaling.beta2 and scaling.ema ------------------------------------------------------------------------------
def test_a_window_scales_beta2_and_the_ema_decay_by_its_batch_over_the_base():
    scaling = BatchScaling(LRScaling.sqrt, 8, Beta2Scaling.half_life, True)
    assert scaling.window(32) == WindowScaling(lr=2.0, beta2=4.0, ema=4.0)
    assert BatchScaling(LRScaling.none, 8).window(32) == WindowScaling(1.0, 1.0, 1.0)
    # the half-life in samples is the base batch's whatever the window's batch
    assert half_life_samples(0.999 ** 4.0, 32) == pytest.approx(half_life_samples(0.999, 8), rel=1e-9)


def test_adamw_steps_with_the_scaled_beta2_and_keeps_its_own():
    """Inside window_hparams AdamW takes the step an AdamW built with β2 ** power would; after it, param_groups (and
    so a checkpoint's state_dict) hold the given betas."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    b.data.copy_(a.data)
    scaled = torch.optim.AdamW([a], lr=0.1, betas=(0.9, 0.99))
    reference = torch.optim.AdamW([b], lr=0.1, betas=(0.9, 0.99 ** 3.0))
    for step in range(4):
        grad = torch.randn(5)
        a.grad, b.grad = grad.clone(), grad.clone()
        with window_hparams(scaled, WindowScaling(beta2=3.0)):
            scaled.step()
        reference.step()
        assert scaled.param_groups[0]["betas"] == (0.9, 0.99)
    assert torch.equal(a, b)


def test_the_ema_decay_is_raised_to_the_windows_power():
    model = torch.nn.Linear(2, 1)
    ema = EMA(model, 0.9)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model, 2.0)
    assert ema.last_decay == pytest.approx(0.81, rel=1e-12)
    torch.testing.assert_close(ema.weights["weight"], model.weight.detach() - 0.81)


@pytest.mark.parametrize("overrides, message", [
    (["scaling.beta2=half_life"], "scaling.beta2=half_life cannot be combined with scaling.base_batch=null: it needs scaling.base_batch"),
    (["scaling.beta2=half_life", "scaling.base_batch=32"],
     "scaling.beta2=half_life cannot be combined with optim._target_=accutrain.models.optim.sgd: it scales Adam's β2, and this optimizer has no betas"),
    (["scaling.ema=true", "scaling.base_batch=32"], "scaling.ema=true cannot be combined with trainer.ema=null: it scales the decay of trainer.ema, which is off"),
    (["scaling.ema=true", "trainer.ema=0.99"], "scaling.ema=true cannot be combined with scaling.base_batch=null: it needs scaling.base_batch"),
])
def test_beta2_and_ema_scaling_refuse_what_they_cannot_scale(compose, overrides, message):
    with pytest.raises(UserError) as info:
        validate(compose(*overrides))
    assert_one_line_user_error(info.value, message)


def test_beta2_and_ema_scaling_are_recorded_per_step_following_the_batch_schedule(tmp_path):
    run_dir, _ = train_here(tmp_path, "run", *TINY, "data.size=96", "micro_batch=4", "optim=adamw",
                            "batch_schedule=ramp", "batch_schedule.batch=[8,32]", "batch_schedule.at=[0,0.5]",
                            "scaling.beta2=half_life", "scaling.base_batch=8", "trainer.ema=0.9", "scaling.ema=true",
                            "trainer.epochs=1")
    steps, _ = read_metrics(run_dir)
    assert len({r["effective"] for r in steps}) > 2  # the ramp: several batches
    for r in steps:
        assert r["beta2"] == pytest.approx(0.999 ** (r["effective"] / 8), rel=1e-12)
        assert r["ema_decay"] == pytest.approx(0.9 ** (r["effective"] / 8), rel=1e-12)
