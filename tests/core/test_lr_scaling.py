"""scaling.lr: the learning rate follows the effective batch, says so at start, and refuses a missing base."""
import math

import pytest

from accutrain.config.validate import validate
from accutrain.core.lr_scaling import describe, scaled_lr
from accutrain.core.options import LRScaling
from accutrain.errors import UserError
from conftest import TINY, assert_one_line_user_error, read_metrics, train_here


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
    (["scaling.lr=linear"], "scaling.lr=linear needs scaling.base_batch"),
    (["scaling.lr=sqrt"], "scaling.lr=sqrt needs scaling.base_batch"),
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
    assert_one_line_user_error(info.value, "scaling.lr=sqrt needs scaling.base_batch")
